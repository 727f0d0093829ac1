"""Checkpoint names resolved as transformers resolves them, and its weight conversions streamed per target.

transformers 5 describes how a checkpoint's tensors become a model's params with a list of transforms (the
model's ``weight_mapping``): ``WeightRenaming`` s (legacy names, ``embed_out.`` → ``lm_head.``, prefixes) and
``WeightConverter`` s, which build one param from several tensors or several params from one (the experts of
a mixture-of-experts layer saved one tensor per expert, ``save_pretrained`` writing them that way again,
and stacked into one 3-D param on load: ``MergeModulelist`` then ``Concatenate``). `resolve` walks the
checkpoint as transformers' ``convert_and_load_state_dict_in_model`` does — keys in its order
(``dot_natural_key``), renamed by its own ``rename_source_key`` (renamings, at most one converter, the
base-model prefix), each converted target's tensors collected in a deep copy of its converter, in that
order — and returns ``name -> Source`` for `zswap.weights.plan`:

- a tensor only renamed is its file entry, read by byte range as before;
- a converted target is a `ConvertedSource`: its shape and dtype come from running transformers' own
  conversion on meta tensors (nothing read); when `zswap.weights.write` first reads one of a converter's
  targets, the converter's source tensors — and only those — are read whole from their files, cast to the
  target's dtype (as transformers casts them before converting), and run through that converter's
  operations, transformers' code, so the result is bitwise what ``from_pretrained`` produces. Each rank
  then keeps its slice. The result is dropped once all of that converter's targets are written, so the
  load holds one converted target at a time (plus transformers' own temporary copies while converting:
  about twice the target), never the whole model.

Only operations that are functions of their input tensors, the config and the target params' shapes and
dtypes are run (`STREAMABLE_OPS`, transformers' own); any other (a quantizer's, one defined elsewhere) is
refused with a `ZswapError` naming it and the key, as is a conversion that fails.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ZswapError
from ..parts.params import param_state

if TYPE_CHECKING:
    from . import weights  # names in annotations only: weights imports this module (it is above it)

STREAMABLE_OPS = frozenset(
    {
        "Chunk", "Split", "Concatenate", "Interleave", "MergeModulelist", "SplitModulelist", "Transpose",
        "Conv3dToLinear", "LinearToConv3d", "PermuteForRope", "VisionFuseAndPermuteForRope",
        "VisionUnfuseAndPermuteForRope", "ErnieFuseAndSplitTextVisionExperts",
        "ErnieSplitAndDecoupleTextVisionExperts", "Inkling2LoopMergeMessageQueries", "Inkling2UnpadVocab",
        "Inkling2LoopDequantizeExperts",
    }
)  # fmt: skip
"""transformers' ``ConversionOps`` (``transformers.core_model_loading``) that zswap runs per target: each a
function of the tensors it is given, the config and the shapes/dtypes of the target params."""

_OPS_MODULE = "transformers.core_model_loading"


class ConversionError(ZswapError, RuntimeError):
    """A checkpoint needs a weight conversion zswap cannot stream, or the conversion failed."""


@dataclass
class Resolved:
    sources: dict[str, weights.Source]
    """Model name -> where its value comes from."""
    unexpected: list[str]
    """Names a converter would produce that the model does not have (transformers reports them so)."""
    used: list[Any]
    """The transforms that matched a key (transformers keeps them on the model, to reverse on save)."""


@dataclass(eq=False)
class _Group:
    """One converted target (transformers' first target key) and the checkpoint tensors it is built from."""

    first: str
    converter: Any
    """A deep copy of the model's ``WeightConverter`` (never run itself: each run deep-copies it again)."""
    dtype: torch.dtype
    config: Any
    view: _ShapeView
    inputs: list[tuple[str, str, weights.Source]] = field(default_factory=list)
    """(source pattern, checkpoint key, source), in transformers' key order."""
    pending: set[str] = field(default_factory=set)
    """Its targets that `zswap.weights.write` is still to write (a mismatched or unexpected one never is)."""
    out: dict[str, torch.Tensor] | None = None

    def run(self, meta: bool) -> dict[str, torch.Tensor]:
        conv = copy.deepcopy(self.converter)
        for pattern, key, src in self.inputs:
            conv.add_tensor(self.first, key, pattern, _loader(src, self.dtype, meta))
        try:
            out = conv.convert(
                self.first, model=self.view, config=self.config, hf_quantizer=None, loading_info=None
            )
        except Exception as e:
            keys = ", ".join(k for _, k, _ in self.inputs)
            ops = ", ".join(type(op).__name__ for op in conv.operations)
            raise ConversionError(
                f"{self.first}: transformers' weight conversion ({ops}) of {keys} failed: {e!r}"
            ) from e
        return {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}

    def result(self) -> dict[str, torch.Tensor]:
        if self.out is None:
            self.out = self.run(meta=False)
        return self.out

    def release(self, name: str) -> None:
        self.pending.discard(name)
        if not self.pending:
            self.out = None


def _loader(src: weights.Source, dtype: torch.dtype, meta: bool) -> Any:
    if meta:
        return lambda: torch.empty(src.shape, dtype=dtype, device="meta")

    def load() -> torch.Tensor:
        t = torch.empty(src.shape.numel(), dtype=src.dtype)
        src.read(0, t)
        return t.view(src.shape).to(dtype)

    return load


@dataclass(eq=False)
class ConvertedSource:
    """One target of a `_Group`, produced when first read (see the module docstring)."""

    group: _Group
    name: str
    shape: torch.Size
    dtype: torch.dtype

    def read(self, start: int, out: torch.Tensor) -> None:
        flat = self.group.result()[self.name].reshape(-1)
        out.copy_(flat[start : start + out.numel()])

    def expect(self) -> None:
        """This target is among those `zswap.weights.write` will write (called before the first is)."""
        self.group.pending.add(self.name)

    def release(self) -> None:
        """This target is written: the group's result goes once all its targets to be written are."""
        self.group.release(self.name)


class _ShapeView:
    """What conversion operations see of the model: ``get_parameter`` answers a meta tensor of the target's
    real shape and dtype (a partitioned param's own ``shape`` is empty), the rest is the model's."""

    def __init__(self, model: Any, targets: Mapping[str, weights.Target]) -> None:
        self._model, self._targets = model, targets

    def get_parameter(self, name: str) -> torch.Tensor:
        t = self._targets.get(name)
        if t is None:
            raise AttributeError(f"{type(self._model).__name__} has no parameter {name!r}")
        return torch.empty(t.shape, dtype=_dtype_of(t), device="meta")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _dtype_of(t: weights.Target) -> torch.dtype:
    st = param_state(t.tensor)
    return t.dtype or (st.dtype if st is not None else t.tensor.dtype)


def check_streamable(converter: Any, key: str) -> None:
    for op in converter.operations:
        kind = type(op)
        if kind.__module__ != _OPS_MODULE or kind.__name__ not in STREAMABLE_OPS:
            raise ConversionError(
                f"{key}: this checkpoint needs transformers' weight conversion {kind.__module__}."
                f"{kind.__name__} (in {converter!r}), which zswap cannot stream into partitions. Load it "
                "once outside zswap.Init, then either partition that model with zswap.Init(config, "
                "module=model), or save it in the model's own layout with zswap.save_weights(model, "
                "folder): that folder then loads under zswap.Init, streamed"
            )


def resolve(
    model: Any,
    sources: Mapping[str, weights.Source],
    mapping: list[Any],
    targets: dict[str, weights.Target],
) -> Resolved:
    """The model's names for ``sources`` (checkpoint name -> source) under transformers' ``mapping``."""
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = model.base_model_prefix
    view = _ShapeView(model, targets)
    out: dict[str, weights.Source] = {}
    origin: dict[str, str] = {}
    groups: dict[str, _Group] = {}
    unexpected: list[str] = []
    for key in sorted(sources, key=dot_natural_key):  # transformers' order: converters stack in it
        src = sources[key]
        new, pattern = rename_source_key(key, renamings, converters, prefix, targets)
        if new not in targets and key in targets:  # as transformers: only the prefix may change then
            new, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=targets)
        if pattern is None:
            _claim(out, origin, new, key, src)
            continue
        conv = by_pattern[pattern]
        if new not in targets:
            unexpected += [new.replace(conv.target_patterns[0], k) for k in conv.target_patterns]
            continue
        check_streamable(conv, key)
        group = groups.get(new)
        if group is None:
            group = groups[new] = _Group(
                new, copy.deepcopy(conv), _dtype_of(targets[new]), model.config, view
            )
        group.inputs.append((pattern, key, src))
    for group in groups.values():
        for name, t in group.run(meta=True).items():
            keys = ", ".join(k for _, k, _ in group.inputs)
            _claim(out, origin, name, keys, ConvertedSource(group, name, t.shape, t.dtype))
    return Resolved(out, unexpected, [m for m in mapping if m.was_used()])


def _claim(out: dict[str, weights.Source], origin: dict[str, str], name: str, key: str, src: Any) -> None:
    if name in out:
        raise ZswapError(f"checkpoint keys {origin[name]!r} and {key!r} both load into {name!r}")
    out[name] = src
    origin[name] = key


def model_mapping(model: object) -> list[Any] | None:
    """transformers' weight mapping for ``model`` when it is a transformers ``PreTrainedModel`` (what
    ``from_pretrained`` would use, without a quantizer or a user ``key_mapping``); None otherwise."""
    mu = sys.modules.get("transformers.modeling_utils")
    if mu is None or not isinstance(model, getattr(mu, "PreTrainedModel", ())):
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import dot_natural_key, rename_source_key  # noqa: F401
    except ImportError:
        return None
    return list(get_model_conversion_mapping(model))  # type: ignore[arg-type]
