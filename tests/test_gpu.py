"""The CUDA compute path: models built under ``Init(nvme)`` on the CPU and run on the GPU through
`zswap.initialize(device="cuda")` give bitwise the logits and gradients of the plain CUDA model with the same
weights (deterministic algorithms on); three AdamW steps match ``torch.optim.AdamW(fused=True)`` on CUDA;
bf16 trains; GPU memory stays within live budget + prefetch bucket + activations; ``close()`` leaves no
host memory registered with CUDA. Skipped cleanly where there is no CUDA device (`pytest -m gpu`)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import zswap
from zswap import Status, full_grad, param_state
from zswap.device import CudaDevice

from .test_runtime import MLP, STREAM, Block, TinyLM, ids, sq

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
# Deterministic cuBLAS: read when the first cuBLAS handle is made (benches/gpu_check.sh exports it too).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(autouse=True)
def deterministic() -> Iterator[None]:
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def nvme_config(tmp_path: Path, **zero: Any) -> dict[str, Any]:
    return {
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
        "zero_optimization": {**STREAM, **zero},
    }


def build(make: Callable[[], nn.Module], cfg: dict[str, Any]) -> tuple[nn.Module, nn.Module]:
    """(the model under Init on the CPU, partitioned to NVMe; the plain CUDA model with the same weights)."""
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    before = torch.cuda.memory_allocated()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            m = make()
    assert torch.cuda.memory_allocated() == before  # Init put nothing on the GPU
    with zswap.GatheredParameters(list(m.parameters())):
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q)  # same weights: the comparisons below are against this model
    return m, ref.to(CUDA)


def engine_for(m: nn.Module, cfg: dict[str, Any], **kwargs: Any) -> zswap.Engine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        return zswap.initialize(m, cfg, device="cuda", **kwargs)


def assert_bitwise_grads(m: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is None, f"{name}: a full-size gradient was left in p.grad"
        g = full_grad(p)
        assert (g is None) == (q.grad is None), name
        if g is not None:
            assert g.device.type == "cuda", name
            assert torch.equal(g, q.grad), f"{name}: max diff {(g - q.grad).abs().max()}"


def released(m: nn.Module) -> bool:
    return all(param_state(p).status is Status.NOT_AVAILABLE and p.numel() == 0 for p in m.parameters())


def test_none_means_the_current_cuda_device(tmp_path):
    cfg = nvme_config(tmp_path)
    m, _ = build(MLP, cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        engine = zswap.initialize(m, cfg)
    with engine:
        assert isinstance(engine.compute_device, CudaDevice)
        assert engine.device == torch.device("cuda", torch.cuda.current_device())
        assert all(p.device.type == "cuda" and p.numel() == 0 for p in m.parameters())
        assert all(param_state(p).tier == "nvme" for p in m.parameters())  # partitions stay on NVMe
    assert all(p.device.type == "cpu" for p in m.parameters())  # close() points them back home


@pytest.mark.parametrize("make", [MLP, TinyLM], ids=["mlp", "tied"])
def test_logits_and_grads_bitwise(make, tmp_path):
    cfg = nvme_config(tmp_path)
    m, ref = build(make, cfg)
    x_of = (lambda s: torch.randn(4, 12, generator=torch.Generator().manual_seed(s))) if make is MLP else ids
    with engine_for(m, cfg) as engine:
        for seed in (1, 2, 3):  # the first records the trace; the others prefetch
            x = x_of(seed).to(CUDA)
            out, want = m(x), ref(x)
            assert torch.equal(out, want)
            sq(out).backward()
            sq(want).backward()
            assert_bitwise_grads(m, ref)
            assert released(m)
            engine.zero_grad()
            ref.zero_grad(set_to_none=True)
        assert engine.stats()["prefetch_hits"] > 0


def test_torch_autocast_is_cuda_autocast(tmp_path):
    """The config's ``torch_autocast`` on the CUDA path: logits and gradients bitwise the plain CUDA model's
    forward under ``torch.autocast("cuda", dtype=torch.bfloat16)``."""
    cfg = {**nvme_config(tmp_path), "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    m, ref = build(MLP, cfg)
    with engine_for(m, cfg) as engine:
        for seed in (1, 2):
            x = torch.randn(4, 12, generator=torch.Generator().manual_seed(seed)).to(CUDA)
            out = m(x)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                want = ref(x)
            assert out.dtype == torch.bfloat16 and torch.equal(out, want)
            assert not torch.is_autocast_enabled("cuda")
            sq(out).backward()
            sq(want).backward()
            assert_bitwise_grads(m, ref)
            engine.zero_grad()
            ref.zero_grad(set_to_none=True)


def test_cuda_autocast_by_default_is_fp16_with_the_grad_scalers_loss_scale(tmp_path):
    """``torch_autocast`` without a dtype on CUDA runs in float16, so the loss is scaled (torch's GradScaler
    rules, `LossScaler.for_autocast`): the engine starts at 2**16 and the first step's gradients are the
    plain CUDA model's under autocast with ``torch.amp.GradScaler("cuda")``, bitwise."""
    cfg = {**nvme_config(tmp_path), "torch_autocast": {"enabled": True}}
    m, ref = build(MLP, cfg)
    scaler = torch.amp.GradScaler("cuda")
    with engine_for(m, cfg) as engine:
        assert engine.loss_scale == 2.0**16
        x = torch.randn(4, 12, generator=torch.Generator().manual_seed(1)).to(CUDA)
        out = m(x)
        with torch.autocast("cuda"):
            want = ref(x)
        assert out.dtype == torch.float16 and torch.equal(out, want)
        # The loss in float32: a float16 loss's gradient at 2**16 is inf (float16 ends at 65504).
        engine.backward(sq(out.float()))
        scaler.scale(sq(want.float())).backward()
        assert_bitwise_grads(m, ref)


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_bitwise(reentrant, tmp_path):
    cfg = nvme_config(tmp_path)
    m, ref = build(lambda: TinyLM(reentrant=reentrant), cfg)
    with engine_for(m, cfg) as engine:
        for seed in (1, 2):
            x = ids(seed=seed).to(CUDA)
            out, want = m(x), ref(x)
            assert torch.equal(out, want)
            sq(out).backward()
            sq(want).backward()
        assert_bitwise_grads(m, ref)
        assert engine.stats()["grad_placeholders"] == 0


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_hf_models_bitwise(model, tmp_path, quiet_transformers):
    pytest.importorskip("transformers")
    from .test_hf_models import MODELS

    cfg = nvme_config(tmp_path)
    m, ref = build(MODELS[model], cfg)
    m.train()
    ref.train()
    x = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1)).to(CUDA)
    # The math attention kernel: fused ones (flash, memory-efficient) may accumulate their backward with
    # atomics, which no bitwise comparison survives, whatever zswap does.
    math_sdpa = sdpa_kernel(SDPBackend.MATH)
    with engine_for(m, cfg), warnings.catch_warnings(), math_sdpa:
        # Attention kernels may note how they honour deterministic mode; both models get the same kernels.
        warnings.simplefilter("ignore", UserWarning)
        for seed in (1, 2):
            torch.manual_seed(seed)  # dropout draws the same masks in both
            out = m(input_ids=x, labels=x, use_cache=False)
            torch.manual_seed(seed)
            want = ref(input_ids=x, labels=x, use_cache=False)
            assert torch.equal(out.logits, want.logits) and torch.equal(out.loss, want.loss)
            out.loss.backward()
            want.loss.backward()
        assert_bitwise_grads(m, ref)


def adamw_config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    cfg = nvme_config(tmp_path)
    cfg["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
    cfg.update(extra)
    return cfg


def test_three_adamw_steps_match_fused_cuda_adamw(tmp_path):
    cfg = adamw_config(tmp_path)
    m, ref = build(TinyLM, cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    with engine_for(m, cfg) as engine:
        for seed in (1, 2, 3):
            x = ids(seed=seed).to(CUDA)
            sq(m(x)).backward()
            sq(ref(x)).backward()
            engine.step()
            opt.step()
            opt.zero_grad()
        x = ids(seed=9).to(CUDA)
        torch.testing.assert_close(m(x), ref(x), rtol=1e-5, atol=1e-6)  # the updates reached the GPU
    with zswap.GatheredParameters(list(m.parameters())):
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q.detach().cpu(), rtol=1e-5, atol=1e-6)


def test_bf16_trains(tmp_path):
    cfg = adamw_config(tmp_path, bf16={"enabled": True})
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            m = TinyLM()
    ref = TinyLM().to(torch.bfloat16)
    with zswap.GatheredParameters(list(m.parameters())):
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            assert p.dtype == torch.bfloat16
            q.data.copy_(p.data)
    ref.to(CUDA)
    x = ids(seed=1).to(CUDA)
    losses = []
    with engine_for(m, cfg) as engine:
        for step in range(6):
            out = m(x)
            if step == 0:
                want = ref(x)
                assert torch.equal(out, want)
                sq(want).backward()
            loss = sq(out)
            loss.backward()
            if step == 0:
                for p, q in zip(m.parameters(), ref.parameters(), strict=True):
                    g = full_grad(p)
                    # bf16 on the wire (exact), accumulated in fp32 on the host
                    assert g.dtype == torch.float32 and torch.equal(g, q.grad.float())
            losses.append(float(loss.detach()))
            engine.step()
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_bf16_grads_accumulate_in_fp32_where_they_land(tmp_path):
    """Three backwards of a bf16 model: the gradients cross in bf16 and their sum is the plain CUDA model's
    gradients summed in fp32, bitwise (for memory and NVMe gradient stores)."""
    for grads in ("memory", "nvme"):
        cfg = nvme_config(tmp_path / grads)
        cfg["bf16"] = {"enabled": True}
        if grads == "nvme":
            cfg["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path / grads)}
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zswap.ZswapWarning)
            with zswap.Init(cfg):
                m = TinyLM()
        ref = TinyLM().to(torch.bfloat16)
        with zswap.GatheredParameters(list(m.parameters())):
            for p, q in zip(m.parameters(), ref.parameters(), strict=True):
                q.data.copy_(p.data)
        ref.to(CUDA)
        acc: list[torch.Tensor | None] = [None] * len(list(ref.parameters()))
        with engine_for(m, cfg):
            for seed in (1, 2, 3):
                x = ids(seed=seed).to(CUDA)
                out, want = m(x), ref(x)
                assert torch.equal(out, want)
                sq(out).backward()
                sq(want).backward()
                for i, q in enumerate(ref.parameters()):
                    assert q.grad is not None
                    acc[i] = q.grad.float() if acc[i] is None else acc[i].add_(q.grad.float())
                    q.grad = None
            for (name, p), a in zip(m.named_parameters(), acc, strict=True):
                g = full_grad(p)
                assert g is not None and g.dtype == torch.float32, name
                assert torch.equal(g, a), f"{grads} {name}: max diff {(g - a).abs().max()}"


class Deep(nn.Module):
    def __init__(self, d: int = 256, layers: int = 16) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(d) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def test_gpu_memory_stays_within_budget_bucket_and_activations(tmp_path):
    d = 256
    per_block = 8 * d * d + 7 * d
    cfg = nvme_config(
        tmp_path, stage3_max_live_parameters=3 * per_block, stage3_prefetch_bucket_size=per_block
    )
    m, ref = build(lambda: Deep(d), cfg)
    x = torch.randn(8, 64, d, generator=torch.Generator().manual_seed(1)).to(CUDA)
    param_bytes = sum(q.numel() * q.element_size() for q in ref.parameters())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    sq(ref(x)).backward()
    activations = torch.cuda.max_memory_allocated() - base  # the plain model's params were already there
    ref.to("cpu")
    del ref
    torch.cuda.empty_cache()
    with engine_for(m, cfg) as engine:
        for _ in range(3):
            sq(m(x)).backward()
            engine.zero_grad()
        s = engine.stats(reset=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        sq(m(x)).backward()
        s = engine.stats()
    peak = s["gpu_max_memory_allocated"] - base
    assert s["gpu_live_budget_bytes"] < param_bytes / 4  # the model is several times its GPU budget
    assert peak <= s["gpu_live_budget_bytes"] + s["gpu_prefetch_bucket_bytes"] + activations, (
        peak,
        s["gpu_live_budget_bytes"],
        s["gpu_prefetch_bucket_bytes"],
        activations,
    )


def test_no_pinned_registration_left_after_close(tmp_path):
    cfg = nvme_config(tmp_path)
    m, _ = build(TinyLM, cfg)
    engine = engine_for(m, cfg)
    dev = engine.compute_device
    assert isinstance(dev, CudaDevice)
    for seed in (1, 2):
        sq(m(ids(seed=seed).to(CUDA))).backward()
    assert dev.registered_bytes > 0
    ptr, storage = next(iter(dev._regs._live.items()))
    view = torch.empty(0, dtype=torch.uint8).set_(storage)  # keeps the engine buffer mapped
    assert view.is_pinned()  # registered: one DMA hop from the engine buffer to the GPU
    assert dev.staged_copies == 0
    engine.close()
    assert dev.registered_bytes == 0
    assert view.data_ptr() == ptr and not view.is_pinned()  # close() unregistered it


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_ranks_gather_and_reduce_scatter_on_the_gpu(tmp_path):
    from .conftest import run_ranks

    # Below benches/gpu_check.sh's 200 s for the whole run, so a hang still leaves its report.
    run_ranks(Path(__file__).with_name("_gpu_dist_worker.py"), tmp_path, world=2, timeout=150)


@pytest.mark.parametrize(
    ("tiers", "extra", "limits", "expect"),
    [
        (("nvme", "nvme"), {}, [None] * 4, [0, 1, 1, 1]),
        (("nvme", "nvme"), {}, [1e6, 1e6, 1e-3, 1e6, 1e6], [0, 1, 0, 0, 1]),
        (("nvme", "nvme"), {"gradient_accumulation_steps": 2}, [None] * 3, [0, 1, 1]),
        (
            ("nvme", "nvme"),
            {"bf16": {"enabled": True, "check_grad_overflow": True}},
            [None] * 4,
            [0, 1, 1, 1],
        ),
        (("nvme", "cpu"), {}, [1e6, 1e6, 1e-3, 1e6, 1e6], [0, 1, 0, 0, 1]),
        (("cpu", "cpu"), {"gradient_accumulation_steps": 2}, [None] * 3, [0, 1, 1]),
        (("nvme", "nvme"), {"past_cap": True}, [1e6, 1e-3, 1e-3, 1e-3], [0, 0, 0, 0]),
        (("nvme", "nvme"), {"resident": True}, [None] * 4, [0, 1, 1, 1]),
        (("nvme", "cpu"), {"resident": True}, [1e6, 1e6, 1e-3, 1e6, 1e6], [0, 1, 0, 0, 1]),
        (("cpu", "nvme"), {"bf16": {"enabled": True}}, [None] * 4, [0, 1, 1, 1]),
    ],
    ids=[
        "plain",
        "clipping",
        "accumulation",
        "bf16",
        "states-in-memory-clipping",
        "all-in-memory-accumulation",
        "clipping-past-the-cap",
        "resident",
        "resident-states-in-memory-clipping",
        "bf16-params-in-memory",
    ],
)
def test_the_step_in_backward_on_cuda_is_bitwise_the_ordinary_step(
    tiers, extra, limits, expect, tmp_path, monkeypatch
):
    """`zswap.step.early_device` on CUDA: params and AdamW states on NVMe or in CPU memory (``tiers``);
    twins with the early step on and off; params, records and counters equal after every optimizer step,
    and the early one committed where it may (`engine.stats()["steps_in_backward"]`). ``past_cap``: the
    early step's cap is the live budget alone, so the deferred steps (clipping bit at the step before)
    hold part of the copies and leave the rest to the ordinary step in their commit. ``resident``: every
    param kept gathered on the GPU (``max_in_cpu``), stepped from a device-to-host copy and gathered again
    from its updated partition: no param read in a warm step."""
    from zswap.step import earlystep

    from .test_earlystep import state
    from .test_faults import cfg_for, same

    extra = dict(extra)
    past_cap = extra.pop("past_cap", False)
    resident = extra.pop("resident", False)
    if past_cap:
        monkeypatch.setattr(earlystep, "CAP_EXTRA", 0)
    gas = extra.get("gradient_accumulation_steps", 1)
    runs = []
    for name, early in (("early", True), ("plain", False)):
        cfg = cfg_for(tmp_path / name, *tiers, **extra)
        if resident:
            cfg["offload_param"]["max_in_cpu"] = 10**9
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zswap.ZswapWarning)
            with zswap.Init(cfg):
                m = TinyLM()
            e = zswap.initialize(m, cfg, device="cuda")
        e.early_step = early
        runs.append((m, e))
    (m, e), (ref, ref_e) = runs
    seen = []
    for step, limit in enumerate(limits):
        for mm, ee in runs:
            ee.max_grad_norm = limit
            ee.stats(reset=True)
            for micro in range(gas):
                ee.backward(sq(mm(ids(seed=10 * step + micro).to(CUDA)).float()))
                ee.step()
        seen.append(e.stats()["steps_in_backward"])
        partly = e.stats()["steps_deferred_partly"]
        if resident and step > 0:  # the records alone (fp32 AdamW: 2 x the params) where on NVMe
            nbytes = sum(param_state(p).partition_numel * 4 for p in m.parameters())
            assert e.stats()["bytes_read"] == (2 * nbytes if tiers[1] == "nvme" else 0), step
        assert same(state(m, e), state(ref, ref_e)), step
        assert partly == (past_cap and step >= 2), step
    assert seen == expect
    for _, ee in runs:
        ee.close()
