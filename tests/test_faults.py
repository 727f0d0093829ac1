"""Faults in training: ENOSPC and EIO (the engine's fault injection) during an `Init` build, a forward, a
backward and an optimizer step each leave the model and the optimizer exactly as before the failing call
(compared bitwise: params through GatheredParameters, gradients through full_grad, optimizer state through
its records), the error is a `SwapIOError` naming the key, and the same call succeeds once the fault is
gone — with bitwise the result of a run that never failed. Plus: ``kill -9`` in a step leaves no file, and
hostile config files give a `ConfigError`.

The table in docs/architecture.md ("Faults in training") names the test of each cell.
"""

from __future__ import annotations

import errno
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zswap
from zswap import ConfigError, GatheredParameters, SwapIOError, full_grad, load_config, param_state
from zswap import storage as zs
from zswap.optim import OffloadedAdamW
from zswap.params import Status

from .test_runtime import GivenAdamW, TinyLM, build, engine_for, ids, sq

FAULTS = [("write", errno.ENOSPC), ("write", errno.EIO), ("read", errno.EIO)]
WHERE = [0.0, 0.5, 1.0]  # the first, a middle and the last transfer of the call


def cfg_for(d: Path, params: str, states: str, **extra: Any) -> dict[str, Any]:
    d.mkdir(exist_ok=True)
    return {
        "offload_param": {"device": params, **({"nvme_path": str(d)} if params == "nvme" else {})},
        "offload_optimizer": {"device": states, **({"nvme_path": str(d)} if states == "nvme" else {})},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "stage3_param_persistence_threshold": 0,
        "stage3_max_live_parameters": 1500,  # the step goes through the params in several chunks
        "sub_group_size": 700,  # several records, some shared by two params
        **extra,
    }


def engine_of(m: nn.Module, opt: Any = None) -> Any:
    """The one SwapEngine a model's params, gradients and records use (one swap directory)."""
    st = param_state(next(m.parameters()))
    if hasattr(st.store, "storage"):
        return st.store.engine
    if st.grad_store is not None:
        return st.grad_store.engine
    return opt._store.engine


def inject(engine: Any, op: str, code: int, skip: int) -> None:
    engine._engine.inject_fault(op, "errno", code, skip, 1)


def transfers(engine: Any, op: str) -> int:
    return int(engine.stats()["reads" if op == "read" else "writes"])


def params_of(m: nn.Module) -> list[torch.Tensor]:
    with GatheredParameters(list(m.parameters())):
        return [p.data.clone() for p in m.parameters()]


def grads_of(m: nn.Module) -> list[torch.Tensor | None]:
    return [None if (g := full_grad(p)) is None else g.clone() for p in m.parameters()]


def optim_state(opt: Any, m: nn.Module) -> Any:
    if isinstance(opt, OffloadedAdamW):
        records: list[torch.Tensor] = []
        opt._store.stream(opt.sub_groups, lambda sg, r: records.append(r.clone()), write=False)
        return records, list(opt._steps)
    return [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
        for p in m.parameters()
        if p in opt.state
    ]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def snapshot(m: nn.Module, engine: zswap.Engine) -> Any:
    return params_of(m), grads_of(m), optim_state(engine.optimizer, m)


def no_leftover_keys(engine: Any, *kinds: str) -> bool:
    """No key of those kinds beyond what the live namespaces hold (a failed write leaked nothing)."""
    return not [k for k in list(engine.keys()) if k.split("/")[0] in kinds and "@" not in k]


# -- the optimizer step ---------------------------------------------------------------------------------

STEP_SETUPS = [
    ("nvme", "nvme", "offloaded"),  # ZeRO-Infinity: params and states on NVMe
    ("cpu", "nvme", "offloaded"),  # states on NVMe, params in memory (changed in place: undo log)
    ("nvme", "cpu", "offloaded"),  # states in memory (changed in place: undo log), params on NVMe
    ("nvme", "cpu", "torch"),  # an ordinary torch optimizer over the partitions (step_partitions)
]


def _two_runs(tmp_path: Path, params: str, states: str, kind: str) -> tuple[Any, Any]:
    runs = []
    for name in ("faulted", "reference"):
        cfg = cfg_for(tmp_path / name, params, states)
        m, _ = build(TinyLM, cfg)
        opt = GivenAdamW(m.parameters(), lr=1e-2, weight_decay=0.1) if kind == "torch" else None
        engine = engine_for(m, cfg, optimizer=opt)
        engine.early_step = False  # faults in the step itself; the early step's: tests/test_earlystep.py
        engine.prefetch_across_passes = False  # its reads ahead would be the step's last transfers
        runs.append((m, engine))
    return runs[0], runs[1]


@pytest.mark.parametrize(("params", "states", "kind"), STEP_SETUPS, ids=["-".join(s) for s in STEP_SETUPS])
@pytest.mark.parametrize(("op", "code"), FAULTS, ids=lambda x: str(x))
def test_a_failed_step_changes_nothing_and_the_retry_is_exact(params, states, kind, op, code, tmp_path):
    """One step after another, each first failing at one point (its first, a middle, its last transfer),
    then retried; a twin that never fails takes the same steps."""
    (m, engine), (ref, ref_engine) = _two_runs(tmp_path, params, states, kind)
    swap = engine_of(m, engine.optimizer)
    ref_swap = engine_of(ref, ref_engine.optimizer)
    for step, where in enumerate(WHERE):  # the first step (fresh state) too
        for mm in (m, ref):
            sq(mm(ids(seed=step))).backward()
        n = transfers(ref_swap, op)
        ref_engine.step()
        n = transfers(ref_swap, op) - n  # transfers of the step, in the twin that does not fail
        assert n > 0
        before = snapshot(m, engine)
        inject(swap, op, code, int(where * (n - 1)))
        with pytest.raises(SwapIOError) as ei:
            engine.step()
        swap._engine.clear_faults()
        assert ei.value.errno == code and ei.value.key is not None and ei.value.key.split("/")[0] in "pgo"
        assert same(snapshot(m, engine), before), where  # params, gradients, optimizer state: as before
        assert no_leftover_keys(swap, "p", "g", "o", "u")
        engine.step()  # the retry: as if the failed step never ran
        assert same(snapshot(m, engine), snapshot(ref, ref_engine)), where
    engine.close()
    ref_engine.close()


@pytest.mark.parametrize(("op", "code"), FAULTS, ids=lambda x: str(x))
@pytest.mark.parametrize("spill", [False, True], ids=["undo_in_memory", "undo_spilled"])
def test_offloaded_adamw_alone_rolls_back_its_cpu_params(op, code, spill, tmp_path, monkeypatch):
    """No zswap Engine: plain CPU params (changed in place by the kernel), states on NVMe."""
    if spill:
        monkeypatch.setattr(zs, "UNDO_MEMORY_BYTES", 1000)  # the param copies go to the swap directory
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(300)), nn.Parameter(torch.randn(50, 20).bfloat16())]
    ref_params = [nn.Parameter(p.detach().clone()) for p in params]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        opt = OffloadedAdamW(params, lr=0.1, device="nvme", nvme_path=tmp_path, sub_group_size=256)
        ref = OffloadedAdamW(ref_params, lr=0.1, device="nvme", nvme_path=tmp_path, sub_group_size=256)
    for step in range(2):
        for ps in (params, ref_params):
            for i, p in enumerate(ps):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step * 10 + i)).to(
                    p.dtype
                )
        if step == 0:
            opt.step()
            ref.step()
    before = ([p.detach().clone() for p in params], optim_state(opt, None), list(opt._steps))
    inject(opt._store.engine, op, code, 1)
    with pytest.raises(SwapIOError):
        opt.step()
    opt._store.engine._engine.clear_faults()
    assert same(([p.detach().clone() for p in params], optim_state(opt, None), list(opt._steps)), before)
    opt.step()
    ref.step()
    assert same([p.detach() for p in params], [p.detach() for p in ref_params])
    assert same(optim_state(opt, None), optim_state(ref, None))
    opt.close()
    ref.close()


# -- backward (the gradient store) ----------------------------------------------------------------------


@pytest.mark.parametrize("params", ["nvme", "cpu"])
@pytest.mark.parametrize(("op", "code"), FAULTS, ids=lambda x: str(x))
def test_a_failed_backward_counts_for_nothing_and_can_be_run_again(params, op, code, tmp_path):
    """Gradient accumulation: a backward fails at one point (the first, a middle, the last of its
    transfers: gradient writes, and reads of the partitions it adds to), then runs again."""
    cfg = cfg_for(tmp_path, params, "nvme")
    m, ref = build(TinyLM, cfg)
    with engine_for(m, cfg) as engine:
        swap = engine_of(m)
        for mm in (m, ref):  # a first backward accumulates fine
            sq(mm(ids(seed=0))).backward()
        for i, where in enumerate(WHERE):
            before = snapshot(m, engine)
            out = m(ids(seed=i + 1))
            n = transfers(swap, op)
            sq(out).backward(retain_graph=True)  # count this backward's transfers ...
            n = transfers(swap, op) - n
            assert n > 0
            engine.zero_grad()  # ... then start over from the gradients before it
            for j in range(i + 1):
                sq(m(ids(seed=j))).backward()
            assert same(snapshot(m, engine), before)
            out = m(ids(seed=i + 1))
            inject(swap, op, code, int(where * (n - 1)))
            with pytest.raises(SwapIOError) as ei:
                sq(out).backward()
            swap._engine.clear_faults()
            assert ei.value.errno == code and ei.value.key.split("/")[0] in "pg"
            assert same(snapshot(m, engine), before), where  # every gradient as before that backward
            sq(m(ids(seed=i + 1))).backward()  # run again: as if the failed one never ran
            sq(ref(ids(seed=i + 1))).backward()
            assert same(grads_of(m), [p.grad for p in ref.parameters()]), where


@pytest.mark.parametrize("states", ["cpu", "nvme"])
def test_a_backward_a_user_hook_breaks_keeps_its_sums_in_memory_and_none_on_nvme(states, tmp_path):
    """docs/troubleshooting.md: in CPU memory what the broken backward summed stays (as PyTorch's
    ``.grad``); on NVMe that backward's gradient writes are one transaction, never made live."""

    class Broken(Exception):
        pass

    def boom(_: torch.Tensor) -> None:
        raise Broken

    cfg = cfg_for(tmp_path, "nvme", states)
    m, ref = build(TinyLM, cfg)
    with engine_for(m, cfg) as engine:
        engine.early_step = False
        first = []
        for mm in (m, ref):
            sq(mm(ids(seed=0))).backward()
            first.append([zswap.full_grad(p).clone() for p in mm.parameters()])
            out = mm(ids(seed=1))
            mm.pos.register_hook(boom)  # `pos` is used first: its gradient comes last, the blocks' before
            with pytest.raises(Broken):
                sq(out).backward()
        plain = [p.grad for p in ref.parameters()]
        assert not same(plain, first[1])  # PyTorch kept the blocks' sums of the broken backward
        assert same(grads_of(m), plain if states == "cpu" else first[0])
        engine.zero_grad()
        assert all(full_grad(p) is None for p in m.parameters())


# -- forward ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", WHERE)
def test_a_failed_forward_read_releases_everything_and_the_next_forward_is_exact(where, tmp_path):
    cfg = cfg_for(tmp_path, "nvme", "cpu")
    m, ref = build(TinyLM, cfg)
    with engine_for(m, cfg) as engine:
        engine.prefetch_across_passes = False  # counted: this pass's own reads (reads ahead: elsewhere)
        swap = engine_of(m)
        before = snapshot(m, engine)
        n, w = transfers(swap, "read"), transfers(swap, "write")
        with torch.no_grad():
            m(ids())
        n = transfers(swap, "read") - n
        assert transfers(swap, "write") == w  # a forward writes nothing: ENOSPC cannot strike there
        inject(swap, "read", errno.EIO, int(where * (n - 1)))
        with pytest.raises(SwapIOError) as ei:
            m(ids())
        swap._engine.clear_faults()
        assert ei.value.errno == errno.EIO and ei.value.key.startswith("p/")
        assert all(param_state(p).status is Status.NOT_AVAILABLE for p in m.parameters())
        assert same(snapshot(m, engine), before)
        out = m(ids())
        assert torch.equal(out, ref(ids()))
        sq(out).backward()


# -- Init -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("op", "code"), [("write", errno.ENOSPC), ("write", errno.EIO)], ids=str)
@pytest.mark.parametrize("where", WHERE)
def test_a_failed_init_build_raises_naming_the_key_and_the_next_build_is_exact(op, code, where, tmp_path):
    cfg = cfg_for(tmp_path, "nvme", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        storage = zs.open_dir(tmp_path)  # the directory's one storage: Init builds on it
    hold = storage.namespace("t")
    n = transfers(storage.engine, op)
    m, ref = build(TinyLM, cfg)
    n = transfers(storage.engine, op) - n
    del m
    gc.collect()
    assert not [k for k in list(storage.engine.keys()) if k.startswith("p/")]
    inject(storage.engine, op, code, int(where * (n - 1)))
    with pytest.raises(SwapIOError) as ei:
        build(TinyLM, cfg)
    storage.engine._engine.clear_faults()
    assert ei.value.errno == code and ei.value.key.startswith("p/")
    del ei  # its traceback holds the half-built model
    gc.collect()
    assert not [k for k in list(storage.engine.keys()) if k.startswith("p/")]  # nothing of it is left
    m, ref = build(TinyLM, cfg)
    assert same(params_of(m), [p.detach() for p in ref.parameters()])
    hold.close()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_failed_write_back_under_init_keeps_the_previous_value(code, tmp_path):
    cfg = cfg_for(tmp_path, "nvme", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    before = params_of(m)
    swap = engine_of(m)
    inject(swap, "write", code, 0)  # the first write-back to complete fails
    with pytest.raises(SwapIOError) as ei, zswap.Init(cfg):
        m.apply(lambda mod: [p.data.fill_(3.0) for p in mod.parameters(recurse=False)])
    swap._engine.clear_faults()
    assert ei.value.errno == code and ei.value.key.startswith("p/")
    after = params_of(m)
    kept = [torch.equal(a, b) for a, b in zip(after, before, strict=True)]
    assert kept.count(True) == 1  # the failed overwrite left the previous value, readable
    assert all(a.eq(3.0).all() for a, k in zip(after, kept, strict=True) if not k)


# -- kill -9 -----------------------------------------------------------------------------------------------


def test_kill_9_during_steps_leaves_no_file(tmp_path):
    d = tmp_path / "swap"
    script = textwrap.dedent(
        f"""
        import sys, warnings
        sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
        warnings.simplefilter("ignore")
        import zswap
        from tests.test_faults import cfg_for
        from tests.test_runtime import TinyLM, ids, sq
        from pathlib import Path
        cfg = cfg_for(Path({str(d)!r}), "nvme", "nvme")
        with zswap.Init(cfg):
            m = TinyLM()
        engine = zswap.initialize(m, cfg)
        i = 0
        while True:
            sq(m(ids(seed=i))).backward()
            print("step", i, flush=True)
            engine.step()
            i += 1
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        seen = 0
        while seen < 3 and time.monotonic() < deadline:
            line = proc.stdout.readline().decode()
            assert line, f"the training process ended early (rc {proc.poll()})"
            seen += line.startswith("step")
        assert seen == 3
        assert os.listdir(d) == []  # unlinked swap files even while it runs
        os.kill(proc.pid, signal.SIGKILL)  # in the middle of a step, or the next
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert os.listdir(d) == []


# -- hostile config files ------------------------------------------------------------------------------------


def test_deeply_nested_config_is_a_config_error_naming_where(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('{"zero_optimization": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ConfigError, match=r"deep\.json: values nested more than 100 levels deep at line 1"):
        load_config(path)
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ConfigError, match=r"optimizer\.params\.betas .* too deeply nested"):
        load_config({"optimizer": {"type": "AdamW", "params": {"betas": deep}}})


def test_a_5000_digit_integer_is_a_config_error_naming_key_and_file(tmp_path):
    path = tmp_path / "big.json"
    path.write_text('{"zero_optimization": {"sub_group_size": ' + "9" * 5000 + "}}")
    with pytest.raises(
        ConfigError, match=r"big\.json: zero_optimization\.sub_group_size: an integer of 5000"
    ):
        load_config(path)
    path.write_text('{"train_batch_size": -' + "1" * 5000 + "}")
    with pytest.raises(ConfigError, match=r"big\.json: train_batch_size: an integer of 5000 digits"):
        load_config(path)
    with pytest.raises(
        ConfigError, match=r"sub_group_size must be at most .*an integer of about 5000 digits"
    ):
        load_config({"zero_optimization": {"sub_group_size": 10**4999}})
