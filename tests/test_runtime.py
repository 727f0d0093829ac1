"""zswap.initialize: forward and backward of offloaded models give bitwise the logits and gradients of the
plain model (same seed), across tied weights, activation checkpointing, data-dependent branches and params
used outside their own module; prefetch, budgets, gradients, stats and close()."""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import zswap
from zswap import Status, ZswapError, full_grad, param_state

TIERS = ("cpu", "nvme")


def config(tier: str, tmp_path: Path, **zero: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"offload_param": {"device": tier}, "zero_optimization": zero}
    if tier == "nvme":
        cfg["offload_param"]["nvme_path"] = str(tmp_path)
    return cfg


def build(make: Callable[[], nn.Module], cfg: dict[str, Any], seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(the model under zswap.Init, the plain model), both from ``seed``."""
    torch.manual_seed(seed)
    ref = make()
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        # io_uring / O_DIRECT fallbacks depend on the test machine, not on what is tested here.
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            m = make()
    return m, ref


def engine_for(m: nn.Module, cfg: dict[str, Any], **kwargs: Any) -> zswap.Engine:
    if kwargs.get("optimizer") is not None:  # the given one steps: the config's section would be refused
        cfg = {k: v for k, v in cfg.items() if k != "optimizer"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        return zswap.initialize(m, cfg, **kwargs)


def no_seeds(*engines: zswap.Engine) -> None:
    """No updated params kept for the next forward, by the early step or the ordinary one: each forward
    reads what the step wrote, as a twin's does (seeds: tests/test_applied_grads.py, test_seeds.py)."""
    for e in engines:
        if e._early is not None:
            e._early.seed_numel = 0
        e._sched.seed_plan = frozenset  # type: ignore[method-assign]


def assert_same_grads(m: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is None, f"{name}: a full-size gradient was left in p.grad"
        g = full_grad(p)
        assert (g is None) == (q.grad is None), name
        if g is not None:
            assert torch.equal(g, q.grad), f"{name}: max diff {(g - q.grad).abs().max()}"


def train_pass(m: nn.Module, ref: nn.Module, x: torch.Tensor, loss: Callable[[Any], torch.Tensor]) -> None:
    out, want = m(x), ref(x)
    assert torch.equal(out, want)
    loss(out).backward()
    loss(want).backward()


def sq(t: torch.Tensor) -> torch.Tensor:
    return t.square().mean()


def all_released(m: nn.Module) -> bool:
    return all(param_state(p).status is Status.NOT_AVAILABLE and p.numel() == 0 for p in m.parameters())


# -- models -----------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class TinyLM(nn.Module):
    """Tied embedding / head, a param of the root used in its own forward, optional checkpointing."""

    def __init__(self, vocab: int = 40, d: int = 16, layers: int = 3, reentrant: bool | None = None) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(8, d) * 0.1)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.reentrant = reentrant

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids) + self.pos[: ids.shape[1]]
        for b in self.blocks:
            h = b(h) if self.reentrant is None else checkpoint(b, h, use_reentrant=self.reentrant)
        return self.head(self.ln_f(h))


class Branchy(nn.Module):
    """Which module runs depends on the data."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.a = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10))
        self.b = nn.Linear(10, 10)
        self.out = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.a(h) if bool(x.sum() > 0) else self.b(h) + self.b(h * 0.5)
        return self.out(h)


class Reach(nn.Module):
    """A parent that uses its own param and reads a child's weight in its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(7, 7)
        self.proj = nn.Linear(7, 4)
        self.gain = nn.Parameter(torch.rand(7) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.child(x) * self.gain
        h = F.linear(torch.tanh(h), self.child.weight)  # the child's weight, used by the parent
        return self.proj(h) + self.gain.sum()


class _Scaled(torch.autograd.Function):
    """``x * w`` with a hand-written backward, as PEFT's LoHa computes its weight."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0)


class Factors(nn.Module):
    """Params kept in a ``ParameterDict`` / ``ParameterList`` (which never run a forward of their own) and
    handed to an autograd Function (whose inputs the torch-function mode does not see)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.scales = nn.ParameterDict({"a": nn.Parameter(torch.rand(6) + 0.5)})
        self.shifts = nn.ParameterList([nn.Parameter(torch.rand(6))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Scaled.apply(self.proj(x), self.scales["a"]) + _Scaled.apply(x, self.shifts[0])


def ids(batch: int = 3, seq: int = 8, vocab: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def xs(n: int, *shape: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


STREAM = {"stage3_param_persistence_threshold": 0}  # every param is fetched and released


# -- bitwise equality -------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
def test_mlp_logits_and_grads_are_bitwise_the_plain_models(tier, tmp_path):
    cfg = config(tier, tmp_path, **STREAM)
    m, ref = build(MLP, cfg)
    with engine_for(m, cfg):
        for x in xs(3, 4, 12):
            train_pass(m, ref, x, sq)
            assert_same_grads(m, ref)
            assert all_released(m)
            for p, q in zip(m.parameters(), ref.parameters(), strict=True):
                p_st = param_state(p)
                p_st.grad, q.grad = None, None  # compare each iteration on its own


@pytest.mark.parametrize("tier", TIERS)
def test_tied_weights_get_one_summed_gradient(tier, tmp_path):
    cfg = config(tier, tmp_path, **STREAM)
    m, ref = build(TinyLM, cfg)
    assert m.head.weight is m.wte.weight
    with engine_for(m, cfg):
        train_pass(m, ref, ids(), sq)
        assert_same_grads(m, ref)
        assert all_released(m)


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("tier", TIERS)
def test_activation_checkpointing(tier, reentrant, tmp_path):
    cfg = config(tier, tmp_path, **STREAM)
    m, ref = build(lambda: TinyLM(reentrant=reentrant), cfg)
    with engine_for(m, cfg) as engine:
        for seed in (1, 2):
            train_pass(m, ref, ids(seed=seed), sq)
        assert_same_grads(m, ref)
        assert all_released(m)
        assert engine.stats()["grad_placeholders"] == 0  # every param was gathered when its grad came


@pytest.mark.parametrize("tier", TIERS)
def test_data_dependent_branch_fetches_on_demand_and_records_again(tier, tmp_path):
    cfg = config(tier, tmp_path, **STREAM)
    m, ref = build(Branchy, cfg)
    g = torch.Generator().manual_seed(3)
    pos, neg = torch.rand(4, 6, generator=g) + 0.1, -torch.rand(4, 6, generator=g) - 0.1
    with engine_for(m, cfg) as engine:
        for x in (pos, pos, neg, neg, pos, neg):
            train_pass(m, ref, x, sq)
            assert all_released(m)
        assert_same_grads(m, ref)
        s = engine.stats()
        assert s["off_trace"] >= 3 and s["traces_recorded"] >= 4 and s["prefetch_hits"] > 0


@pytest.mark.parametrize("make", [Reach, Factors])
@pytest.mark.parametrize("tier", TIERS)
def test_params_used_directly_by_a_parent(tier, make, tmp_path):
    """A child's weight used by its parent (fetched on use); a ``ParameterDict`` / ``ParameterList``
    child's params, gathered with their parent's (before: an autograd Function given one got the empty
    placeholder, and backward failed on its gradient's shape)."""
    cfg = config(tier, tmp_path, **STREAM)
    m, ref = build(make, cfg)
    with engine_for(m, cfg):
        for x in xs(2, 5, 7 if make is Reach else 6):
            train_pass(m, ref, x, sq)
        assert_same_grads(m, ref)
        assert all_released(m)


@pytest.mark.parametrize("tier", TIERS)
def test_eval_and_no_grad(tier, tmp_path):
    cfg = config(tier, tmp_path, **STREAM)
    m, ref = build(lambda: TinyLM(reentrant=False), cfg)
    m.eval()
    ref.eval()
    with engine_for(m, cfg):
        with torch.no_grad():
            for seed in (1, 2, 3):
                out = m(ids(seed=seed))
                assert torch.equal(out, ref(ids(seed=seed))) and not out.requires_grad
                assert all_released(m)
        m.train()
        ref.train()
        train_pass(m, ref, ids(), sq)  # and training right after
        assert_same_grads(m, ref)


@pytest.mark.parametrize("tier", TIERS)
def test_gradients_accumulate_over_backward_calls(tier, tmp_path):
    cfg = config(tier, tmp_path, **STREAM)
    m, ref = build(TinyLM, cfg)
    with engine_for(m, cfg) as engine:
        for seed in (1, 2):
            train_pass(m, ref, ids(seed=seed), sq)
        assert_same_grads(m, ref)
        engine.zero_grad()
        ref.zero_grad()
        assert all(full_grad(p) is None for p in m.parameters())
        train_pass(m, ref, ids(seed=3), sq)
        assert_same_grads(m, ref)


def test_full_grad_is_none_without_gradient_and_p_grad_for_unmanaged(tmp_path):
    cfg = config("cpu", tmp_path, **STREAM)
    m, _ = build(Reach, cfg)
    m.proj.bias.requires_grad_(False)
    with engine_for(m, cfg):
        assert all(full_grad(p) is None for p in m.parameters())
        sq(m(xs(1, 2, 7)[0])).backward()
        assert full_grad(m.proj.bias) is None and full_grad(m.proj.weight).shape == (4, 7)
        plain = torch.ones(3, requires_grad=True)
        (plain * 2).sum().backward()
        assert torch.equal(full_grad(plain), torch.full((3,), 2.0))


# -- scheduling -------------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
def test_stats_show_prefetch_hits_from_the_first_iteration(tier, tmp_path):
    cfg = config(tier, tmp_path, **STREAM)
    m, _ = build(TinyLM, cfg)
    with engine_for(m, cfg) as engine:
        sq(m(ids())).backward()
        first = engine.stats(reset=True)  # follows the static guess (registration order)
        assert first["prefetch_hits"] > 0 and first["guessed_iterations"] == 1
        sq(m(ids(seed=2))).backward()
        second = engine.stats()
    assert second["prefetch_hit_rate"] > 0.5 and second["fetches"] > 0
    assert second["fetch_wait_seconds"] >= 0 and second["bytes_fetched"] > 0
    if tier == "nvme":
        assert first["bytes_read"] > 0 and second["bytes_read"] > 0
    else:
        assert first["bytes_read"] == 0


def test_live_budget_is_never_exceeded(tmp_path):
    knobs = {"stage3_param_persistence_threshold": 100, "stage3_max_reuse_distance": 0}
    m, ref = build(TinyLM, config("nvme", tmp_path, **knobs))
    with engine_for(m, config("nvme", tmp_path, **knobs)) as engine:
        chain = engine.sizing.largest_chain  # what one module and its parents hold at once
    assert chain == 128 + 4 * 16 * 16  # `pos` (root) + fc1.weight; biases and norms are persistent
    cfg = config(
        "nvme", tmp_path, stage3_max_live_parameters=chain, stage3_prefetch_bucket_size=chain, **knobs
    )
    with engine_for(m, cfg) as engine:
        for seed in (1, 2, 3):
            train_pass(m, ref, ids(seed=seed), sq)
        assert_same_grads(m, ref)
        s = engine.stats()
    assert 0 < s["peak_live_elements"] <= chain and s["budget_exceeded"] == 0
    assert s["prefetch_hits"] > 0 and s["persistent_elements"] > 0


@pytest.mark.parametrize("between", ["chained", "tanh"])
def test_backward_hands_over_one_module_at_a_time(between, tmp_path):
    # Module i's output is module i+1's input (nn.Sequential): backward releases module i+1's params before
    # it gathers module i's, as DeepSpeed does, so a budget of one module holds in backward as in forward.
    def make() -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(5):
            layers += [nn.Linear(8, 8)] + ([nn.Tanh()] if between == "tanh" else [])
        return nn.Sequential(*layers)

    one = 8 * 8 + 8
    knobs = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
             "stage3_prefetch_bucket_size": 0, "stage3_max_live_parameters": one}  # fmt: skip
    m, ref = build(make, config("nvme", tmp_path, **knobs))
    with engine_for(m, config("nvme", tmp_path, **knobs)) as engine:
        for seed in (1, 2):
            engine.stats(reset=True)
            train_pass(m, ref, torch.randn(2, 8, generator=torch.Generator().manual_seed(seed)), sq)
            s = engine.stats()
            assert s["peak_live_elements"] == one and s["budget_exceeded"] == 0, s
        assert_same_grads(m, ref)


def test_autograd_keeps_no_gathered_weight_alive_until_backward(tmp_path):
    # F.linear saves weight.t(), a view: kept as a reference to the param, not as the gathered memory.
    from zswap.params import _storage_uses

    cfg = config("nvme", tmp_path, stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0,
                 stage3_max_reuse_distance=0)  # fmt: skip
    m, ref = build(TinyLM, cfg)
    with engine_for(m, cfg):
        out = m(ids())
        store = param_state(m.head.weight).store
        pooled = [(buf, uses) for pool in store._pool.values() for buf, uses in pool]

        def held(buf: torch.Tensor) -> int:  # the scheduler may keep a param for its backward (reuse)
            ptr = buf.untyped_storage().data_ptr()
            return sum(p.numel() > 0 and p.untyped_storage().data_ptr() == ptr for p in m.parameters())

        assert pooled and all(_storage_uses(buf) == uses + held(buf) for buf, uses in pooled)
        sq(out).backward()
        sq(ref(ids())).backward()
        assert_same_grads(m, ref)


def test_a_budget_below_one_module_gathers_one_module_at_a_time(tmp_path):
    """As DeepSpeed's: the module running gets its params whatever ``stage3_max_live_parameters`` says;
    nothing is prefetched beside them. The gradients are plain torch's."""
    cfg = config("nvme", tmp_path, stage3_param_persistence_threshold=0, stage3_max_live_parameters=100)
    m, ref = build(TinyLM, cfg)
    with engine_for(m, cfg) as engine:
        train_pass(m, ref, ids(), sq)
        assert_same_grads(m, ref)
        stats = engine.stats()
        assert stats["max_live_elements"] == 100 and stats["prefetch_issued"] == 0
        assert engine.sizing.live_elements == engine.sizing.largest_chain > 100
    assert all_released(m)


def test_persistent_params_stay_gathered(tmp_path):
    cfg = config("cpu", tmp_path, stage3_param_persistence_threshold=64)
    m, ref = build(TinyLM, cfg)
    with engine_for(m, cfg) as engine:
        train_pass(m, ref, ids(), sq)
        assert_same_grads(m, ref)
        for p in m.parameters():
            st = param_state(p)
            assert (st.status is Status.AVAILABLE) == (st.numel <= 64)
        assert engine.stats()["persistent_elements"] == sum(
            p.numel() for p in ref.parameters() if p.numel() <= 64
        )
    assert all_released(m)


def test_reuse_distance_keeps_params_between_uses(tmp_path):
    fetched = {}
    for reuse in (0, 10**9):
        cfg = config("cpu", tmp_path, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=reuse)
        m, ref = build(TinyLM, cfg)
        with engine_for(m, cfg) as engine:
            for seed in (1, 2):
                train_pass(m, ref, ids(seed=seed), sq)
            assert_same_grads(m, ref)
            fetched[reuse] = engine.stats()["fetches"]
    assert fetched[10**9] < fetched[0]


def test_initialize_converts_a_plain_model(tmp_path):
    torch.manual_seed(0)
    ref = TinyLM()
    torch.manual_seed(0)
    m = TinyLM()
    cfg = config("nvme", tmp_path, **STREAM)
    with engine_for(m, cfg):
        assert {param_state(p).tier for p in m.parameters()} == {"nvme"}
        train_pass(m, ref, ids(), sq)
        assert_same_grads(m, ref)


@pytest.mark.parametrize("tier", TIERS)
def test_an_exception_in_forward_releases_and_the_next_pass_works(tier, tmp_path):
    cfg = config(tier, tmp_path, **STREAM)
    m, ref = build(MLP, cfg)

    def boom(module: nn.Module, args: Any, out: Any) -> None:
        raise KeyError("boom")

    with engine_for(m, cfg):
        handle = m.net[2].register_forward_hook(boom)
        with pytest.raises(KeyError, match="boom"):
            m(xs(1, 2, 12)[0])
        handle.remove()
        assert all_released(m)
        train_pass(m, ref, xs(1, 2, 12)[0], sq)
        assert_same_grads(m, ref)


# -- the engine -------------------------------------------------------------------------------------


def test_step_without_an_optimizer_says_how_to_get_one(tmp_path):
    cfg = config("cpu", tmp_path)
    m, _ = build(MLP, cfg)
    with (
        engine_for(m, cfg) as engine,
        pytest.raises(ZswapError, match="no optimizer: pass optimizer= or add"),
    ):
        engine.step()


class RecordingOptimizer:
    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = list(params)
        self.seen: list[list[torch.Tensor | None]] = []

    def step(self) -> None:
        self.seen.append([param_state(p).grad for p in self.params])


def test_step_runs_the_given_optimizer_on_the_partitions_then_clears(tmp_path):
    cfg = config("nvme", tmp_path, stage3_param_persistence_threshold=16)
    m, ref = build(MLP, cfg)
    opt = RecordingOptimizer(m.parameters())
    with engine_for(m, cfg, optimizer=opt) as engine:
        assert engine.optimizer is opt
        train_pass(m, ref, xs(1, 3, 12)[0], sq)
        engine.step()
        assert [g.shape for g in opt.seen[0]] == [(q.numel(),) for q in ref.parameters()]
        assert all(param_state(p).grad is None for p in m.parameters())
        small = [p for p in m.parameters() if param_state(p).numel <= 16]
        assert small and all(param_state(p).status is Status.AVAILABLE for p in small)  # gathered again


class GivenAdamW(torch.optim.AdamW):
    """torch's AdamW as a subclass: stepped as given over the partitions (`zswap.initialize` rebuilds only
    the plain class as its offloaded AdamW, `tests/test_adopt.py`), the path these tests cover."""


def _adamw(kind: str) -> Callable[[Iterable[torch.Tensor]], Any]:
    if kind == "torch":
        return lambda params: GivenAdamW(params, lr=1e-2)
    return lambda params: zswap.optim.OffloadedAdamW(params, lr=1e-2)


@pytest.mark.parametrize("kind", ["torch", "zswap"])
@pytest.mark.parametrize("tier", TIERS)
def test_training_steps_match_the_plain_model_bitwise(tier, kind, tmp_path):
    # A budget below the model: on nvme the step loads the partitions in several chunks.
    cfg = config(tier, tmp_path, stage3_param_persistence_threshold=20, stage3_max_live_parameters=2500)
    m, ref = build(TinyLM, cfg)
    make = _adamw(kind)
    ref_opt = make(ref.parameters())
    with engine_for(m, cfg, optimizer=make(m.parameters())) as engine:
        for step in range(3):
            train_pass(m, ref, ids(seed=step), sq)  # asserts equal logits: the updates were equal
            engine.step()
            ref_opt.step()
            ref_opt.zero_grad()
        assert all(full_grad(p) is None for p in m.parameters())
        assert engine.stats()["budget_exceeded"] == 0
    with zswap.GatheredParameters(m.parameters()):
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.data, q.data)


def test_close_removes_every_hook_and_releases(tmp_path):
    cfg = config("cpu", tmp_path, stage3_param_persistence_threshold=64)
    m, _ = build(TinyLM, cfg)
    engine = zswap.initialize(m, cfg)
    assert any(mod._forward_pre_hooks for mod in m.modules())
    sq(m(ids())).backward()
    out = m(ids())  # a graph built before close(): its hooks must do nothing afterwards
    engine.close()
    engine.close()  # idempotent
    for mod in m.modules():
        assert not mod._forward_pre_hooks and not mod._forward_hooks
    for p in m.parameters():
        assert not p._backward_hooks and not p._post_accumulate_grad_hooks
        assert param_state(p).grad is None
    assert all_released(m)
    with pytest.raises(ZswapError, match="closed"):
        engine.step()
    with pytest.raises(ZswapError, match="closed"):
        engine.zero_grad()
    del out
    with zswap.initialize(m, cfg):  # the model can be run by a new engine
        sq(m(ids())).backward()


def test_one_engine_per_model_at_a_time(tmp_path):
    cfg = config("cpu", tmp_path)
    m, _ = build(MLP, cfg)
    with zswap.initialize(m, cfg):
        with pytest.raises(ZswapError, match="already run by another"):
            zswap.initialize(m, cfg)
        with pytest.raises(ZswapError, match="already run by another"):
            zswap.initialize(m.net, cfg)


def test_a_closed_engine_is_freed(tmp_path):
    cfg = config("cpu", tmp_path)
    m, _ = build(MLP, cfg)
    engine = zswap.initialize(m, cfg)
    sq(m(xs(1, 2, 12)[0])).backward()
    engine.close()
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None


def test_closing_an_engine_gives_its_swap_space_back(tmp_path):
    """The optimizer records and gradients an engine freed at close were kept reserved for reuse (the engine
    gives space back past 128 MiB idle), so each initialize / close cycle over a live model held more of the
    drive; now the params' bytes alone stay allocated after close, cycle after cycle."""
    from zswap.store import storage

    cfg = {
        "zero_optimization": {
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    with zswap.Init(cfg):
        m = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    params = sum(param_state(p).numel * 4 for p in m.parameters())
    (store,) = [s for s in storage._BY_DIR.values() if not s.closed and str(tmp_path) in s.paths[0]]
    for _ in range(3):
        engine = zswap.initialize(m, cfg)
        m(torch.randn(2, 256)).sum().backward()
        engine.step()
        assert store.engine.stats()["allocated_bytes"] >= 3 * params  # params, moments
        engine.close()
        held = store.engine.stats()["allocated_bytes"]
        assert params <= held <= params + (64 << 10), (held, params)


def test_initialize_checks_its_arguments():
    with pytest.raises(TypeError, match=r"nn\.Module"):
        zswap.initialize("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        zswap.initialize(MLP(), 3)


def test_public_names():
    for name in ("initialize", "Engine", "full_grad"):
        assert name in zswap.__all__ and getattr(zswap, name) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_params_stream_from_nvme(tmp_path):
    cfg = config("nvme", tmp_path, **STREAM)
    torch.manual_seed(0)
    ref = TinyLM(reentrant=False).cuda()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with torch.device("cuda"), zswap.Init(cfg):
            m = TinyLM(reentrant=False)
    with engine_for(m, cfg):
        x = ids().cuda()
        out, want = m(x), ref(x)
        torch.testing.assert_close(out, want)
        sq(out).backward()
        sq(want).backward()
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(full_grad(p), q.grad)


def test_demo_trains_a_small_model(tmp_path, capsys):
    from zswap.cli import main

    assert main(["demo", "--path", str(tmp_path), "--size", "6MiB", "--steps", "3"]) == 0
    text = capsys.readouterr().out
    assert "raw disk" in text and "prefetch hit rate" in text and "peak RSS" in text
    assert "3 AdamW steps" in text and ": down" in text
    assert list(tmp_path.iterdir()) == []  # swap files are unlinked; fio's file removed


def test_demo_takes_a_config_as_json(tmp_path, capsys):
    from zswap.cli import main

    cfg = '{"zero_optimization": {"offload_param": {"device": "cpu"}}}'
    assert main(["demo", "--path", str(tmp_path), "--size", "4MiB", "--steps", "1", "--config", cfg]) == 0
    assert "gradient norm" in capsys.readouterr().out  # no optimizer section: forward + backward only


def test_saved_weight_views_read_outside_backward(tmp_path):
    cfg = config("nvme", tmp_path, **STREAM)
    m, ref = build(MLP, cfg)
    with engine_for(m, cfg):
        x = xs(1, 2, 12)[0]
        out = m(x)
        node = out.grad_fn
        while not hasattr(node, "_saved_mat2"):
            node = node.next_functions[0][0]
        want = ref.net[4].weight.t()
        assert torch.equal(node._saved_mat2, want)  # rebuilt from the param, gathered on demand
        sq(out).backward()
        sq(ref(x)).backward()
        assert_same_grads(m, ref)
        assert all_released(m)
