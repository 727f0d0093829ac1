"""The small state of a checkpoint (``state.pt``): RNG streams, scheduler, loss scaler, optimizer settings,
client_state. Written with `torch.save` in a form ``torch.load(weights_only=True)`` reads back (tensors and
plain containers only: numpy's RNG key is stored as a tensor), and checked whole — every RNG state tried
on a scratch generator — before a load writes anything."""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any, NoReturn, cast

import torch

from .errors import CheckpointCorruptError


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "cuda": None,
        "numpy": None,
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch here
        pass
    else:
        kind, keys, pos, has_gauss, gauss = cast(tuple[str, Any, int, int, float], np.random.get_state())
        state["numpy"] = (
            kind,
            torch.from_numpy(keys.astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(gauss),
        )
    return state


def _numpy_state(saved: Any) -> Any:
    import numpy as np

    kind, keys, pos, has_gauss, gauss = saved
    return kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss


def set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if rng.get("numpy") is not None:
        import numpy as np

        np.random.set_state(_numpy_state(rng["numpy"]))


def unpickle(data: bytes, path: Path) -> Any:
    """``state.pt``'s content (``data``, its checksum verified) through ``torch.load(weights_only=True)``:
    tensors and plain containers only, so no pickle can run code; a refusal names the file."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # the restricted unpickler refuses any global it does not allow
        lines = str(e).strip().splitlines()
        raise CheckpointCorruptError(
            f"{path}: refused by torch.load(weights_only=True) ({type(e).__name__}: "
            f"{lines[-1] if lines else ''}): it holds objects other than tensors and plain containers"
        ) from None


def _refuse(path: Path, why: str) -> NoReturn:
    raise CheckpointCorruptError(f"{path}: {why}")


NO_NEEDS: dict[str, Any] = {"rng": False, "optimizer": None}
"""What `check_state` checks of a state an export only vets (its RNG and optimizer are not restored)."""


def check_state(state: Any, path: Path, needs: dict[str, Any]) -> dict[str, Any]:
    """``state`` if it holds what a load uses (``needs``: whether its RNG streams are restored, and the
    optimizer's kind and group count or None), else `CheckpointCorruptError` naming the field."""
    if not isinstance(state, dict):
        _refuse(path, f"holds a {type(state).__name__}, not a dict")
    for key in ("lr_scheduler", "loss_scaler"):
        if not isinstance(state.get(key, ...), dict | None):
            _refuse(path, f"field {key!r} is {type(state.get(key, ...)).__name__}, not a state_dict or None")
    if "client_state" not in state:
        _refuse(path, "field 'client_state' is missing")
    if needs["rng"]:
        _check_rng(state.get("rng"), path)
    if needs["optimizer"] is not None:
        kind, groups = needs["optimizer"]
        opt = state.get("optimizer")
        if not isinstance(opt, dict):
            _refuse(path, f"field 'optimizer' is {type(opt).__name__}, not a dict")
        pg = opt.get("param_groups")
        if not isinstance(pg, list) or len(pg) != groups or not all(isinstance(g, dict) for g in pg):
            _refuse(path, f"field 'optimizer'.'param_groups' is not a list of {groups} dicts")
        if kind == "zswap":
            skipped = opt.get("skipped_steps")
            if type(skipped) is not int or skipped < 0:
                _refuse(path, f"field 'optimizer'.'skipped_steps' is {skipped!r}, not a non-negative integer")
        elif not isinstance(opt.get("state"), dict):
            _refuse(path, "field 'optimizer'.'state' is not a dict")
    return state


def _check_rng(rng: Any, path: Path) -> None:
    if not isinstance(rng, dict):
        _refuse(path, "field 'rng' is not a dict")
    try:
        torch.Generator().set_state(rng["torch"])
        random.Random().setstate(rng["python"])
        if rng.get("numpy") is not None:
            import numpy as np

            np.random.RandomState().set_state(_numpy_state(rng["numpy"]))
        cuda = rng.get("cuda")
        if cuda is not None and not (
            isinstance(cuda, list) and all(isinstance(t, torch.Tensor) for t in cuda)
        ):
            raise TypeError("'cuda' is not a list of tensors")
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        _refuse(path, f"field 'rng' is not an RNG state this machine restores ({type(e).__name__}: {e})")
