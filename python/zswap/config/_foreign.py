"""DeepSpeed's top-level features outside the sections zswap reads, checked where a config switches them on.

A DeepSpeed config may switch on features that change what training computes: progressive layer drop and the
legacy curriculum (extra arguments to the model's forward), data efficiency, quantized or compressed training,
elastic batch sizes, tensor or sequence parallelism, apex AMP, gradient pre-scaling. zswap implements none of
them, and running on as if they were off would train something other than the config says: each one switched
on is a `ConfigError` naming the key, why, and what to do. Sections that feed DeepSpeed's monitors and tools
(TensorBoard, W&B, the flops profiler, autotuning …) change no result: each one switched on is named in the
loader's "ignored" warning, as are ``activation_checkpointing``'s extras (read by
`zswap.deepspeed.checkpointing.configure`, which refuses them). The rest outside zswap's sections
(``steps_per_print``, ``zero_allow_untested_optimizer``, a ``pipeline`` section, which acts only on
DeepSpeed's pipeline modules …) is never looked at. "Switched on" follows DeepSpeed's parsing: an
``enabled`` key (default false), a size above 1, a value off its default.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pydantic_core import PydanticCustomError

from ..errors import ConfigError
from . import _values as v

_DATA = "zswap trains on the batches it is given, as they are; shape them in your data loader"

REFUSED_WHEN_ENABLED: dict[str, str] = {
    "amp": "apex AMP does not combine with ZeRO (DeepSpeed refuses it too); use the bf16 or fp16 section, "
    "or torch_autocast",
    "progressive_layer_drop": "zswap passes no progressive-layer-drop schedule to the model's forward",
    "curriculum_learning": _DATA,
    "quantize_training": "zswap trains unquantized weights",
    "elasticity": "zswap takes the batch sizes as given; set train_batch_size and "
    "train_micro_batch_size_per_gpu",
    "hybrid_engine": "zswap has no hybrid inference engine; generate inside "
    "zswap.deepspeed.zero.unwrap_model_for_generation (or zswap.GatheredParameters)",
    "eigenvalue": "zswap computes no Hessian eigenvalues (they drive DeepSpeed's quantize_training)",
    "expert_parallel": "zswap partitions every param over all ranks and runs every expert of a "
    "mixture-of-experts layer on each rank (no expert parallelism); mark such a layer a leaf module",
}
"""Sections with an ``enabled`` key that change results when true → why zswap refuses them."""

MONITORS = (
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "comms_logger",
    "flops_profiler",
    "autotuning",
    "nebula",
)
"""Sections with an ``enabled`` key that only feed DeepSpeed's monitors, profilers and tools."""

MONITOR_SWITCHES = ("wall_clock_breakdown", "memory_breakdown", "sparse_gradients", "graph_harvesting")
"""Top-level booleans of DeepSpeed's machinery (timers, sparse all-reduce, CUDA graphs): same results."""

CHECKPOINTING_SWITCHES = (
    "partition_activations",
    "contiguous_memory_optimization",
    "cpu_checkpointing",
    "synchronize_checkpoint_boundary",
    "profile",
)
"""``activation_checkpointing``'s extras: read by ``deepspeed.checkpointing.configure`` alone (which
`zswap.deepspeed.checkpointing.configure` and the Lightning strategy refuse); the loader names those on."""

_AVERAGING = "zswap averages the ranks' gradients over the world size"


def check(raw: Mapping[Any, Any]) -> list[str]:
    """`ConfigError` for the first DeepSpeed feature switched on in ``raw`` that changes results and that
    zswap does not implement; else the dotted keys of monitoring features switched on, for the warning."""
    for key, why in REFUSED_WHEN_ENABLED.items():
        if _enabled(raw.get(key)):
            _refuse(f"{key}.enabled", why)
    for path in _switches(raw.get("compression_training"), "compression_training"):
        _refuse(path, "zswap does not quantize, prune or shrink the model while training")
    efficiency = raw.get("data_efficiency")
    if isinstance(efficiency, Mapping) and _enabled(efficiency):  # on where a part is (each has a switch)
        for part in ("data_sampling", "data_routing"):
            for path in _switches(efficiency.get(part), f"data_efficiency.{part}"):
                _refuse(path, _DATA)
    quantization = raw.get("weight_quantization")
    if isinstance(quantization, Mapping):
        for sub in ("quantized_initialization", "post_init_quant"):
            if quantization.get(sub) is not None:
                _refuse(f"weight_quantization.{sub}", "zswap keeps every weight in its own dtype")
    parallel = raw.get("tensor_parallel")
    if isinstance(parallel, Mapping):
        tp = parallel.get("tp")
        for path, size in (
            ("tensor_parallel.autotp_size", parallel.get("autotp_size")),
            ("tensor_parallel.tp.tp_size", tp.get("tp_size") if isinstance(tp, Mapping) else None),
        ):
            _at_most_one(
                path,
                size,
                "zswap partitions every param over all ranks (ZeRO stage 3) and does no tensor parallelism",
            )
    _at_most_one(
        "sequence_parallel_size", raw.get("sequence_parallel_size"), "zswap gives each rank whole sequences"
    )
    if _enabled(raw.get("prescale_gradients")):
        _refuse("prescale_gradients", _AVERAGING)
    factor = raw.get("gradient_predivide_factor")
    if factor is not None and not (isinstance(factor, int | float) and factor == 1.0):
        _refuse("gradient_predivide_factor", f"{_AVERAGING}; it may only be 1.0")
    _check_allreduce_op(raw.get("gradient_allreduce_op"))
    checkpoint = raw.get("checkpoint")
    _check_tag_validation(checkpoint.get("tag_validation") if isinstance(checkpoint, Mapping) else None)
    warned = [f"{key}.enabled" for key in MONITORS if _enabled(raw.get(key))]
    warned += [key for key in MONITOR_SWITCHES if _enabled(raw.get(key))]
    section = raw.get("activation_checkpointing")
    if isinstance(section, Mapping):
        warned += [
            f"activation_checkpointing.{k}" for k in CHECKPOINTING_SWITCHES if _enabled(section.get(k))
        ]
    compile_section = raw.get("compile")
    if isinstance(compile_section, Mapping) and _enabled(compile_section.get("deepcompile")):
        warned.append("compile.deepcompile")
    return warned


def check_param_dtype(given: Any, params: str | None) -> None:
    """``data_types.param_dtype`` (``given``) must name the params' dtype the bf16 / fp16 sections fix,
    ``params`` (``None`` where they leave it open), as DeepSpeed asserts; "auto" is not set."""
    if given is None or (isinstance(given, str) and given.strip().lower() == "auto"):
        return
    try:
        named = v.to_dtype_name(given)
    except PydanticCustomError as exc:
        raise ConfigError(f"data_types.param_dtype {exc.message()}, got {v.show(given)}") from None
    if named != params:
        where = f"they make the params {params}" if params else "they leave the params' dtype open"
        raise ConfigError(
            f"data_types.param_dtype is {named!r} but the bf16 / fp16 sections decide the params' dtype "
            f"({where}): switch on the matching section, or drop data_types.param_dtype"
        )


def _enabled(section_or_flag: Any) -> bool:
    """Whether DeepSpeed reads this as switched on: ``true`` itself, or a section whose ``enabled`` is."""
    flag = section_or_flag.get("enabled") if isinstance(section_or_flag, Mapping) else section_or_flag
    if isinstance(flag, str):
        return flag.strip().lower() == "true"
    return flag is True or (type(flag) is int and flag == 1)


def _switches(section: Any, where: str) -> Iterator[str]:
    """The dotted ``…enabled`` keys switched on anywhere inside ``section`` (DeepSpeed's compression
    techniques each nest theirs under ``shared_parameters``)."""
    if not isinstance(section, Mapping):
        return
    for key, value in section.items():
        if key == "enabled" and _enabled(value):
            yield f"{where}.enabled"
        elif isinstance(value, Mapping):
            yield from _switches(value, f"{where}.{key}")


def _check_allreduce_op(op: Any) -> None:
    """``gradient_allreduce_op``: DeepSpeed reads "mean" (its default) or "sum", any case; its ZeRO-3
    averages whichever is given, so "sum" would be silently ignored there: refused, naming the way."""
    name = op.strip().lower() if isinstance(op, str) else op
    if op is None or name == "mean":
        return
    if name != "sum":
        raise ConfigError(f"gradient_allreduce_op must be 'mean' or 'sum', got {v.show(op)}")
    _refuse(
        "gradient_allreduce_op",
        f"{_AVERAGING}, as DeepSpeed's ZeRO-3 does whatever this says; for the sum, multiply the loss by "
        "the world size",
    )


def _check_tag_validation(mode: Any) -> None:
    """``checkpoint.tag_validation``: DeepSpeed's "Warn" (its default), "Ignore" or "Fail", any case, else
    its config error. zswap's `save_checkpoint` always fails when ranks pass different tags: "Fail" as
    asked, "Warn" stricter than asked (the default, so a config that only spells it out still loads);
    "Ignore" is refused."""
    name = mode.strip().upper() if isinstance(mode, str) else mode
    if mode is None or name in ("WARN", "FAIL"):
        return
    if name != "IGNORE":
        raise ConfigError(f"checkpoint.tag_validation must be 'Warn', 'Ignore' or 'Fail', got {v.show(mode)}")
    raise ConfigError(
        "checkpoint.tag_validation 'Ignore' is not supported: zswap's save_checkpoint always fails when the "
        "ranks pass different tags (DeepSpeed's 'Fail'); pass the same tag on every rank"
    )


def _at_most_one(path: str, size: Any, why: str) -> None:
    if size is not None and not (isinstance(size, int) and not isinstance(size, bool) and size <= 1):
        _refuse(path, f"{why}; it may only be 0 or 1")


def _refuse(path: str, why: str) -> None:
    raise ConfigError(f"{path} switches on a DeepSpeed feature zswap does not implement: {why}")
