"""`zswap._stfile.Readahead`: the page-cache readahead that keeps the disk busy while checkpoints load.

It is a hint: it never changes what is loaded (every load test checks the bytes). What is checked here is
that it advises the ranges the loader will read, in the loader's order, never more than its window ahead of
the loader, that an unreadable range costs nothing, and that ``from_pretrained`` under ``Init`` starts one
over this rank's slices before transformers' own set-up work.
"""

from __future__ import annotations

import os
import queue
from pathlib import Path

import pytest

import zswap
import zswap._stfile as stfile

from ._pretrained import init_for, save

MIB = 1 << 20


class Advice:
    """Records every WILLNEED the readahead gives, and the loader's position when it gave it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: queue.Queue[tuple[str, int, int]] = queue.Queue()
        self.ra: stfile.Readahead | None = None
        self.ahead: list[int] = []
        real = os.posix_fadvise

        def spy(fd: int, offset: int, length: int, advice: int) -> None:
            assert advice == os.POSIX_FADV_WILLNEED
            if self.ra is not None:  # bytes advised before this call, past what the loader has consumed
                self.ahead.append(self.advised - self.ra._consumed)
            self.advised += length
            self.calls.put((os.readlink(f"/proc/self/fd/{fd}"), offset, length))
            real(fd, offset, length, advice)

        self.advised = 0
        monkeypatch.setattr(os, "posix_fadvise", spy)

    def next(self) -> tuple[str, int, int]:
        return self.calls.get(timeout=60)


def test_advises_in_the_loaders_order_within_the_window(tmp_path, monkeypatch):
    f = tmp_path / "ckpt.bin"
    with open(f, "wb") as fh:
        fh.truncate(64 * MIB)
    path = str(f.resolve())
    ranges = [(path, i * 4 * MIB, 4 * MIB) for i in range(6)]
    ranges.insert(2, None)  # an item that reads nothing from a file
    advice = Advice(monkeypatch)
    advice.ra = ra = stfile.Readahead.__new__(stfile.Readahead)  # the spy sees it before its thread starts
    stfile.Readahead.__init__(ra, ranges, window=8 * MIB)
    try:
        assert [advice.next(), advice.next()] == [ranges[0], ranges[1]]
        ra.done(0)
        assert advice.next() == ranges[3]
        ra.done(3)  # items 1, 2 and 3 done at once
        assert [advice.next(), advice.next()] == [ranges[4], ranges[5]]
        ra.done(4)
        assert advice.next() == ranges[6]
    finally:
        ra.close()
    assert advice.calls.empty()
    assert advice.ahead and max(advice.ahead) < 8 * MIB


def test_large_ranges_are_advised_in_pieces(tmp_path, monkeypatch):
    f = tmp_path / "big.bin"
    with open(f, "wb") as fh:
        fh.truncate(80 * MIB)
    monkeypatch.setattr(stfile, "advice_bytes", lambda fd: 32 * MIB)
    advice = Advice(monkeypatch)
    ra = stfile.Readahead([(str(f.resolve()), 4096, 70 * MIB)], window=1 << 30)
    got = [advice.next() for _ in range(3)]
    ra.close()
    assert [(o, n) for _, o, n in got] == [
        (4096, 32 * MIB),
        (4096 + 32 * MIB, 32 * MIB),
        (4096 + 64 * MIB, 6 * MIB),
    ]


def test_advice_pieces_are_what_the_kernel_reads_per_call(tmp_path):
    f = tmp_path / "f.bin"
    f.write_bytes(b"x")
    fd = os.open(f, os.O_RDONLY)
    try:
        got = stfile.advice_bytes(fd)
        dev = os.fstat(fd).st_dev
    finally:
        os.close(fd)
    queue = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    queue = queue / "queue" if (queue / "queue").exists() else queue.parent / "queue"
    if not queue.exists():
        assert got == 128 << 10
        return
    kib = max(int((queue / "read_ahead_kb").read_text()), int((queue / "max_sectors_kb").read_text()))
    assert got == min(max(kib, 128), 8192) * 1024
    assert stfile.advice_bytes(-1) == 128 << 10


def test_an_unreadable_range_is_skipped_and_frees_its_window(tmp_path, monkeypatch):
    f = tmp_path / "ok.bin"
    with open(f, "wb") as fh:
        fh.truncate(8 * MIB)
    ok = (str(f.resolve()), 0, 4 * MIB)
    advice = Advice(monkeypatch)
    ra = stfile.Readahead([(str(tmp_path / "missing.bin"), 0, 4 * MIB), ok], window=4 * MIB)
    ra.done(0)
    assert advice.next() == ok
    ra.close()
    assert ra._thread is not None and not ra._thread.is_alive()


def test_nothing_to_read_starts_no_thread():
    ra = stfile.Readahead([None, None])
    assert ra._thread is None
    ra.close()


@pytest.mark.usefixtures("quiet_transformers")
@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_from_pretrained_under_init_primes_the_checkpoint_first(sharded, tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    ckpt = save("gpt2", tmp_path / "ckpt", sharded=sharded)
    made: list[tuple[list[tuple[str, int, int] | None], bool]] = []
    events: list[str] = []

    class Spy(stfile.Readahead):
        def __init__(self, ranges, window=stfile.READAHEAD_BYTES):  # type: ignore[no-untyped-def]
            ranges = list(ranges)
            events.append("readahead")
            made.append((ranges, False))
            super().__init__(ranges, window)

        def close(self) -> None:
            super().close()
            events.append("closed")

    real_read = stfile.read_range

    def read(entry, start, out):  # type: ignore[no-untyped-def]
        if not events or events[-1] != "read":
            events.append("read")
        real_read(entry, start, out)

    monkeypatch.setattr(stfile, "Readahead", Spy)
    monkeypatch.setattr(stfile, "read_range", read)
    with init_for("nvme", tmp_path):
        m = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    assert all(zswap.param_state(p) is not None for p in m.parameters())
    # The prime (before any weight is read), then the load's own readahead over what it reads; both closed.
    assert events == ["readahead", "readahead", "read", "closed", "closed"]
    entries = sorted(stfile.resolve(ckpt).values(), key=lambda e: (e.path, e.offset))
    want = [(e.path, e.offset, e.numel * e.dtype.itemsize) for e in entries if e.numel]
    assert made[0][0] == want
    assert sorted(r for r in made[1][0] if r is not None) == sorted(want)
    made.clear()
    events.clear()
    transformers.AutoModelForCausalLM.from_pretrained(ckpt)  # outside Init: transformers' own load
    assert made == []


def test_a_hub_id_or_a_folder_without_safetensors_is_not_primed(tmp_path, monkeypatch):
    from zswap import _hf
    from zswap.init import _CTX

    made: list[object] = []
    monkeypatch.setattr(stfile, "Readahead", lambda *a, **k: made.append(a))
    (tmp_path / "empty").mkdir()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with init_for("cpu", tmp_path):
        assert _CTX.active
        for where in ("gpt2-does-not-exist/locally", tmp_path / "empty", tmp_path / "bin", None):
            assert _hf._prime(_CTX, where, {}) is None
        assert _hf._prime(_CTX, tmp_path / "bin", {"variant": "fp16"}) is None
    assert made == []
