"""Interrupts are faults like any other: a KeyboardInterrupt raised at any point where zswap waits for I/O
(injected through `zswap.storage`'s await hook, not by timing) leaves the write queue and the engine usable —
the next backward and step run, nothing spins — and a storage transaction all or nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from zswap import storage
from zswap.store import queue

from .test_checkpoint import build, cfg, train


@contextmanager
def no_hang(seconds: int = 120) -> Iterator[None]:
    def fail(*_: Any) -> None:
        raise TimeoutError("hung (a spin or a wait that never returns)")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@contextmanager
def hook(fn: Any) -> Iterator[None]:
    queue._AWAIT_HOOK.append(fn)
    try:
        yield
    finally:
        queue._AWAIT_HOOK.remove(fn)


class _Handle:
    """A write that lands when waited for; the first ``interrupts`` waits are interrupted."""

    def __init__(self, interrupts: int = 0) -> None:
        self.interrupts = interrupts
        self.waits = 0

    def done(self) -> bool:
        return False

    def wait(self) -> None:
        self.waits += 1
        if self.interrupts:
            self.interrupts -= 1
            raise KeyboardInterrupt


def _write(q: storage.WriteQueue, handle: _Handle, landed: list[str], name: str) -> storage._Write:
    return storage._Write(handle, 10, f"x/{name}@1", name, lambda w: landed.append(w.name), q)


def test_a_write_interrupted_while_settling_is_waited_for_again_not_spun_on():
    q = storage.WriteQueue(limit=0)
    landed: list[str] = []
    first = _Handle(interrupts=1)
    q.push(_write(q, first, landed, "a"))
    with pytest.raises(KeyboardInterrupt):
        q.push(_write(q, _Handle(), landed, "b"))  # over the limit: waits for "a", interrupted
    with no_hang(10):
        q.push(_write(q, _Handle(), landed, "c"))  # waits for "a" again (it spun forever here before)
        q.drain()
    assert landed == ["a", "b", "c"] and first.waits == 2 and q.queued == 0


@pytest.mark.parametrize("where", ["write", "commit"])
def test_an_interrupted_commit_leaves_every_name_on_its_old_value(tmp_path, where):
    st = storage.open_dir(tmp_path)
    ns = st.namespace("p")
    old, new = torch.arange(1024.0), torch.zeros(1024)
    ns.put("a", old)
    ns.wait()

    fired: list[str] = []

    def interrupt(at: str) -> None:  # once, as a Ctrl-C
        if at == where and not fired:
            fired.append(at)
            raise KeyboardInterrupt

    with no_hang(30), pytest.raises(KeyboardInterrupt), hook(interrupt), storage.step_transaction() as txn:
        txn.put(ns, "a", new)
    out = torch.empty(1024)
    ns.read("a", out).wait()
    assert torch.equal(out, old)
    with storage.step_transaction() as txn:  # and the next one commits
        txn.put(ns, "a", new)
    ns.read("a", out).wait()
    assert torch.equal(out, new)
    ns.close()


def _count_points(config: dict[str, Any]) -> int:
    seen: list[str] = []
    m, engine = build(config)
    with engine, hook(seen.append):
        train(m, engine, 1)
    return len(seen)


def every_point(tmp: str) -> None:
    """Interrupt one training step at each of its await points in turn; each time the next backward and
    step must run. Run in a child process: a spin would not return to the alarm's handler."""
    config = cfg(Path(tmp), "nvme", "nvme")
    points = _count_points(config)
    assert points > 0
    for n in range(points):
        calls = [0]

        def interrupt(_: str, n: int = n, calls: list[int] = calls) -> None:
            calls[0] += 1
            if calls[0] == n + 1:
                raise KeyboardInterrupt

        m, engine = build(config)
        with engine:
            with hook(interrupt), pytest.raises(KeyboardInterrupt):
                train(m, engine, 1)
            engine.zero_grad()
            train(m, engine, 2)  # the next backward and step run
    print(f"interrupted at each of {points} await points")
    _step_is_all_or_nothing(config)


def _snapshot(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def _step_is_all_or_nothing(config: dict[str, Any]) -> None:
    """An interrupt at any await point of ``engine.step()`` leaves the weights and ``global_steps`` both as
    before the step or both as after it."""
    n, outcomes = 0, set()
    while True:
        calls = [0]

        def interrupt(_: str, n: int = n, calls: list[int] = calls) -> None:
            calls[0] += 1
            if calls[0] == n + 1:
                raise KeyboardInterrupt

        m, engine = build(config)
        with engine:
            train(m, engine, 1)
            x = torch.randn(4, 12, generator=torch.Generator().manual_seed(5))
            m(x).square().mean().backward()
            before, steps = _snapshot(m), engine.global_steps
            interrupted = False
            with hook(interrupt):
                try:
                    engine.step()
                except KeyboardInterrupt:
                    interrupted = True
            after = _snapshot(m)
            changed = [k for k in before if not torch.equal(before[k], after[k])]
            moved = engine.global_steps - steps
            assert (not changed and moved == 0) or (len(changed) == len(before) and moved == 1), (
                f"torn step at await point {n}: {len(changed)} of {len(before)} weights changed, "
                f"global_steps moved by {moved}"
            )
            outcomes.add(moved)
            engine.zero_grad()
            train(m, engine, 1)
        if not interrupted:
            break
        n += 1
    print(f"step interrupted at each of {n} await points: outcomes {sorted(outcomes)}")


def test_keyboard_interrupt_at_every_await_point_of_a_step_leaves_the_engine_usable(tmp_path):
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "python"), str(root)])}
    code = f"from tests.test_interrupts import every_point; every_point({str(tmp_path)!r})"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a step after an interrupt hung (the write queue spun, or a wait never returned)")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "interrupted at each of" in done.stdout and "step interrupted at each of" in done.stdout


# -- real SIGINTs (os.kill to this process: Python raises KeyboardInterrupt between two bytecodes) ----------


def _sigint() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def test_a_ctrl_c_while_a_commit_makes_its_names_live_is_raised_after_all_of_them(tmp_path, monkeypatch):
    from zswap.store.namespaces import Namespace

    st = storage.open_dir(tmp_path)
    ns = st.namespace("p")
    names = ["a", "b", "c"]
    for name in names:
        ns.put(name, torch.zeros(256))
    ns.wait()
    replace = Namespace.replace
    sent: list[str] = []

    def replace_then_interrupt(self: Namespace, name: str, physical: str) -> None:
        replace(self, name, physical)
        if not sent:  # Ctrl-C right after the first name went live
            sent.append(name)
            _sigint()

    monkeypatch.setattr(Namespace, "replace", replace_then_interrupt)
    with no_hang(30), pytest.raises(KeyboardInterrupt), storage.step_transaction() as txn:
        for name in names:
            txn.put(ns, name, torch.ones(256))
    monkeypatch.undo()
    assert sent and txn.state == "committed"
    out = torch.empty(256)
    for name in names:  # all of them live, not only the first
        ns.read(name, out).wait()
        assert torch.equal(out, torch.ones(256)), name
    ns.close()


def _step_with(config: dict[str, Any], on_point: Any) -> tuple[int, int, bool]:
    """One step with ``on_point`` as the await hook: (global_steps moved by, how many weights changed (of
    the model's 6), interrupted); then the engine must step on."""
    m, engine = build(config)
    with engine:
        train(m, engine, 1)
        x = torch.randn(4, 12, generator=torch.Generator().manual_seed(5))
        m(x).square().mean().backward()
        before, steps = _snapshot(m), engine.global_steps
        interrupted = False
        with no_hang(60), hook(on_point):
            try:
                engine.step()
            except KeyboardInterrupt:
                interrupted = True
        after = _snapshot(m)
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        moved = engine.global_steps - steps
        engine.zero_grad()
        train(m, engine, 1)  # and the engine steps on
        assert len(before) == 6
        return moved, len(changed), interrupted


@pytest.mark.parametrize("early", [True, False], ids=["early-step", "ordinary-step"])
def test_one_ctrl_c_during_a_step_lets_it_finish_then_raises(tmp_path, early):
    config = cfg(tmp_path, "nvme", "nvme")
    sent: list[str] = []

    def interrupt_once(at: str) -> None:
        if not sent:
            sent.append(at)
            _sigint()

    if not early:
        config = {**config, "gradient_clipping": 1e-6}  # clipping that bites: the ordinary step
    moved, changed, interrupted = _step_with(config, interrupt_once)
    assert sent and interrupted
    assert (moved, changed) == (1, 6)  # the whole step, then the interrupt


def test_a_second_ctrl_c_aborts_the_step_and_changes_nothing(tmp_path):
    config = {**cfg(tmp_path, "nvme", "nvme"), "gradient_clipping": 1e-6}
    sent: list[str] = []

    def interrupt_twice(at: str) -> None:
        if not sent:
            sent.append(at)
            _sigint()
            _sigint()  # impatient: the step aborts at once

    moved, changed, interrupted = _step_with(config, interrupt_twice)
    assert sent and interrupted
    assert (moved, changed) == (0, 0)


def test_a_ctrl_c_while_a_checkpoint_loads_is_raised_once_it_is_whole(tmp_path, monkeypatch):
    """Params, optimizer state and counters are written one after another; a Ctrl-C between two of them
    left a mix of the checkpoint and the run it was loaded into (params loaded, moments and global_steps
    not), and training went on from it."""
    from zswap.checkpoint import load

    from .test_checkpoint import same, snapshot

    config = cfg(tmp_path, "nvme", "nvme")
    m, engine = build(config)
    with engine:
        train(m, engine, 2)
        engine.save_checkpoint(tmp_path / "ck", tag="a")
        want = snapshot(m, engine)
        train(m, engine, 2)
        assert not same(snapshot(m, engine), want)
        params = load._Plan._load_params

        def params_then_interrupt(self: Any) -> None:
            params(self)
            _sigint()  # after the params, before the optimizer state and the counters

        monkeypatch.setattr(load._Plan, "_load_params", params_then_interrupt)
        with no_hang(60), pytest.raises(KeyboardInterrupt):
            engine.load_checkpoint(tmp_path / "ck", tag="a")
        monkeypatch.undo()
        assert same(snapshot(m, engine), want)
        train(m, engine, 1)  # and the engine steps on
