"""SwapEngine behaviour: bitwise round trips, concurrency, fallbacks, faults and cleanup."""

from __future__ import annotations

import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import zswap
from zswap import SwapEngine
from zswap.errors import (
    ConfigError,
    DirectIOUnavailable,
    EngineClosedError,
    NvmePathMissing,
    NvmePathNotADirectory,
    NvmePathNotWritable,
    SwapIOError,
    UnknownKeyError,
    ZswapWarning,
)

from .conftest import mounted, swap_fds

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.bool, torch.complex64]
SIZES = [1, 4095, 4097, 3 * 2**20 + 7]


def filled(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, (n * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=g
    )
    if dtype == torch.bool:
        return (raw[:n] & 1).bool()
    return raw.view(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture
def engine(backend: str, swap_dir: Path):
    with SwapEngine(swap_dir, backend=backend, block_size=1 << 20, queue_depth=8, checksum="crc32c") as e:
        yield e


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_bitwise_for_plain_and_engine_tensors(engine: SwapEngine, dtype: torch.dtype) -> None:
    for i, n in enumerate(SIZES):
        src = filled(n, dtype, seed=i)
        engine.write(f"plain{i}", src).wait()
        out = torch.empty(n, dtype=dtype)
        engine.read(f"plain{i}", out).wait()
        assert same_bytes(out, src), (dtype, n)

        buf = engine.empty((n,), dtype)
        buf.copy_(src)
        engine.write(f"eng{i}", buf).wait()
        back = engine.empty(n, dtype)
        engine.read(f"eng{i}", back).wait()
        assert same_bytes(back, src), (dtype, n)
    assert engine.stats()["bytes_read"] == engine.stats()["bytes_written"]


def test_trim_gives_every_free_byte_back(swap_dir: Path) -> None:
    with SwapEngine(swap_dir, direct=False) as e:
        e.write("a", torch.ones(1 << 18)).wait()
        e.write("b", torch.ones(1 << 18)).wait()
        e.write("c", torch.ones(1 << 18)).wait()
        e.free("a")
        e.free("b")  # 2 MiB free below "c": kept for reuse (far below the 128 MiB threshold)
        assert e.stats()["allocated_bytes"] >= 3 << 20
        e.trim()
        assert (1 << 20) <= e.stats()["allocated_bytes"] < (1 << 20) + (64 << 10)
        back = torch.empty(1 << 18)
        e.read("c", back).wait()
        assert torch.equal(back, torch.ones(1 << 18))
    with pytest.raises(zswap.errors.EngineClosedError):
        e.trim()


@pytest.mark.parametrize("zero_copy_reads", [True, False])
def test_engine_buffers_avoid_bounce_copies_on_write_and_on_read_where_asked(
    swap_dir: Path, zero_copy_reads: bool
) -> None:
    with SwapEngine(swap_dir, block_size=1 << 20, zero_copy_reads=zero_copy_reads) as e:
        if not e.info["direct"]:
            pytest.skip("buffered I/O never bounces")
        assert (e.info["zero_copy_reads"], e.info["zero_copy_reads_reason"]) == (zero_copy_reads, "given")
        src = filled((4 << 20) // 4, torch.float32, seed=9)
        t = e.empty(src.numel(), torch.float32)
        t.copy_(src)
        e.write("k", t).wait()
        assert e.stats()["bounced_blocks"] == 0
        back = e.empty(src.numel(), torch.float32)
        e.read("k", back).wait()
        assert same_bytes(back, src)
        assert e.stats()["bounced_blocks"] == (0 if zero_copy_reads else 4)


def test_reads_bounce_by_default_only_on_a_virtio_disk(swap_dir: Path) -> None:
    """The engine's own choice follows the disk's driver (`machine::zero_copy_reads`, measured there)."""
    st = os.stat(swap_dir)
    dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    link = next((d / "device/driver" for d in (dev, dev / "..") if (d / "device/driver").exists()), None)
    virtio = link is not None and os.path.basename(os.readlink(link)) == "virtio_blk"
    with SwapEngine(swap_dir) as e:
        assert e.info["zero_copy_reads"] is not virtio
        assert ("virtio" in e.info["zero_copy_reads_reason"]) is virtio


def test_a_forked_child_is_refused_the_engine_and_leaves_it_to_the_parent(swap_dir: Path) -> None:
    """fork copies one thread: the child has none of the engine's workers. Its calls raise saying so, and
    its close() and its interpreter's exit tear nothing down (joining the missing threads panicked; the
    read was refused as unmapped memory); the parent reads its data after."""
    script = textwrap.dedent(
        f"""
        import os, sys, torch, zswap
        e = zswap.SwapEngine({str(swap_dir)!r})
        x = torch.arange(1 << 18, dtype=torch.float32)
        e.write("k", x).wait()
        pid = os.fork()
        if pid == 0:
            try:
                e.read("k", torch.empty_like(x))
            except BaseException as exc:  # a Rust panic is a BaseException
                print("child", type(exc).__name__, exc, flush=True)
            e.close()
            print("child closed", e.closed, flush=True)
            sys.exit(0)  # the interpreter's finalization drops the engine too
        _, status = os.waitpid(pid, 0)
        y = torch.empty_like(x)
        e.read("k", y).wait()
        print("parent", os.waitstatus_to_exitcode(status), torch.equal(x, y), os.getpid())
        e.close()
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    child, closed, parent = run.stdout.splitlines()
    assert parent.startswith("parent 0 True ")
    owner = parent.split()[-1]
    assert child.startswith(f"child ZswapError this swap engine was opened in process {owner}, and process ")
    assert closed == "child closed False"


def _without_ipc_lock(memlock: int, script: str) -> subprocess.CompletedProcess[str]:
    """``script`` run as a process that lacks CAP_IPC_LOCK, its RLIMIT_MEMLOCK ``memlock`` bytes (a
    user's lot: root's capability makes every pin succeed)."""
    if shutil.which("setpriv") is None or shutil.which("prlimit") is None or os.geteuid() != 0:
        pytest.skip("needs root with setpriv and prlimit (util-linux) to drop CAP_IPC_LOCK")
    cmd = ["setpriv", "--bounding-set=-ipc_lock", "prlimit", f"--memlock={memlock}:{memlock}"]
    return subprocess.run(
        [*cmd, sys.executable, "-W", "always", "-c", textwrap.dedent(script)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_memlock_limits_are_said_not_silent(swap_dir: Path) -> None:
    """Below the bounce buffers' size, registration (and lock_memory's mlock) is refused: once silent,
    now `info` says why and lock_memory=True warns; at 0, io_uring's own refusal names the limit."""
    run = _without_ipc_lock(
        8 << 20,
        f"""
        import zswap
        with zswap.SwapEngine({str(swap_dir)!r}, lock_memory=True) as e:
            print(e.info["fixed_buffers"], e.info["bounce_bytes"], e.info["fixed_buffers_reason"])
        """,
    )
    assert run.returncode == 0, run.stderr
    fixed, nbytes, why = run.stdout.split(" ", 2)
    assert fixed == "False" and int(nbytes) > 8 << 20
    assert why.startswith(
        f"registering the {int(nbytes) >> 20} MiB of bounce buffers failed: Cannot allocate"
    )
    assert f"RLIMIT_MEMLOCK (8192 KiB here, {int(nbytes) >> 10} KiB needed) without CAP_IPC_LOCK" in why
    assert "ZswapWarning: lock_memory: the" in run.stderr and "could not be locked" in run.stderr
    run = _without_ipc_lock(0, f"import zswap; print(zswap.SwapEngine({str(swap_dir)!r}).info['backend'])")
    assert run.returncode == 0 and run.stdout == "psync\n", run.stderr
    assert (
        "io_uring unavailable (Cannot allocate memory: pinned memory is charged to RLIMIT_MEMLOCK (0 KiB"
        in (run.stderr)
    )


def test_a_file_size_limit_grows_the_file_by_just_what_is_needed(tmp_path: Path) -> None:
    """Under RLIMIT_FSIZE the growth ahead of need (64 MiB) is refused with EFBIG: once a 4 MiB write
    failed so with 10 MiB allowed; now the file grows by what the write needs, as after ENOSPC."""
    if shutil.which("prlimit") is None:
        pytest.skip("needs prlimit (util-linux)")
    script = f"""
        import zswap, torch
        with zswap.SwapEngine({str(tmp_path)!r}) as e:
            e.write("a", torch.zeros(1 << 20)).wait()
            print(e.stats()["file_bytes"] >> 20)
            try:
                e.write("b", torch.zeros(2 << 20)).wait()
            except OSError as x:
                print(x.errno, x.length)
    """
    run = subprocess.run(
        ["prlimit", f"--fsize={10 << 20}", sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["4", f"27 {8 << 20}"]  # EFBIG: 8 MiB more would pass 10 MiB


def test_backends_store_identical_bytes(swap_dir: Path) -> None:
    if zswap._zswap.io_uring_available() is not None:
        pytest.skip("io_uring refused on this machine")
    src = filled(3 * 2**20 + 7, torch.float32, seed=5)
    outs = []
    for backend in ("io_uring", "psync"):
        with SwapEngine(swap_dir, backend=backend) as e:
            e.write("x", src).wait()
            out = torch.empty_like(src)
            e.read("x", out).wait()
            outs.append(out)
            assert e.stats()["backend"] == backend
    assert same_bytes(outs[0], outs[1]) and same_bytes(outs[0], src)


@pytest.mark.parametrize("spare", [True, False])
def test_bounced_blocks_round_trip_with_and_without_a_spare_buffer(swap_dir: Path, spare: bool) -> None:
    if zswap._zswap.io_uring_available() is not None:
        pytest.skip("io_uring refused on this machine")
    block, depth, threads = 64 << 10, 4, 2
    budget = None if spare else depth * block  # exactly one buffer per slot: no copy ahead
    with SwapEngine(
        swap_dir, backend="io_uring", block_size=block, queue_depth=depth, threads=threads,
        pinned_memory_budget=budget, checksum="crc32c",
    ) as e:  # fmt: skip
        assert e.info["bounce_spare"] == (1 if spare else 0)
        assert e.info["bounce_bytes"] == (depth // threads + e.info["bounce_spare"]) * threads * block
        # Many blocks of ordinary memory at an odd offset: every block bounces, most are copied ahead.
        srcs = [filled(40 * block // 4 + 3, torch.float32, seed=s)[1:] for s in range(3)]
        handles = [e.write(f"k{i}", t) for i, t in enumerate(srcs)]
        for h in handles:
            h.wait()
        outs = [torch.empty(t.numel() + 1, dtype=torch.float32)[1:] for t in srcs]
        for h in [e.read(f"k{i}", o) for i, o in enumerate(outs)]:
            h.wait()
        assert all(same_bytes(o, t) for o, t in zip(outs, srcs, strict=True))
        assert e.stats()["bounced_blocks"] == e.stats()["blocks"] > 6 * 40


def test_eight_threads_many_keys(engine: SwapEngine) -> None:
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            handles = []
            tensors = {
                f"{t}/{k}": filled(1000 + 7919 * k, torch.float32, seed=t * 100 + k) for k in range(24)
            }
            for key, v in tensors.items():
                handles.append(engine.write(key, v))
            for h in handles:
                h.wait()
            for key, v in tensors.items():
                out = torch.empty_like(v)
                engine.read(key, out).wait()
                assert same_bytes(out, v), key
            for key in list(tensors)[::2]:
                engine.free(key)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert engine.stats()["keys"] == 8 * 12


def test_multiple_paths_stripe(tmp_path: Path, backend: str) -> None:
    dirs = [tmp_path / f"d{i}" for i in range(3)]
    for d in dirs:
        d.mkdir()
    with SwapEngine(dirs, backend=backend, block_size=4096) as e:
        src = filled(100_003, torch.int8, seed=1)
        e.write("s", src).wait()
        out = torch.empty_like(src)
        e.read("s", out).wait()
        assert same_bytes(out, src)
        assert e.info["paths"] == [str(d) for d in dirs]


def test_overwrite_replaces_and_read_waits_for_pending_write(engine: SwapEngine) -> None:
    a, b = filled(2**20, torch.float32, 1), filled(2**20, torch.float32, 2)
    engine.write("k", a).wait()
    engine.write("k", b)  # not waited: the read must still see b
    out = torch.empty_like(b)
    engine.read("k", out).wait()
    assert same_bytes(out, b)


def test_non_contiguous_write_and_shapes(engine: SwapEngine) -> None:
    src = filled(64 * 64, torch.float32, 3).view(64, 64).t()
    engine.write("t", src).wait()
    out = torch.empty(64, 64)
    engine.read("t", out).wait()
    assert same_bytes(out, src.contiguous())
    with pytest.raises(ValueError, match="contiguous"):
        engine.read("t", torch.empty(64, 64).t())


def test_read_size_must_match(engine: SwapEngine) -> None:
    engine.write("k", torch.zeros(10)).wait()
    with pytest.raises(ValueError, match=r"key 'k' holds 40 bytes but out holds 44"):
        engine.read("k", torch.empty(11))
    engine.read("k", torch.empty(10, dtype=torch.int32)).wait()  # same bytes, other dtype: fine


def test_bad_arguments(engine: SwapEngine, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="keys are str"):
        engine.write(3, torch.zeros(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        engine.write("k", [1, 2])  # type: ignore[arg-type]
    # Every refused engine argument is a ConfigError (a ZswapError and a ValueError), whichever side checks.
    bad: list[tuple[dict[str, Any], str]] = [
        ({"block_size": 5000}, "block_size must be a power of two"),
        ({"backend": "aio"}, "backend must be one of"),
        ({"direct": "yes"}, "direct must be True, False or 'auto'"),
        ({"checksum": "md5"}, "checksum must be one of"),
        ({"threads": 0}, "threads must be a positive integer, got 0"),
        ({"queue_depth": 0}, "queue_depth must be a positive integer, got 0"),
        ({"pinned_memory_budget": 4096}, "pinned_memory_budget 4096 bytes is too small"),
    ]
    for kwargs, message in bad:
        with pytest.raises(zswap.ConfigError, match=re.escape(message)):
            SwapEngine(tmp_path, **kwargs)
    with pytest.raises(zswap.ConfigError, match="SwapEngine needs at least one path"):
        SwapEngine([])


def test_unknown_key_and_closed_engine(swap_dir: Path, backend: str) -> None:
    e = SwapEngine(swap_dir, backend=backend)
    with pytest.raises(UnknownKeyError, match="unknown key 'nope'"):
        e.read("nope", torch.empty(1))
    with pytest.raises(KeyError):
        e.free("nope")
    e.write("k", torch.zeros(4)).wait()
    e.close()
    e.close()  # idempotent
    with pytest.raises(EngineClosedError, match="closed"):
        e.write("k", torch.zeros(1))
    # Every call says closed — not "unknown key" for a key it held.
    calls = {
        "read": lambda: e.read("k", torch.empty(4)),
        "free": lambda: e.free("k"),
        "nbytes": lambda: e.nbytes("k"),
        "contains": lambda: "k" in e,
        "keys": lambda: list(e.keys()),
        "empty": lambda: e.empty(4),
        "empty0": lambda: e.empty(0),
    }
    for name, call in calls.items():
        with pytest.raises(EngineClosedError, match="closed"):
            call()
            pytest.fail(f"{name} worked on a closed engine")
    assert e.stats()["keys"] == 0 and e.closed
    assert isinstance(EngineClosedError("x"), zswap.ZswapError)


def test_missing_and_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as ei:
        SwapEngine(tmp_path / "typo")
    assert ei.value.filename == str(tmp_path / "typo") and ei.value.errno == 2
    assert isinstance(ei.value, NvmePathMissing) and isinstance(ei.value, ConfigError)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError) as ei2:
        SwapEngine(f)
    assert isinstance(ei2.value, NvmePathNotADirectory) and isinstance(ei2.value, zswap.ZswapError)
    # A directory that exists, on a file system that takes no new file: once said not to exist.
    with pytest.raises(NvmePathNotWritable, match=r"exists, but its file system refused a new file") as ei3:
        SwapEngine("/proc")
    assert ei3.value.errno == 2 and ei3.value.filename == "/proc"


def test_io_error_names_errno_path_offset_length_and_leaves_source_intact(engine: SwapEngine) -> None:
    src = filled(3 * 2**20, torch.float32, 4)
    keep = src.clone()
    engine._engine.inject_fault("write", "errno", 5, skip=1)  # EIO on the second block
    h = engine.write("k", src)
    with pytest.raises(SwapIOError) as ei:
        h.wait()
    err = ei.value
    assert (err.errno, err.key, err.length) == (5, "k", 1 << 20)
    # The second completion: on a ring block 1, across psync's threads any of the 12 (once always None).
    assert 0 <= err.block < src.nbytes >> 20 and f"block={err.block}" in str(err)
    assert err.path == str(engine.info["paths"][0]) and err.offset is not None and err.offset % 4096 == 0
    assert "write failed: Input/output error" in str(err) and "key='k'" in str(err)
    with pytest.raises(SwapIOError):  # raised every time it is waited on
        h.wait()
    assert same_bytes(src, keep)
    with pytest.raises(SwapIOError, match="last write failed"):
        engine.read("k", torch.empty_like(src))
    engine.write("k", src).wait()  # still usable
    out = torch.empty_like(src)
    engine.read("k", out).wait()
    assert same_bytes(out, src)


def test_short_transfers_are_completed(engine: SwapEngine) -> None:
    short = 4096 if engine.info["direct"] else 1000
    engine._engine.inject_fault("write", "short", short, count=3)
    engine._engine.inject_fault("read", "short", short, count=3)
    src = filled(3 * 2**20, torch.float32, 6)
    engine.write("k", src).wait()
    out = torch.empty_like(src)
    engine.read("k", out).wait()
    assert same_bytes(out, src)
    assert engine.stats()["short_transfers"] >= 6


def test_checksum_catches_corruption_on_disk(engine: SwapEngine) -> None:
    src = filled(3 * 2**20, torch.float32, 7)
    engine.write("k", src).wait()
    # The swap file has no name; reach it through this process's descriptor table and flip a byte of
    # the second block (buffered writes through /proc are made coherent with O_DIRECT reads by the kernel).
    fd = os.open(swap_fds(engine)[0], os.O_RDWR)
    try:
        b = os.pread(fd, 1, (1 << 20) + 10)
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), (1 << 20) + 10)
        os.fsync(fd)
    finally:
        os.close(fd)
    with pytest.raises(SwapIOError) as ei:
        engine.read("k", torch.empty_like(src)).wait()
    assert ei.value.key == "k" and ei.value.block == 1 and "checksum mismatch" in str(ei.value)


def test_enospc_on_a_tiny_file_system_keeps_source_and_engine(backend: str) -> None:
    with mounted("tmpfs", "size=2m") as d, SwapEngine(d, backend=backend) as e:
        src = filled(2**20, torch.float32, 8)  # 4 MiB into 2 MiB
        keep = src.clone()
        with pytest.raises(SwapIOError) as ei:
            e.write("big", src).wait()
        assert ei.value.errno == 28 and ei.value.path == str(d)
        assert ei.value.offset is not None and ei.value.length is not None and ei.value.length > 0
        assert same_bytes(src, keep)
        small = filled(1000, torch.float32, 9)
        e.write("small", small).wait()
        out = torch.empty_like(small)
        e.read("small", out).wait()
        assert same_bytes(out, small)


def test_buffered_fallback_where_o_direct_is_refused(backend: str) -> None:
    # ramfs has no direct I/O (tmpfs gained it in Linux 6.6, so it no longer serves for this test).
    with mounted("ramfs") as d:
        with pytest.warns(ZswapWarning, match="direct I/O unavailable"):
            e = SwapEngine(d, backend=backend, direct="auto")
        with e:
            assert e.info["direct"] is False
            src = filled(4097, torch.float16, 10)
            e.write("k", src).wait()
            out = torch.empty_like(src)
            e.read("k", out).wait()
            assert same_bytes(out, src)
        assert list(d.iterdir()) == []
        with pytest.raises(DirectIOUnavailable, match=r"direct I/O \(O_DIRECT\) was required but refused"):
            SwapEngine(d, backend=backend, direct=True)


def test_tmpfs_buffered_round_trip(backend: str) -> None:
    with mounted("tmpfs", "size=64m") as d, SwapEngine(d, backend=backend, direct=False) as e:
        src = filled(4097, torch.bfloat16, 11)
        e.write("k", src).wait()
        out = torch.empty_like(src)
        e.read("k", out).wait()
        assert same_bytes(out, src) and e.info["direct"] is False


def test_close_leaves_no_files(swap_dir: Path, backend: str) -> None:
    before = set(swap_dir.iterdir())
    e = SwapEngine(swap_dir, backend=backend)
    e.write("k", torch.ones(2**20)).wait()
    assert set(swap_dir.iterdir()) == before  # unlinked from the start
    e.close()
    assert set(swap_dir.iterdir()) == before


def test_kill_9_leaves_no_files(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys, torch, zswap
        e = zswap.SwapEngine({str(tmp_path)!r})
        e.write("k", torch.ones(4 << 20)).wait()
        print("ready", flush=True)
        sys.stdin.read()
        """
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait(timeout=30)
        for stream in (p.stdin, p.stdout):
            if stream is not None:
                stream.close()
    assert list(tmp_path.iterdir()) == []


def test_other_threads_run_while_one_waits(engine: SwapEngine) -> None:
    src = engine.empty(64 << 20 >> 2, torch.float32)
    engine.write("big", src).wait()
    out = engine.empty(64 << 20 >> 2, torch.float32)
    ticks = 0
    stop = threading.Event()

    def spin() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0)

    th = threading.Thread(target=spin)
    th.start()
    try:
        start = ticks
        for _ in range(4):
            engine.read("big", out).wait()
        progressed = ticks - start
    finally:
        stop.set()
        th.join()
    assert progressed > 0


def test_dropped_handle_keeps_tensor_alive_until_done(engine: SwapEngine) -> None:
    src = filled(8 * 2**20, torch.float32, 12)
    engine.write("k", src).wait()
    out = torch.empty_like(src)
    ref = weakref.ref(out)
    engine.read("k", out)  # handle dropped at once
    del out
    gc.collect()
    engine.read("k", torch.empty_like(src)).wait()  # later calls release finished orphans
    engine.free("k")  # waits for every reader of the key
    engine.write("k2", torch.zeros(1)).wait()
    assert ref() is None


def test_engine_buffers_are_freed_with_their_tensors(engine: SwapEngine) -> None:
    t = engine.empty(2**20, torch.float32)
    assert engine.stats()["live_buffers"] == 1
    view = t[10:20]
    del t
    gc.collect()
    view.fill_(1.0)  # the storage keeps the mapping alive
    assert engine.stats()["live_buffers"] == 1
    del view
    gc.collect()
    assert engine.stats()["live_buffers"] == 0


def test_zero_element_tensors(engine: SwapEngine) -> None:
    engine.write("z", torch.empty(0)).wait()
    engine.read("z", torch.empty(0, 5)).wait()
    assert engine.nbytes("z") == 0 and "z" in engine
    assert engine.empty((0, 3)).shape == (0, 3)


def test_psync_fallback_when_io_uring_is_refused(tmp_path: Path) -> None:
    # A child process, so the environment switch and the once-per-process warning stay there.
    code = textwrap.dedent(
        f"""
        import warnings, torch, zswap
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as w:
            e1 = zswap.SwapEngine({str(tmp_path)!r})
            e2 = zswap.SwapEngine({str(tmp_path)!r})
        assert e1.info["backend"] == "psync" == e2.info["backend"], e1.info
        msgs = [str(x.message) for x in w if issubclass(x.category, zswap.ZswapWarning)]
        # The switch is named (an EPERM alone reads like a kernel's or sandbox's refusal).
        assert msgs == ["io_uring unavailable (ZSWAP_DISABLE_IO_URING is set), using the psync backend"], msgs
        t = torch.arange(5000.0)
        e1.write("k", t).wait()
        out = torch.empty_like(t)
        e1.read("k", out).wait()
        assert torch.equal(out, t)
        try:
            zswap.SwapEngine({str(tmp_path)!r}, backend="io_uring")
        except zswap.errors.BackendUnavailable as err:
            assert err.errno == 1 and "io_uring was required but refused" in str(err), err
            assert "ZSWAP_DISABLE_IO_URING is set" in str(err), err
        else:
            raise AssertionError("backend='io_uring' must not fall back")
        print("ok")
        """
    )
    env = {**os.environ, "ZSWAP_DISABLE_IO_URING": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
