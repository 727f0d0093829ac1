"""`zswap estimate`: the memory and disk a model's states need on each rank, by where they are offloaded.

The same arithmetic as DeepSpeed's ``estimate_zero3_model_states_mem_needs`` and ``accelerate
estimate-memory``, for what zswap stores (activations, the CUDA context and allocator slack are not
counted; they depend on the batch, not on the model):

- params: ``dtype`` bytes each, 1/world of every param on each rank, on the param tier;
- gradients: ``dtype`` bytes each, 1/world per rank, kept where the optimizer lives (memory for ``none`` /
  ``cpu``, NVMe for ``nvme``);
- Adam/AdamW states: float32 ``exp_avg`` and ``exp_avg_sq`` (8 bytes) plus a float32 master copy (4 bytes)
  when the params are not float32, 1/world per rank, on the optimizer tier;
- the working set: a gathered layer in use and the one prefetched after it, full size, on the compute
  device (known only from a model config or ``largest_layer``).

`estimate` is the function behind the command; `shape_from_config` builds a local config on the meta device
(nothing is allocated or downloaded) to count params and find the largest layer.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
TIERS = ("none", "cpu", "nvme")
PLACES = ("gpu", "ram", "nvme")
"""Where bytes land: ``gpu`` is the compute device (the CPU itself when there is no GPU)."""

_WHERE = {"none": "gpu", "cpu": "ram", "nvme": "nvme"}
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


MAX_COUNT = 100 * 10**12
"""The largest parameter count taken (100T; the table's columns are laid out for such figures)."""


def parse_count(text: str) -> int:
    """``'7B'`` → 7_000_000_000 (K, M, B or G, T: powers of ten, as model names use them); a plain integer
    as it is."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMBGT]?)\s*", text.upper())
    if m is None:
        raise ValueError(f"{text!r} is not a parameter count such as 7B, 350M or 1234567")
    number, unit = m.groups()
    value = int(number) if "." not in number and not unit else round(float(number) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"{text!r}: a parameter count must be positive")
    if value > MAX_COUNT:
        raise ValueError(f"{text!r}: more than {MAX_COUNT:,} params (100T) is not a model this estimates")
    return value


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: its param count (tied params once) and, when known, the params
    of its largest layer (a module's own params, not its children's)."""

    params: int
    largest_layer: int | None = None
    name: str | None = None


@dataclass(frozen=True)
class Estimate:
    """Bytes per rank of each state (`rows`: name → {place: bytes}), and the inputs that produced them."""

    shape: ModelShape
    dtype: str
    world_size: int
    offload_param: str
    offload_optimizer: str
    rows: dict[str, dict[str, int]]

    def total(self, place: str) -> int:
        """Bytes per rank in `place` ("gpu", "ram" or "nvme")."""
        return sum(row[place] for row in self.rows.values())

    def swap_files(self) -> int:
        """Bytes per rank the swap files may reach: `COPY_ON_WRITE` × the NVMe total, and the files'
        growth ahead of use (`GROWTH_AHEAD`)."""
        used = COPY_ON_WRITE * self.total("nvme")
        return used + min(max(used, GROWTH_MIN), GROWTH_MAX) if used else 0


COPY_ON_WRITE = 2
"""Swap space in use reaches up to twice the bytes on NVMe: a step writes every record and param to new
space before their old copies are freed (the engine's copy-on-write), and freed space is kept for the next
step's writes. Measured (a 50 M-param MLP, six steps): 1.50 × (fp32), 1.75 × (bf16)."""
GROWTH_MIN, GROWTH_MAX = 64 << 20, 1 << 30
"""A swap file grows by its own size, at least 64 MiB, at most 1 GiB, when full (`src/store/file.rs`)."""


def estimate(
    shape: ModelShape | int, *, dtype: str = "bf16", world_size: int = 1, offload_param: str = "nvme",
    offload_optimizer: str = "nvme",
) -> Estimate:  # fmt: skip
    """Bytes per rank for `shape` (or a bare param count) at `world_size` ranks, params on `offload_param`
    and optimizer states and gradients on `offload_optimizer` (each ``"none"``, ``"cpu"`` or ``"nvme"``)."""
    if isinstance(shape, int):
        shape = ModelShape(shape)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    for key, tier in (("offload_param", offload_param), ("offload_optimizer", offload_optimizer)):
        if tier not in TIERS:
            raise ValueError(f"{key} must be one of {list(TIERS)}, got {tier!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size}")
    width = DTYPE_BYTES[dtype]
    part = math.ceil(shape.params / world_size)  # the largest rank's share, as partitions are padded
    optim_bytes = 8 + (0 if width == 4 else 4)

    def at(tier: str, nbytes: int) -> dict[str, int]:
        return {place: nbytes if place == _WHERE[tier] else 0 for place in PLACES}

    rows = {
        "params": at(offload_param, part * width),
        "gradients": at(offload_optimizer, part * width),
        "optimizer states": at(offload_optimizer, part * optim_bytes),
    }
    if shape.largest_layer is not None:
        rows["working set"] = at("none", 2 * shape.largest_layer * width)
    return Estimate(shape, dtype, world_size, offload_param, offload_optimizer, rows)


def shape_from_config(path: str | os.PathLike[str]) -> ModelShape:
    """Param count and largest layer of the Hugging Face model a local ``config.json`` (or a folder holding
    one) describes, built on the meta device: nothing is allocated and nothing is fetched from the hub."""
    source = Path(path)
    if not source.exists():
        raise FileNotFoundError(f"{str(source)!r} does not exist")
    if source.is_dir() and not (source / "config.json").is_file():
        raise ValueError(f"{str(source)!r} has no config.json")
    import torch
    import transformers

    # The file itself where a file is given (any name: ``llama-70b.json``), not its folder's config.json.
    config = transformers.AutoConfig.from_pretrained(source, local_files_only=True)
    # The class config.json names (an encoder-decoder also maps to a decoder-only *ForCausalLM, which
    # would leave its encoder out), else a causal LM, else the base model.
    named = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, named, None) if named else None
    with torch.device("meta"):
        if cls is not None:
            model = cls(config)
        else:
            try:
                model = transformers.AutoModelForCausalLM.from_config(config)
            except ValueError:  # not a causal LM (an encoder, a classifier...): its base model
                model = transformers.AutoModel.from_config(config)
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # parameters() yields a tied param once
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return ModelShape(total, largest, type(model).__name__)


def _size(n: int) -> str:
    if n == 0:
        return "-"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _count(n: int) -> str:
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def render(est: Estimate) -> str:
    """The table (bytes per rank by state and place, then the total and the whole job's NVMe) and how to
    read it."""
    s = est.shape
    head = f"{s.name + ': ' if s.name else ''}{_count(s.params)} params ({s.params:,})"
    if s.largest_layer is not None:
        head += f", largest layer {_count(s.largest_layer)}"
    lines = [
        head,
        f"dtype {est.dtype}, world size {est.world_size}, offload_param {est.offload_param}, "
        f"offload_optimizer {est.offload_optimizer}",
        "",
        f"{'per rank':<18}{'GPU':>12}{'CPU RAM':>12}{'NVMe':>12}",
    ]
    for name, row in [*est.rows.items(), ("total", {p: est.total(p) for p in PLACES})]:
        lines.append(f"{name:<18}" + "".join(f"{_size(row[p]):>12}" for p in PLACES))
    if est.swap_files():
        lines.append(f"{'swap files, peak':<18}{'':>24}{_size(est.swap_files()):>12}")
    if est.world_size > 1:
        lines.append(f"{'NVMe, all ranks':<18}{'':>24}{_size(est.swap_files() * est.world_size):>12}")
    lines += [
        "",
        "Model states only: activations, the CUDA context and the framework's own buffers come on top.",
        f"Params and gradients take {DTYPE_BYTES[est.dtype]} B each; Adam/AdamW keeps exp_avg and exp_avg_sq"
        + (" in float32 (8 B)." if est.dtype == "fp32" else " and a float32 master copy (12 B)."),
        "Gradients live with the optimizer states (memory for none/cpu, NVMe for nvme).",
    ]
    if s.largest_layer is None:
        lines.append("The working set (a gathered layer and the prefetched next one) is not counted: pass "
                     "--model or --largest-layer.")  # fmt: skip
    else:
        lines.append("Working set: the largest layer gathered twice (in use, and prefetched).")
    if "nvme" in (est.offload_param, est.offload_optimizer):
        lines.append(
            f"Swap files, peak: up to {COPY_ON_WRITE} × the NVMe total in use (a step writes each record and "
            "param to new space before freeing the old, and keeps freed space for the next), plus the files' "
            "growth ahead of use (64 MiB to 1 GiB): the disk space to keep free."
        )
        lines.append("zswap also uses pinned staging buffers in RAM, sized from aio.pinned_memory_budget.")
    return "\n".join(lines) + "\n"
