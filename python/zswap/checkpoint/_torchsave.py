"""A ``torch.save`` archive of a state dict whose partitioned params are gathered one at a time, as each
one's bytes are written, so memory holds one param, never the model.

``torch.save`` pickles the object first, naming every storage it meets by a key (``data.pkl``), and then
writes each storage as a zip record ``data/<key>``; `torch.load` (``weights_only=True`` and ``mmap=True``
included) reads records by name. Here the pickle is made from `Pending` placeholders (what
`zswap.checkpoint.statedict.deferred` puts in a state dict for each partitioned param), which pickle as
the tensor ``torch.save`` would write for the full value, and the records are written in key order, each
pending one gathered right before. The archive is what ``torch.save`` writes for the gathered state dict:
same records, same pickle, a tied param one storage under each of its names.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import sys
from collections import OrderedDict
from typing import IO, Any

import torch
from torch.serialization import location_tag

from ..parts.params import ParamState
from ._gather import full_copy


class Pending:
    """A partitioned param's entry in a state dict: its full value is gathered when it is written."""

    __slots__ = ("p", "st")

    def __init__(self, p: torch.Tensor, st: ParamState) -> None:
        self.p, self.st = p, st

    def __repr__(self) -> str:
        return f"Pending({tuple(self.st.shape)}, {self.st.dtype})"


class _Key:
    """The storage a `Pending` stands for, met by the pickler as ``torch.save`` meets a tensor's storage."""

    __slots__ = ("pending",)

    def __init__(self, pending: Pending) -> None:
        self.pending = pending


def _rebuild_args(pending: Pending) -> tuple[Any, ...]:
    shape = pending.st.shape
    stride, step = [], 1
    for n in reversed(shape):  # contiguous: the gathered value is written as one compact storage
        stride.append(step)
        step *= n
    return (_Key(pending), 0, tuple(shape), tuple(reversed(stride)), False, OrderedDict())


def save(obj: Any, out: IO[bytes] | None) -> None:
    """Write ``obj`` (a state dict holding `Pending` entries) to ``out`` as ``torch.save`` would write it
    with each entry's full value. Every rank of the params' groups calls this with the same ``obj`` (each
    pending param is gathered, in the same order everywhere); ranks with ``out=None`` write nothing."""
    storages: dict[int, tuple[str, Any]] = {}  # param or storage id -> (key, Pending or storage)

    def persistent_id(o: Any) -> tuple[Any, ...] | None:
        if isinstance(o, _Key):
            key = _key(storages, id(o.pending.p), o.pending)  # a tied param: one storage, each name a tensor
            dtype, numel = o.pending.st.dtype, o.pending.st.shape.numel()
            return ("storage", _storage_type(dtype), key, "cpu", numel)
        if isinstance(o, torch.storage.TypedStorage):
            untyped = o._untyped_storage
            key = _key(storages, untyped._cdata, untyped)
            kind = getattr(torch, o._pickle_storage_type())
            return ("storage", kind, key, location_tag(untyped), o._size())
        if torch.is_storage(o):  # an untyped storage in the object itself
            key = _key(storages, o._cdata, o)
            return ("storage", torch.UntypedStorage, key, location_tag(o), o.nbytes())
        return None

    class Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            return persistent_id(o)

        def reducer_override(self, o: Any) -> Any:
            if isinstance(o, Pending):
                return (torch._utils._rebuild_tensor_v2, _rebuild_args(o))
            return NotImplemented

    buf = io.BytesIO()
    Pickler(buf, protocol=torch.serialization.DEFAULT_PROTOCOL).dump(obj)
    writer = torch._C.PyTorchFileWriter(out) if out is not None else None
    try:
        if writer is not None:
            records = [("data.pkl", buf.getvalue())]
            alignment = getattr(torch.serialization, "_get_storage_alignment", None)
            if alignment is not None:  # (the torch versions that write these two records have it)
                records += [(".format_version", b"1"), (".storage_alignment", str(alignment()).encode())]
            records.append(("byteorder", sys.byteorder.encode()))
            for name, data in records:
                writer.write_record(name, data, len(data))
        for key, item in storages.values():  # (insertion order: the keys' order, as torch.save writes them)
            _put(writer, key, item)
        if writer is not None:
            writer.write_end_of_file()
    except BaseException:
        if writer is not None:
            # torch's writer not ended writes the end of the archive when it is destroyed, and a failure
            # there (the disk that failed the write is still full) aborts the process: end it now, which
            # marks it ended even where that write fails too.
            with contextlib.suppress(Exception):
                writer.write_end_of_file()
        raise


def _put(writer: Any, key: str, item: Any) -> None:
    """Gather (a `Pending`) and write one storage; its bytes are let go on return, before the next."""
    storage = _gathered(item) if isinstance(item, Pending) else item
    if writer is not None:
        if storage.device.type != "cpu":
            storage = storage.cpu()
        writer.write_record(f"data/{key}", storage, storage.nbytes())


def _key(storages: dict[int, tuple[str, Any]], ident: int, item: Any) -> str:
    if ident not in storages:
        storages[ident] = (str(len(storages)), item)
    return storages[ident][0]


def _storage_type(dtype: torch.dtype) -> Any:
    return getattr(torch, torch.TypedStorage(0, dtype=dtype, _internal=True)._pickle_storage_type())


def _gathered(pending: Pending) -> torch.UntypedStorage:
    """The full value's bytes (`zswap.checkpoint._gather.full_copy`: a CPU tensor) as one compact storage of
    the pickled numel (an all-gather's output may be a view into a padded buffer: copied then)."""
    value = full_copy(pending.p, pending.st).detach()
    st = pending.st
    if value.dtype != st.dtype or value.shape != st.shape:
        got, want = f"{value.dtype} {tuple(value.shape)}", f"{st.dtype} {tuple(st.shape)}"
        raise AssertionError(f"a gathered param is {got}, its state says {want}")
    flat = value.reshape(-1)
    if flat.storage_offset() or flat.untyped_storage().nbytes() != flat.nbytes:
        flat = flat.clone()
    return flat.untyped_storage()
