"""transformers' weight conversions reversed as ``save_pretrained`` reverses them, one group at a time.

transformers 5 loads some checkpoints through conversions (a mixture-of-experts layer's experts, saved one
tensor per expert, stacked into one 3-D param) and ``save_pretrained`` reverses them
(``revert_weight_conversion``, over the whole state dict at once), so that it writes the layout the hub,
transformers 4 and other readers know. `plan` finds that result without reading a value: the reversal run
on meta tensors for the whole model, then per group — a key alone where its result is its own part of the
whole one (a stacked experts tensor splits into its experts' tensors; a renamed key is renamed), else
with the other such keys of its numbered block (``model.layers.3.``: a reversal that joins tensors) — and
it checks that the groups' results make up the whole one exactly. `Reversal.run` then runs one group's
reversal on real tensors, transformers' own code, so the files hold bitwise what ``save_pretrained``
writes while memory holds one group. Where the groups do not make up the whole (a reversal joining
tensors of different blocks) or the reversal fails, the model's own keys are kept (transformers 5 loads
them as they are) and a warning says why.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Shapes = dict[str, tuple[torch.dtype, tuple[int, ...]]]

_BLOCK = re.compile(r"^(.*?\.\d+)\.")
"""The first numbered prefix of a key (``model.layers.3.``): the keys a joining reversal may need."""


@dataclass(frozen=True)
class Output:
    """One tensor the reversed layout holds: its key, dtype and shape, and the `Reversal.groups` index
    whose reversal makes it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    group: int


@dataclass(frozen=True)
class Reversal:
    groups: list[list[str]]
    """The model's keys, grouped: each group's reversal needs those keys' values only."""
    outputs: list[Output]
    """The tensors to write, group by group (groups in the order of their first key)."""
    _run: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]

    def run(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The reversed tensors of one group, from the values of its keys (``{key: full value}``)."""
        return self._run(values)


def plan(model: object, tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> Reversal | None:
    """How ``save_pretrained`` would write ``tensors`` (``(key, dtype, shape)`` of each tensor saved, in
    order) of ``model``: None where it writes them as they are (no conversion to reverse; not a
    transformers model) or where no streamed reversal gives its result (a warning says why)."""
    revert = _reverter(model)
    if revert is None:
        return None
    meta = {k: torch.empty(shape, dtype=dt, device="meta") for k, dt, shape in tensors}
    try:
        whole = _shapes(revert(dict(meta)))
    except Exception as e:  # save_pretrained would fail alike; the model's own layout loads
        _kept(model, f"transformers' reversal failed ({type(e).__name__}: {e})")
        return None
    if whole == _shapes(meta):
        return None  # nothing to reverse
    first: dict[str, int] = {}  # group id by its first key, in key order
    members: list[list[str]] = []
    results: dict[int, Shapes] = {}  # a key's own result, where it is its group
    for k in meta:
        alone = _try_shapes(revert, {k: meta[k]})
        gid = f"key:{k}" if alone is not None and _part_of(alone, whole) else f"block:{_block(k)}"
        if gid not in first:
            first[gid] = len(members)
            members.append([])
            if alone is not None and gid.startswith("key:"):
                results[first[gid]] = alone
        members[first[gid]].append(k)
    outputs: list[Output] = []
    seen: Shapes = {}
    for i, keys in enumerate(members):
        got = results.get(i) or _try_shapes(revert, {k: meta[k] for k in keys})
        if got is None or not _part_of(got, whole) or seen.keys() & got.keys():
            _kept(model, f"the reversal of {keys[0]!r} needs tensors outside its block")
            return None
        seen.update(got)
        outputs += [Output(name, dt, shape, i) for name, (dt, shape) in got.items()]
    if seen != whole:
        _kept(model, "the reversal per block does not make up the whole model's")
        return None
    return Reversal(members, outputs, revert)


def _reverter(model: object) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None:
    mu = sys.modules.get("transformers.modeling_utils")
    if mu is None or not isinstance(model, getattr(mu, "PreTrainedModel", ())):
        return None
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: no conversions
        return None
    return lambda sd: revert_weight_conversion(model, sd)  # type: ignore[arg-type]


def _shapes(sd: dict[str, torch.Tensor]) -> Shapes:
    return {k: (t.dtype, tuple(t.shape)) for k, t in sd.items()}


def _try_shapes(
    revert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]], sd: dict
) -> Shapes | None:
    try:
        return _shapes(revert(sd))
    except Exception:  # a part that cannot be reversed alone goes with its block
        return None


def _part_of(part: Shapes, whole: Shapes) -> bool:
    return all(whole.get(k) == v for k, v in part.items())


def _block(key: str) -> str:
    m = _BLOCK.match(key)
    return m.group(1) if m else ""


def _kept(model: object, why: str) -> None:
    logging.getLogger(__name__).warning(
        "%s: weights saved under the model's own keys, which transformers 5 loads as they are, not in the "
        "layout save_pretrained writes: %s",
        type(model).__name__,
        why,
    )


class Values:
    """The value of each tensor to write, by name, in the order a writer asks for them: ``read(key)`` gives
    a model key's full value; with a `Reversal`, a group's keys are read and reversed when the first of
    its outputs is asked for, and its outputs held until asked for (a shard boundary in between keeps
    them; a group asked for again, after another, is read again)."""

    def __init__(self, reversal: Reversal | None, read: Callable[[str], torch.Tensor]) -> None:
        self._reversal = reversal
        self._read = read
        self._group_of = {o.name: o.group for o in reversal.outputs} if reversal is not None else {}
        self._group = -1
        self._held: dict[str, torch.Tensor] = {}

    def __call__(self, name: str) -> torch.Tensor:
        if self._reversal is None:
            return self._read(name)
        group = self._group_of[name]
        if group != self._group or name not in self._held:
            self._held = {}  # the last group's results go before this one's are made
            self._held = self._reversal.run({k: self._read(k) for k in self._reversal.groups[group]})
            self._group = group
        return self._held.pop(name)


def meta_model(config: bytes) -> object | None:
    """The transformers model a checkpoint's ``config.json`` (its bytes) names in ``architectures``, built
    on the meta device (nothing allocated) for its weight conversions; None where transformers is not
    installed or has no such class."""
    try:
        import transformers
    except ImportError:
        return None
    try:
        cfg = json.loads(config)
        named = (cfg.get("architectures") or [None])[0] if isinstance(cfg, dict) else None
        cls = getattr(transformers, named, None) if isinstance(named, str) else None
        mu = sys.modules.get("transformers.modeling_utils")
        if not (isinstance(cls, type) and mu is not None and issubclass(cls, mu.PreTrainedModel)):
            return None
        with torch.device("meta"):
            return cls(cls.config_class.from_dict(cfg))  # type: ignore[attr-defined]
    except Exception as e:  # a config this transformers cannot build: the model's own keys, as saved
        logging.getLogger(__name__).warning(
            "config.json's model could not be built to reverse its weight conversions (%s: %s); the "
            "weights keep the model's own keys, which transformers 5 loads as they are",
            type(e).__name__,
            e,
        )
        return None
