"""`zswap._stread.RangedFile`, the one ranged reader under both entry points: ``read_range`` (weights
loading, ``from_pretrained`` under ``Init``; buffered) and ``TensorFile`` (checkpoints, ``zswap export``;
direct). Short reads are continued, and a read the kernel fails is a `CheckpointError` naming the file and
the tensor, from either."""

from __future__ import annotations

import errno
import mmap
import os
import re

import pytest
import torch
from safetensors.torch import save_file

from zswap import _stfile, _stread
from zswap.checkpoint.errors import CheckpointCorruptError, CheckpointError

CAP = 3 * 4096  # a short read of whole blocks, so O_DIRECT reads stay aligned


@pytest.fixture
def weights(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(5, 7, generator=g),
        "w": torch.randn(1000, 300, generator=g),  # about 1.2 MB: many short reads, several stages
        "z": torch.arange(13, dtype=torch.int64),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def _aligned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor in page-aligned memory (so a direct read may go in place)."""
    mem = mmap.mmap(-1, max(numel * dtype.itemsize, 1))
    return torch.frombuffer(mem, dtype=dtype, count=numel)


def _all_reads(path, tensors):
    """Every tensor of ``path``, in whole and from the middle, through both readers; checks each."""
    for name, e in _stfile.read_header(str(path)).items():
        want = tensors[name].reshape(-1)
        t = torch.empty(e.numel, dtype=e.dtype)
        _stfile.read_range(e, 0, t)
        assert torch.equal(t, want), name
        half = e.numel // 2
        t = torch.empty(e.numel - half, dtype=e.dtype)
        _stfile.read_range(e, half, t)
        assert torch.equal(t, want[half:]), name
    for direct in (False, True):
        with _stfile.TensorFile(path, direct=direct) as f:
            for name, want in tensors.items():
                for out in (torch.empty(want.numel(), dtype=want.dtype), _aligned(want.numel(), want.dtype)):
                    f.read_elements(name, 0, out)
                    assert torch.equal(out, want.reshape(-1)), (name, direct)


def test_short_reads_are_continued_by_both_readers(weights, monkeypatch):
    path, tensors = weights
    real = os.preadv
    calls = []

    def short(fd, bufs, offset):
        calls.append(offset)
        return real(fd, [bufs[0][:CAP]], offset)

    monkeypatch.setattr(os, "preadv", short)
    _all_reads(path, tensors)
    assert len(calls) > 2 * (path.stat().st_size // CAP)  # the cap did cut reads short


def test_a_failed_read_names_the_file_and_the_tensor_from_both_readers(weights, monkeypatch):
    path, _ = weights
    entries = _stfile.read_header(str(path))
    data_start = min(e.offset for e in entries.values())
    real = os.preadv

    def failing(fd, bufs, offset):
        if offset + len(bufs[0]) > data_start:  # the header reads, the data fails
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", failing)
    e = entries["w"]
    with pytest.raises(CheckpointError) as info:
        _stfile.read_range(e, 10, torch.empty(100))
    assert isinstance(info.value, _stread.CheckpointReadError)
    assert str(path) in str(info.value) and "'w'" in str(info.value)
    assert os.strerror(errno.EIO) in str(info.value)
    for direct in (False, True):
        with _stfile.TensorFile(path, direct=direct) as f, pytest.raises(CheckpointCorruptError) as info:
            f.read_elements("w", 0, torch.empty(300_000))
        assert str(path) in str(info.value) and "'w'" in str(info.value), direct


def test_a_file_cut_short_after_its_header_was_read_is_refused_by_both(weights):
    path, _ = weights
    (e,) = [e for n, e in _stfile.read_header(str(path)).items() if n == "w"]
    with _stfile.TensorFile(path) as f:
        os.truncate(path, e.offset + 100)
        with pytest.raises(
            CheckpointCorruptError, match=rf"{re.escape(str(path))}: truncated: .* reading 'w'"
        ):
            f.read_elements("w", 0, torch.empty(300_000))
    with pytest.raises(CheckpointCorruptError, match=r"replaced or changed after its header was read .*'w'"):
        _stfile.read_range(e, 0, torch.empty(10))
