"""``engine.save_checkpoint``: every rank streams its partitions from the offload tier into safetensors files
in a temp folder; rank 0 adds the manifest, renames the folder into place and points ``latest`` at it.

Memory: a param partition is read from its store and written to its file one at a time (an NVMe partition
lands in the engine's pooled fetch buffers); optimizer records go through the optimizer's own record walk
(`OffloadedAdamW.stream_state`), each segment appended to its file as it passes. What a save adds to the
peak RSS is therefore the largest partition or record, not the model.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._progress import progress
from ..errors import ZswapError, ZswapWarning
from ..step.optim import OffloadedAdamW
from ..step.optim._layout import needs_master
from . import _atomic, _hf_revert
from ._collective import agree, all_gather, group_of
from ._crc import BlockCrc
from ._gather import local_partition
from ._hf_layout import CONFIG_FILES, save_config, weight_keys
from ._safetensors import BLOCK_BYTES, Entry, FileInfo, StreamWriter
from ._state import rng_state
from ._validate import CHECKSUM, canonical_checksum
from .errors import CheckpointArgumentError
from .manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    STATE_KINDS,
    ParamRecord,
    check_dir,
    check_tag,
    describe,
    dtype_name,
    file_name,
    foreign_entries,
    persistent_buffers,
    same_dir,
    same_tag,
)
from .peft_save import adapters
from .weights import key_tensors

if TYPE_CHECKING:
    from ._training import TrainingState


def _warn_mid_window(engine: TrainingState) -> None:
    """A save inside an accumulation window keeps none of that window's gradients (DeepSpeed saves none
    either, without a word): say so, since a resume from it differs from the run that goes on."""
    gas = getattr(engine, "gradient_accumulation_steps", None)
    batch = getattr(getattr(engine, "config", None), "batch", None)
    if not callable(gas) or not getattr(batch, "managed_gradient_accumulation", False):
        return
    window = int(gas())
    done = (engine.micro_steps - engine._window_from) % window
    if done:
        warnings.warn(
            f"save_checkpoint inside an accumulation window ({done} of its {window} micro-batches have run): "
            "their gradients are not saved, and a load begins a new window; save after the engine.step() "
            "that ends the window to resume exactly",
            ZswapWarning,
            stacklevel=4,
        )


def save_checkpoint(
    engine: TrainingState,
    save_dir: str | os.PathLike[str],
    tag: str | None = None,
    client_state: Any = None,
    *,
    save_latest: bool = True,
    optimizer_state: bool = True,
) -> Path:
    """See `zswap.Engine.save_checkpoint`. Returns the tag folder. ``optimizer_state=False``: the params
    and the rest without the optimizer's records, as a checkpoint of an engine without one (Lightning's
    ``weights_only``)."""
    root = check_dir(save_dir, "save_checkpoint: save_dir")
    _warn_mid_window(engine)
    records = describe(engine.module)
    group, rank, world = group_of(records)
    tag = check_tag(f"global_step{engine.global_steps}" if tag is None else tag)
    same_tag(tag, "save_checkpoint", group, world)
    same_dir(root, "save_checkpoint", group, world)
    tmp_name: str | None = None
    error: BaseException | None = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _atomic.remove_stale(root)
            tmp_name = _atomic.new_temp_dir(root, tag).name
        except OSError as e:
            error = _os_error(e, root)
    agree(error, "save_checkpoint (creating the temp folder)", group, world)
    tmp = root / all_gather(tmp_name, group, world)[0]
    try:
        error, report = None, None
        if not tmp.is_dir():  # the same path, but not one file system (a node's local disk)
            error = CheckpointArgumentError(
                f"save_checkpoint: the temp folder {str(tmp)!r} rank 0 created is not there on rank {rank}: "
                "save_dir must be on a file system every rank shares"
            )
        agree(error, "save_checkpoint", group, world)
        try:
            report = _write_rank(engine, records, tmp, rank, world, client_state, optimizer_state)
        except OSError as e:
            error = _os_error(e, tmp)
        except Exception as e:
            error = e
        agree(error, "save_checkpoint", group, world)
        reports = all_gather(report, group, world)
        error = None
        if rank == 0:
            try:
                _finish(engine, records, tmp, root, tag, world, reports, save_latest)
            except OSError as e:
                error = _os_error(e, root / tag)
            except Exception as e:
                error = e
        agree(error, "save_checkpoint (commit)", group, world)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    logging.getLogger(__name__).info("checkpoint saved: %s (rank %d of %d)", root / tag, rank, world)
    return root / tag


def _os_error(e: OSError, path: Path) -> Exception:
    """A failed file operation of a save as zswap's error naming the path: a name too long for the file
    system is the caller's `CheckpointArgumentError`, anything else (a full disk) a `SwapIOError`."""
    if e.errno == errno.ENAMETOOLONG:
        return CheckpointArgumentError(
            f"save_checkpoint: {e.filename or path}: name too long for its file system"
        )
    return _atomic.io_error(e, path, "save_checkpoint: cannot write")


def _write_rank(
    engine: TrainingState,
    records: list[ParamRecord],
    tmp: Path,
    rank: int,
    world: int,
    client_state: Any,
    optimizer_state: bool,
) -> dict[str, Any]:
    files: list[FileInfo] = []
    buffers = persistent_buffers(engine.module) if rank == 0 else []
    entries = [Entry(r.name, r.dtype, (r.partition_numel,)) for r in records]
    entries += [Entry(name, b.dtype, tuple(b.shape)) for name, b in buffers]
    w = StreamWriter(tmp / file_name(rank, world, "params"), entries)
    try:
        for r in progress(records, "saving checkpoint", unit="param"):
            w.write(local_partition(r.p, r.st))
        for _, b in buffers:
            w.write(b.detach().to("cpu").contiguous())
        files.append(w.close())
    finally:
        w.abort()
    opt = engine.optimizer if optimizer_state else None
    optim: dict[str, Any] | None = None
    extra: dict[str, Any] = {}
    if isinstance(opt, OffloadedAdamW):
        optim, groups = _write_offloaded(opt, records, tmp, rank, world, files)
        extra["optimizer"] = {"param_groups": groups, "skipped_steps": opt.skipped_steps}
    elif opt is not None:
        optim, extra["optimizer"] = _write_torch_optimizer(opt, records, tmp, rank, world, files)
    state = {
        "rng": rng_state(),
        "lr_scheduler": _state_of(getattr(engine, "lr_scheduler", None)),
        "loss_scaler": _state_of(getattr(engine, "loss_scaler", None)),
        "client_state": client_state,
        **extra,
    }
    path = tmp / file_name(rank, world, "state")
    _atomic.write_file(path, _pickled(state))
    files.append(_file_info(path))
    return {"files": [f.to_json() for f in files], "optimizer": optim}


def _pickled(state: dict[str, Any]) -> bytes:
    """``state.pt``'s bytes. A save that `load_checkpoint` would refuse is refused now, before anything is
    written: the state is read back with ``weights_only=True`` (tensors and plain containers), as a load
    reads it."""
    buf = io.BytesIO()
    try:
        torch.save(state, buf)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:
        found = _foreign(state, "")
        where = f"{found[0]} is a {found[1]}" if found else f"{type(e).__name__}: {e}".strip().splitlines()[0]
        raise CheckpointArgumentError(
            "save_checkpoint: client_state (or the lr scheduler's / loss scaler's state_dict) holds objects "
            "other than tensors, numbers, strings and plain containers, which load_checkpoint cannot read "
            f"back safely ({where})"
        ) from None
    return buf.getvalue()


_PLAIN = (str, bytes, int, float, complex, bool, type(None), torch.Size, torch.dtype, torch.device)


def _foreign(obj: Any, path: str) -> tuple[str, str] | None:
    """(where, type) of the first object in ``obj`` that is neither plain nor a plain container."""
    if isinstance(obj, dict):
        items: Any = ((f"{path}[{k!r}]", v) for k, v in obj.items())
    elif isinstance(obj, list | tuple | set | frozenset) and type(obj) in (list, tuple, set, frozenset):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(obj))
    elif type(obj) in _PLAIN or isinstance(obj, torch.Tensor):
        return None
    else:
        return path or "the state", f"{type(obj).__module__}.{type(obj).__qualname__}"
    for where, value in items:
        found = _foreign(value, where)
        if found is not None:
            return found
    return None


def _names(opt: Any, records: list[ParamRecord]) -> list[list[str]]:
    by_id = {id(r.p): r.name for r in records}
    out = []
    for g in opt.param_groups:
        names = []
        for p in g["params"]:
            if id(p) not in by_id:
                raise ZswapError(
                    f"the optimizer holds a param of shape {tuple(p.shape)} that is not one of the model's: "
                    "save_checkpoint saves the model's params and their optimizer state only"
                )
            names.append(by_id[id(p)])
        out.append(names)
    return out


def _write_offloaded(
    opt: OffloadedAdamW, records: list[ParamRecord], tmp: Path, rank: int, world: int, files: list[FileInfo]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    groups = _names(opt, records)
    flat = [n for g in groups for n in g]
    params = [p for g in opt.param_groups for p in g["params"]]
    layout = opt.state_layout()
    plan = {
        kind: [
            Entry(flat[i], torch.float32, (numel,))
            for i, _, numel in layout
            if kind != "master" or needs_master(params[i])
        ]
        for kind in STATE_KINDS
    }
    writers = {kind: StreamWriter(tmp / file_name(rank, world, kind), plan[kind]) for kind in STATE_KINDS}
    order = iter(layout)
    at = [-1, 0, 0]  # param index, next expected start, its numel

    def visit(i: int, start: int, views: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> None:
        if i != at[0]:
            if at[1] != at[2]:
                raise ZswapError(f"optimizer state of {flat[at[0]]!r} was not walked whole")
            nxt = next(order, None)
            if nxt is None or nxt[0] != i:
                raise ZswapError(f"optimizer records visit {flat[i]!r} out of their layout order")
            at[:] = [i, 0, nxt[2]]
        if start != at[1]:
            raise ZswapError(f"optimizer state of {flat[i]!r} visited at element {start}, expected {at[1]}")
        for kind, v in zip(STATE_KINDS, views, strict=True):
            if v is not None:
                writers[kind].write(v)
        at[1] += views[0].numel()

    try:
        opt.stream_state(visit, write=False)
        files.extend(writers[kind].close() for kind in STATE_KINDS)
    finally:
        for wr in writers.values():
            wr.abort()
    settings = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    summary = {
        "kind": "zswap",
        "type": type(opt).__name__,
        "groups": groups,
        "layout": [[flat[i], step, numel] for i, step, numel in layout],
    }
    return summary, settings


def _write_torch_optimizer(
    opt: Any, records: list[ParamRecord], tmp: Path, rank: int, world: int, files: list[FileInfo]
) -> tuple[dict[str, Any], dict[str, Any]]:
    groups = _names(opt, records)
    sd = opt.state_dict()
    tensors: list[tuple[str, torch.Tensor]] = []
    skeleton: dict[Any, dict[str, Any]] = {}
    for pid, st in sd["state"].items():
        sk: dict[str, Any] = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                name = f"{pid}/{k}"
                tensors.append((name, v.detach().to("cpu").contiguous()))
                sk[k] = ("__tensor__", name)
            else:
                sk[k] = v
        skeleton[pid] = sk
    w = StreamWriter(
        tmp / file_name(rank, world, "optim"), [Entry(n, t.dtype, tuple(t.shape)) for n, t in tensors]
    )
    try:
        for _, t in tensors:
            w.write(t)
        files.append(w.close())
    finally:
        w.abort()
    summary = {"kind": "torch", "type": type(opt).__name__, "groups": groups}
    return summary, {"state": skeleton, "param_groups": sd["param_groups"]}


def _state_of(obj: Any) -> Any:
    return None if obj is None else obj.state_dict()


def _file_info(path: Path) -> FileInfo:
    """Size and CRCs of a small finished file, read back in blocks; fsynced."""
    crc = BlockCrc(BLOCK_BYTES)
    with open(path, "rb") as f:
        while chunk := f.read(BLOCK_BYTES):
            crc.update(torch.frombuffer(bytearray(chunk), dtype=torch.uint8))
        os.fsync(f.fileno())
    whole, blocks = crc.finish()
    return FileInfo(path.name, path.stat().st_size, whole, BLOCK_BYTES, blocks)


def _finish(
    engine: TrainingState,
    records: list[ParamRecord],
    tmp: Path,
    root: Path,
    tag: str,
    world: int,
    reports: list[dict[str, Any]],
    save_latest: bool,
) -> None:
    from .._zswap import __version__

    model = engine.module
    files = [f for rep in reports for f in rep["files"]]
    # config.json, so that ``zswap export`` makes a folder from_pretrained loads
    if save_config(model, tmp, [r.dtype for r in records], None):
        files += [_file_info(tmp / n).to_json() for n in CONFIG_FILES if (tmp / n).is_file()]
    buffers = persistent_buffers(model)
    keys = weight_keys(model, {id(r.p): r.name for r in records}, {id(b): n for n, b in buffers})
    optim = reports[0]["optimizer"]
    if optim is not None and optim["kind"] == "zswap":
        optim = {**optim, "layout": [rep["optimizer"]["layout"] for rep in reports]}
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "zswap_version": __version__,
        "tag": tag,
        "world_size": world,
        "global_steps": int(engine.global_steps),
        "skipped_steps": int(engine.skipped_steps),
        "micro_steps": int(getattr(engine, "micro_steps", 0)),
        "params": [r.to_json() for r in records],
        "buffers": [{"name": n, "shape": list(b.shape), "dtype": dtype_name(b.dtype)} for n, b in buffers],
        "optimizer": optim,
        "weights": [[k.key, k.kind, k.source] for k in keys],
        "adapters": adapters(model),  # PEFT's state dict, not a model's: `export` refuses it
        # whether save_weights reverses transformers' conversions (a model loaded from stacked experts has
        # none recorded, and keeps them stacked, as save_pretrained does): `export` does the same
        "reverts": _hf_revert.plan(model, key_tensors(keys, {r.name: r for r in records}, dict(buffers)))
        is not None,
        "total_parameters": sum(r.numel for r in records),
        "files": files,
    }
    manifest[CHECKSUM] = {"crc32c": canonical_checksum(manifest)}
    _atomic.write_file(tmp / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    _atomic.commit(tmp, root / tag, carry=foreign_entries(root / tag))
    if save_latest:
        _atomic.write_latest(root, tag)
