"""Nothing silent: each way of stepping, clipping, running or configuring that zswap cannot honour raises,
naming the zswap way, instead of doing nothing.

- a torch optimizer's ``step()`` (zswap's own included) over managed params outside ``engine.step()``;
- ``torch.nn.utils.clip_grad_norm_`` over managed params (it would see no gradient and return 0);
- ``optimizer.zero_grad()`` over managed params (torch's would clear ``p.grad``, where they have none):
  it drops the engine's gradients, as DeepSpeed's ZeRO-3 optimizer clears its partitions;
- a ``.grad`` set by hand on a managed param before ``engine.step()`` (it failed inside the kernel on the
  placeholder's shape);
- a forward with no open engine (``initialize`` forgotten, or after ``close()``), which torch would fail
  with ``'weight' must be 2-D``;
- ``initialize`` of a model on the meta device;
- a top-level config key that is a near miss of a section zswap reads;
- any engine call after ``close()`` (`zswap.EngineClosedError`);
- the ignored-keys warning, read by ``zswap.deepspeed``'s ``zero.Init`` and ``initialize``: once;
- a sparse gradient (``nn.Embedding(sparse=True)`` at ``initialize``, ``F.embedding(sparse=True)`` in
  backward), which failed inside torch with "reshape is not implemented for sparse tensors";
- weight-decay groups split by ``p.dim()`` on partitioned params (nanoGPT's ``configure_optimizers``): the
  decayed group comes out empty, so weight decay would never apply.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import zswap
import zswap.deepspeed
from zswap.parts import guards

STEP = (
    "{name}.step() over params zswap partitioned does nothing: their data and gradients live in zswap's "
    "stores, which only engine.step() applies the optimizer to. Call engine.step() after backward (engine = "
    "zswap.initialize(model, config, optimizer=...)), and let it clip (max_grad_norm= or the config's "
    "'gradient_clipping'); with the Hugging Face Trainer use zswap.transformers.Trainer"
)
CLIP = (
    "torch.nn.utils.clip_grad_norm_ over params zswap partitioned cannot see their gradients (they live in "
    "zswap's gradient store, not in p.grad) and would return 0 without clipping: let engine.step() clip by "
    "the global norm instead — zswap.initialize(..., max_grad_norm=...) or the config's "
    "'gradient_clipping' — and read the norm from engine.last_grad_norm"
)
FORWARD = (
    "Linear has params zswap partitioned that are not gathered, and no open zswap Engine runs them ({why}): "
    "call engine = zswap.initialize(model, config) before running the model, or run it inside "
    "`with zswap.GatheredParameters(model.parameters()):`"
)
CLOSED = "this zswap Engine is closed: build a new one with initialize()"


def _cfg(tmp_path) -> dict:
    return {
        "zero_optimization": {
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
            "stage3_param_persistence_threshold": 0,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }


def _model(cfg) -> nn.Module:
    torch.manual_seed(0)
    with zswap.Init(cfg):
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _snapshot(model) -> list[torch.Tensor]:
    with zswap.GatheredParameters(list(model.parameters())):
        return [p.detach().clone() for p in model.parameters()]


def _raises(exc_type, message):
    return pytest.raises(exc_type, match=f"^{re.escape(message)}$")


def test_optimizer_step_outside_engine_step_raises(tmp_path):
    cfg = _cfg(tmp_path)
    model = _model(cfg)
    with zswap.initialize(model, cfg) as engine:
        model(torch.randn(3, 4)).square().sum().backward()
        before = _snapshot(model)
        with _raises(zswap.ZswapError, STEP.format(name="OffloadedAdamW")):
            engine.optimizer.step()
        foreign = torch.optim.SGD(model.parameters(), lr=0.1)
        with _raises(zswap.ZswapError, STEP.format(name="SGD")):
            foreign.step()
        assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(model), strict=True))
        engine.step()  # the zswap way: trains, with the same optimizer
        assert all(not torch.equal(a, b) for a, b in zip(before, _snapshot(model), strict=True))


def test_optimizers_over_plain_params_are_untouched(tmp_path):
    """The guard only looks at zswap's params: a plain model's optimizer and clipping work as ever."""
    cfg = _cfg(tmp_path)
    _model(cfg)  # guards installed
    plain = nn.Linear(3, 3)
    plain(torch.randn(2, 3)).sum().backward()
    want = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in plain.parameters()]))
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e-3)
    assert float(norm) == pytest.approx(float(want), rel=1e-6)
    before = plain.weight.detach().clone()
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    assert not torch.equal(before, plain.weight)


def test_clip_grad_norm_over_managed_params_raises(tmp_path):
    cfg = _cfg(tmp_path)
    model = _model(cfg)
    with zswap.initialize(model, cfg, max_grad_norm=1e-3) as engine:
        model(torch.randn(3, 4)).square().sum().backward()
        with _raises(zswap.ZswapError, CLIP):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with _raises(zswap.ZswapError, CLIP):
            torch.nn.utils.clip_grad.clip_grad_norm_(list(model.parameters()), 1.0)
        engine.step()
        assert engine.last_grad_norm is not None and engine.last_grad_norm > 1e-3  # the engine's clipping


def test_weight_norm_and_pruning_of_a_partitioned_param_raise_naming_the_way(tmp_path):
    """They computed from the empty placeholder: weight_norm failed in torch ("cannot reshape tensor of 0
    elements"), pruning took a mask of shape (0,) and the next forward failed. Applied before zswap
    partitions the module they train as plain PyTorch does; a parametrization that keeps the param as its
    original (no right_inverse) is let through."""
    from torch.nn.utils import parametrize, prune
    from torch.nn.utils.parametrizations import weight_norm

    cfg = _cfg(tmp_path)
    model = _model(cfg)
    with zswap.initialize(model, cfg):
        for what, apply in (
            ("a parametrization", lambda: weight_norm(model[0])),
            ("pruning", lambda: prune.l1_unstructured(model[0], name="weight", amount=0.5)),
        ):
            with _raises(
                zswap.ZswapError, guards.READER_MESSAGE.format(what=what, module="Linear", name="weight")
            ):
                apply()
        assert "weight" in model[0]._parameters and not hasattr(model[0], "parametrizations")

        class Doubled(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return 2 * x

        parametrize.register_parametrization(model[2], "weight", Doubled())

    def build(zswapped: bool) -> tuple[nn.Module, list[float]]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        weight_norm(m[0])
        prune.l1_unstructured(m[2], name="weight", amount=0.5)
        x, losses = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)), []
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
        if zswapped:
            no_opt = {k: v for k, v in _cfg(tmp_path).items() if k != "optimizer"}
            engine = zswap.initialize(m, no_opt, optimizer=opt)
        for _ in range(3):
            loss = m(x).square().sum()
            losses.append(loss.item())
            if zswapped:
                engine.backward(loss)
                engine.step()
            else:
                loss.backward()
                opt.step()
                opt.zero_grad()
        if zswapped:
            engine.close()
        return m, losses

    assert build(zswapped=True)[1] == build(zswapped=False)[1]


def test_clip_grad_value_over_managed_params_raises_naming_a_clamping_hook(tmp_path):
    """It failed inside a torch kernel ("Expected !nested_tensorlist[0].empty()"); a loop catching that
    trained unclipped."""
    cfg = _cfg(tmp_path)
    model = _model(cfg)
    with zswap.initialize(model, cfg) as engine:
        model(torch.randn(3, 4)).square().sum().backward()
        with _raises(zswap.ZswapError, guards.VALUE_MESSAGE):
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
        engine.step()
    assert "p.register_hook(lambda g: g.clamp(-value, value))" in guards.VALUE_MESSAGE
    plain = nn.Linear(2, 2)
    plain(torch.ones(1, 2)).sum().backward()
    torch.nn.utils.clip_grad_value_(plain.parameters(), 0.1)  # a plain model's is torch's own
    assert plain.weight.grad is not None and plain.weight.grad.abs().max() <= 0.1


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_users_post_accumulate_grad_hook_sees_and_changes_each_gradient(when, tmp_path):
    """zswap takes each gradient from .grad in its own post-accumulate hook, registered at initialize: one
    registered after it saw None (a mask silently dropped). Both now run before zswap's, on each
    backward's gradient, and what they change is what the step applies."""
    cfg = _cfg(tmp_path)
    seen: list[torch.Tensor | None] = []

    def halve(p: torch.Tensor) -> None:
        seen.append(None if p.grad is None else p.grad.clone())
        if p.grad is not None:
            p.grad.mul_(0.5)

    model = _model(cfg)
    if when == "before":
        model[2].weight.register_post_accumulate_grad_hook(halve)
    with zswap.initialize(model, cfg) as engine:
        if when == "after":
            model[2].weight.register_post_accumulate_grad_hook(halve)
        for _ in range(2):
            engine.backward(model(torch.ones(3, 4)).square().sum())
            assert seen[-1] is not None
            assert torch.equal(zswap.full_grad(model[2].weight), seen[-1] * 0.5)  # its change is kept
            engine.step()
        got = _snapshot(model)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    plain[2].weight.register_post_accumulate_grad_hook(halve)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0, fused=True)  # the config's
    for _ in range(2):
        plain(torch.ones(3, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(a, b.detach()) for a, b in zip(got, plain.parameters(), strict=True))


@pytest.mark.parametrize("which", ["engine's", "given", "deepspeed"])
def test_optimizer_zero_grad_drops_the_engines_gradients(which, tmp_path):
    """The optimizer's ``zero_grad`` between two backwards: the step applies the second one's only (and
    one before any backward, as loops call it first, changes nothing)."""
    cfg = _cfg(tmp_path)
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    model = _model(cfg)
    if which == "deepspeed":
        cfg["train_micro_batch_size_per_gpu"] = 3
        engine, opt, *_ = zswap.deepspeed.initialize(model=model, config={**cfg, "gradient_clipping": 0})
    elif which == "given":
        del cfg["optimizer"]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        engine = zswap.initialize(model, cfg, optimizer=opt)
        assert engine.optimizer is not opt  # adopted: an OffloadedAdamW over its groups
    else:
        cfg["optimizer"]["params"]["weight_decay"] = 0.0
        engine = zswap.initialize(model, cfg)
        opt = engine.optimizer
    with engine:
        for first, second in [(xs[0], xs[1]), (None, xs[2])]:
            opt.zero_grad()
            if first is not None:
                engine.backward(engine(first).square().sum())
                opt.zero_grad()
            engine.backward(engine(second).square().sum())
            engine.step()
            ref(second).square().sum().backward()
            ref_opt.step()
            ref_opt.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(_snapshot(model), ref.parameters(), strict=True))


def test_a_models_zero_grad_drops_the_engines_gradients_and_a_part_of_it_is_refused(tmp_path):
    """``model.zero_grad()`` between two backwards, as the optimizer's: the step applies the second one's
    only (it summed both, silently). Over a submodule it raises: the engine drops all or none."""
    cfg = _cfg(tmp_path)
    cfg["optimizer"]["params"]["weight_decay"] = 0.0
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    model = _model(cfg)
    with zswap.initialize(model, cfg) as engine:
        engine.backward(engine(xs[0]).square().sum())
        with pytest.raises(zswap.ZswapError, match=r"^Linear\.zero_grad\(\) over part of the params"):
            model[0].zero_grad()
        model.zero_grad()
        engine.backward(engine(xs[1]).square().sum())
        engine.step()
        ref(xs[1]).square().sum().backward()
        ref_opt.step()
        assert all(torch.equal(a, b) for a, b in zip(_snapshot(model), ref.parameters(), strict=True))


def test_zero_grad_keeping_zeros_warns_that_the_gradients_are_dropped(tmp_path):
    cfg = _cfg(tmp_path)
    model = _model(cfg)
    with zswap.initialize(model, cfg) as engine:
        for zero in (engine.optimizer.zero_grad, model.zero_grad):
            with pytest.warns(zswap.ZswapWarning, match=r"^zero_grad\(set_to_none=False\) over params"):
                zero(set_to_none=False)


@pytest.mark.parametrize("tier", ["nvme", "cpu"])
def test_a_param_written_in_place_in_a_forward_warns_that_the_change_is_lost(tier, tmp_path):
    """A model that changes its own weights in its forward (RWKV's rescaling, under ``no_grad``): the
    engine drops the gathered copy it was written in, and says so; params in CPU memory (one rank) are
    gathered without a copy, so there the change stays — and the warning says that (it said "lost")."""

    class Rescaling(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

            self.rescaled = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.rescaled:
                with torch.no_grad():
                    self.lin.weight.div_(2)
                self.rescaled = True
            return self.lin(x)

    cfg = _cfg(tmp_path)
    cfg["zero_optimization"]["offload_param"]["device"] = tier
    torch.manual_seed(0)
    with zswap.Init(cfg):
        model = Rescaling()
    with zswap.GatheredParameters([model.lin.weight]):
        before = model.lin.weight.detach().clone()
    with zswap.initialize(model, cfg) as engine:
        fate = "so the change stays, where with params on NVMe" if tier == "cpu" else "so the change is lost"
        written = rf"^a param of shape \(4, 4\) was changed in place.*{fate}"
        with pytest.warns(zswap.ZswapWarning, match=written), torch.no_grad():
            engine(torch.randn(2, 4))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.no_grad():
                engine(torch.randn(2, 4))  # gathered afresh: nothing was written since
        with zswap.GatheredParameters([model.lin.weight]):
            after = model.lin.weight.detach().clone()
    assert torch.equal(after, before / 2 if tier == "cpu" else before)


def test_a_grad_set_by_hand_is_refused_before_the_step_changes_anything(tmp_path):
    cfg = _cfg(tmp_path)
    cfg["optimizer"]["params"]["weight_decay"] = 0.0
    model = _model(cfg)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with zswap.initialize(model, cfg) as engine:
        engine.backward(engine(x).square().sum())
        model[2].bias.grad = torch.zeros_like(model[2].bias)  # the placeholder's shape, as torch demands
        message = (
            "engine.step(): 2.bias have a .grad set by hand, which zswap does not read: a partitioned "
            "param's gradient lives in zswap's gradient store (p.grad stays None). Make gradients with "
            "backward, or set one with zswap.deepspeed.utils.safe_set_full_grad(param, value)"
        )
        with _raises(zswap.ZswapError, message):
            engine.step()
        model[2].bias.grad = None
        engine.step()  # the backward's gradients, untouched by the refused step
        ref(x).square().sum().backward()
        torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, fused=True).step()
        assert all(torch.equal(a, b) for a, b in zip(_snapshot(model), ref.parameters(), strict=True))


def test_a_param_unfrozen_after_initialize_is_refused_naming_it(tmp_path):
    """Unfreezing mid-training (Lightning's BackboneFinetuning): the engine hooked the gradients of the
    params that required grad when it was built, so autograd left the unfrozen ones' in ``.grad``; the step
    says so, rather than that something set a ``.grad`` by hand."""
    cfg = _cfg(tmp_path)
    model = _model(cfg)
    model[0].requires_grad_(False)
    with zswap.initialize(model, cfg) as engine:
        model[0].requires_grad_(True)
        engine.backward(engine(torch.randn(3, 4)).square().sum())
        message = (
            "engine.step(): 0.weight, 0.bias required no grad when the engine was built and do now: zswap "
            "puts its gradient hooks on the params that require grad at zswap.initialize, so autograd left "
            "these gradients in .grad, which zswap does not read. Unfreeze them before the engine is built "
            "(under Lightning: before fit, e.g. in configure_model), or build a new engine after unfreezing"
        )
        with _raises(zswap.ZswapError, message):
            engine.step()


def test_forward_without_an_engine_raises(tmp_path):
    cfg = _cfg(tmp_path)
    model = _model(cfg)
    x = torch.randn(3, 4)
    with _raises(zswap.ZswapError, FORWARD.format(why="zswap.initialize was not called for them")):
        model(x)
    engine = zswap.initialize(model, cfg)
    want = model(x).detach()
    engine.close()
    with _raises(zswap.ZswapError, FORWARD.format(why="its engine was closed")):
        model(x)
    with zswap.GatheredParameters(list(model.parameters())):  # the other way named in the message
        assert torch.equal(model(x), want)


def test_initialize_refuses_a_meta_model(tmp_path):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    with _raises(
        zswap.ZswapError,
        "param '0.weight' of the model is on the meta device (no values): build the model under "
        "zswap.Init(config) — or load it with from_pretrained under zswap.Init — instead of on the meta "
        "device, then call zswap.initialize",
    ):
        zswap.initialize(model, _cfg(tmp_path))
    assert zswap.param_state(model[0].weight) is None  # refused before anything was partitioned


def test_initialize_refuses_a_shape_dependent_optimizer(tmp_path):
    cfg = {k: v for k, v in _cfg(tmp_path).items() if k != "optimizer"}  # the given one is the optimizer
    model = _model(cfg)
    with _raises(
        zswap.ConfigError,
        "optimizer= is Adafactor, whose update depends on each param's shape; zswap steps every param as its "
        "flat partition, so it would compute something else: use an element-wise optimizer (Adam/AdamW, "
        "SGD, RMSprop, …) or add an 'optimizer' section to the config",
    ):
        zswap.initialize(model, cfg, optimizer=torch.optim.Adafactor(model.parameters()))
    zswap.initialize(
        model, cfg, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)
    ).close()  # element-wise


@pytest.mark.parametrize(
    ("key", "section"),
    [
        ("zero_optimisation", "zero_optimization"),
        ("optimiser", "optimizer"),
        ("bf_16", "bf16"),
        ("FP16", "fp16"),
        ("schedular", "scheduler"),
        ("gradient_clip", "gradient_clipping"),
        ("offload_params", "offload_param"),
        ("torch_autocst", "torch_autocast"),
        ("datatypes", "data_types"),
        ("communication_datatype", "communication_data_type"),
        ("aoi", "aio"),  # letters swapped in a short name: a low ratio, the same letters
        ("fp61", "fp16"),
    ],
)
def test_top_level_near_miss_is_an_error(key, section):
    with _raises(
        zswap.ConfigError,
        f"unknown top-level key {key!r}: did you mean {section!r}? zswap reads {section!r} and would ignore "
        f"{key!r} (keys outside zswap's sections are left to DeepSpeed)",
    ):
        zswap.load_config({key: {}})


def test_full_deepspeed_config_still_loads(tmp_path):
    """A DeepSpeed / Hugging Face config keeps its many other top-level keys, some close to zswap's."""
    cfg = {
        **_cfg(tmp_path),
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_accumulation_dtype": "fp32",
        "gradient_clipping": "auto",
        "gradient_predivide_factor": 1.0,
        "steps_per_print": 2000,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "communication_data_type": "fp32",
        "prescale_gradients": False,
        "activation_checkpointing": {"partition_activations": False},
        "checkpoint": {"use_node_local_storage": True},
        "data_types": {"grad_accum_dtype": "fp32"},
        "amp": {"enabled": False},
        "tensorboard": {"enabled": False},
        "flops_profiler": {"enabled": False},
        "comms_logger": {"enabled": False},
    }
    loaded = zswap.load_config(cfg)
    assert loaded.offload_param.device == "nvme"


def test_engine_calls_after_close_raise_engine_closed_error(tmp_path):
    cfg = _cfg(tmp_path)
    model = _model(cfg)
    engine = zswap.initialize(model, cfg)
    engine.close()
    assert issubclass(zswap.EngineClosedError, zswap.ZswapError)
    with _raises(zswap.EngineClosedError, CLOSED):
        engine.step()
    with _raises(zswap.EngineClosedError, CLOSED):
        engine.zero_grad()
    with _raises(zswap.EngineClosedError, CLOSED):
        engine.backward(torch.ones((), requires_grad=True))
    with _raises(zswap.EngineClosedError, CLOSED):
        engine.save_checkpoint(tmp_path / "ckpt")
    with _raises(zswap.EngineClosedError, CLOSED):
        engine.load_checkpoint(tmp_path / "ckpt")
    with _raises(zswap.EngineClosedError, CLOSED):
        engine.get_lr()


def test_ignored_keys_warning_once_through_zswap_deepspeed(tmp_path):
    cfg = _cfg(tmp_path)
    cfg["zero_optimization"]["overlap_comm"] = True
    cfg["train_micro_batch_size_per_gpu"] = 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # what a user's script gets: repeats from one place shown once
        with zswap.deepspeed.zero.Init(config_dict_or_path=cfg):
            model = nn.Linear(4, 4)
        engine, *_ = zswap.deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
        engine.close()
    ignored = [str(w.message) for w in caught if issubclass(w.category, zswap.ZswapWarning)]
    assert ignored == [
        "zswap ignores these DeepSpeed settings, which tune DeepSpeed's own machinery and change no result: "
        "zero_optimization.overlap_comm"
    ]


class SparseUse(nn.Module):
    def __init__(self, module: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=module)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(nn.functional.embedding(x, self.emb.weight, sparse=True)).sum()


def test_a_sparse_gradient_is_refused_naming_the_param_and_the_dense_way():
    sparse = r"emb\.weight has a sparse gradient .* Build the embedding with sparse=False"
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    with zswap.Init(cfg):
        model = SparseUse(module=True)
    with pytest.raises(zswap.errors.SparseGradientError, match=sparse):
        zswap.initialize(model, cfg)
    with zswap.Init(cfg):
        model = SparseUse(module=False)
    with zswap.initialize(model, cfg) as engine:
        with pytest.raises(zswap.errors.SparseGradientError, match=sparse):
            engine.backward(model(torch.tensor([[1, 2]])))
        assert engine.stats()["steps_ordinary"] == 0


def _split(model: nn.Module, ndim: object) -> list[dict]:
    """nanoGPT's ``configure_optimizers`` groups: params of two or more dimensions decayed, the rest not."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if ndim(p) >= 2]  # type: ignore[operator]
    rest = [p for p in params if ndim(p) < 2]  # type: ignore[operator]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


SPLIT = (
    "the optimizer's param groups look split by p.dim() or p.shape on partitioned params: a group with "
    "weight decay is empty, and group 1, without weight decay, holds 2 params of two or more dimensions "
    "('0.weight', shape (8, 4)). Outside forward a partitioned param's data is an empty placeholder "
    "(torch.Size([0])); split by len(zswap.param_state(p).shape) or by name (as the Hugging Face Trainer "
    "does)"
)


@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.SGD])
def test_a_weight_decay_split_by_placeholder_shapes_is_refused(kind, tmp_path):
    cfg = _cfg(tmp_path)
    del cfg["optimizer"]
    model = _model(cfg)
    assert all(p.dim() == 1 for p in model.parameters())  # the placeholders the split saw
    with _raises(zswap.ConfigError, SPLIT):
        zswap.initialize(model, cfg, optimizer=kind(_split(model, torch.Tensor.dim), lr=1e-2))
    # The split by the real shapes, and groups where the empty one is legitimately so, are taken.
    real = kind(_split(model, lambda p: len(zswap.param_state(p).shape)), lr=1e-2)
    assert [len(g["params"]) for g in real.param_groups] == [2, 2]
    zswap.initialize(model, cfg, optimizer=real).close()
    biases = [p for p in model.parameters() if len(zswap.param_state(p).shape) == 1]  # BitFit: no matrices
    bitfit = kind([{"params": [], "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}], lr=1e-2)
    zswap.initialize(model, cfg, optimizer=bitfit).close()


def test_a_plateau_schedule_is_refused_where_step_has_no_metric_to_give(tmp_path):
    """engine.step() calls the schedule's step() with nothing: ReduceLROnPlateau raised a TypeError at
    every step, after the weights moved and before the gradients were cleared. zswap.deepspeed's
    step(lr_kwargs=...) hands it the metric, as DeepSpeed's."""
    cfg = _cfg(tmp_path)
    model = _model(cfg)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    with pytest.raises(
        zswap.ConfigError, match=r"lr_scheduler= is a ReduceLROnPlateau, which steps on a metric"
    ):
        zswap.initialize(model, cfg, lr_scheduler=lambda opt: plateau(opt, patience=0))
    engine, *_ = zswap.deepspeed.initialize(
        model=model, config=cfg | {"train_micro_batch_size_per_gpu": 3},
        lr_scheduler=lambda opt: plateau(opt, patience=0, factor=0.5),
    )  # fmt: skip
    with engine:
        for _ in range(3):
            engine.backward(engine(torch.randn(3, 4)).square().sum())
            engine.step(lr_kwargs={"metrics": 1.0})  # never better: the lr halves after each step
        assert engine.get_lr() == [1e-2 * 0.5**2]


def test_a_schedule_that_raises_leaves_the_step_applied_and_the_gradients_cleared(tmp_path):
    """The error comes out of engine.step(); the gradients it applied do not carry into the next step."""

    class Broken(torch.optim.lr_scheduler.ConstantLR):
        def step(self, epoch: object = None) -> None:
            if getattr(self, "built", False):
                raise RuntimeError("schedule failed")
            self.built = True  # (the constructor steps once)

    cfg = _cfg(tmp_path)
    twins = []
    for broken in (True, False):
        model = _model(cfg)
        engine = zswap.initialize(model, cfg, lr_scheduler=Broken if broken else None)
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            engine.backward(model(torch.randn(3, 4, generator=g)).square().sum())
            if broken:
                with pytest.raises(RuntimeError, match="schedule failed"):
                    engine.step()
            else:
                engine.step()
        twins.append(_snapshot(model))
        engine.close()
    assert all(torch.equal(a, b) for a, b in zip(*twins, strict=True))


def test_a_non_finite_norm_is_said_so_not_taken_for_clipping(tmp_path):
    """fp32 without an overflow check applies a NaN gradient as PyTorch does; the early step's drop was
    reported as "clipping bit" with clipping far above the norm."""
    cfg = _cfg(tmp_path) | {"gradient_clipping": 1e6}
    model = _model(cfg)
    with zswap.initialize(model, cfg) as engine:
        for i in range(3):
            engine.backward(model(torch.randn(3, 4)).square().mean() * (float("nan") if i == 2 else 1.0))
            engine.step()
        stats = engine.stats()
    assert stats["steps_ordinary_reason"] == (
        "the gradient norm is not finite (gradient scale nan), and no check skips the step"
    )
