"""Ctrl-C during a step: delivered when the step is whole again, never in the middle of making it live.

A KeyboardInterrupt is raised by Python's SIGINT handler between any two bytecodes of the main thread. Most
of a step is safe to interrupt: until its transaction commits, an exception aborts it and nothing changes.
Two stretches are not: the loop of a commit that makes the staged values live one name after another, and
the counters, loss scale and schedule that must move with them. An interrupt there would leave some params
stepped and others not, or the weights stepped and `global_steps` not.

`deferred` swaps the SIGINT handler for one that only notes the signal and, when the block ends, restores
the handler and delivers what arrived. Two modes, nestable (the innermost decides):

- ``critical=True``: every SIGINT waits for the block's end (used around a commit's make-live loop, which
  does no I/O, so the wait is short);
- ``critical=False`` (the step as a whole): the first SIGINT waits, so the step either finishes or aborts
  and the interrupt is raised right after it; a second one raises at once, as an impatient user expects
  from a step stuck on a slow drive — the step then aborts, which is safe outside the critical stretches.

Only the main thread receives SIGINT and only it may set handlers; elsewhere `deferred` does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

_log = logging.getLogger(__name__)

_MODES: list[bool] = []  # the active blocks' ``critical`` flags, innermost last
_PENDING: list[int] = []  # SIGINTs noted and not yet delivered
_PREVIOUS: list[Any] = []  # the handler the outermost block replaced


def _note(signum: int, frame: FrameType | None) -> None:
    _PENDING.append(signum)
    if _MODES and not _MODES[-1] and len(_PENDING) > 1:
        _PENDING.clear()
        raise KeyboardInterrupt  # the second Ctrl-C: abort the step now
    if len(_PENDING) == 1:
        _log.warning("interrupt received: the step finishes first (press Ctrl-C again to abort it)")


def _deliver(handler: Any) -> None:
    """Hand a noted SIGINT to the handler that was in place (Python's default raises KeyboardInterrupt)."""
    if callable(handler):
        handler(signal.SIGINT, None)
    elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), signal.SIGINT)  # the handler is restored: the default action takes place


@contextlib.contextmanager
def deferred(*, critical: bool = False) -> Iterator[None]:
    """Hold SIGINT back for the block (see the module docstring); deliver it when the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outermost = not _MODES
    if outermost:
        try:
            _PREVIOUS.append(signal.signal(signal.SIGINT, _note))
        except ValueError:  # not the main interpreter: signals are not ours to handle
            yield
            return
    _MODES.append(critical)
    try:
        yield
    finally:
        _MODES.pop()
        if outermost:
            previous = _PREVIOUS.pop()
            signal.signal(signal.SIGINT, previous)
            if _PENDING:
                _PENDING.clear()
                _deliver(previous)
        elif _MODES and not _MODES[-1] and len(_PENDING) > 1:
            _PENDING.clear()  # a second Ctrl-C came during a critical stretch inside a step: abort now
            raise KeyboardInterrupt
