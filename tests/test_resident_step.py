"""Resident params (``offload_param.max_in_cpu``, small persistent ones) are stepped in their gathered copy:
a warm step reads nothing from the swap files for them, their NVMe copy is written in the step's
transaction, and the results are bitwise those of plain PyTorch and of the ordinary (streamed) path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zswap
from zswap import Status, SwapIOError, param_state
from zswap.device import StandInDevice
from zswap.parts.params import NvmeStore

from .conftest import run_ranks
from .test_runtime import build, engine_for

HYPER: dict[str, Any] = {"lr": 1e-2, "betas": [0.9, 0.99], "weight_decay": 0.01}
ALL = 10**9


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 48)
        self.b = nn.Linear(48, 48)
        self.c = nn.Linear(48, 5)  # an odd bias: padding in the last partition over two ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.c(torch.tanh(self.b(torch.relu(self.a(x))))) * 4).square().mean()


def config(tmp_path: Any, optimizer: str, max_in_cpu: int, **extra: Any) -> dict[str, Any]:
    """Params on NVMe; ``optimizer``: ``"torch"`` (given to initialize) or the tier of the config's
    OffloadedAdamW. ``max_in_cpu`` 0 with no persistence: the ordinary path, every param streamed."""
    zero: dict[str, Any] = {
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": max_in_cpu},
        "stage3_param_persistence_threshold": 0 if max_in_cpu == 0 else 100,
    }
    cfg: dict[str, Any] = {"zero_optimization": zero, **extra}
    if optimizer != "torch":
        zero["offload_optimizer"] = {"device": optimizer}
        if optimizer == "nvme":
            zero["offload_optimizer"]["nvme_path"] = str(tmp_path)
        cfg["optimizer"] = {"type": "AdamW", "params": HYPER}
    return cfg


def adamw(params: Any) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        params, lr=HYPER["lr"], betas=tuple(HYPER["betas"]), weight_decay=HYPER["weight_decay"], fused=True
    )


def inputs(n: int, dtype: torch.dtype = torch.float32) -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    for _ in range(n):
        yield torch.randn(8, 12, generator=g).to(dtype)


def compute(device: str) -> Any:
    return StandInDevice() if device == "stand-in" else "cpu"


def train(
    tmp_path: Any,
    optimizer: str,
    max_in_cpu: int,
    clip: float | None,
    steps: int = 4,
    device: str = "cpu",
    **extra: Any,
) -> tuple[list[torch.Tensor], list[float | None]]:
    """Params after ``steps`` zswap steps on ``device`` ("cpu" or "stand-in"), and each step's gradient
    norm."""
    tmp_path.mkdir(exist_ok=True)
    cfg = config(tmp_path, optimizer, max_in_cpu, **extra)
    m, _ = build(Net, cfg)
    dtype = param_state(m.a.weight).dtype
    given = adamw(m.parameters()) if optimizer == "torch" else None
    norms = []
    with engine_for(m, cfg, optimizer=given, max_grad_norm=clip, device=compute(device)) as engine:
        for x in inputs(steps, dtype):
            engine.backward(engine(x))
            engine.step()
            norms.append(engine.last_grad_norm)
            kept = [p for p in m.parameters() if engine._slots[id(p)].persistent]
            assert len(kept) == {ALL: 6, 0: 0}.get(max_in_cpu, 5)  # "part": not c.weight
            assert all(param_state(p).status is Status.AVAILABLE for p in kept)  # across the step
        with zswap.GatheredParameters(list(m.parameters())):
            return [p.detach().clone() for p in m.parameters()], norms


def plain(clip: float | None, steps: int = 4) -> tuple[list[torch.Tensor], list[float]]:
    torch.manual_seed(0)
    ref = Net()
    opt = adamw(ref.parameters())
    norms = []
    for x in inputs(steps):
        ref(x).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip or float("inf"))))
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in ref.parameters()], norms


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("device", ["cpu", "stand-in"])
@pytest.mark.parametrize("clip", [None, 0.5, 1e6], ids=["no-clip", "clip-bites", "clip-above-norm"])
@pytest.mark.parametrize("max_in_cpu", [ALL, 48 * 12 + 48 * 48], ids=["all", "part"])
@pytest.mark.parametrize("optimizer", ["torch", "cpu", "nvme"])
def test_resident_params_step_as_the_ordinary_path_and_plain_torch(
    optimizer, max_in_cpu, clip, device, tmp_path
):
    """On a compute device too: there the gathered copy is the device's, so the step takes the host
    partition from it (no read) and the param is gathered again from the updated partition."""
    got, norms = train(tmp_path / "resident", optimizer, max_in_cpu, clip, device=device)
    ordinary, ordinary_norms = train(tmp_path / "streamed", optimizer, 0, clip, device=device)
    assert same(got, ordinary) and norms == ordinary_norms
    want, want_norms = plain(clip)
    if clip is not None:
        assert norms == want_norms
        assert (min(want_norms) > clip) == (clip == 0.5)
    # OffloadedAdamW scales clipped gradients inside its kernel: bitwise torch's only without clipping.
    if optimizer == "torch" or clip is None:
        assert same(got, want)


@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_bf16_resident_params_step_as_the_ordinary_path(optimizer, clip, tmp_path):
    got, norms = train(tmp_path / "resident", optimizer, ALL, clip, bf16={"enabled": True})
    ordinary, ordinary_norms = train(tmp_path / "streamed", optimizer, 0, clip, bf16={"enabled": True})
    assert got[0].dtype == torch.bfloat16
    assert same(got, ordinary) and norms == ordinary_norms


def _stored(p: torch.Tensor) -> torch.Tensor:
    st = param_state(p)
    buf, handle = st.store.load(st.key, st.partition_numel, st.dtype)
    if handle is not None:
        handle.wait()
    return buf.clone()


@pytest.mark.parametrize("early", [False, True], ids=["ordinary", "early"])
@pytest.mark.parametrize("device", ["cpu", "stand-in"])
@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_a_warm_step_reads_nothing_for_resident_params(optimizer, device, early, tmp_path, monkeypatch):
    """The ordinary step and the early one (made live in backward), on the CPU and on a compute device,
    where the host partitions the step needs come from the device's gathered copies and the params are
    gathered again from the updated ones."""
    cfg = config(tmp_path, optimizer, ALL, **({} if early else {"gradient_clipping": 1.0}))
    m, _ = build(Net, cfg)
    params = list(m.parameters())
    model_bytes = sum(param_state(p).numel * 4 for p in params)
    loaded: list[str] = []
    load = NvmeStore.load

    def counting(self: NvmeStore, key: str, numel: int, dtype: torch.dtype) -> Any:
        loaded.append(key)
        return load(self, key, numel, dtype)

    with engine_for(m, cfg, device=compute(device)) as engine:
        engine.early_step = early
        data = list(inputs(5))
        for i, x in enumerate(data):
            if i == 2:  # warm from here on
                engine.stats(reset=True)
                monkeypatch.setattr(NvmeStore, "load", counting)
            engine.backward(engine(x))
            engine.step()
        s = engine.stats()
        monkeypatch.undo()
        assert loaded == []
        assert s["steps_in_backward"] == (3 if early else 0)
        if optimizer == "cpu":  # nothing else on NVMe: the whole traffic is the params' write-through
            assert s["bytes_read"] == 0
            assert s["bytes_written"] == 3 * model_bytes
        for p in params:  # the NVMe copy is the gathered one
            assert param_state(p).status is Status.AVAILABLE
            assert torch.equal(_stored(p), p.data.reshape(-1))


@pytest.mark.parametrize("device", ["cpu", "stand-in"])
@pytest.mark.parametrize("optimizer", ["torch", "cpu"])
def test_a_failed_write_in_the_step_leaves_the_gathered_copies_as_they_were(optimizer, device, tmp_path):
    """On a compute device the gathered copies there are given back unchanged (the host partitions the
    step changed are restored by its undo log, and dropped)."""
    cfg = config(tmp_path, optimizer, ALL)
    m, ref = build(Net, cfg)
    ref_opt = adamw(ref.parameters())
    data = list(inputs(4))
    given = adamw(m.parameters()) if optimizer == "torch" else None
    with engine_for(m, cfg, optimizer=given, device=compute(device)) as engine:
        # The step's own write-through: states in CPU memory would have the update (and its writes) run
        # in backward (a fault there: tests/test_early_cputier.py).
        engine.early_step = False
        for x in data[:2]:
            engine.backward(engine(x))
            engine.step()
            ref(x).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        before = [p.data.clone() for p in m.parameters()]
        engine.backward(engine(data[2]))
        param_state(m.a.weight).store.engine._engine.inject_fault("write", "errno", 5)
        with pytest.raises(SwapIOError):
            engine.step()
        for p, b in zip(m.parameters(), before, strict=True):
            assert param_state(p).status is Status.AVAILABLE
            assert torch.equal(p.data, b) and torch.equal(_stored(p), b.reshape(-1))
        engine.zero_grad()
        for x in data[2:]:  # and it trains on as plain torch
            engine.backward(engine(x))
            engine.step()
            ref(x).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        with zswap.GatheredParameters(list(m.parameters())):
            assert same([p.data for p in m.parameters()], [q.data for q in ref.parameters()])


@pytest.mark.dist
def test_two_ranks_step_their_slice_of_the_gathered_copy(tmp_path):
    run_ranks(Path(__file__).with_name("_resident_dist_worker.py"), tmp_path)


def test_a_frozen_resident_param_stays_gathered_and_unchanged(tmp_path):
    cfg = config(tmp_path, "torch", ALL)
    m, ref = build(Net, cfg)
    for net in (m, ref):
        net.a.weight.requires_grad_(False)
    with zswap.GatheredParameters(m.a.weight):
        start = m.a.weight.data.clone()
    ref_opt = adamw([p for p in ref.parameters() if p.requires_grad])
    with engine_for(m, cfg, optimizer=adamw([p for p in m.parameters() if p.requires_grad])) as engine:
        for x in inputs(3):
            engine.backward(engine(x))
            engine.step()
            ref(x).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert param_state(m.a.weight).status is Status.AVAILABLE
            assert torch.equal(m.a.weight.data, start) and torch.equal(_stored(m.a.weight), start.reshape(-1))
        assert same([p.data for p in m.parameters()], [q.data for q in ref.parameters()])
