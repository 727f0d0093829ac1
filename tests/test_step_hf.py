"""The step pipeline on real Hugging Face architectures (tiny configs of `tests._hf_archs.ARCHS`), trained
in train mode (dropout on, the same seeds) through the public API:

- float32: against plain PyTorch in RAM (``clip_grad_norm_`` then ``AdamW(fused=True)``) — every param after
  4 optimizer steps and every norm bitwise, and every step after the first (which makes the optimizer's
  records) in backward or deferred to the step, in seven setups: NVMe/NVMe; clipping that bites on every
  step with accumulation 2; clipping at 1.0; the device stand-in with states in CPU memory; the stand-in
  with accumulation 2; params resident by ``max_in_cpu`` with clipping, on the CPU and on the stand-in.
- bf16 / fp16 (fp32 master weights in the optimizer's records): the update in backward against the same
  setup's ordinary step (``engine.early_step = False``) — params, losses and norms bitwise.
- Every architecture at the default budgets, which it fits: a warm step moves the fast path's bytes.

The architectures are picked for what they do to the bookkeeping: BERT's masked-LM head ties its decoder
weight and bias, T5 ties one embedding into three places and keeps its ``wo`` in float32, ALBERT runs one
layer's params in every layer (gradients summed over the uses), Gemma2 soft-caps its logits, Mamba has
state-space params outside any Linear, Whisper's encoder starts with convolutions, GPT-OSS and DeepSeek-V3
route tokens to experts held in 3-D params (a slice of an expert no token reached gets no gradient; over
two ranks each rank routes its own tokens) and DeepSeek-V3 attends through low-rank projections.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import zswap
from zswap.device import StandInDevice

from ._ddp import ddp_grads
from ._hf_archs import ARCHS, Arch
from .conftest import run_ranks

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("quiet_transformers")

STEPS = 4
HYPER = {"lr": 3e-3, "betas": (0.8, 0.95), "weight_decay": 0.1}

# tiers: (params, optimizer states)
SETUPS: dict[str, dict[str, Any]] = {
    "nvme": {"tiers": ("nvme", "nvme"), "device": "cpu", "gas": 1, "clip": None},
    "clip-bites-gas2": {"tiers": ("nvme", "nvme"), "device": "cpu", "gas": 2, "clip": 1e-3},
    "clip-1": {"tiers": ("nvme", "nvme"), "device": "cpu", "gas": 1, "clip": 1.0},
    "stand-in-clip-1": {"tiers": ("nvme", "cpu"), "device": "standin", "gas": 1, "clip": 1.0},
    "stand-in-gas2": {"tiers": ("nvme", "nvme"), "device": "standin", "gas": 2, "clip": None},
    "resident-clip": {"tiers": ("nvme", "cpu"), "device": "cpu", "gas": 1, "clip": 0.5, "max_in_cpu": 2000},
    "stand-in-resident": {
        "tiers": ("nvme", "nvme"),
        "device": "standin",
        "gas": 1,
        "clip": 0.5,
        "max_in_cpu": 2000,
    },
}
FP32_ARCHS = ["bert-mlm", "t5", "albert-mlm", "gemma2", "mamba", "whisper", "gpt-oss", "deepseek-v3"]

LOW_PRECISION: dict[str, dict[str, Any]] = {
    "bf16-clip-1": {"tiers": ("nvme", "nvme"), "device": "cpu", "gas": 1, "clip": 1.0, "half": "bf16"},
    "bf16-stand-in-gas2": {
        "tiers": ("nvme", "nvme"), "device": "standin", "gas": 2, "clip": 1e-3, "half": "bf16"
    },
    "fp16-clip-1": {"tiers": ("nvme", "cpu"), "device": "cpu", "gas": 1, "clip": 1.0, "half": "fp16"},
}  # fmt: skip


def config(tmp_path: Path, setup: dict[str, Any]) -> dict[str, Any]:
    params: dict[str, Any] = {"device": setup["tiers"][0], "nvme_path": str(tmp_path)}
    if setup.get("max_in_cpu"):
        params["max_in_cpu"] = setup["max_in_cpu"]
    cfg: dict[str, Any] = {
        "zero_optimization": {
            "offload_param": params,
            "offload_optimizer": {"device": setup["tiers"][1], "nvme_path": str(tmp_path)},
            "stage3_param_persistence_threshold": 0,
        },
        "optimizer": {"type": "AdamW", "params": {**HYPER, "betas": list(HYPER["betas"])}},
        "gradient_accumulation_steps": setup["gas"],
    }
    if setup["clip"]:
        cfg["gradient_clipping"] = setup["clip"]
    if setup.get("half") == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif setup.get("half") == "fp16":  # a loss scale of 2^8, which these models' gradients never overflow
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def micro_batches(gas: int) -> list[tuple[int, int]]:
    """Each micro-batch's (inputs' seed, dropout's seed)."""
    return [(i + 1, 100 + i) for i in range(STEPS * gas)]


def plain(arch: Arch, setup: dict[str, Any], world: int = 1) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Params after the steps in RAM and each step's norm. ``world`` > 1: DDP's gradients — rank r's
    micro-batch i is `micro_batches`' number ``i * world + r``, each micro-batch's gradients averaged over
    the ranks, then summed over the micro-batches (as zswap adds each averaged partition); one rank: the
    same sum autograd accumulates."""
    gas, clip = setup["gas"], setup["clip"]
    torch.manual_seed(0)
    ref = arch.build().train()
    params = list(ref.parameters())
    opt = torch.optim.AdamW(params, **HYPER, fused=True)
    xs, norms = micro_batches(gas * world), []
    for s in range(STEPS):

        def backward(k: int, r: int, s: int = s) -> None:
            inputs, dropout = xs[(s * gas + k) * world + r]
            torch.manual_seed(dropout)  # the same dropout masks
            (ref(**arch.loss_inputs(inputs)).loss / gas).backward()

        ddp_grads(params, gas, world, backward)
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in ref.named_parameters()}, norms


def through_zswap(
    arch: Arch,
    setup: dict[str, Any],
    tmp_path: Path,
    early: bool = True,
    batches: list[tuple[int, int]] | None = None,
    hypers_at: dict[int, dict[str, float]] | None = None,
) -> tuple[dict[str, torch.Tensor], list[float | None], list[float], dict[str, Any]]:
    """Params after the steps, each step's norm, each micro-batch's loss, and the stats; ``batches``: this
    rank's micro-batches (default `micro_batches`); ``hypers_at[step]``: set on every param group between
    that step's last backward and its ``step()``."""
    gas = setup["gas"]
    cfg = config(tmp_path, setup)
    torch.manual_seed(0)
    with zswap.Init(cfg):
        model = arch.build()
    model.train()
    device = StandInDevice() if setup["device"] == "standin" else "cpu"
    xs, norms, losses = batches or micro_batches(gas), [], []
    with zswap.initialize(model, cfg, device=device) as engine:
        engine.early_step = early
        for s in range(STEPS):
            for k in range(gas):
                inputs, dropout = xs[s * gas + k]
                torch.manual_seed(dropout)
                loss = model(**arch.loss_inputs(inputs)).loss
                losses.append(float(loss.detach()))
                engine.backward(loss)
                if k == gas - 1:
                    for g in engine.optimizer.param_groups:
                        for key, value in (hypers_at or {}).get(s, {}).items():
                            g[key] = value
                engine.step()
            norms.append(engine.last_grad_norm)
        stats = engine.stats()
        named = dict(model.named_parameters())
        with zswap.GatheredParameters(list(named.values())):
            got = {n: p.detach().clone() for n, p in named.items()}
    return got, norms, losses, stats


def assert_fast_after_the_first(stats: dict[str, Any]) -> None:
    assert stats["steps_ordinary"] == 1, stats["steps_ordinary_reason"]
    assert stats["steps_in_backward"] + stats["steps_deferred"] == STEPS - 1, stats


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("arch", FP32_ARCHS)
def test_hf_architectures_train_bitwise_plain_pytorch(arch, setup, tmp_path):
    chosen = SETUPS[setup]
    want, want_norms = plain(ARCHS[arch], chosen)
    got, norms, _, stats = through_zswap(ARCHS[arch], chosen, tmp_path)
    if chosen["clip"]:
        assert norms == want_norms
    assert [n for n, w in want.items() if not torch.equal(got[n], w)] == []
    assert_fast_after_the_first(stats)


@pytest.mark.parametrize("setup", list(LOW_PRECISION))
@pytest.mark.parametrize("arch", ["qwen2", "bert-mlm"])
def test_hf_architectures_in_low_precision_step_in_backward_as_the_ordinary_step(arch, setup, tmp_path):
    chosen = LOW_PRECISION[setup]
    (tmp_path / "early").mkdir()
    (tmp_path / "ordinary").mkdir()
    got, norms, losses, stats = through_zswap(ARCHS[arch], chosen, tmp_path / "early")
    want, want_norms, want_losses, _ = through_zswap(ARCHS[arch], chosen, tmp_path / "ordinary", early=False)
    assert losses == want_losses
    assert norms == want_norms
    assert [n for n, w in want.items() if not torch.equal(got[n], w)] == []
    assert_fast_after_the_first(stats)


@pytest.mark.parametrize("optimizer_tier", ["nvme", "cpu"])
@pytest.mark.parametrize("half", ["bf16", "fp16"])
def test_hypers_set_at_a_milestone_are_redone_on_fp32_masters(half, optimizer_tier, tmp_path):
    """Low precision keeps each param's fp32 master in its record: an lr, eps and weight decay first set
    between backward and step at step 3 redo that step's masters from the committed record's and the
    staged moments — bitwise the ordinary step given the same values."""
    chosen = {"tiers": ("nvme", optimizer_tier), "device": "cpu", "gas": 1, "clip": None, "half": half}
    at = {3: {"lr": 3e-4, "eps": 1e-6, "weight_decay": 0.05}}
    (tmp_path / "early").mkdir()
    (tmp_path / "ordinary").mkdir()
    got, _, losses, stats = through_zswap(ARCHS["qwen2"], chosen, tmp_path / "early", hypers_at=at)
    want, _, want_losses, _ = through_zswap(
        ARCHS["qwen2"], chosen, tmp_path / "ordinary", early=False, hypers_at=at
    )
    assert losses == want_losses
    assert [n for n, w in want.items() if not torch.equal(got[n], w)] == []
    assert_fast_after_the_first(stats)
    assert stats["steps_hypers_redone"] == 1, stats


@pytest.mark.parametrize("arch", list(ARCHS))
def test_hf_architectures_within_the_live_budget_move_the_fast_paths_bytes(arch, tmp_path):
    """Every architecture at the default budgets, which it fits: a warm step reads the AdamW moments of the
    params it trains and writes them and those params (2 R / 3 W), and reads a param it does not train once
    (Whisper's frozen position embedding). What is used again later in the pass stays gathered (tied
    embeddings, ALBERT's block at every depth, a position embedding beside a tied one) and the updated
    params seed the next forward, around a frozen one too."""
    a = ARCHS[arch]
    cfg = config(tmp_path, SETUPS["nvme"])
    torch.manual_seed(0)
    with zswap.Init(cfg):
        model = a.build()
    model.train()
    with zswap.initialize(model, cfg) as engine:
        for s in range(3):
            engine.stats(reset=True)
            engine.backward(model(**a.loss_inputs(s)).loss)
            engine.step()
        stats = engine.stats()
    sizes = {p.requires_grad: 0 for p in model.parameters()}
    for p in model.parameters():
        sizes[p.requires_grad] += zswap.param_state(p).numel * 4
    trained, frozen = sizes[True], sizes.get(False, 0)
    assert stats["steps_in_backward"] == 1, stats["steps_ordinary_reason"]
    assert (stats["bytes_read"], stats["bytes_written"]) == (2 * trained + frozen, 3 * trained)


@pytest.mark.dist
def test_hf_architectures_over_two_ranks_match_ddp(tmp_path):
    """See `_step_hf_dist_worker.py`: DDP's averaged gradients as the reference, bitwise without clipping."""
    run_ranks(Path(__file__).with_name("_step_hf_dist_worker.py"), tmp_path)
