"""`SwapEngine.empty` without the buffer protocol (abi3-py310): the tensor is the engine buffer itself and
keeps it alive."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

import zswap
from zswap._memview import tensor_over


def test_empty_tensor_is_the_engine_buffer_and_outlives_its_owners(tmp_path: Path) -> None:
    with zswap.SwapEngine(tmp_path, zero_copy_reads=True) as eng:
        t = eng.empty((3, 1 << 18), torch.float32)  # 3 MiB: huge-page backed, several blocks
        assert t.data_ptr() % 4096 == 0 and torch.count_nonzero(t) == 0
        want = torch.randn(t.shape, generator=torch.Generator().manual_seed(1))
        t.copy_(want)
        eng.write("k", t).wait()
        if eng.info["direct"]:
            assert eng.stats()["bounced_blocks"] == 0  # the engine saw its own memory: zero-copy
        back = eng.empty(t.shape, torch.float32)
        eng.read("k", back).wait()
        assert torch.equal(back.view(torch.int32), want.view(torch.int32))
    view = back[1:]
    del eng, back, t
    gc.collect()
    assert torch.equal(view.view(torch.int32), want[1:].view(torch.int32))  # still mapped


def test_tensor_over_refuses_lengths_outside_the_buffer(tmp_path: Path) -> None:
    eng = zswap._zswap.Engine([str(tmp_path)])
    try:
        buf = eng.alloc(4096)
        assert tensor_over(buf, 4096).numel() == 4096
        for bad in (0, 4097):
            with pytest.raises(ValueError, match=rf"nbytes {bad} outside the buffer's 1..4096 bytes"):
                tensor_over(buf, bad)
    finally:
        eng.close()
