"""The early step ahead of clipping, loss scaling, the overflow check and gradient accumulation
(`zswap.step.speculation`): it runs with the gradient scale the step will use if clipping does not bite,
and `Engine.step` commits it only when the scale it computes is exactly that one.

Each test trains twins — the early step on, and off (the ordinary step) — and asserts params, optimizer
records and step counters bitwise equal after every optimizer step; and, through ``engine.stats()``, how
many steps ran in backward, were redone the ordinary way or were dropped for an overflow.
"""

from __future__ import annotations

import errno
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

import zswap
from zswap.device import StandInDevice
from zswap.device.cuda import _Registrations
from zswap.step import early_memory, earlystep
from zswap.train import bridge

from .conftest import run_ranks
from .test_earlystep import state, twins
from .test_faults import cfg_for, engine_of, inject, same
from .test_runtime import TinyLM, build, engine_for, ids, sq


def device_twins(tmp_path: Path, **extra: Any) -> tuple[Any, Any]:
    """`twins` computing on the suite's stand-in for a CUDA device (deferred, poisoned copies)."""
    runs = []
    for name, early in (("early", True), ("plain", False)):
        cfg = cfg_for(tmp_path / name, "nvme", "nvme", **extra)
        m, _ = build(TinyLM, cfg)
        e = engine_for(m, cfg, device=StandInDevice())
        e.early_step = early
        e.keep_applied_grads = False
        runs.append((m, e))
    return runs[0], runs[1]


def run(
    tmp_path: Path,
    steps: int,
    gas: int = 1,
    clip: Any = None,
    loss_mult: Any = None,
    device: bool = False,
    **extra: Any,
) -> tuple[Any, Any, list[dict[str, Any]]]:
    """Train both twins ``steps`` optimizer steps of ``gas`` micro-batches through `Engine.backward`;
    ``clip(step)``: each engine's ``max_grad_norm`` for that step; ``loss_mult(step)``: a factor on the
    loss (a huge one overflows); ``device``: on the stand-in device. Returns the twins and the early
    one's stats after each step."""
    if gas > 1:
        extra["gradient_accumulation_steps"] = gas
    tmp_path.mkdir(parents=True, exist_ok=True)
    (m, e), (ref, ref_e) = (device_twins if device else partial(twins, keep=False))(tmp_path, **extra)
    seen = []
    for step in range(steps):
        for mm, ee in ((m, e), (ref, ref_e)):
            if clip is not None:
                ee.max_grad_norm = clip(step)
            ee.stats(reset=True)
            for micro in range(gas):
                loss = sq(mm(ids(seed=10 * step + micro)).float())
                ee.backward(loss * (1.0 if loss_mult is None else loss_mult(step)))
                ee.step()
        seen.append(e.stats())
        assert same(state(m, e), state(ref, ref_e)), step
        assert e.global_steps == ref_e.global_steps and e.skipped_steps == ref_e.skipped_steps
        assert repr(e.last_grad_norm) == repr(ref_e.last_grad_norm), step  # the true norm (or nan), alike
    assert ref_e.stats()["steps_in_backward"] == 0
    return (m, e), (ref, ref_e), seen


def counts(seen: list[dict[str, Any]], key: str) -> list[int]:
    return [s[key] for s in seen]


def test_clipping_that_does_not_bite_commits_every_step_after_the_first(tmp_path):
    (_, e), (_, ref_e), seen = run(tmp_path, 4, clip=lambda step: 1e6)
    assert counts(seen, "steps_in_backward") == [0, 1, 1, 1]
    assert seen[0]["steps_ordinary_reason"].startswith("it updated no record")
    assert counts(seen, "steps_redone") == [0, 0, 0, 0]
    e.close()
    ref_e.close()


def test_clipping_that_bites_redoes_the_step_from_the_kept_gradients(tmp_path):
    # Not biting for two steps, then biting (speculated and redone), then deferred while it bites (the
    # update waits for the norm, from the copies held), then speculated again once a step found it off.
    limits = [1e6, 1e6, 1e-3, 1e-3, 1e6, 1e6]
    (_, e), (_, ref_e), seen = run(tmp_path, len(limits), clip=lambda step: limits[step])
    assert counts(seen, "steps_in_backward") == [0, 1, 0, 0, 0, 1]
    assert counts(seen, "steps_redone") == [0, 0, 1, 0, 0, 0]
    assert counts(seen, "steps_deferred") == [0, 0, 0, 1, 1, 0]
    assert seen[2]["steps_ordinary_reason"].startswith("clipping bit (gradient scale ")
    e.close()
    ref_e.close()


@pytest.mark.parametrize("device", [False, True], ids=["cpu", "stand-in"])
def test_where_copies_and_gradients_exceed_the_cap_the_rest_takes_the_ordinary_step_in_the_commit(
    tmp_path, monkeypatch, device
):
    """A deferred step holds the copies and gradients of the first params backward completes, up to its
    cap; the records past it are updated the ordinary way within the same commit. Bitwise the ordinary
    step (`run`), and it reads and writes less than the ordinary twin."""
    monkeypatch.setattr(earlystep, "CAP_EXTRA", 0)  # the cap: the live budget only (1500 elements)
    limits = [1e6, 1e6, 1e-3, 1e-3, 1e-3]
    (_, e), (_, ref_e), seen = run(tmp_path, len(limits), clip=lambda step: limits[step], device=device)
    assert counts(seen, "steps_deferred") == [0, 0, 0, 1, 1]
    assert counts(seen, "steps_deferred_partly") == [0, 0, 0, 1, 1]
    # (in backward the step would have to hold a whole record, 8192 bytes: it does not begin)
    assert seen[2]["steps_ordinary_reason"].startswith("the param copies and gradients of one optimizer")
    ordinary = ref_e.stats()
    assert seen[-1]["bytes_read"] < ordinary["bytes_read"]
    assert seen[-1]["bytes_written"] <= ordinary["bytes_written"]
    e.close()
    ref_e.close()


def test_clipping_keeps_gradients_in_memory_within_the_live_budget(tmp_path):
    """A model that fits the live budget: the gradients a redo may need stay in memory, so a committed
    step with clipping on writes what one without it writes, and reads the same."""
    moved = []
    for name, clip in (("off", None), ("on", lambda step: 1e6)):
        (_, e), (_, ref_e), seen = run(
            tmp_path / name, 4, clip=clip, stage3_max_live_parameters=100_000, sub_group_size=700
        )
        assert seen[-1]["steps_in_backward"] == 1
        moved.append((seen[-1]["bytes_read"], seen[-1]["bytes_written"]))
        e.close()
        ref_e.close()
    assert moved[0] == moved[1], moved


@pytest.mark.parametrize("gas", [2, 3])
def test_accumulation_updates_in_the_boundary_backward(gas, tmp_path):
    (_, e), (_, ref_e), seen = run(tmp_path, 4, gas=gas)
    assert counts(seen, "steps_in_backward") == [0, 1, 1, 1]
    e.close()
    ref_e.close()


def test_accumulation_with_clipping(tmp_path):
    limits = [1e6, 1e6, 1e-3, 1e6, 1e6]
    (_, e), (_, ref_e), seen = run(tmp_path, len(limits), gas=2, clip=lambda step: limits[step])
    assert counts(seen, "steps_in_backward") == [0, 1, 0, 0, 1]
    assert counts(seen, "steps_redone") == [0, 0, 1, 0, 0]
    e.close()
    ref_e.close()


def test_bf16_overflow_check_drops_the_early_step_and_skips(tmp_path):
    pattern = [1.0, 1.0, 1e38, 1.0, 1.0]
    (_, e), (_, ref_e), seen = run(
        tmp_path,
        len(pattern),
        loss_mult=lambda step: pattern[step],
        bf16={"enabled": True, "check_grad_overflow": True},
    )
    assert e.skipped_steps == 1
    assert counts(seen, "steps_in_backward") == [0, 1, 0, 1, 1]
    assert counts(seen, "steps_overflow_dropped") == [0, 0, 1, 0, 0]
    e.close()
    ref_e.close()


def test_a_skipped_step_keeps_the_clipping_guess(tmp_path):
    """Clipping that bites on every step: the step after a skipped one is deferred as the one before it
    was (the skipped step clipped nothing, so it says nothing of the next), not speculated and redone."""
    pattern = [1.0, 1.0, 1e38, 1.0, 1.0]
    (_, e), (_, ref_e), seen = run(
        tmp_path,
        len(pattern),
        clip=lambda step: 1e-3,
        loss_mult=lambda step: pattern[step],
        bf16={"enabled": True, "check_grad_overflow": True},
    )
    assert e.skipped_steps == 1
    assert counts(seen, "steps_overflow_dropped") == [0, 0, 1, 0, 0]
    assert counts(seen, "steps_redone") == [0, 0, 0, 0, 0]
    assert counts(seen, "steps_deferred") == [0, 1, 0, 1, 1]
    e.close()
    ref_e.close()


def test_fp16_loss_scale_is_the_factor_the_early_step_runs_with(tmp_path):
    pattern = [1.0, 1.0, 6e4, 1.0, 1.0]
    (_, e), (_, ref_e), seen = run(
        tmp_path,
        len(pattern),
        loss_mult=lambda step: pattern[step],
        fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
    )
    assert e.skipped_steps >= 1 and e.loss_scale == ref_e.loss_scale
    assert sum(counts(seen, "steps_in_backward")) >= 2
    assert sum(counts(seen, "steps_overflow_dropped")) >= 1
    e.close()
    ref_e.close()


def test_stats_say_why_the_ordinary_step_ran(tmp_path):
    (m, e), (ref, ref_e) = twins(tmp_path, keep=False)
    e.early_step = False
    for mm, ee in ((m, e), (ref, ref_e)):
        sq(mm(ids(seed=1))).backward()
        ee.step()
    s = e.stats()
    assert s["steps_in_backward"] == 0 and s["steps_ordinary"] == 1
    assert s["steps_ordinary_reason"] == "engine.early_step is False"
    e.close()
    ref_e.close()
    # A setup it cannot run in (states in CPU memory run it: tests/test_early_cputier.py).
    cfg = {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}
    with zswap.Init(cfg):
        lin = torch.nn.Linear(4, 4)
    with zswap.initialize(lin, cfg, optimizer=torch.optim.SGD(lin.parameters(), lr=0.1)) as eng:
        eng.backward(sq(eng(torch.ones(2, 4))))
        eng.step()
        assert eng.stats()["steps_ordinary_reason"] == "the optimizer is SGD, not zswap's OffloadedAdamW"


@pytest.mark.dist
def test_two_ranks_update_their_partitions_in_backward_bitwise(tmp_path):
    run_ranks(Path(__file__).with_name("_early_dist_worker.py"), tmp_path)


@pytest.mark.parametrize(
    ("gas", "limits", "expect"),
    [
        (1, [None] * 4, [0, 1, 1, 1]),
        (1, [1e6, 1e6, 1e-3, 1e6, 1e6], [0, 1, 0, 0, 1]),
        (2, [None] * 3, [0, 1, 1]),
    ],
    ids=["plain", "clipping", "accumulation"],
)
def test_on_a_compute_device_the_update_runs_from_landed_copies(gas, limits, expect, tmp_path):
    """The device path: each param's partition and gradient are copied to the host (the stand-in runs a
    copy only when it is waited for, and poisons its destination until then) and updated there."""
    (_, e), (_, ref_e), seen = run(
        tmp_path, len(limits), gas=gas, clip=lambda step: limits[step], device=True
    )
    assert counts(seen, "steps_in_backward") == expect
    e.close()
    ref_e.close()


def test_bf16_on_a_compute_device(tmp_path):
    (_, e), (_, ref_e), seen = run(tmp_path, 4, device=True, bf16={"enabled": True})
    assert counts(seen, "steps_in_backward") == [0, 1, 1, 1]
    e.close()
    ref_e.close()


@pytest.mark.parametrize("device", [False, True], ids=["cpu", "stand-in"])
@pytest.mark.parametrize("past_cap", [False, True], ids=["within-the-cap", "past-the-cap"])
def test_bf16_deferred_steps(device, past_cap, tmp_path, monkeypatch):
    """bf16 params (fp32 master weights in the records) with the overflow check, clipping biting from the
    second step: deferred steps — past the cap in part — bitwise the ordinary step (`run`)."""
    if past_cap:
        monkeypatch.setattr(earlystep, "CAP_EXTRA", 0)
    limits = [1e6, 1e-3, 1e-3, 1e-3]
    (_, e), (_, ref_e), seen = run(
        tmp_path,
        len(limits),
        clip=lambda step: limits[step],
        device=device,
        bf16={"enabled": True, "check_grad_overflow": True},
    )
    assert counts(seen, "steps_deferred") == [0, 0, 1, 1]
    assert counts(seen, "steps_deferred_partly") == [0, 0, past_cap, past_cap]
    e.close()
    ref_e.close()


def poisoned_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every buffer the early step takes for a param copy starts as NaN: one the update takes for a param
    it only writes (`early_memory.materialize`) must come out bitwise all the same."""
    alloc = early_memory.alloc
    monkeypatch.setattr(early_memory, "alloc", lambda st, like: alloc(st, like).fill_(float("nan")))


@pytest.mark.parametrize("device", [False, True], ids=["cpu", "stand-in"])
@pytest.mark.parametrize("deferred", [False, True], ids=["in-backward", "deferred"])
def test_bf16_params_are_copied_at_their_update_only(device, deferred, tmp_path, monkeypatch):
    """A param with a float32 master is only written by its update (the kernel steps the master and
    rounds it into the param): the early step takes no copy of its value at its gradient but a buffer at
    the update (`early_memory.copy_of`). Deferred, it holds the gradient alone, so a cap of exactly the
    gradients' bytes holds every param. Bitwise the ordinary step, from buffers that start as NaN."""
    poisoned_copies(monkeypatch)
    monkeypatch.setattr(earlystep, "CAP_EXTRA", 0)
    numel = sum(p.numel() for p in TinyLM().parameters())
    limits = [1e6, 1e-3, 1e-3, 1e-3] if deferred else [1e6] * 4
    (_, e), (_, ref_e), seen = run(
        tmp_path,
        len(limits),
        clip=lambda step: limits[step],
        device=device,
        bf16={"enabled": True},
        stage3_max_live_parameters=numel,  # the cap: every bf16 gradient, not one param copy more
    )
    assert counts(seen, "steps_in_backward") == [0, 0, 0, 0] if deferred else [0, 1, 1, 1]
    assert counts(seen, "steps_deferred") == [0, 0, 1, 1] if deferred else [0, 0, 0, 0]
    assert counts(seen, "steps_deferred_partly") == [0, 0, 0, 0]
    e.close()
    ref_e.close()


@pytest.mark.parametrize("half", [False, True], ids=["fp32", "bf16"])
def test_a_deferred_step_on_a_device_reuses_its_gradients_landing_buffers(half, tmp_path, monkeypatch):
    """A deferred step holds the gradients a compute device's copies landed in through all of backward,
    past the live budget the landing pool was sized for: it is widened by what the early step may hold,
    so warm steps land in buffers already registered with the device (on CUDA each new one is a
    ``cudaHostRegister``, and its unregistering at the sweep) — none registered after the first deferred
    step."""
    registered: dict[int, list[int]] = {}  # each device's registrations, the early twin's first

    def register_alloc(self: StandInDevice, alloc: Any) -> Any:
        mine = registered.setdefault(id(self), [])
        return _Registrations(lambda ptr, n: mine.append(n) or True, lambda ptr: None).wrap(alloc)

    monkeypatch.setattr(StandInDevice, "register_alloc", register_alloc)
    extra: dict[str, Any] = {"bf16": {"enabled": True}} if half else {}
    limits = [1e6, 1e-3, 1e-3, 1e-3, 1e-3]
    before = []  # the early twin's registrations before each step (`run` asks it first)

    def clip(step: int) -> float:
        before.append(len(next(iter(registered.values()))))
        return limits[step]

    (_, e), (_, ref_e), seen = run(tmp_path, len(limits), clip=clip, device=True, **extra)
    assert counts(seen, "steps_deferred") == [0, 0, 1, 1, 1]
    early = [*before[::2], len(next(iter(registered.values())))]  # and after the last step
    assert early[3] > early[2] and early[5] == early[4] == early[3], early  # steps 2 | 3, 4 deferred
    e.close()
    ref_e.close()


def test_after_a_step_whose_clipping_bit_the_update_waits_for_the_norm_holding_copies(tmp_path):
    """Deferred: clipping bit at the last step, and every param copy and gradient fits in the early
    step's cap: they are held through backward and every record is updated at the step with the scale
    it computed — no param or gradient read for it, as a step in backward."""
    limits = [1e-3, 1e-3, 1e-3, 1e6, 1e6]
    (_, e), (_, ref_e), seen = run(
        tmp_path, len(limits), clip=lambda step: limits[step], stage3_max_live_parameters=100_000
    )
    assert counts(seen, "steps_deferred") == [0, 1, 1, 1, 0]
    assert counts(seen, "steps_in_backward") == [0, 0, 0, 0, 1]
    e.close()
    ref_e.close()


@pytest.mark.parametrize("device", [False, True], ids=["cpu", "device"])
def test_deferred_steps_with_accumulation(device, tmp_path):
    limits = [1e-3] * 4
    (_, e), (_, ref_e), seen = run(
        tmp_path,
        len(limits),
        gas=2,
        clip=lambda step: limits[step],
        device=device,
        stage3_max_live_parameters=100_000,
    )
    assert counts(seen, "steps_deferred") == [0, 1, 1, 1]
    e.close()
    ref_e.close()


@pytest.mark.parametrize("live", [100_000, None], ids=["wide-budget", "default-budget"])
@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("clip", [1e6, 1e-3], ids=["not-biting", "biting"])
def test_low_precision_sums_from_a_device_stay_in_memory(clip, half, live, tmp_path):
    """On a compute device a float16 / bfloat16 gradient is summed in float32 where it lands
    (`NvmeGrads.add_fp32`). Within the live budget — its elements, counted at float32 for such sums
    (`sizing.grad_room`; counted in the params' bytes, half of them were written) — the boundary
    micro-batch's sums stay in memory where the first micro-batch's gradients were, and their norms are
    taken as they are made: a step of two micro-batches moves exactly the bytes of a step of one (before,
    each sum was written, and read back for the norm)."""
    moved = []
    for gas in (1, 2):
        (_, e), (_, ref_e), seen = run(
            tmp_path / f"gas{gas}",
            4,
            gas=gas,
            clip=lambda step: clip,
            device=True,
            stage3_max_live_parameters=live,
            **{half: {"enabled": True, **({"initial_scale_power": 4} if half == "fp16" else {})}},
        )
        assert seen[-1]["steps_in_backward" if clip > 1 else "steps_deferred"] == 1
        moved.append((seen[-1]["bytes_read"], seen[-1]["bytes_written"]))
        e.close()
        ref_e.close()
    assert moved[1] == moved[0], moved


@pytest.mark.parametrize(
    ("clip", "past_cap"),
    [(None, False), (1e6, False), (1e-3, False), (1e-3, True)],
    ids=["off", "not-biting", "biting", "biting-past-the-cap"],
)
@pytest.mark.parametrize("device", ["cpu", "stand-in"])
def test_resident_params_are_updated_in_backward_and_read_no_more(
    device, clip, past_cap, tmp_path, monkeypatch
):
    """``offload_param.max_in_cpu`` covering the model: the early step's updated copies become the
    gathered copies at the commit (on a compute device, the host values they are gathered again from), so
    a warm step reads only the optimizer records (2 × the params' bytes in fp32 AdamW) and writes them and
    the params (3 ×), clipping that bites included (deferred; past the early step's cap — the live budget
    alone — in part: the ordinary part steps the resident params past it in their gathered copies)."""
    if past_cap:
        monkeypatch.setattr(earlystep, "CAP_EXTRA", 0)
    s, nbytes = resident_twins(tmp_path, "nvme", clip, live=1500 if past_cap else 100_000, device=device)
    assert s["steps_in_backward"] + s["steps_deferred"] == 1
    assert s["steps_deferred_partly"] == past_cap
    assert (s["bytes_read"], s["bytes_written"]) == (2 * nbytes, 3 * nbytes)


def resident_twins(
    tmp_path: Path, states: str, clip: float | None, live: int = 100_000, device: str = "cpu"
) -> tuple[Any, int]:
    """Twins (the early step on, off) with every param resident (``max_in_cpu``), params on NVMe and the
    AdamW states on ``states``, ``stage3_max_live_parameters`` ``live``, on ``device`` ("cpu" or
    "stand-in"): 4 steps, bitwise alike after each. Returns the early twin's stats of the last step and
    the params' bytes."""
    runs = []
    for name, early in (("early", True), ("plain", False)):
        cfg = cfg_for(tmp_path / name, "nvme", states, stage3_max_live_parameters=live)
        cfg["offload_param"]["max_in_cpu"] = 10**9
        mm, _ = build(TinyLM, cfg)
        ee = engine_for(
            mm, cfg, max_grad_norm=clip, device=StandInDevice() if device == "stand-in" else "cpu"
        )
        ee.early_step = early
        runs.append((mm, ee))
    (m, e), (ref, ref_e) = runs
    nbytes = sum(zswap.param_state(p).partition_numel * 4 for p in m.parameters())
    for step in range(4):
        for mm, ee in runs:
            ee.stats(reset=True)
            ee.backward(sq(mm(ids(seed=step))))
            ee.step()
        s = e.stats()  # before `state` reads the records itself
        assert same(state(m, e), state(ref, ref_e)), step
    e.close()
    ref_e.close()
    return s, nbytes


def test_backwards_summed_with_accumulation_steps_1_stop_the_update_in_backward(tmp_path):
    """A caller that sums backwards itself (two per engine.step() with gradient_accumulation_steps 1):
    the first update in backward is dropped by the second backward; from then on none is begun (their
    transfers would be wasted), and stats say why; results as the ordinary step's."""
    (m, e), (ref, ref_e) = twins(tmp_path, keep=True)
    for step in range(4):
        for mm, ee in ((m, e), (ref, ref_e)):
            ee.stats(reset=True)
            sq(mm(ids(seed=2 * step))).backward()
            sq(mm(ids(seed=2 * step + 1))).backward()
            ee.step()
        s = e.stats()
        assert same(state(m, e), state(ref, ref_e)), step
    assert e._early.accumulates and s["steps_in_backward"] == 0
    assert "backwards are summed before engine.step()" in s["steps_ordinary_reason"]
    e.close()
    ref_e.close()


def against_plain_pytorch(
    tmp_path: Path, tiers: tuple[str, str], device: str, gas: int, clip: float | None, **extra: Any
) -> dict[str, Any]:
    """Trains `test_ds_clipping.Net` 5 optimizer steps in plain PyTorch and through zswap (``extra``: more
    config keys), asserts params and norms bitwise equal, and returns zswap's stats of the whole run."""
    from .test_ds_clipping import HYPER, Net, inputs

    torch.manual_seed(0)
    ref = Net()
    opt = torch.optim.AdamW(
        ref.parameters(), lr=HYPER["lr"], betas=tuple(HYPER["betas"]), weight_decay=HYPER["weight_decay"],
        fused=True,
    )  # fmt: skip
    xs = inputs(5 * gas)
    norms = []
    for s in range(5):
        for k in range(gas):
            (ref(xs[s * gas + k]) / gas).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip or float("inf"))))
        opt.step()
        opt.zero_grad()
    d = tmp_path / "swap"
    d.mkdir()
    cfg: dict[str, Any] = {
        "offload_param": {"device": tiers[0], "nvme_path": str(d)},
        "offload_optimizer": {"device": tiers[1], "nvme_path": str(d)},
        "optimizer": {"type": "AdamW", "params": HYPER},
        "gradient_accumulation_steps": gas,
        **({"gradient_clipping": clip} if clip else {}),
        **extra,
    }
    torch.manual_seed(0)
    with zswap.Init(cfg):
        model = Net()
    engine = zswap.initialize(model, cfg, device=StandInDevice() if device == "standin" else "cpu")
    with engine:
        for s in range(5):
            for k in range(gas):
                engine.backward(engine(xs[s * gas + k]))
                engine.step()
            if clip:
                assert engine.last_grad_norm == norms[s], s
        stats = engine.stats()
        with zswap.GatheredParameters(list(model.parameters())):
            got = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(g, r) for g, r in zip(got, ref.parameters(), strict=True))
    return stats


@pytest.mark.parametrize(
    ("tiers", "device"),
    [
        (("nvme", "nvme"), "cpu"),
        (("nvme", "cpu"), "cpu"),
        (("cpu", "cpu"), "cpu"),
        (("nvme", "nvme"), "standin"),
    ],
    ids=["nvme", "states-in-memory", "all-in-memory", "stand-in"],
)
@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clip", "clip-bites"])
def test_the_fast_path_is_bitwise_plain_pytorch(tiers, device, gas, clip, tmp_path):
    """Against plain PyTorch in RAM — fused AdamW after ``clip_grad_norm_`` — not only the early-off twin:
    params after 5 optimizer steps bitwise equal, each step's norm too, the update made in backward or
    deferred (clipping at 1.0 bites on every step of this model)."""
    stats = against_plain_pytorch(tmp_path, tiers, device, gas, clip)
    assert stats["steps_in_backward"] + stats["steps_deferred"] == 4  # all but the first, which makes records


@pytest.mark.parametrize("device", ["cpu", "standin"])
@pytest.mark.parametrize("gas", [1, 2])
def test_past_the_cap_a_deferred_step_is_bitwise_plain_pytorch(device, gas, tmp_path, monkeypatch):
    """Clipping that bites on a model whose copies and gradients pass the early step's cap (the live
    budget of 60 elements alone): each step after the first holds what fits and leaves the rest to the
    ordinary step in its commit — still bitwise plain PyTorch."""
    monkeypatch.setattr(earlystep, "CAP_EXTRA", 0)
    stats = against_plain_pytorch(
        tmp_path, ("nvme", "nvme"), device, gas, 1.0, zero_optimization={"stage3_max_live_parameters": 60}
    )
    assert stats["steps_deferred"] == stats["steps_deferred_partly"] == 4


def test_a_fault_in_the_ordinary_part_of_a_deferred_step_changes_nothing(tmp_path, monkeypatch):
    """The records past the cap fail to read at the step: `Engine.step` raises the `SwapIOError` and
    nothing changed (one transaction for both parts); the next `Engine.step` runs the ordinary step from
    the stored gradients, bitwise the twin's."""
    monkeypatch.setattr(earlystep, "CAP_EXTRA", 0)
    (m, e), (ref, ref_e) = twins(tmp_path, keep=False)
    pairs = [(m, e), (ref, ref_e)]
    for seed in range(3):  # records made, then clipping bites: the next step is deferred
        for mm, ee in pairs:
            ee.max_grad_norm = 1e-3
            sq(mm(ids(seed=seed))).backward()
            ee.step()
    before = state(m, e)
    for mm in (m, ref):
        sq(mm(ids(seed=3))).backward()
    swap = engine_of(m)
    ordinary_part = bridge.step_indices

    def failing(*args: Any) -> None:  # the first read of the ordinary part fails (after the early part's)
        inject(swap, "read", errno.EIO, 0)
        ordinary_part(*args)

    monkeypatch.setattr(bridge, "step_indices", failing)
    with pytest.raises(zswap.SwapIOError):
        e.step()
    monkeypatch.setattr(bridge, "step_indices", ordinary_part)
    swap._engine.clear_faults()
    assert same(state(m, e), before)
    assert e.stats()["steps_deferred"] == e.stats()["steps_deferred_partly"] == 2  # (steps 1 and 2)
    e.step()
    ref_e.step()
    assert same(state(m, e), state(ref, ref_e))
    e.close()
    ref_e.close()
