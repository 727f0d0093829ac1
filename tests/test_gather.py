"""zswap.GatheredParameters: full data inside the block, kept with modifier_rank, dropped (with a warning)
without it, released on errors, refused when nested."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import zswap
from zswap import GatheredParameters, Init, Status, ZswapError, ZswapWarning, param_state
from zswap.gather import checksum, flatten_params

from ._init_helpers import TIERS, gathered, make_init


def built(tier: str, tmp_path, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    ref = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))
    init = make_init(tier, tmp_path)
    torch.manual_seed(seed)
    with init:
        m = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))
    return m, ref


@pytest.mark.parametrize("tier", TIERS)
def test_full_data_inside_the_block_only(tier, tmp_path):
    m, ref = built(tier, tmp_path)
    params = list(m.parameters())
    with GatheredParameters(params):
        for p, r in zip(params, ref.parameters(), strict=True):
            assert param_state(p).status is Status.AVAILABLE
            assert torch.equal(p.data, r.data) and p.shape == r.shape
    for p in params:
        assert param_state(p).status is Status.NOT_AVAILABLE and p.numel() == 0


@pytest.mark.parametrize("tier", TIERS)
def test_modifier_rank_keeps_changes(tier, tmp_path):
    m, _ = built(tier, tmp_path)
    with GatheredParameters(m[0].weight, modifier_rank=0):
        m[0].weight.data.fill_(2.0)
    with GatheredParameters(m[0].bias, modifier_rank=0):
        m[0].bias.data = torch.arange(3.0)  # a new tensor of the same shape
    w, b = gathered([m[0].weight, m[0].bias])
    assert torch.all(w == 2.0) and torch.equal(b, torch.arange(3.0))


@pytest.mark.parametrize("tier", TIERS)
def test_without_modifier_rank_changes_are_dropped_with_a_warning(tier, tmp_path):
    m, ref = built(tier, tmp_path)
    with pytest.warns(ZswapWarning, match=r"shape \(3, 5\).*dropped"), GatheredParameters(m.parameters()):
        m[0].weight.data.add_(1.0)
    with pytest.warns(ZswapWarning, match="dropped"), GatheredParameters(m[1].bias):
        m[1].bias.data = torch.zeros(2)
    with GatheredParameters(m.parameters()):  # read only: no warning (filterwarnings=error)
        _ = [p.sum() for p in m.parameters()]
    assert all(
        torch.equal(a, b) for a, b in zip(gathered(m.parameters()), gathered(ref.parameters()), strict=True)
    )


@pytest.mark.parametrize("tier", TIERS)
def test_a_raising_block_drops_changes_and_releases(tier, tmp_path):
    m, ref = built(tier, tmp_path)
    with pytest.raises(KeyError, match="inside"), GatheredParameters(m.parameters(), modifier_rank=0):
        m[0].weight.data.zero_()
        raise KeyError("inside")
    assert all(param_state(p).status is Status.NOT_AVAILABLE and p.numel() == 0 for p in m.parameters())
    assert all(
        torch.equal(a, b) for a, b in zip(gathered(m.parameters()), gathered(ref.parameters()), strict=True)
    )
    with GatheredParameters(m.parameters()):  # usable again: nothing left marked as gathered
        pass


def test_accepts_params_iterables_generators_and_nesting():
    m, _ = built("cpu", None)
    w0, b0, w1, b1 = m.parameters()
    flat = flatten_params([w1, (w0, [b0, None, w0]), (p for p in (b1, w1))])
    assert [id(p) for p in flat] == [id(w1), id(w0), id(b0), id(b1)]  # first appearance, deduplicated
    with GatheredParameters(p for p in m.parameters()):
        assert all(p.numel() > 0 for p in m.parameters())
    with GatheredParameters(w0):
        assert w0.shape == (3, 5) and b0.numel() == 0
    with pytest.raises(TypeError, match="not str"):
        GatheredParameters("weight")
    with pytest.raises(TypeError, match="not int"):
        GatheredParameters([w0, 3])


def test_nesting_over_the_same_param_is_an_error():
    m, _ = built("cpu", None)
    with GatheredParameters(m[1].weight):
        with GatheredParameters(m[0].parameters()):  # other params: fine
            pass
        with pytest.raises(ZswapError, match=r"shape \(2, 3\).*already gathered"):  # noqa: SIM117
            with GatheredParameters([m[0].weight, m[1].weight]):
                pass
        assert m[1].weight.shape == (2, 3)
    assert m[1].weight.numel() == 0


def test_unmanaged_params_and_disabled_blocks_do_nothing():
    plain = nn.Linear(3, 2)
    before, values = plain.weight.data_ptr(), plain.weight.detach().clone()
    with GatheredParameters(plain.parameters(), modifier_rank=0):
        plain.weight.data.add_(1.0)
    assert plain.weight.data_ptr() == before  # left alone: the change is simply there
    assert torch.equal(plain.weight.detach(), values + 1.0)
    m, _ = built("cpu", None)
    with GatheredParameters([*m.parameters(), plain.weight], enabled=False):
        assert all(p.numel() == 0 for p in m.parameters())
    with GatheredParameters([m[0].weight, plain.weight]):
        assert m[0].weight.shape == (3, 5) and plain.weight.data_ptr() == before


def test_modifier_rank_must_be_a_rank():
    m, _ = built("cpu", None)
    with pytest.raises(ValueError, match="modifier_rank=1"), GatheredParameters(m[0].weight, modifier_rank=1):
        pass
    assert m[0].weight.numel() == 0


def test_inside_init_on_a_touched_param():
    with Init(remote_device="cpu"):
        lin = nn.Linear(4, 4)
        lin.weight.data.fill_(5.0)  # touched: a pending write
        with GatheredParameters(lin.weight, modifier_rank=0):
            assert torch.all(lin.weight == 5.0)
            lin.weight.data.add_(1.0)
        lin.bias.data.fill_(1.0)
    w, b = gathered([lin.weight, lin.bias])
    assert torch.all(w == 6.0) and torch.all(b == 1.0)


def test_dtype_is_kept_through_a_round_trip(tmp_path):
    with make_init("nvme", tmp_path, dtype=torch.bfloat16):
        lin = nn.Linear(4, 4)
    with GatheredParameters(lin.weight, modifier_rank=0):
        assert lin.weight.dtype == torch.bfloat16
        lin.weight.data.fill_(0.5)
    assert torch.all(gathered([lin.weight])[0] == 0.5)


@settings(database=None)  # nothing written to the working directory
@given(st.lists(st.integers(0, 5), max_size=20))
def test_flatten_keeps_first_appearance_order(picks):
    pool = [torch.zeros(1) for _ in range(6)]
    got = flatten_params([pool[i] for i in picks])
    want = list(dict.fromkeys(picks))
    assert [id(t) for t in got] == [id(pool[i]) for i in want]


def test_checksum_sees_any_changed_byte():
    t = torch.randn(1000, dtype=torch.bfloat16)
    c = checksum(t)
    t2 = t.clone()
    t2.view(torch.int16)[500] ^= 1
    assert checksum(t2) != c and checksum(t.clone()) == c
    assert checksum(torch.tensor(3.0)) == checksum(torch.tensor(3.0))


def test_public_names():
    for name in ("Init", "GatheredParameters", "param_state", "ParamState", "Status"):
        assert name in zswap.__all__ and getattr(zswap, name) is not None
    assert {s.name for s in Status} == {"AVAILABLE", "NOT_AVAILABLE", "INFLIGHT"}


# -- a param an open Engine is prefetching ----------------------------------------------------------


@pytest.mark.parametrize("modifier_rank", [None, 0])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_gathering_a_param_whose_prefetch_is_in_flight(tier, modifier_rank, tmp_path):
    # Between a forward and its backward the engine has the backward's first params in flight; a block
    # over them then (logging, a custom loss) must see their full data, and the backward stay right.
    torch.manual_seed(0)
    ref = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    torch.manual_seed(0)
    with make_init(tier, tmp_path):
        m = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    z = {
        "stage": 3,
        "offload_param": {"device": tier, "nvme_path": str(tmp_path)},
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 300,  # about one layer ahead
        "stage3_max_live_parameters": 600,
        "stage3_max_reuse_distance": 0,
    }
    x = torch.randn(2, 16)
    weights = [layer.weight for layer in m]
    with zswap.initialize(m, {"zero_optimization": z}) as engine:
        for it in range(3):
            out = m(x).square().sum()
            status = [param_state(w).status for w in weights]
            with GatheredParameters(weights, modifier_rank=modifier_rank):
                inside = [w.data.clone() for w in weights]
            if it > 0:  # traced: the case under test occurs
                assert Status.INFLIGHT in status
            assert all(torch.equal(a, r.weight.data) for a, r in zip(inside, ref, strict=True)), it
            out.backward()
            want = ref(x).square().sum()
            want.backward()
            assert torch.equal(out.detach(), want.detach())
            for p, q in zip(m.parameters(), ref.parameters(), strict=True):
                assert torch.equal(zswap.full_grad(p), q.grad)
            engine.zero_grad()
            ref.zero_grad()
        assert engine.stats()["prefetch_dropped"] >= 2
    assert all(param_state(w).status is Status.NOT_AVAILABLE for w in weights)


@pytest.mark.parametrize(
    "keep", ["persistent-cpu", "persistent-nvme", "max_in_cpu"], ids=lambda k: k.replace("_", "-")
)
def test_without_modifier_rank_a_param_that_stays_gathered_drops_its_change_too(keep, tmp_path):
    """A param gathered before the block (below the persistence threshold, resident by ``max_in_cpu``):
    its data may be the stored partition itself, so the block works on a copy; the change is dropped with
    the warning, as for a param the block gathers, and training goes on as if it never happened. Before, the
    write was kept silently (on several ranks, each rank's own)."""
    tier = "nvme" if keep != "persistent-cpu" else "cpu"
    z: dict = {"offload_param": {"device": tier, "nvme_path": str(tmp_path)}}
    z["stage3_param_persistence_threshold"] = 100 if keep.startswith("persistent") else 0
    if keep == "max_in_cpu":
        z["offload_param"]["max_in_cpu"] = 10**6
    cfg = {
        "zero_optimization": z,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
    }
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 8))
    torch.manual_seed(0)
    with zswap.Init(cfg):
        m = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 8))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    x = torch.randn(2, 8)
    with zswap.initialize(m, cfg) as engine:
        for it in range(3):
            if it == 1:
                assert param_state(m[1].bias).status is Status.AVAILABLE  # gathered before the block
                with (
                    pytest.warns(ZswapWarning, match=r"shape \(8,\).*dropped"),
                    GatheredParameters(m[1].bias),
                ):
                    m[1].bias.data.add_(1.0)
                with pytest.warns(ZswapWarning, match="dropped"), GatheredParameters(m[1].parameters()):
                    m[1].bias.data = torch.zeros(8)
            out = m(x).square().sum()
            out.backward()
            engine.step()
            want = ref(x).square().sum()
            want.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert torch.equal(out.detach(), want.detach()), it
    assert all(
        torch.equal(a, b) for a, b in zip(gathered(m.parameters()), gathered(ref.parameters()), strict=True)
    )


@pytest.mark.parametrize("keep", ["persistent-cpu", "max_in_cpu"], ids=lambda k: k.replace("_", "-"))
def test_a_read_only_block_over_a_gathered_param_holding_nan_warns_nothing(keep, tmp_path):
    """Whether the block changed a param gathered before it is a bitwise question: a NaN is unchanged
    when its bits are (before, ``NaN != NaN`` made a read-only block warn of a change it dropped)."""
    tier = "nvme" if keep == "max_in_cpu" else "cpu"
    z: dict = {"offload_param": {"device": tier, "nvme_path": str(tmp_path)}}
    z["stage3_param_persistence_threshold"] = 100 if keep.startswith("persistent") else 0
    if keep == "max_in_cpu":
        z["offload_param"]["max_in_cpu"] = 10**6
    with zswap.Init({"zero_optimization": z}):
        m = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 8))
    with GatheredParameters(m[1].bias, modifier_rank=0):
        m[1].bias.data[3] = float("nan")
    with zswap.initialize(m, {"zero_optimization": z}):
        m(torch.randn(2, 8))
        assert param_state(m[1].bias).status is Status.AVAILABLE  # gathered before the block
        with GatheredParameters(m.parameters()):
            bias = m[1].bias.data.clone()
        assert torch.isnan(bias[3]) and not torch.isnan(bias[:3]).any()
        with pytest.warns(ZswapWarning, match="dropped"), GatheredParameters(m[1].bias):
            m[1].bias.data[3] = float("inf")
