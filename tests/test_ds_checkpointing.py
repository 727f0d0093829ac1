"""`zswap.deepspeed.checkpointing`: DeepSpeed's activation checkpointing calls (scenarios of DeepSpeed's
``tests/unit/activation_checkpointing``, written for zswap). `checkpoint` gives the values and gradients of
the function run plainly — tensors and non-tensors in and out, keyword tensors included — and a model
checkpointed with it trains through `zswap.deepspeed.initialize` bitwise as plain PyTorch does, the update
running in backward; `configure` refuses what zswap does not do, naming it."""

from __future__ import annotations

import functools
import json
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import zswap
import zswap.deepspeed as deepspeed
from zswap.deepspeed import checkpointing

WIDTH = 8


def _grads_of(fn: Any, make_args: Any) -> tuple[Any, list[torch.Tensor]]:
    """(outputs, input gradients) of ``fn(*args)`` with a loss over its tensor outputs."""
    args = make_args()
    out = fn(*args)
    outs = out if isinstance(out, tuple) else (out,)
    sum(o.square().sum() for o in outs if isinstance(o, torch.Tensor) and o.requires_grad).backward()
    return out, [a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad]


def _inputs() -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(3, WIDTH, generator=g, requires_grad=True),
        2.0,
        None,
        torch.randn(3, WIDTH, generator=g),
    )


def _mixed(x: torch.Tensor, s: float, none: None, y: torch.Tensor) -> tuple[Any, ...]:
    assert none is None
    return torch.tanh(x) * s + y, "a label", torch.relu(x), y.sum()


@pytest.mark.parametrize("ckpt", [checkpointing.checkpoint, checkpointing.non_reentrant_checkpoint])
def test_tensors_and_non_tensors_in_and_out_as_run_plainly(ckpt):
    torch.manual_seed(0)
    want, want_grads = _grads_of(_mixed, _inputs)
    got, got_grads = _grads_of(lambda *a: ckpt(_mixed, *a), _inputs)
    assert got[1] == "a label"
    assert all(torch.equal(got[i], want[i]) for i in (0, 2, 3))
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads, strict=True))


def test_keyword_tensors_take_part_in_autograd():
    w = torch.randn(WIDTH, requires_grad=True)

    def scaled(x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * scale

    x = torch.randn(3, WIDTH, requires_grad=True)
    checkpointing.checkpoint(scaled, x, scale=w).sum().backward()
    want_x, want_w = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    scaled(x, scale=w).sum().backward()
    assert torch.equal(x.grad, want_x) and torch.equal(w.grad, want_w)


class Checkpointed(nn.Module):
    def __init__(self, ckpt: Any) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)) for _ in range(3)
        )
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = h + self.ckpt(b, h)
        return nn.functional.cross_entropy(self.head(h), y)


def test_a_model_checkpointed_with_it_trains_as_plain_pytorch_with_the_step_in_backward(tmp_path):
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1e6,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    }
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, WIDTH, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(4)]
    torch.manual_seed(0)
    ref = Checkpointed(lambda f, h: torch.utils.checkpoint.checkpoint(f, h, use_reentrant=True))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    for x, y in data:
        ref(x, y).backward()
        opt.step()
        opt.zero_grad()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = Checkpointed(deepspeed.checkpointing.checkpoint)
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
    with engine:
        for x, y in data:
            engine.backward(engine(x, y))
            engine.step()
        assert engine.stats()["steps_in_backward"] == len(data) - 1
        with zswap.GatheredParameters(list(model.parameters())):
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True))


class RaisesInRecompute(nn.Module):
    """DeepSpeed's ``_RecomputeExceptionModel`` (TestZero3ActivationCheckpointLifecycle): a frozen layer, then
    a raise inside the checkpoint's re-run in backward when ``fail`` is set, then a trainable layer."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.trainable = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 1)
        self.fail = False

    def _checkpointed(self, x: torch.Tensor) -> torch.Tensor:
        x = self.frozen(x)
        if self.fail and torch._C._current_graph_task_id() != -1:
            raise RuntimeError("injected checkpoint recompute forward")
        return self.trainable(torch.tanh(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.utils.checkpoint.checkpoint(self._checkpointed, x, use_reentrant=False)).sum()


@pytest.mark.parametrize("tier", ["none", "nvme"])
def test_a_backward_raising_in_a_recompute_leaves_nothing_gathered_and_training_goes_on(tmp_path, tier):
    """DeepSpeed's test_recompute_forward_exception_unwinds_for_clean_retry: autograd drops the end callbacks
    of a backward that raised, so the next forward lets go of what that one held (every param is partitioned
    again after the retry's backward, not at the step), and training goes on as in torch — where gradients
    live in memory, torch's own rule (the raised backward's completed gradients stay, summed with the next);
    on NVMe that backward counts for nothing (`zswap.gradients.gradstore.NvmeGrads`)."""
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if tier == "nvme":
        for key in ("offload_param", "offload_optimizer"):
            zero[key] = {"device": "nvme", "nvme_path": str(tmp_path)}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    }
    torch.manual_seed(0)
    ref = RaisesInRecompute()
    torch.manual_seed(0)
    model = RaisesInRecompute()
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(config=cfg, model=model, model_parameters=trained)
    opt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=1e-3, fused=True)
    g = torch.Generator().manual_seed(1)
    with engine:
        for i in range(5):
            x = torch.randn(2, WIDTH, generator=g)
            model.fail = ref.fail = i in (1, 3)
            kept = [p.grad for p in ref.parameters()]
            for backward in (ref(x).backward, functools.partial(engine.backward, engine(x))):
                if not model.fail:
                    backward()
                    continue
                with pytest.raises(RuntimeError, match="injected checkpoint recompute forward"):
                    backward()
            if model.fail:
                if tier == "nvme":  # the raised backward's gradients are dropped there
                    for p, grad in zip(ref.parameters(), kept, strict=True):
                        p.grad = grad
                continue  # the next batch's backward runs before the step
            assert all(p.numel() == 0 for p in model.parameters()), "a param stayed gathered after backward"
            engine.step()
            opt.step()
            opt.zero_grad()
        params = list(model.parameters())
        with zswap.GatheredParameters(params):
            assert all(torch.equal(p, q) for p, q in zip(params, ref.parameters(), strict=True))


def test_configure_takes_the_plain_checkpoint_and_refuses_the_rest(tmp_path):
    checkpointing.configure(None)
    assert checkpointing.is_configured()
    checkpointing.reset()
    path = tmp_path / "ds_config.json"
    path.write_text(
        json.dumps({"activation_checkpointing": {"partition_activations": False, "profile": False}})
    )
    checkpointing.configure(None, deepspeed_config=str(path), num_checkpoints=4)
    with pytest.raises(TypeError, match=r"configure: mpu_=.* is not supported"):
        checkpointing.configure(object())
    with pytest.raises(TypeError, match="configure: partition_activations=True is not supported"):
        checkpointing.configure(None, partition_activations=True)
    on = {"activation_checkpointing": {"cpu_checkpointing": True}}
    with pytest.raises(TypeError, match="configure: checkpoint_in_cpu=True is not supported"):
        checkpointing.configure(None, deepspeed_config=on)
    checkpointing.configure(None, deepspeed_config=on, checkpoint_in_cpu=False)  # the keyword overrides
    with pytest.raises(AttributeError, match="get_cuda_rng_tracker: zswap has no model parallelism"):
        deepspeed.checkpointing.get_cuda_rng_tracker()
