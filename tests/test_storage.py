"""The one storage layer (`zswap.storage`): copy-on-write commits, the bounded write queue, one error policy,
transactions with an undo log, and one engine per swap directory shared by params, gradients and optimizer
records."""

from __future__ import annotations

import errno
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import zswap
from zswap import SwapIOError, param_state
from zswap import storage as zs
from zswap.errors import UnknownKeyError
from zswap.gradstore import NvmeGrads
from zswap.optim import OffloadedAdamW

from .test_runtime import TinyLM, build, engine_for, ids, sq

FAULTS = [errno.ENOSPC, errno.EIO]


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[zs.Storage]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        s = zs.open_dir(tmp_path)
    keep = s.namespace("t")  # holds the storage open for the test
    yield s
    keep.close()


def t(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def read(ns: zs.Namespace, name: str, n: int, txn: zs.Transaction | None = None) -> torch.Tensor:
    out = torch.empty(n)
    ns.read(name, out, txn).wait()
    return out


def fault(s: zs.Storage, op: str, code: int, skip: int = 0, count: int = 1) -> None:
    s.engine._engine.inject_fault(op, "errno", code, skip, count)


# -- copy-on-write ------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", FAULTS)
def test_a_failed_overwrite_leaves_the_previous_value_readable(storage, code):
    ns = storage.namespace("p")
    ns.put("a", t(1000, 0))
    ns.wait()
    fault(storage, "write", code)
    ns.put("a", t(1000, 1))
    with pytest.raises(SwapIOError) as ei:
        ns.wait()
    assert ei.value.errno == code and ei.value.key == f"{ns.prefix}/a"  # the logical key
    assert torch.equal(read(ns, "a", 1000), t(1000, 0))
    assert [k for k in list(storage.engine.keys()) if k.startswith(ns.prefix)] == [
        ns.physical("a")
    ]  # no leak
    ns.wait()  # raised once


@pytest.mark.parametrize("code", FAULTS)
def test_a_failed_first_write_leaves_no_key(storage, code):
    ns = storage.namespace("p")
    fault(storage, "write", code)
    ns.put("a", t(10, 0))
    with pytest.raises(SwapIOError, match=f"key='{ns.prefix}/a'"):
        ns.wait()
    assert "a" not in ns and not [k for k in list(storage.engine.keys()) if k.startswith(ns.prefix)]
    with pytest.raises(UnknownKeyError, match="was never written"):
        ns.read("a", torch.empty(10))


def test_a_read_after_a_failed_write_raises_once_then_sees_the_old_value(storage):
    ns = storage.namespace("p")
    ns.put("a", t(100, 0))
    ns.wait()
    fault(storage, "write", errno.EIO)
    ns.put("a", t(100, 1))
    with pytest.raises(SwapIOError, match="Input/output"):
        read(ns, "a", 100)
    assert torch.equal(read(ns, "a", 100), t(100, 0))
    ns.wait()  # the read reported it: nothing left to raise


def test_an_overwrite_frees_the_old_version_once_it_landed(storage):
    ns = storage.namespace("p")
    for i in range(5):
        ns.put("a", t(4096, i))
    ns.wait()
    assert [k for k in list(storage.engine.keys()) if k.startswith(ns.prefix)] == [ns.physical("a")]
    assert torch.equal(read(ns, "a", 4096), t(4096, 4))
    ns.free("a")
    assert not [k for k in list(storage.engine.keys()) if k.startswith(ns.prefix)]


def test_the_write_queue_bounds_the_bytes_in_flight(storage, monkeypatch):
    storage.queue.limit = 3 * 4096 * 4
    ns = storage.namespace("p")
    most = 0
    for i in range(20):
        ns.put(str(i), t(4096, i))
        most = max(most, storage.queue.queued)
    assert most <= storage.queue.limit
    ns.wait()
    assert storage.queue.queued == 0
    assert all(torch.equal(read(ns, str(i), 4096), t(4096, i)) for i in range(20))


def test_a_write_larger_than_the_queue_does_not_wait_for_itself_the_next_put_waits_for_it(storage):
    storage.queue.limit = 4096 * 4
    ns = storage.namespace("p")
    big = ns.put("big", t(3 * 4096, 1))
    assert not big.settled and storage.queue.queued == 3 * 4096 * 4  # still in flight: the caller goes on
    small = ns.put("small", t(16, 2))
    assert big.settled and storage.queue.queued <= storage.queue.limit  # over the limit: the oldest waited
    ns.wait()
    assert small.settled and storage.queue.queued == 0
    assert torch.equal(read(ns, "big", 3 * 4096), t(3 * 4096, 1))
    assert torch.equal(read(ns, "small", 16), t(16, 2))


def test_a_write_whose_source_is_counted_elsewhere_is_not_counted_by_the_queue(storage):
    ns = storage.namespace("p")
    slot = t(4096, 3)  # e.g. a slot of the optimizer's ring, which outlives the write anyway
    w = ns.put("rec", slot, held=0)
    assert storage.queue.queued == 0
    txn = zs.Transaction()
    staged = ns.put("rec", t(4096, 4), txn, held=0)
    assert storage.queue.queued == 0
    w.settle()
    staged.settle()
    txn.commit()
    assert torch.equal(read(ns, "rec", 4096), t(4096, 4))


# -- transactions ---------------------------------------------------------------------------------------


def test_a_transaction_commits_every_write_at_once(storage):
    a, b = storage.namespace("o"), storage.namespace("p")
    a.put("x", t(10, 0))
    a.wait()
    txn = zs.Transaction()
    a.put("x", t(10, 1), txn)
    b.put("y", t(10, 2), txn)
    assert torch.equal(read(a, "x", 10, txn), t(10, 1))  # the transaction sees its staged value
    assert torch.equal(read(a, "x", 10), t(10, 0)) and "y" not in b  # nobody else does yet
    txn.commit()
    assert torch.equal(read(a, "x", 10), t(10, 1)) and torch.equal(read(b, "y", 10), t(10, 2))
    assert sorted(k for k in list(storage.engine.keys()) if k[0] in "op") == sorted(
        [a.physical("x"), b.physical("y")]
    )


@pytest.mark.parametrize("code", FAULTS)
@pytest.mark.parametrize("skip", [0, 2, 4])
def test_one_failed_write_aborts_the_whole_transaction(storage, code, skip):
    ns = storage.namespace("o")
    for i in range(5):
        ns.put(str(i), t(10, i))
    ns.wait()
    kept = {str(i): ns.physical(str(i)) for i in range(5)}
    fault(storage, "write", code, skip)
    txn = zs.Transaction()
    for i in range(5):
        ns.put(str(i), t(10, 10 + i), txn)
    with pytest.raises(SwapIOError) as ei:
        txn.commit()
    # Completions come in any order across the engine's workers: the fault hits one of the five.
    assert ei.value.errno == code and ei.value.key in {f"{ns.prefix}/{i}" for i in range(5)}
    assert all(torch.equal(read(ns, str(i), 10), t(10, i)) for i in range(5))
    assert {str(i): ns.physical(str(i)) for i in range(5)} == kept
    assert sorted(k for k in list(storage.engine.keys()) if k.startswith("o/")) == sorted(kept.values())
    with pytest.raises(zswap.ZswapError, match="aborted"):
        txn.commit()


def test_abort_restores_the_undo_log_in_memory_and_spilled(storage, monkeypatch):
    monkeypatch.setattr(zs, "UNDO_MEMORY_BYTES", 100)  # everything past 100 bytes goes to the storage
    txn = zs.Transaction()
    txn.uses(storage)
    xs = [t(1000, i) for i in range(4)]
    want = [x.clone() for x in xs]
    for x in xs:
        txn.save(x[100:900])
        x[100:900] = 7.0
    txn.undo.settle()
    assert any(k.startswith("u/") for k in list(storage.engine.keys()))  # spilled, memory copies dropped
    txn.abort()
    assert all(torch.equal(x, w) for x, w in zip(xs, want, strict=True))
    assert not any(k.startswith("u/") for k in list(storage.engine.keys()))


@pytest.mark.parametrize("fail", [None, 3], ids=["all-land", "one-fails"])
def test_spilled_copies_reuse_the_buffers_of_landed_spills(storage, monkeypatch, fail):
    """Past the memory budget the copies being spilled take at most `UNDO_SPILL_BYTES` (the oldest waited
    for), each in a landed spill's buffer where one holds it (a smaller copy in part of one): a step that
    saves every record makes a few buffers, not one per record. The rollback is exact either way — a
    failed spill keeps its copy (its buffer is not reused) and the step fails."""
    monkeypatch.setattr(zs, "UNDO_MEMORY_BYTES", 0)
    monkeypatch.setattr(zs, "SPILL_BUFFER_MIN", 64)
    monkeypatch.setattr(zs, "UNDO_SPILL_BYTES", 2 * 4000)  # two copies of 1000 floats being spilled
    made = []
    empty = storage.engine.empty
    monkeypatch.setattr(storage.engine, "empty", lambda *a: made.append(a) or empty(*a))
    txn = zs.Transaction()
    txn.uses(storage)
    xs = [t(1000 - 100 * (i % 2), i) for i in range(10)]  # of two sizes: the smaller fits the larger's
    want = [x.clone() for x in xs]
    for i, x in enumerate(xs):
        if i == fail:
            fault(storage, "write", errno.ENOSPC)
        txn.save(x)
        x.fill_(7.0)
    assert 1 <= len(made) <= 3 + (fail is not None), made  # engine buffers, 10 copies spilled
    assert txn.undo._spilling <= 2 * 4000
    if fail is None:
        txn.undo.settle()
        assert sum(e[1] is None for e in txn.undo._entries) == 10  # every copy durable, its memory let go
        txn.abort()
    else:
        with pytest.raises(SwapIOError):
            txn.commit()
        assert txn.state == "aborted"
    assert all(torch.equal(x, w) for x, w in zip(xs, want, strict=True))
    assert not any(k.startswith("u/") for k in list(storage.engine.keys()))


def test_a_failed_spill_keeps_its_memory_copy(storage, monkeypatch):
    monkeypatch.setattr(zs, "UNDO_MEMORY_BYTES", 0)
    txn = zs.Transaction()
    txn.uses(storage)
    x = t(1000, 0)
    want = x.clone()
    fault(storage, "write", errno.ENOSPC)
    txn.save(x)
    x.zero_()
    with pytest.raises(SwapIOError):
        txn.commit()  # the undo log could not be made durable: the step fails, and rolls back
    assert torch.equal(x, want) and txn.state == "aborted"


def test_a_transaction_that_does_no_io_keeps_no_undo(storage):
    txn = zs.Transaction()
    x = t(10, 0)
    txn.save(x)  # nothing can fail: nothing saved
    assert not txn.fallible and txn.undo._entries == []


def test_step_transaction_is_joined_by_nested_steps(storage):
    ns = storage.namespace("o")
    with zs.step_transaction() as outer:
        with zs.step_transaction() as inner:
            assert inner is outer and zs.current() is outer
            ns.put("a", t(10, 0), zs.current())
        assert "a" not in ns  # the inner block did not commit
    assert zs.current() is None and torch.equal(read(ns, "a", 10), t(10, 0))


# -- one engine per swap directory -----------------------------------------------------------------------


def test_open_dir_shares_one_storage_per_directory(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        a = zs.open_dir(tmp_path)
        ns = a.namespace("p")
        os.symlink(tmp_path, tmp_path.parent / f"{tmp_path.name}-link")
        b = zs.open_dir(tmp_path.parent / f"{tmp_path.name}-link")
        assert b is a and zs.storage_for(a.engine) is a
        ns2 = b.namespace("o")
        assert ns.prefix != ns2.prefix
        ns.close()
        assert not a.engine.closed  # still used
        ns2.close()
        assert a.engine.closed  # the last namespace closed the engine zswap opened


def test_one_directory_with_other_aio_settings_gets_its_own_engine(tmp_path):
    """A second model on the same ``nvme_path`` asking for other ``aio`` settings gets them (its own
    engine, its own swap files): a checksum it asked for is on; settings equal to the defaults share."""
    base = {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}
    checked = {**base, "aio": {"checksum": "crc32c", "backend": "psync", "block_size": 65536}}
    same_as_default = {**base, "aio": {"checksum": "off", "backend": "auto"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(base):
            a = nn.Linear(64, 64)
        with zswap.Init(checked):
            b = nn.Linear(64, 64)
        with zswap.Init(same_as_default):
            c = nn.Linear(64, 64)
    ea, eb, ec = (param_state(m.weight).store.engine for m in (a, b, c))
    assert eb is not ea and ec is ea
    assert eb.info["checksum"] and eb.info["backend"] == "psync" and eb.info["block_size"] == 65536
    assert not ea.info["checksum"]


def test_params_gradients_and_optimizer_records_share_one_engine(tmp_path):
    cfg = {
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "stage3_param_persistence_threshold": 0,
    }
    m, _ = build(TinyLM, cfg)
    with engine_for(m, cfg) as engine:
        st = param_state(next(m.parameters()))
        assert isinstance(st.grad_store, NvmeGrads)
        opt = engine.optimizer
        assert isinstance(opt, OffloadedAdamW)
        assert st.store.storage is st.grad_store.storage is opt._store.storage  # type: ignore[attr-defined]
        sq(m(ids())).backward()
        engine.step()
        kinds = {k.split("/")[0] for k in list(st.store.engine.keys())}
        assert kinds == {"p", "o"}  # params and records in the one engine (gradients were cleared)


def test_growth_refused_on_a_small_ext4_gives_back_what_it_got(tmp_path):
    """ext4 keeps the blocks a refused fallocate allocated (tmpfs undoes them): the swap file's growth
    ahead of need, refused on a file system smaller than it, must not leave them taken from it."""
    import shutil
    import subprocess

    image, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(48 << 20)  # below the first growth step (64 MiB)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot make an ext4 image here: {made.stderr.strip()}")
    up = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True, text=True)
    if up.returncode != 0:
        pytest.skip(f"cannot mount a loop device here: {up.stderr.strip()}")
    try:
        free = shutil.disk_usage(mnt).free
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zswap.ZswapWarning)
            s = zs.open_dir(mnt)
        ns = s.namespace("p")
        ns.put("a", t(1 << 10, 0))
        assert free - shutil.disk_usage(mnt).free <= 1 << 20  # the file holds what it stores, not the fs
        assert torch.equal(read(ns, "a", 1 << 10), t(1 << 10, 0))
        ns.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_real_full_file_system_keeps_the_old_value_and_space_freed_is_reused(tmp_path):
    """ENOSPC from a real, size-limited tmpfs (skipped where mounting is refused), not injected."""
    from .conftest import mounted

    with mounted("tmpfs", "size=72m") as d:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zswap.ZswapWarning)
            s = zs.open_dir(d)
        ns = s.namespace("p")
        old = t(10 << 20, 0)  # 40 MiB: the file grows once and the rest of the fs cannot hold a copy
        ns.put("a", old)
        ns.wait()
        with pytest.raises(SwapIOError) as ei:
            ns.put("a", t(10 << 20, 1))
            ns.wait()
        assert ei.value.errno == errno.ENOSPC and ei.value.key == f"{ns.prefix}/a"
        assert torch.equal(read(ns, "a", 10 << 20), old)  # copy-on-write: the old value survived
        ns.put("b", t(4 << 20, 2))  # 16 MiB fits in what the file already holds
        ns.wait()
        ns.free("b")
        ns.put("a", t(4 << 20, 3))  # a smaller new value fits: the freed space is reused
        ns.wait()
        assert torch.equal(read(ns, "a", 4 << 20), t(4 << 20, 3))
        ns.close()
