"""The Hugging Face weights layout, shared by `zswap.save_weights` and ``zswap export``.

As transformers 5 writes it (``save_pretrained``; its weight conversions are reversed by `_hf_revert`,
which takes the keys from here): keys are ``model.state_dict()``'s, in its order; a
tied param is stored once, under the name transformers keeps (``all_tied_weights_keys`` lists the tied
*targets*, which are dropped; without it, the first name); one ``model.safetensors`` when everything fits
in ``max_shard_size``, else ``model-00001-of-0000N.safetensors`` shards filled greedily in key order (a
tensor bigger than the limit alone in its shard) plus ``model.safetensors.index.json``; every file has the
metadata ``{"format": "pt"}``; ``config.json`` next to them for a `PreTrainedModel`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._atomic import fsync_path, io_error, temp_name, write_file
from ._safetensors import Entry
from .errors import CheckpointCorruptError

WEIGHTS = "model.safetensors"
METADATA = {"format": "pt"}
CONFIG_FILES = ("config.json", "generation_config.json")

_UNITS = {
    "": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string such as ``"5GB"`` (10⁹, as Hugging Face counts) or
    ``"512MiB"``."""
    if isinstance(size, bool):
        raise TypeError("max_shard_size must be an int or a size string such as '5GB'")
    if isinstance(size, int):
        value = size
    elif isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size)
        if m is None or m.group(2).upper() not in _UNITS:
            raise ValueError(f"max_shard_size {size!r} is not a size such as '5GB', '500MB' or '1GiB'")
        value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    else:
        raise TypeError(
            f"max_shard_size must be an int or a size string such as '5GB', not {type(size).__name__}"
        )
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


@dataclass(frozen=True)
class Key:
    """One tensor of the weights: its key, and which param or buffer (by its checkpoint name) it is."""

    key: str
    kind: str  # "param" or "buffer"
    source: str


def weight_keys(model: nn.Module, param_names: dict[int, str], buffer_names: dict[int, str]) -> list[Key]:
    """The keys ``model``'s weights are saved under. ``param_names`` / ``buffer_names`` map the identity of
    each param / buffer to its checkpoint name. Reads no data (``state_dict(keep_vars=True)``)."""
    sd = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for key, t in sd.items():
        groups.setdefault(id(t), []).append(key)
    tied_targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    ignore = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    dropped: set[str] = set()
    for keys in groups.values():
        if len(keys) > 1:
            keep = [k for k in keys if k not in tied_targets] or keys[:1]
            dropped.update(k for k in keys if k != keep[0])
    out = []
    for key, t in sd.items():
        if key in dropped or key in ignore:
            continue
        if id(t) in param_names:
            out.append(Key(key, "param", param_names[id(t)]))
        elif id(t) in buffer_names:
            out.append(Key(key, "buffer", buffer_names[id(t)]))
        else:
            raise ValueError(
                f"state_dict key {key!r} is neither a param nor a persistent buffer of the model"
            )
    return out


def plan_shards(entries: Sequence[Entry], max_shard_size: int) -> list[list[Entry]]:
    """Hugging Face's greedy split (huggingface_hub ``split_torch_state_dict_into_shards``)."""
    shards: list[list[Entry]] = []
    current: list[Entry] = []
    size = 0
    for e in entries:
        if e.nbytes > max_shard_size:
            shards.append([e])
            continue
        if current and size + e.nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(n: int, weights: str = WEIGHTS) -> list[str]:
    """The files of ``n`` shards, as Hugging Face names them: ``weights`` itself for one, else
    ``{stem}-0000i-of-0000n.{ext}`` (``model.safetensors``; ``pytorch_model.bin`` for ``torch.save``)."""
    if n == 1:
        return [weights]
    stem, _, ext = weights.partition(".")
    return [f"{stem}-{i + 1:05d}-of-{n:05d}.{ext}" for i in range(n)]


def write_index(
    staged: Staged,
    shards: list[list[Entry]],
    names: list[str],
    total_parameters: int,
    weights: str = WEIGHTS,
) -> None:
    """``{weights}.index.json``, past one shard: which shard holds each tensor."""
    if len(shards) == 1:
        return
    index: dict[str, Any] = {
        "metadata": {
            "total_parameters": total_parameters,
            "total_size": sum(e.nbytes for s in shards for e in s),
        },
        "weight_map": {e.name: name for s, name in zip(shards, names, strict=True) for e in s},
    }
    write_file(
        staged.path(f"{weights}.index.json"), (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
    )


def _is_weights(name: str, weights: str) -> bool:
    """Whether ``name`` is one of the files a save of ``weights`` writes (`shard_names`, its index)."""
    stem, _, ext = weights.partition(".")
    shard = rf"{re.escape(stem)}-\d{{5}}-of-\d{{5}}\.{re.escape(ext)}"
    return name in (weights, f"{weights}.index.json") or re.fullmatch(shard, name) is not None


class Staged:
    """The files of one weights save, written under temp names in ``out_dir`` and renamed into place only
    once all are complete and fsynced (`commit`): a full disk or a crash leaves the previous weights whole
    under their names, never a partial file. Weight files of an earlier save that this one does not
    replace are removed after the renames, as ``save_pretrained`` removes them."""

    def __init__(self, out_dir: Path, weights: str = WEIGHTS) -> None:
        self.out = out_dir
        self._weights = weights
        """The kind of files this save writes (`shard_names`): those of an earlier save of that kind that
        `commit` does not overwrite, it removes."""
        self._files: list[tuple[Path, Path]] = []

    def path(self, name: str) -> Path:
        tmp = self.out / temp_name(name)
        self._files.append((tmp, self.out / name))
        return tmp

    def commit(self) -> None:
        try:
            for tmp, _ in self._files:
                fsync_path(tmp)
            for tmp, final in self._files:
                os.replace(tmp, final)
        except OSError as e:
            self.abort()
            raise io_error(e, self.out, "cannot write weights into") from None
        kept = {final.name for _, final in self._files}
        for f in self.out.iterdir():
            if _is_weights(f.name, self._weights) and f.name not in kept and f.is_file():
                f.unlink()
        fsync_path(self.out)
        self._files = []

    def abort(self) -> None:
        for tmp, _ in self._files:
            with contextlib.suppress(OSError):
                tmp.unlink()
        self._files = []


def save_config(
    model: nn.Module, out_dir: Path, params: Sequence[torch.dtype], dtype: torch.dtype | None
) -> bool:
    """``config.json`` (and ``generation_config.json`` for a model that generates) of a model that has a
    Hugging Face config, as ``save_pretrained`` writes them: ``dtype`` the dtype of the weights (``None``:
    its params' — ``params``, their dtypes in ``model.parameters()`` order —, the first floating one's as
    ``PreTrainedModel.dtype``; not ``config.dtype`` where the params were cast after loading, as ``bf16``
    under ``zswap.Init`` casts them), ``architectures`` the
    class saved (a transformers model: ``save_weights(model.model)`` is a ``LlamaModel``). False where the
    model has no such config."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return False
    config.save_pretrained(out_dir)
    gen = getattr(model, "generation_config", None)
    if gen is not None and getattr(model, "can_generate", lambda: False)():
        gen.save_pretrained(out_dir)
    path = out_dir / "config.json"
    if not path.is_file():
        return True
    fields: dict[str, Any] = {}
    dtype = dtype or next((d for d in params if d.is_floating_point), None)
    if dtype is not None:
        fields["dtype"] = str(dtype).removeprefix("torch.")
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        fields["architectures"] = [type(model).__name__]
    path.write_bytes(with_fields(path.read_bytes(), fields, path))
    return True


def with_fields(config: bytes, fields: dict[str, Any], where: Path) -> bytes:
    """A checkpoint's ``config.json`` bytes with ``fields`` set, checked (a JSON object) before anything is
    written."""
    try:
        cfg = json.loads(config)
    except ValueError as e:
        raise CheckpointCorruptError(f"{where}: not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointCorruptError(f"{where}: holds a JSON {type(cfg).__name__}, not an object")
    cfg.update(fields)
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()
