"""Seeds from the ordinary step (`zswap.train.bridge.step_partitions`, `step_indices`): the partitions a
step updated in memory and wrote, of the params the next forward starts with (`Scheduler.seed_plan`), are
kept as they were written and gathered with no read when that forward begins — after an ordinary step
(a given optimizer, the first step, the early step off) as after the early step's commit, and for the
ordinary part of a deferred early step (the params past its cap: those backward completes last, the
first the next forward uses). Counts are exact; logits, params and records bitwise a twin's that reads
every param."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from zswap import GatheredParameters
from zswap.device import StandInDevice
from zswap.gradients import grads
from zswap.step import earlystep

from .test_earlystep import state, train_counting_forward_reads
from .test_faults import cfg_for, same
from .test_runtime import TinyLM, build, engine_for, ids, no_seeds, sq


def pair(tmp_path: Path, optimizer: str, device: Any = None, **extra: Any) -> list[tuple[Any, Any]]:
    """(seeded, twin without seeds): the same model and config; ``optimizer``: "sgd" (a torch SGD with
    momentum, stepped as given), "offloaded" (the config's, early step off) or "deferred" (the config's,
    early step on, clipping that bites every step)."""
    runs = []
    for name in ("seeded", "twin"):
        cfg = cfg_for(tmp_path / name, "nvme", "nvme", **extra)
        m, _ = build(TinyLM, cfg)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd" else None
        e = engine_for(m, cfg, optimizer=opt, device=device)
        e.early_step = optimizer == "deferred"
        e.keep_applied_grads = False
        e.prefetch_across_passes = False  # a forward's reads counted alone: none issued by the step
        if optimizer == "deferred":
            e.max_grad_norm = 1e-3
        runs.append((m, e))
    no_seeds(runs[1][1])
    return runs


def seeded_bytes(e: Any, first_chunk: bool = False) -> int:
    """Bytes of the params the next forward starts with (``first_chunk``: of those the ordinary step steps
    last, the model's first chunk of about half the live budget: `bridge.Kept`)."""
    plan, items = e._sched.seed_plan(), e._items
    if first_chunk:
        items = grads.chunks(items, e.sizing.budget.max_live // 2)[0]  # every param of TinyLM has a gradient
    return sum(st.partition_numel * p.dtype.itemsize for p, st in items if id(p) in plan)


@pytest.mark.parametrize("device", [None, "standin"])
@pytest.mark.parametrize("optimizer", ["sgd", "offloaded"])
def test_an_ordinary_step_keeps_the_next_forwards_first_params(optimizer, device, tmp_path):
    runs = pair(tmp_path, optimizer, StandInDevice() if device else None)
    (m, e), (twin, _) = runs
    for it in range(4):
        reads = train_counting_forward_reads(runs, it)  # kept, not gathered, between step and forward
        assert same(state(m, e), state(twin, runs[1][1])), it
        # After a step, those of the plan's params (the first forward steps within the live budget) that
        # the step's last chunk updated are not read — from the second step on where the first laid the
        # records out in the model's order (OffloadedAdamW).
        seeded = it > (1 if optimizer == "offloaded" else 0)
        saved = seeded_bytes(e, first_chunk=True) if seeded else 0
        assert not seeded or 0 < saved < seeded_bytes(e)
        assert reads[1] - reads[0] == saved, (it, reads)
    for _, ee in runs:
        ee.close()


def test_a_write_back_between_step_and_forward_wins_over_the_kept_value(tmp_path):
    runs = pair(tmp_path, "offloaded")
    for it in range(2):
        for mm, ee in runs:
            sq(mm(ids(seed=it))).backward()
            ee.step()
    first = [next(mm.parameters()) for mm, _ in runs]
    assert id(first[0]) in runs[0][1]._sched.seed_plan()  # a param the seeded engine kept
    for p in first:
        with GatheredParameters([p], modifier_rank=0):
            p.data.mul_(0.5)
    outs = [mm(ids(seed=5)) for mm, _ in runs]
    assert torch.equal(outs[0], outs[1])
    for _, ee in runs:
        ee.close()


def test_the_ordinary_part_of_a_deferred_step_keeps_the_next_forwards_first_params(tmp_path, monkeypatch):
    """Past the early step's cap (the live budget alone here) the params backward completes last take the
    ordinary step in the commit: their updated partitions are the seeds, which before only the part
    updated in backward gave (and that part is the model's last layers, no use to the next forward)."""
    monkeypatch.setattr(earlystep, "CAP_EXTRA", 0)
    runs = pair(tmp_path, "deferred")
    (m, e), (twin, te) = runs
    for it in range(5):
        reads = []
        for mm, ee in runs:
            ee.stats(reset=True)
            out = mm(ids(seed=it))
            reads.append(ee.stats()["bytes_read"])
            sq(out).backward()
            ee.step()
        assert same(state(m, e), state(twin, te)), it
        if it >= 3:  # records made, clipping seen biting, then deferred with a part past the cap
            assert e.stats()["steps_deferred_partly"] == te.stats()["steps_deferred_partly"] == 1
        if it >= 4:
            assert reads[0] < reads[1], (it, reads)
    for _, ee in runs:
        ee.close()


def _layers(tmp_path: Path, early: bool, live: int, sub: int) -> tuple[Any, Any]:
    """16 × Linear(250, 250) (1 M params) on NVMe with ``live`` elements of live budget and records of
    ``sub`` elements: a record's copies and gradients are large next to the early step's cap."""
    d = tmp_path / ("early" if early else "twin")
    cfg = cfg_for(d, "nvme", "nvme", stage3_max_live_parameters=live, sub_group_size=sub)
    cfg["stage3_prefetch_bucket_size"] = 5 * 10**4
    m, _ = build(lambda: torch.nn.Sequential(*[torch.nn.Linear(250, 250) for _ in range(16)]), cfg)
    e = engine_for(m, cfg)
    e.early_step = early
    return m, e


def _train_layers(m: Any, e: Any, steps: int) -> tuple[list[Any], list[dict[str, Any]]]:
    """States and stats after each step (one engine at a time: the next-pass seeds are kept only while no
    other engine runs a pass in between)."""
    states, seen = [], []
    for it in range(steps):
        x = torch.randn(4, 250, generator=torch.Generator().manual_seed(it))
        e.stats(reset=True)
        e.backward(m(x).square().mean())
        e.step()
        seen.append(e.stats())
        states.append(state(m, e))
    return states, seen


@pytest.mark.parametrize(
    ("extra", "live", "sub", "how"),
    [
        (0, 10**6, 10**5, "in backward"),  # the seeds fill the live budget: they make way
        (0, 10**5, 10**5, "refused"),  # one record's copies and gradients alone pass the cap
        (0, 2 * 10**5, 10**5, "kept"),  # two records at once may pass it: the gradients are kept
    ],
)
def test_the_step_in_backward_never_runs_out_of_room_after_letting_gradients_go(
    extra, live, sub, how, tmp_path, monkeypatch
):
    """The early step's cap holds the next forward's seeds (up to the live budget) and the copies and
    gradients waiting for their records. Past it, it let go of seeds first and waits for its writes; it
    does not begin where one record alone passes the cap, and keeps the gradients it applies where two
    might — so it never stops halfway after letting gradients go (that backward raised
    `GradientsNotKeptError`). Params and records bitwise a twin's with the ordinary step."""
    monkeypatch.setattr(earlystep, "CAP_EXTRA", extra)
    m, e = _layers(tmp_path, True, live, sub)
    states, seen = _train_layers(m, e, 4)
    e.close()
    twin, te = _layers(tmp_path, False, live, sub)
    want, _ = _train_layers(twin, te, 4)
    te.close()
    assert [same(a, b) for a, b in zip(states, want, strict=True)] == [True] * 4
    if how == "in backward":
        assert [s["steps_in_backward"] for s in seen] == [0, 1, 1, 1]
    elif how == "refused":
        assert [s["steps_in_backward"] for s in seen] == [0, 0, 0, 0]
        assert seen[-1]["steps_ordinary_reason"].startswith("the param copies and gradients of one optimizer")
    else:
        assert e._early.thin


class _TiedChain(torch.nn.Module):
    """A tied embedding (its gradient complete only at backward's end) and blocks whose records chain
    into it (records of 200 elements span param boundaries): most gradients wait for the last one."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(23, 24)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.Linear(48, 24))
            for _ in range(2)
        )
        self.head = torch.nn.Linear(24, 23, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1).float(), x.roll(1, 1).flatten())


def test_gradients_waiting_for_a_late_one_are_kept_where_they_may_pass_the_cap(tmp_path, monkeypatch):
    """Where the last backward's order would have held more than the cap — the updates of records
    trailing their gradients, copies made at the update held with them — the early step keeps the
    gradients it applies (``thin``), so past the cap it falls back instead of raising
    `GradientsNotKeptError` (as it did with a cap of the live budget alone). Bitwise the ordinary twin."""
    monkeypatch.setattr(earlystep, "CAP_EXTRA", 0)
    runs = []
    for early in (True, False):
        cfg = cfg_for(tmp_path / str(early), "nvme", "nvme", sub_group_size=200, bf16={"enabled": True})
        del cfg["stage3_max_live_parameters"]  # the default: the model fits
        m, _ = build(_TiedChain, cfg)
        e = engine_for(m, cfg)
        e.early_step = early
        seen = []
        for it in range(4):
            x = torch.randint(0, 23, (2, 6), generator=torch.Generator().manual_seed(it))
            e.backward(m(x))
            e.step()
            seen.append(state(m, e))
        runs.append((seen, e._early.thin if early else None))
        e.close()
    (got, thin), (want, _) = runs
    assert thin
    assert [same(a, b) for a, b in zip(got, want, strict=True)] == [True] * 4
