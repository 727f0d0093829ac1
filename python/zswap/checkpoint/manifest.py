"""What a checkpoint folder holds, and how the live model is described and compared with it.

A tag folder (``save_dir/<tag>/``) holds ``manifest.json`` and, per saving rank *r* of *W*:
``rank{r:05d}-of-{W:05d}.params.safetensors`` (its partition of every param, 1-D; rank 0 also the module's
persistent buffers), ``….exp_avg`` / ``….exp_avg_sq`` / ``….master.safetensors`` (its partition of
`OffloadedAdamW`'s states, float32), ``….optim.safetensors`` (the tensors of any other optimizer's
state_dict, as that rank sees them) and ``….state.pt`` (small Python state: RNG, scheduler, loss scaler,
optimizer settings, client_state; a `torch.save` pickle). The manifest lists every param (name, tied
aliases, full shape, dtype, partitioning), the world size, zswap's version, every file with its size
and CRC-32C (whole and per 8 MiB block), the keys weights are saved under, whether the model holds PEFT
adapters (``adapters``: what kind, or null; ``zswap export`` refuses those) and whether `save_weights`
reverses transformers' conversions for it (``reverts``; the two absent from older checkpoints). Anything
else in a tag folder is the user's: a save of the tag keeps it (`foreign_entries`).

Partitioning: a param of ``numel`` elements saved with ``ranks`` holders of ``partition_numel`` each is the
flat, zero-padded range ``[0, ranks·partition_numel)``; holder *s* has ``[s·n, (s+1)·n)``. A param zswap
manages has ``ranks`` = world size; one it does not (replicated on every rank) has ``ranks`` = 1. Any
rank of any new world size reads the slice it needs from the files that hold it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..parts.params import ParamState, param_state
from ._atomic import LATEST, TMP_PREFIX
from ._validate import check_checksum, check_structure, read_bytes, read_json
from .errors import (
    CheckpointArgumentError,
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)

FORMAT = "zswap-checkpoint"
FORMAT_VERSION = 2
"""2: the manifest carries its own checksum and ``state.pt`` loads with ``weights_only=True`` (the numpy
RNG state is saved as a tensor). Version 1 checkpoints are refused with a message saying so: without the
checksum an edited manifest could not be told from a good one, and their ``state.pt`` needs a full pickle
load (arbitrary code) for numpy's RNG state."""
MANIFEST = "manifest.json"
NAME_MAX = 255  # bytes in one path component: Linux's NAME_MAX, on every file system it mounts
STATE_KINDS = ("exp_avg", "exp_avg_sq", "master")


def file_name(rank: int, world: int, kind: str) -> str:
    ext = "pt" if kind == "state" else "safetensors"
    return f"rank{rank:05d}-of-{world:05d}.{kind}.{ext}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointCorruptError(f"unknown dtype {name!r} in a checkpoint manifest")
    return dt


@dataclass(eq=False)
class ParamRecord:
    """One unique param of the live model, as a checkpoint sees it."""

    name: str
    aliases: list[str]
    p: torch.Tensor
    st: ParamState | None
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def partition_numel(self) -> int:
        """Elements this rank holds (and the optimizer's state of this param has)."""
        return self.st.partition_numel if self.st is not None else self.numel

    @property
    def ranks(self) -> int:
        return self.st.world_size if self.st is not None else 1

    @property
    def start(self) -> int:
        """First flat element this rank holds."""
        return self.st.rank * self.st.partition_numel if self.st is not None else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "aliases": self.aliases,
            "shape": list(self.shape),
            "dtype": dtype_name(self.dtype),
            "requires_grad": bool(self.p.requires_grad),  # DeepSpeed's "frozen" (zero_to_fp32)
            "partition": {
                "kind": "flat" if self.st is not None else "replicated",
                "ranks": self.ranks,
                "partition_numel": self.partition_numel,
            },
        }


def describe(model: nn.Module) -> list[ParamRecord]:
    """Every unique param of ``model`` (by identity, under its first name), with its tied aliases."""
    by_id: dict[int, ParamRecord] = {}
    out: list[ParamRecord] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        rec = by_id.get(id(p))
        if rec is not None:
            rec.aliases.append(name)
            continue
        st = param_state(p)
        shape = tuple(st.shape) if st is not None else tuple(p.shape)
        rec = ParamRecord(name, [], p, st, shape, st.dtype if st is not None else p.dtype)
        by_id[id(p)] = rec
        out.append(rec)
    return out


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers ``model.state_dict()`` would hold, in its order, each once."""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for mod_name, m in model.named_modules():
        for name, b in m._buffers.items():
            if b is None or name in m._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            out.append((f"{mod_name}.{name}" if mod_name else name, b))
    return out


def check_tag(tag: object) -> str:
    if not isinstance(tag, str) or not tag or tag in (".", "..", LATEST) or "/" in tag or "\0" in tag:
        raise CheckpointArgumentError(
            f"checkpoint tag must be a folder name other than {LATEST!r}, got {tag!r}"
        )
    if len(os.fsencode(tag)) > NAME_MAX:
        raise CheckpointArgumentError(
            f"checkpoint tag of {len(os.fsencode(tag))} bytes: a folder name holds at most {NAME_MAX} "
            f"({tag[:40]!r}...)"
        )
    if tag.startswith("."):
        raise CheckpointArgumentError(
            f"checkpoint tag {tag!r} must not start with '.' (zswap's temp folders do)"
        )
    return tag


def check_dir(path: object, what: str) -> Path:
    """``path`` as a `Path`; `CheckpointArgumentError` for ``None`` or an empty string (``Path("")`` would
    silently be the current directory), `TypeError` for anything but a str or PathLike."""
    if path is None or (isinstance(path, str | bytes) and not path):
        raise CheckpointArgumentError(f"{what} must name a checkpoint folder, got {path!r}")
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{what} must be a str or os.PathLike, got {type(path).__name__}")
    return Path(os.fsdecode(os.fspath(path)))


def same_tag(tag: str | None, what: str, group: Any, world: int) -> None:
    """`CheckpointArgumentError` on every rank when the ranks asked for different tags: a checkpoint is one
    folder for all ranks (DeepSpeed's ``checkpoint.tag_validation: "Fail"``)."""
    from ._collective import all_gather

    tags = all_gather(tag, group, world)
    if len(set(tags)) > 1:
        listed = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
        raise CheckpointArgumentError(f"{what}: every rank must pass the same tag, got {listed}")


def same_dir(root: Path, what: str, group: Any, world: int) -> None:
    """`CheckpointArgumentError` on every rank when the ranks name different folders (symlinks and relative
    paths resolved): every rank writes its files into the one folder rank 0 creates in it."""
    from ._collective import all_gather

    dirs = all_gather(os.path.realpath(root), group, world)
    if len(set(dirs)) > 1:
        listed = ", ".join(f"rank {r}: {d!r}" for r, d in enumerate(dirs))
        raise CheckpointArgumentError(f"{what}: every rank must pass the same save_dir, got {listed}")


def resolve(load_dir: str | os.PathLike[str], tag: str | None) -> tuple[Path, str]:
    """(tag folder, tag) for ``tag``, or for the one ``load_dir/latest`` names."""
    root = Path(load_dir)
    if not root.is_dir():
        raise CheckpointNotFoundError(2, "checkpoint folder does not exist", str(root))
    tag = read_latest(root) if tag is None else check_tag(tag)
    folder = root / tag
    if not folder.is_dir():
        tags = sorted(e.name for e in root.iterdir() if e.is_dir() and not e.name.startswith(TMP_PREFIX[0]))
        raise CheckpointNotFoundError(2, f"checkpoint tag {tag!r} does not exist (tags: {tags})", str(folder))
    return folder, tag


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of tag folder ``folder``, its checksum and every field checked (`_validate`)."""
    path = folder / MANIFEST
    if not path.exists():
        raise CheckpointNotFoundError(2, "checkpoint manifest does not exist", str(path))
    m = read_json(str(path))
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{path}: not a zswap checkpoint manifest (field 'format')")
    version = m.get("format_version")
    if version != FORMAT_VERSION:
        hint = (
            " (written before checkpoints carried a checksum: load it with the zswap that wrote it, "
            "without a world size change, and save it again)"
            if version == 1
            else ""
        )
        raise CheckpointCorruptError(
            f"{path}: field 'format_version' is {version!r}; this zswap reads {FORMAT_VERSION}{hint}"
        )
    check_checksum(m, path)
    check_structure(m, path, dtype_of)
    return m


_RANK_FILE = re.compile(r"rank\d{5}-of-\d{5}\..+")


def foreign_entries(folder: Path) -> list[str]:
    """The names in an existing tag folder that no checkpoint wrote (a tokenizer, notes, a folder of the
    user's): a save of that tag carries them into its new folder, as DeepSpeed, writing into the folder,
    leaves them. A checkpoint's are its manifest and the files that lists; where the manifest cannot be
    read, the per-rank files by their names."""
    if not folder.is_dir():
        return []
    listed: set[str] | None = None
    try:
        files = read_json(str(folder / MANIFEST)).get("files", [])
        listed = {f["name"] for f in files if isinstance(f, dict) and isinstance(f.get("name"), str)}
    except (OSError, ValueError, AttributeError, TypeError):  # no manifest, or not one: names decide
        pass

    def ours(name: str) -> bool:
        if listed is None:
            return name == MANIFEST or _RANK_FILE.fullmatch(name) is not None
        return name == MANIFEST or name in listed

    return sorted(e.name for e in folder.iterdir() if not ours(e.name))


def read_latest(root: Path) -> str:
    """The tag ``root/latest`` names (a regular file of one line)."""
    latest = root / LATEST
    if not latest.exists():
        raise CheckpointNotFoundError(
            2, f"no {LATEST!r} file in the checkpoint folder (pass tag= to name one)", str(latest)
        )
    raw = read_bytes(str(latest), 4096)
    try:
        tag = raw.decode("utf-8").strip()
        return check_tag(tag)
    except (UnicodeDecodeError, CheckpointArgumentError):
        raise CheckpointCorruptError(f"{latest}: does not name a checkpoint tag ({raw[:80]!r})") from None


def check_model(manifest: dict[str, Any], records: list[ParamRecord], folder: Path) -> None:
    """Raise `CheckpointMismatchError` naming the first param whose name, shape or dtype differs."""
    saved = manifest["params"]
    for i, (ours, theirs) in enumerate(zip(records, saved, strict=False)):
        if ours.name != theirs["name"]:
            raise CheckpointMismatchError(
                f"{folder} is a checkpoint of another model: param {i} is {theirs['name']!r} there, "
                f"{ours.name!r} here"
            )
        if list(ours.shape) != theirs["shape"] or dtype_name(ours.dtype) != theirs["dtype"]:
            # Same shape, another dtype: PEFT's float32 adapters on a bf16 base keep their dtype at
            # initialize (`partition_rest`); a checkpoint saved with them cast loads into adapters cast so.
            hint = (
                f" (to load it, cast the param to {theirs['dtype']} before zswap.initialize)"
                if list(ours.shape) == theirs["shape"]
                else ""
            )
            raise CheckpointMismatchError(
                f"{folder} is a checkpoint of another model: param {ours.name!r} is "
                f"{theirs['dtype']} {tuple(theirs['shape'])} there, "
                f"{dtype_name(ours.dtype)} {ours.shape} here{hint}"
            )
    if len(records) != len(saved):
        extra = records[len(saved)].name if len(records) > len(saved) else saved[len(records)]["name"]
        where = "here only" if len(records) > len(saved) else "in the checkpoint only"
        raise CheckpointMismatchError(
            f"{folder} is a checkpoint of another model: {len(saved)} params there, {len(records)} here "
            f"(first extra: {extra!r}, {where})"
        )
