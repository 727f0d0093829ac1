"""`zswap.deepspeed.utils`: DeepSpeed's tensor-fragment API (scenarios of DeepSpeed's
``tests/unit/runtime/zero/test_zero_tensor_fragment.py``, written for zswap): a param's float32 value,
AdamW moments and gradient read after backward and after the step — equal to plain PyTorch's — and
written there, the writes honoured by the next step exactly as the same writes in plain PyTorch; what
zswap cannot do is an error naming why."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zswap
import zswap.deepspeed as deepspeed
from zswap.deepspeed import utils
from zswap.errors import GradientsNotKeptError, ZswapError

from .conftest import run_ranks

HIDDEN = 12
LR, WD = 1e-2, 0.01
KEYS = ("exp_avg", "exp_avg_sq")


class ThreeLinears(nn.Module):
    """DeepSpeed's model for these tests: hidden → 1 → 1 → hidden, ReLU between, cross-entropy."""

    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(HIDDEN, 1), nn.Linear(1, 1), nn.Linear(1, HIDDEN)])
        if frozen:
            for p in self.linears[0].parameters():
                p.requires_grad = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.linears:
            x = torch.relu(layer(x))
        return nn.functional.cross_entropy(x, y)


def config(
    path: Path, states: str = "nvme", params: str = "nvme", dtype: Any = torch.float32
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_batch_size": 2,
        "gradient_clipping": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": states, "nvme_path": str(path)},
            "offload_param": {"device": params, "nvme_path": str(path)},
        },
    }
    if dtype == torch.bfloat16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def build(cfg: dict[str, Any], frozen: bool = False, dtype: Any = torch.float32) -> tuple[Any, nn.Module]:
    """A zswap engine over `ThreeLinears` and the same model in plain PyTorch (the same initial values)."""
    torch.manual_seed(0)
    plain = ThreeLinears(frozen).to(dtype)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        torch.manual_seed(0)
        model = ThreeLinears(frozen).to(dtype)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine, plain


def batch(seed: int, dtype: Any = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, HIDDEN, generator=g).to(dtype), torch.randint(0, HIDDEN, (2,), generator=g)


def plain_adamw(plain: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [p for p in plain.parameters() if p.requires_grad], lr=LR, weight_decay=WD, fused=True
    )


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        yield


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen-first-layer"])
@pytest.mark.parametrize("tiers", [("nvme", "nvme"), ("cpu", "cpu"), ("nvme", "cpu"), ("cpu", "nvme")])
def test_reads_after_backward_and_step_are_plain_torchs(tmp_path, tiers, frozen):
    engine, plain = build(config(tmp_path, *tiers), frozen)
    opt = plain_adamw(plain)
    with engine:
        for step in range(3):
            x, y = batch(step)
            engine.backward(engine(x, y))
            plain(x, y).backward()
            for p, q in zip(engine.module.parameters(), plain.parameters(), strict=True):
                full = [utils.safe_get_full_fp32_param(p), utils.safe_get_full_grad(p)]
                local = [utils.safe_get_local_fp32_param(p), utils.safe_get_local_grad(p)]
                if not q.requires_grad:
                    assert full == [None, None] and local == [None, None]
                    continue
                assert torch.equal(full[0], q.detach()) and torch.equal(full[1], q.grad)
                assert all(torch.equal(a, b.reshape(-1)) for a, b in zip(local, full, strict=True))
            engine.step()
            opt.step()
            opt.zero_grad()
            for p, q in zip(engine.module.parameters(), plain.parameters(), strict=True):
                if not q.requires_grad:
                    assert utils.safe_get_full_optimizer_state(p, "exp_avg") is None
                    assert utils.safe_get_local_optimizer_state(p, "exp_avg_sq") is None
                    continue
                assert torch.equal(utils.safe_get_full_fp32_param(p), q.detach())
                for key in KEYS:
                    got = utils.safe_get_full_optimizer_state(p, key)
                    assert torch.equal(got, opt.state[q][key]), (step, key)
                    assert torch.equal(utils.safe_get_local_optimizer_state(p, key), got.reshape(-1))
        assert engine.stats()["steps_in_backward"] >= 1  # the fast step ran where nothing was written


def partition(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """This rank's flat partition of the full value ``v`` of ``p`` (the last rank's padded with zeros)."""
    st = zswap.param_state(p)
    flat = torch.cat([v.reshape(-1), v.new_zeros(st.partition_numel * st.world_size - v.numel())])
    return flat[st.rank * st.partition_numel : (st.rank + 1) * st.partition_numel]


def write_everything(
    engine: Any, plain: nn.Module, opt: torch.optim.Optimizer, seed: int, full: bool
) -> None:
    """Random float32 values written into every param's master, moments (where the plain optimizer has
    them) and gradient (where it has one), in zswap and in plain PyTorch alike."""
    g = torch.Generator().manual_seed(seed)
    suffix = "full" if full else "local"
    for p, q in zip(engine.module.parameters(), plain.parameters(), strict=True):
        values = {"fp32": torch.rand(q.shape, generator=g)}
        if q in opt.state:
            values.update({k: torch.rand(q.shape, generator=g) for k in KEYS})
        if q.grad is not None:
            values["grad"] = torch.rand(q.shape, generator=g)
        for kind, v in values.items():
            given = v if full else partition(p, v)
            if kind == "fp32":
                getattr(utils, f"safe_set_{suffix}_fp32_param")(p, given)
                q.data.copy_(v)
                assert torch.equal(getattr(utils, f"safe_get_{suffix}_fp32_param")(p), given)
            elif kind == "grad":
                getattr(utils, f"safe_set_{suffix}_grad")(p, given)
                q.grad.copy_(v)
                assert torch.equal(getattr(utils, f"safe_get_{suffix}_grad")(p), given)
            else:
                getattr(utils, f"safe_set_{suffix}_optimizer_state")(p, given, kind)
                opt.state[q][kind].copy_(v)
                assert torch.equal(getattr(utils, f"safe_get_{suffix}_optimizer_state")(p, kind), given)


@pytest.mark.parametrize("full", [True, False], ids=["full", "local"])
@pytest.mark.parametrize("tiers", [("nvme", "nvme"), ("cpu", "cpu")])
def test_writes_after_backward_and_after_step_are_honoured_as_in_plain_torch(tmp_path, tiers, full):
    engine, plain = build(config(tmp_path, *tiers))
    opt = plain_adamw(plain)
    with engine:
        for step in range(4):
            x, y = batch(step)
            engine.backward(engine(x, y))
            plain(x, y).backward()
            write_everything(engine, plain, opt, 10 * step, full)  # the value and the gradient
            engine.step()
            opt.step()
            opt.zero_grad()
            write_everything(engine, plain, opt, 10 * step + 1, full)  # the value and the moments
            with zswap.GatheredParameters(list(engine.module.parameters())):
                for p, q in zip(engine.module.parameters(), plain.parameters(), strict=True):
                    assert torch.equal(p.data, q.data)
        x, y = batch(9)
        engine.backward(engine(x, y))
        plain(x, y).backward()
        engine.step()
        opt.step()
        with zswap.GatheredParameters(list(engine.module.parameters())):
            for p, q in zip(engine.module.parameters(), plain.parameters(), strict=True):
                assert torch.equal(p.data, q.data)  # every write taken by the steps after it
        stats = engine.stats()
        assert stats["steps_in_backward"] >= 1  # the steps after writes between steps only
        assert "safe_set_" in stats["steps_ordinary_reason"]


@pytest.mark.parametrize("states", ["nvme", "cpu"])
def test_gradients_clamped_through_local_writes_are_clipped_and_stepped_as_plain_torch(tmp_path, states):
    """DeepSpeed's TestZeroGradClip: each local gradient clamped through safe_set_local_grad; the step's
    global norm (and clipping) is taken over the clamped gradients."""
    cfg = {**config(tmp_path, states), "gradient_clipping": 0.05}
    engine, plain = build(cfg)
    opt = plain_adamw(plain)
    with engine:
        for step in range(4):
            x, y = batch(step)
            engine.backward(engine(x, y))
            plain(x, y).backward()
            for p, q in zip(engine.module.parameters(), plain.parameters(), strict=True):
                utils.safe_set_local_grad(p, utils.safe_get_local_grad(p).clamp(-0.01, 0.01))
                q.grad.clamp_(-0.01, 0.01)
            norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
            engine.step()
            opt.step()
            opt.zero_grad()
            assert engine.get_global_grad_norm() == float(norm)
        with zswap.GatheredParameters(list(engine.module.parameters())):
            for p, q in zip(engine.module.parameters(), plain.parameters(), strict=True):
                assert torch.equal(p.data, q.data)


def test_bf16_master_and_moments_are_written_and_stepped_from(tmp_path):
    engine, _ = build(config(tmp_path, dtype=torch.bfloat16), dtype=torch.bfloat16)
    with engine:
        x, y = batch(0, torch.bfloat16)
        engine.backward(engine(x, y))
        weight = engine.module.linears[2].weight
        assert utils.safe_get_full_grad(weight).dtype == torch.float32  # read once: kept from now on
        with pytest.raises(ZswapError, match="no optimizer step yet, so zswap keeps no float32 master"):
            utils.safe_set_full_fp32_param(weight, torch.zeros(HIDDEN, 1))
        with pytest.raises(ZswapError, match="keeps no exp_avg for it"):
            utils.safe_set_full_optimizer_state(weight, torch.zeros(HIDDEN, 1), "exp_avg")
        assert utils.safe_get_full_optimizer_state(weight, "exp_avg").count_nonzero() == 0  # (Adam's start)
        with zswap.GatheredParameters([weight]):
            assert torch.equal(utils.safe_get_full_fp32_param(weight), weight.detach().float())
        engine.step()
        master = torch.full((HIDDEN, 1), 0.1 + 2**-20)  # not a bfloat16 value
        utils.safe_set_full_fp32_param(weight, master)
        utils.safe_set_full_optimizer_state(weight, torch.zeros(HIDDEN, 1), "exp_avg")
        utils.safe_set_full_optimizer_state(weight, torch.ones(HIDDEN, 1), "exp_avg_sq")
        assert torch.equal(utils.safe_get_full_fp32_param(weight), master)
        engine.backward(engine(*batch(1, torch.bfloat16)))
        grad = utils.safe_get_full_grad(weight)
        engine.step()
        # One AdamW step (step 2) from the written state, as torch computes it in float32.
        m = 0.1 * grad
        v = 0.999 * torch.ones_like(grad) + 0.001 * grad * grad
        want = master * (1 - LR * WD) - LR * (m / 0.19) / ((v / (1 - 0.999**2)).sqrt() + 1e-8)
        got = utils.safe_get_full_fp32_param(weight)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-9)
        with zswap.GatheredParameters([weight]):  # the bfloat16 param follows its master at the step
            assert torch.equal(weight.detach(), got.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_gathered_write_to_a_param_with_a_master_is_refused(tmp_path, dtype):
    """``GatheredParameters(modifier_rank=0)`` writes the param back, but a bf16 param's float32 master (its
    optimizer record) would be stepped at the next step and rounded over the write: the write was lost
    without a word (DeepSpeed loses it too). Refused, the change dropped, naming the way that sets both;
    an unchanged block and a float32 param (no master) write back as before."""
    engine, _ = build(config(tmp_path, dtype=dtype), dtype=dtype)
    with engine:
        engine.backward(engine(*batch(0, dtype)))
        engine.step()
        weight = engine.module.linears[2].weight
        with zswap.GatheredParameters([weight], modifier_rank=0):
            before = weight.detach().clone()  # read alone: written back unchanged
        if dtype == torch.bfloat16:
            refused = pytest.raises(
                ZswapError, match=r"holds its float32 master copy.*safe_set_full_fp32_param"
            )
            with refused, zswap.GatheredParameters([weight], modifier_rank=0):
                weight.data.fill_(1.0)
            with zswap.GatheredParameters([weight]):
                assert torch.equal(weight.detach(), before)  # the change dropped
            utils.safe_set_full_fp32_param(weight, torch.ones(HIDDEN, 1))  # the way: the param follows it
            assert torch.equal(utils.safe_get_full_fp32_param(weight), torch.ones(HIDDEN, 1))
        else:
            with zswap.GatheredParameters([weight], modifier_rank=0):
                weight.data.fill_(1.0)
            with zswap.GatheredParameters([weight]):
                assert torch.equal(weight.detach(), torch.ones(HIDDEN, 1))


def test_a_write_between_backward_and_step_needs_the_gradients_kept(tmp_path):
    engine, _ = build(config(tmp_path))
    with engine:
        weight = engine.module.linears[0].weight
        for step in range(2):  # the first step makes the records; the second runs in backward
            engine.backward(engine(*batch(step)))
            engine.step()
        engine.backward(engine(*batch(2)))
        with pytest.raises(GradientsNotKeptError, match="safe_set_full_grad wrote between backward and step"):
            utils.safe_set_full_grad(weight, torch.zeros(1, HIDDEN))
        with pytest.raises(GradientsNotKeptError):
            engine.step()
        engine.zero_grad()  # "auto" keeps them from now on: the write takes the ordinary step
        engine.backward(engine(*batch(2)))
        utils.safe_set_full_grad(weight, torch.zeros(1, HIDDEN))
        engine.step()
        assert engine.stats()["steps_ordinary_reason"].startswith("safe_set_full_grad wrote")


def test_what_cannot_be_honoured_is_an_error(tmp_path):
    engine, _ = build(config(tmp_path), frozen=True)
    frozen, weight = engine.module.linears[0].weight, engine.module.linears[1].weight
    with engine:
        engine.backward(engine(*batch(0)))
        engine.step()
        with pytest.raises(ZswapError, match="does not require grad, so it has no optimizer state"):
            utils.safe_set_full_fp32_param(frozen, torch.zeros(1, HIDDEN))
        with pytest.raises(ZswapError, match="does not require grad"):
            utils.safe_set_local_grad(frozen, torch.zeros(HIDDEN))
        with pytest.raises(ZswapError, match="keeps exp_avg and exp_avg_sq, not 'momentum_buffer'"):
            utils.safe_get_full_optimizer_state(weight, "momentum_buffer")
        with pytest.raises(ValueError, match=r"the value has 2 elements, the param's \(1, 1\) has 1"):
            utils.safe_set_full_fp32_param(weight, torch.zeros(2))
        with pytest.raises(ValueError, match="this rank's partition of the param has 1"):
            utils.safe_set_local_optimizer_state(weight, torch.zeros(3), "exp_avg")
        with pytest.raises(TypeError, match="must be a floating-point tensor, got list"):
            utils.safe_set_full_grad(weight, [0.0])
        with pytest.raises(ZswapError, match="not trained by an open zswap engine"):
            utils.safe_get_full_fp32_param(nn.Linear(2, 2).weight)

        def read_inside(_: torch.Tensor) -> None:
            utils.safe_set_full_grad(weight, torch.zeros(1, 1))

        loss = engine(*batch(1))
        loss.register_hook(read_inside)
        with pytest.raises(ZswapError, match="safe_set_full_grad inside backward"):
            engine.backward(loss)
    with pytest.raises(ZswapError, match="not trained by an open zswap engine"):
        utils.safe_get_full_grad(weight)  # the engine is closed


def test_two_ranks_full_is_every_ranks_local_and_writes_train_as_one_model(tmp_path):
    run_ranks(Path(__file__).with_name("_fragments_dist_worker.py"), tmp_path)
