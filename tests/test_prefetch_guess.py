"""The first iteration of each kind prefetches along the static guess (module registration order); a wrong
guess only costs cancelled reads and demand fetches, never a different value; the prefetch counters add
up over whole iterations."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from zswap import Status, param_state

from .test_runtime import (
    TIERS,
    Reach,
    TinyLM,
    all_released,
    assert_same_grads,
    build,
    config,
    ids,
    sq,
    xs,
)
from .test_runtime import engine_for as _engine_for

# Every weight and bias streamed, nothing kept between uses: each step of an iteration is one fetch.
STREAM = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}


class Deep(nn.Module):
    """Linears used in registration order."""

    def __init__(self, n: int = 6, d: int = 24) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(d, d) for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Shuffled(nn.Module):
    """Registered a, b, c, d, e; run e, b, d, a, c, then b again: the guess is wrong at most steps."""

    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.d, self.e = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(self.e(x)))
        h = self.a(self.d(h)) + self.c(h)
        return self.b(torch.relu(h))


def engine_for(m: nn.Module, cfg: dict[str, Any], **kwargs: Any) -> Any:
    """The prefetch within a pass alone: nothing read ahead across passes (tests/test_prefetch_across.py),
    so the first step of each pass is on demand and the guess is what fills the rest."""
    engine = _engine_for(m, cfg, **kwargs)
    engine.prefetch_across_passes = False
    return engine


def x(seed: int, d: int = 24) -> torch.Tensor:
    return torch.randn(3, d, generator=torch.Generator().manual_seed(seed))


def assert_adds_up(s: dict[str, Any]) -> None:
    assert s["fetches"] == s["demand_fetches"] + s["prefetch_hits"]
    assert s["prefetch_issued"] == s["prefetch_hits"] + s["prefetch_dropped"]  # nothing left in flight
    assert s["prefetch_hit_rate"] == (s["prefetch_hits"] / s["fetches"] if s["fetches"] else 0.0)


def in_flight(m: nn.Module) -> list[str]:
    return [n for n, p in m.named_parameters() if param_state(p).status is Status.INFLIGHT]


@pytest.mark.parametrize("tier", TIERS)
def test_the_first_inference_pass_prefetches_along_registration_order(tier, tmp_path):
    cfg = config(tier, tmp_path, **STREAM)
    m, ref = build(Deep, cfg)
    with engine_for(m, cfg) as engine, torch.no_grad():
        m.eval()
        ref.eval()
        engine.stats(reset=True)
        assert torch.equal(m(x(1)), ref(x(1)))
        first = engine.stats(reset=True)
        assert torch.equal(m(x(2)), ref(x(2)))
        second = engine.stats(reset=True)
    # 12 params, one step per Linear: only the first step's two are fetched on demand, on a guess too.
    assert first["guessed_iterations"] == 1 and first["traces_recorded"] == 1
    assert (first["fetches"], first["demand_fetches"], first["prefetch_hits"]) == (12, 2, 10)
    assert second["guessed_iterations"] == 0 and second["traces_recorded"] == 0
    assert (second["fetches"], second["demand_fetches"], second["prefetch_hits"]) == (12, 2, 10)
    assert first["prefetch_dropped"] == second["prefetch_dropped"] == 0
    for s in (first, second):
        assert_adds_up(s)
    assert all_released(m)


@pytest.mark.parametrize("tier", TIERS)
def test_the_first_training_pass_guesses_its_backward_from_its_forward(tier, tmp_path):
    cfg = config(tier, tmp_path, **STREAM, stage3_max_live_parameters=3 * 600)  # three Linears
    m, ref = build(Deep, cfg)
    with engine_for(m, cfg) as engine:
        engine.stats(reset=True)
        out, want = m(x(1)), ref(x(1))
        assert torch.equal(out, want)
        sq(out).backward()
        sq(want).backward()
        first = engine.stats(reset=True)
        assert_same_grads(m, ref)
    # 6 forward and 6 backward steps of 2 params; the live budget keeps the last two Linears from their
    # forward to their backward (with room for the next one's read): 20 fetches, only the first step's two
    # on demand.
    assert first["guessed_iterations"] == 1 and first["off_trace"] == 0
    assert (first["fetches"], first["demand_fetches"], first["prefetch_hits"]) == (20, 2, 18)
    assert_adds_up(first)
    assert all_released(m)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("train", [False, True])
def test_a_forward_order_unlike_registration_order_is_bitwise_the_plain_models(tier, train, tmp_path):
    cfg = config(tier, tmp_path, **STREAM)
    m, ref = build(Shuffled, cfg)
    with engine_for(m, cfg) as engine:
        engine.stats(reset=True)
        stats = []
        for seed in (1, 2, 3):
            with torch.set_grad_enabled(train):
                out, want = m(x(seed)), ref(x(seed))
            assert torch.equal(out, want), seed
            if train:
                sq(out).backward()
                sq(want).backward()
            assert in_flight(m) == [], seed
            stats.append(engine.stats(reset=True))
        if train:
            assert_same_grads(m, ref)
    first, later = stats[0], stats[1:]
    assert first["guessed_iterations"] == 1 and first["traces_recorded"] == 1
    if not train:  # no backward step uses them later: the reads passed over are cancelled ...
        assert first["prefetch_dropped"] > 0
    for s in stats:
        assert_adds_up(s)  # ... and every one is accounted for
    for s in later:  # the recording is exact from the second pass on
        assert s["guessed_iterations"] == s["traces_recorded"] == s["off_trace"] == s["prefetch_dropped"] == 0
        assert s["demand_fetches"] == 2 and s["prefetch_hits"] == s["fetches"] - 2
    assert all_released(m)


def test_a_branch_off_the_guess_then_back_on_it(tmp_path):
    # Registration order a..e; a forward that runs a, d (skips b, c), e: the skip within the prefetched
    # range moves the guess on, the cancelled reads of b and c are counted as dropped.
    class Skip(Shuffled):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.e(self.d(self.a(x)))

    cfg = config("nvme", tmp_path, **STREAM)
    m, ref = build(Skip, cfg)
    with engine_for(m, cfg) as engine, torch.no_grad():
        engine.stats(reset=True)
        assert torch.equal(m(x(1)), ref(x(1)))
        s = engine.stats(reset=True)
    assert_adds_up(s)
    assert s["fetches"] == 6 and s["demand_fetches"] == 2 and s["prefetch_hits"] == 4
    assert s["prefetch_dropped"] == 4  # b's and c's weight and bias
    assert all_released(m)


@pytest.mark.parametrize(
    "make",
    [Reach, TinyLM, lambda: TinyLM(reentrant=True), lambda: TinyLM(reentrant=False)],
    ids=["parent-reads-child", "tied", "checkpoint-reentrant", "checkpoint"],
)
def test_guessed_first_passes_of_harder_models_are_bitwise_and_accounted(make, tmp_path):
    cfg = config("nvme", tmp_path, **STREAM)
    m, ref = build(make, cfg)
    inputs = ids if make is not Reach else (lambda seed: xs(1, 5, 7, seed=seed)[0])
    with engine_for(m, cfg) as engine:
        engine.stats(reset=True)
        for seed in (1, 2, 3):
            out, want = m(inputs(seed=seed)), ref(inputs(seed=seed))
            assert torch.equal(out, want), seed
            sq(out).backward()
            sq(want).backward()
            assert in_flight(m) == [], seed
            s = engine.stats(reset=True)
            assert_adds_up(s)
            assert s["prefetch_hits"] > 0, seed
            assert s["guessed_iterations"] == (seed == 1), seed
        assert_same_grads(m, ref)
    assert all_released(m)


def test_initialize_prefills_the_first_passes_read_buffers(tmp_path):
    # The whole model fits the live budget: every read buffer of pass 1 exists, faulted in, before it runs,
    # so the pass allocates none; values are unchanged.
    cfg = config("nvme", tmp_path, **STREAM)
    m, ref = build(Deep, cfg)
    store = param_state(m.layers[0].weight).store

    def pooled() -> list[int]:
        return sorted(buf.data_ptr() for pool in store._pool.values() for buf, _ in pool)

    with engine_for(m, cfg), torch.no_grad():
        before = pooled()
        assert len(before) == 12  # 6 weights and 6 biases
        assert torch.equal(m(x(1)), ref(x(1)))
        assert pooled() == before
    assert all_released(m)


@pytest.mark.parametrize("across", [True, False], ids=["reads-ahead", "no-reads-ahead"])
def test_persistent_params_leave_the_prefilled_read_buffers_to_pass_1(across, tmp_path, monkeypatch):
    # Biases persistent (24 elements), weights streamed, the whole model in the live budget: the prefill
    # makes one read buffer per weight, and nothing else ever makes another — not the persistent params'
    # fetches at initialize (a pool miss unpools idle buffers first: run before the prefill, they unpooled
    # its buffers), not initialize's reads ahead, not passes 1 and 2. Values are the plain model's.
    cfg = config("nvme", tmp_path, stage3_param_persistence_threshold=24, stage3_max_reuse_distance=0)
    m, ref = build(Deep, cfg)
    store = param_state(m.layers[0].weight).store
    made: list[int] = []
    allocate = type(store)._allocate

    def counted(self: Any, numel: int, dtype: torch.dtype) -> torch.Tensor:
        made.append(numel)
        return allocate(self, numel, dtype)

    monkeypatch.setattr(type(store), "_allocate", counted)

    def pooled() -> list[int]:
        return sorted(buf.data_ptr() for buf, _ in store._pool.get((24 * 24, torch.float32), []))

    engine = _engine_for(m, cfg)
    engine.prefetch_across_passes = across
    with engine, torch.no_grad():
        assert made == [24] * 6 + [24 * 24] * 6  # the biases' buffers, then the prefill's
        before = pooled()
        assert len(before) == 6
        m.eval()
        ref.eval()
        for seed in (1, 2):
            assert torch.equal(m(x(seed)), ref(x(seed))), seed
            assert pooled() == before, seed
        s = engine.stats()
        assert s["fetches"] == 12 and s["prefetch_hits"] == (12 if across else 10)
    assert len(made) == 12
    assert all_released(m)
