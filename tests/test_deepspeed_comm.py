"""``zswap.deepspeed.comm`` and ``zswap.deepspeed.accelerator``: DeepSpeed's ``deepspeed.comm`` and
``get_accelerator()`` for scripts ported by changing their imports."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zswap.deepspeed as deepspeed
import zswap.deepspeed.comm as dist
from zswap.deepspeed.accelerator import Accelerator, get_accelerator

from .conftest import run_ranks


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_a_script_on_deepspeeds_comm_and_accelerator_runs_over_ranks(world, tmp_path):
    """See `_ds_comm_dist_worker.py`."""
    run_ranks(Path(__file__).with_name("_ds_comm_dist_worker.py"), tmp_path, world=world)


def test_the_package_exposes_both_as_deepspeed_does():
    assert deepspeed.comm is dist and deepspeed.accelerator.get_accelerator is get_accelerator
    assert dist.init_distributed.__doc__ and dist.is_available() is torch.distributed.is_available()
    assert dist.ReduceOp is torch.distributed.ReduceOp


def test_a_collective_keeps_deepspeeds_keywords_and_refuses_its_logger():
    with pytest.raises(TypeError, match=r"all_reduce\(prof=True\): DeepSpeed's communication logger"):
        dist.all_reduce(torch.ones(1), prof=True)
    with pytest.raises(AttributeError, match=r"zswap.deepspeed.comm has no 'log_summary'"):
        dist.log_summary()  # type: ignore[operator]


def test_local_rank_comes_from_the_launcher(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_RANK", raising=False)
    assert dist.get_local_rank() == 0
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2")
    assert dist.get_local_rank() == 2
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert dist.get_local_rank() == 3 and get_accelerator().current_device() == (
        torch.cuda.current_device() if torch.cuda.is_available() else 3
    )


def test_the_cpu_accelerator_answers_as_deepspeeds_with_gloo():
    acc = Accelerator("cpu")
    assert (acc.device_name(), acc.device_name(1), acc.current_device_name()) == ("cpu", "cpu", "cpu")
    assert acc.communication_backend_name() == "gloo" and acc.is_available() and acc.is_synchronized_device()
    assert acc.supported_dtypes() == [torch.float32, torch.bfloat16, torch.float16]
    assert acc.is_bf16_supported() and acc.is_fp16_supported() and not acc.is_triton_supported()
    assert acc.Stream is None and acc.Event is None and acc.current_stream() is None and acc.device() is None
    with acc.stream(None):
        acc.synchronize()
    t = acc.LongTensor([1, 2])
    assert t.dtype == torch.int64 and t.device.type == "cpu" and acc.on_accelerator(t)
    assert acc.pin_memory(t) is t and not acc.is_pinned(t)
    acc.manual_seed(5)
    a = torch.rand(3)
    acc.manual_seed_all(5)
    assert torch.equal(a, torch.rand(3)) and acc.initial_seed() == 5
    state = acc.get_rng_state()
    b = torch.rand(2)
    acc.set_rng_state(state)
    assert torch.equal(b, torch.rand(2))


def test_the_cpu_accelerators_memory_figures_are_the_process_rss():
    acc = Accelerator("cpu")
    assert 0 < acc.memory_allocated() <= acc.max_memory_allocated() <= acc.total_memory()
    grown = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB touched: the peak rises past it
    peak = acc.max_memory_allocated()
    assert peak >= acc.memory_allocated() >= 64 << 20
    del grown
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() < peak and 0 < acc.available_memory() < acc.total_memory()


def test_what_the_accelerator_does_not_have_is_named():
    acc = Accelerator("cpu")
    with pytest.raises(AttributeError, match=r"no 'create_op_builder': DeepSpeed's compiled ops are") as e:
        acc.create_op_builder("CPUAdamBuilder")
    import zswap.optim

    assert "CPU Adam is zswap.optim.OffloadedAdamW," in str(e.value) and zswap.optim.OffloadedAdamW
    with pytest.raises(AttributeError, match=r"no 'amp': it answers DeepSpeed's device"):
        acc.amp()
    with pytest.raises(ValueError, match="'cuda' or 'cpu', not 'xpu'"):
        Accelerator("xpu")


def test_get_accelerator_is_the_device_initialize_computes_on():
    acc = get_accelerator()
    assert acc is get_accelerator()
    assert acc.device_name() == ("cuda" if torch.cuda.is_available() else "cpu")
