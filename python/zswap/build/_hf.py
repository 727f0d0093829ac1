"""transformers' ``from_pretrained`` under `zswap.Init`: each weight read into its partition as it loads.

transformers 5 builds the model on the meta device, then hands the checkpoint to the static method
``PreTrainedModel._load_pretrained_model(model, state_dict, checkpoint_files, load_config)``, which opens
every shard and materialises each tensor on the CPU. While an Init is active that one method is replaced (on
Init's reversible patch stack, so it is back when the outermost Init exits): the replacement resolves the
checkpoint's names as transformers does (its own ``rename_source_key``: legacy renamings and the base-model
prefix) and streams each tensor through `zswap.weights.write` — this rank's byte range of the file straight
into a new, managed param — then returns the same ``LoadStateDictInfo`` transformers would (missing,
unexpected, mismatched keys), so transformers' own finishing steps run unchanged: it ties the weights
(the tied param stays one managed param), materialises and initialises the missing ones (which Init then
partitions), and reports the keys.

Names and weight conversions are resolved by `zswap._hfconv` with transformers' own functions: a tensor
only renamed streams by byte range; a target transformers builds from several tensors (the experts of
mixture-of-experts models, saved one tensor per expert and stacked on load) is converted by transformers'
own operations from just its source tensors when it is written, one target at a time.

The DeepSpeed seam (``is_deepspeed_zero3_enabled``) is not used: behind it transformers imports ``deepspeed``
itself and loads the whole state dict on rank 0 through ``GatheredParameters`` — neither streamed nor per
rank.

What cannot be streamed is refused with a `ZswapError` naming it, never loaded silently otherwise: ``.bin``
(pickle) checkpoints, quantized models, ``device_map`` / tensor-parallel meshes, conversion operations that
are not transformers' plain tensor reshuffles (`zswap._hfconv.STREAMABLE_OPS`), and any transformers whose
loading entry point is not the one described above (checked at the first Init entry after transformers is
imported).
"""

from __future__ import annotations

import inspect
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ZswapError

if TYPE_CHECKING:
    from .init import _Frame, _InitContext

_PARAMS = ["model", "state_dict", "checkpoint_files", "load_config"]


class UnsupportedTransformersError(ZswapError, RuntimeError):
    """This transformers version's ``from_pretrained`` cannot be streamed into partitions."""


def install(ctx: _InitContext) -> None:
    mod = sys.modules.get("transformers.modeling_utils")
    if mod is not None and hasattr(mod, "PreTrainedModel"):
        _patch(ctx, mod.PreTrainedModel)


def class_defined(ctx: _InitContext, cls: type) -> None:
    """``cls`` was just defined inside an active Init: patch it if it is transformers' ``PreTrainedModel``."""
    if cls.__name__ == "PreTrainedModel" and cls.__module__ == "transformers.modeling_utils":
        _patch(ctx, cls)


def unsupported_reason(pretrained: type) -> str | None:
    import transformers

    version = getattr(transformers, "__version__", "?")
    loader = pretrained.__dict__.get("_load_pretrained_model")
    why = None
    try:
        major = int(version.split(".")[0])
    except ValueError:
        major = 0
    if major < 5:
        why = "its from_pretrained loads through a different path (zswap streams the transformers 5 one)"
    elif not isinstance(loader, staticmethod):
        why = "PreTrainedModel._load_pretrained_model is not the static method zswap replaces"
    elif list(inspect.signature(loader.__func__).parameters)[:4] != _PARAMS:
        why = "PreTrainedModel._load_pretrained_model takes other arguments than (model, state_dict, " \
              "checkpoint_files, load_config)"  # fmt: skip
    else:
        try:
            from transformers.core_model_loading import (  # noqa: F401
                WeightConverter,
                WeightRenaming,
                dot_natural_key,
                rename_source_key,
            )
            from transformers.utils.loading_report import LoadStateDictInfo  # noqa: F401
        except ImportError as e:
            why = f"a loading helper zswap uses is missing ({e})"
    if why is None:
        return None
    return (
        f"transformers {version} is not supported by zswap.Init's from_pretrained: {why}. Build the model "
        "under zswap.Init and load with zswap.load_weights(model, checkpoint), or load it outside Init and "
        "partition it with zswap.Init(config, module=model)"
    )


def _patch(ctx: _InitContext, pretrained: type) -> None:
    if getattr(pretrained.__dict__.get("from_pretrained"), "__zswap__", False) or getattr(
        pretrained.__dict__.get("_load_pretrained_model"), "__zswap__", False
    ):
        return
    reason = unsupported_reason(pretrained)
    if reason is not None:
        plain = pretrained.__dict__["from_pretrained"]

        def refuse(cls: Any, *args: Any, **kwargs: Any) -> Any:
            if ctx.active:
                raise UnsupportedTransformersError(reason)
            return plain.__func__(cls, *args, **kwargs)

        refuse.__zswap__ = True  # type: ignore[attr-defined]
        ctx.patches.set(pretrained, "from_pretrained", classmethod(refuse))
        return
    plain_from = pretrained.__dict__["from_pretrained"].__func__

    def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
        ahead = _prime(ctx, args[0] if args else kwargs.get("pretrained_model_name_or_path"), kwargs)
        try:
            return plain_from(cls, *args, **kwargs)
        finally:
            if ahead is not None:
                ahead.close()

    from_pretrained.__zswap__ = True  # type: ignore[attr-defined]
    ctx.patches.set(pretrained, "from_pretrained", classmethod(from_pretrained))
    original = pretrained.__dict__["_load_pretrained_model"].__func__

    def _load_pretrained_model(
        model: Any, state_dict: Any, checkpoint_files: Any, load_config: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if not ctx.active:
            return original(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
        return load_into_partitions(ctx, model, state_dict, checkpoint_files, load_config)

    _load_pretrained_model.__zswap__ = True  # type: ignore[attr-defined]
    ctx.patches.set(pretrained, "_load_pretrained_model", staticmethod(_load_pretrained_model))
    if "_adjust_bias" in pretrained.__dict__:  # tie_weights inside from_pretrained, on partitioned params
        from .module_api import adjust_bias

        plain_adjust = pretrained.__dict__["_adjust_bias"]

        def _adjust_bias(self: Any, output_embeddings: Any, input_embeddings: Any) -> None:
            adjust_bias(self, output_embeddings, input_embeddings, plain=plain_adjust)

        _adjust_bias.__zswap__ = True  # type: ignore[attr-defined]
        ctx.patches.set(pretrained, "_adjust_bias", _adjust_bias)


def _prime(ctx: _InitContext, name_or_path: Any, kwargs: dict[str, Any]) -> Any:
    """Starts reading this rank's bytes of a local safetensors checkpoint as ``from_pretrained`` begins.

    Before the first weight is read transformers loads the config, builds the model on the meta device and
    compiles its weight-renaming tables: about a second of CPU work in which the disk idles. A `Readahead`
    over the checkpoint's tensors in file order (this rank's slice of each, as the load will read them) fills
    the page cache meanwhile, a window's worth; the load's own readahead takes over from there. Only the
    files transformers itself picks in a local folder (``model.safetensors``, else the sharded index); a
    hub id, a variant, a subfolder it must download, or anything unreadable is left to transformers (the
    prime is a hint: it never changes what is loaded). Returns the readahead to close, or None."""
    from pathlib import Path

    from .. import _stfile
    from ..parts.params import partition_numel

    if not ctx.active or not ctx.frames or kwargs.get("variant") or kwargs.get("gguf_file"):
        return None
    try:
        folder = Path(name_or_path) / (kwargs.get("subfolder") or "")
        single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
        if single.is_file():
            entries = _stfile.resolve(single)
        elif index.is_file():
            entries = _stfile.resolve(index)
        else:
            return None
    except (TypeError, OSError, ZswapError):
        return None
    where = ctx.frames[-1].build_placement
    ranges = []
    for e in sorted(entries.values(), key=lambda e: (e.path, e.offset)):
        part = partition_numel(e.numel, where.world_size)
        ranges.append(e.span(where.rank * part, (where.rank + 1) * part))
    return _stfile.Readahead(ranges)


def load_into_partitions(
    ctx: _InitContext, model: Any, state_dict: Any, checkpoint_files: Any, load_config: Any
) -> tuple[Any, None]:
    from transformers.utils.loading_report import LoadStateDictInfo

    from .. import _stfile
    from ..io import _hfconv, weights

    for what, value in (
        ("a quantization config", load_config.hf_quantizer),
        ("device_map", load_config.device_map),
        ("a device mesh (tensor parallelism)", getattr(load_config, "device_mesh", None)),
    ):
        if value is not None:
            raise ZswapError(
                f"from_pretrained under zswap.Init cannot load with {what}: zswap places the params"
            )
    sources: dict[str, weights.Source]
    if state_dict is not None:
        sources = {k: weights.TensorSource(v) for k, v in state_dict.items()}
    elif checkpoint_files and all(str(f).endswith(".safetensors") for f in checkpoint_files):
        sources = {
            k: weights.FileSource(e) for k, e in _stfile.merge([str(f) for f in checkpoint_files]).items()
        }
    else:
        raise ZswapError(
            f"from_pretrained under zswap.Init reads safetensors checkpoints only, by byte range; "
            f"{checkpoint_files} cannot be (pickle must be loaded whole): convert it once with "
            "save_pretrained outside Init"
        )
    targets = weights.targets(model)
    _apply_dtype_plan(targets, load_config)  # before resolving: converted tensors are cast to these dtypes
    resolved = _hfconv.resolve(model, sources, list(load_config.weight_mapping or []), targets)
    plan = weights.plan(targets, resolved.sources)
    frame = ctx.frames[-1]
    _cast_on_load(plan, frame.placement.dtype, ctx.lineage)
    weights.check_optimizer(plan.items)
    weights.write(plan.items, frame.build_placement, _frame_hook(frame))
    for target, _, _ in plan.items:
        target.tensor._is_hf_initialized = True  # type: ignore[attr-defined]  # transformers: no re-init
    model._weight_conversions = resolved.used
    info = LoadStateDictInfo(
        missing_keys=set(plan.missing),
        unexpected_keys={*plan.unexpected, *resolved.unexpected},
        mismatched_keys={(k, tuple(a), tuple(b)) for k, a, b in plan.mismatched},  # type: ignore[misc]
        conversion_errors={},
        error_msgs=[],
        skipped_pp_keys=set(),
    )
    return info, None


_EXACT = {
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
    (torch.float64, torch.float64), (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
    (torch.bfloat16, torch.float64), (torch.float16, torch.float64), (torch.float32, torch.float64),
}  # fmt: skip
"""(file dtype, model dtype) pairs where loading changes no value: casting the file's tensor straight to the
Init's dtype then gives the bits of load-then-cast."""


def _cast_on_load(plan: Any, dtype: torch.dtype | None, lineage: Any) -> None:
    """Under ``Init(dtype=…)``, load a param straight into that dtype where that is bitwise load-then-cast,
    so the cast at Init's exit (a read and a write of every param) has nothing left to do for it; and load
    a buffer a build with that default dtype would have made in it (`_lineage`) in it, as transformers'
    ``from_pretrained(dtype=…)`` and DeepSpeed's loader (copying into its bf16 buffer) do — where
    transformers' own dtype plan leaves a buffer's open."""
    if dtype is None:
        return
    for target, _, src in plan.items:
        t = target.tensor
        if not t.is_floating_point():
            continue
        if target.slots[0][2]:  # a param (a tensor is a param or a buffer in every slot it has)
            if t.device.type == "meta" and (src.dtype, target.dtype or t.dtype) in _EXACT:
                target.dtype = dtype
        elif target.dtype is None and t in lineage:
            target.dtype = dtype


def _apply_dtype_plan(targets: dict[str, Any], load_config: Any) -> None:
    """transformers' ``keep_in_fp32`` plan: matching meta params are loaded in the plan's dtype."""
    dtype_plan = getattr(load_config, "dtype_plan", None) or {}
    if not dtype_plan:
        return
    from transformers.core_model_loading import build_glob_alternation

    alt, by_group, _ = build_glob_alternation(list(dtype_plan))
    for key, target in targets.items():
        m = alt.search(key)
        if m is not None and target.tensor.is_floating_point():
            target.dtype = dtype_plan[by_group[str(m.lastgroup)]]


def _frame_hook(frame: _Frame) -> Callable[[torch.Tensor], None]:
    """``on_new`` for `zswap.weights.write` under an Init frame: the frame casts what it created at its
    exit."""
    return lambda p: frame.created.append(weakref.ref(p))
