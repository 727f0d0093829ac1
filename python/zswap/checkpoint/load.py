"""``engine.load_checkpoint``: validate everything, then stream each rank's slices into its partitions.

Order, so that a bad checkpoint changes nothing: (1) manifest, model (every param's name, shape and dtype)
and optimizer checked; (2) every read planned — which bytes of which file this rank needs, at this world
size — and the CRC-32C of every block they touch verified, with every file's size; (3) all ranks agree that
all of that passed; only then (4) partitions are written to their stores (at most `WRITE_BATCH_BYTES`
queued), buffers copied, optimizer records filled through the optimizer's record walk, and the scheduler,
loss scaler, RNG and counters restored. An I/O error in step 4 is the one case that can leave the model
partly loaded; it is raised.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._interrupts import deferred
from .._progress import progress
from ..errors import ZswapWarning
from ..parts.gather import no_torch_function
from ..step.optim import OffloadedAdamW
from ..step.optim._layout import needs_master
from ..step.stepping import few
from . import _masters
from ._atomic import LATEST
from ._collective import agree, all_gather, group_of
from ._reader import Piece, Reader, window
from ._state import check_state, set_rng_state, unpickle
from .errors import CheckpointArgumentError, CheckpointCorruptError, CheckpointMismatchError
from .manifest import (
    STATE_KINDS,
    ParamRecord,
    check_dir,
    check_model,
    describe,
    dtype_of,
    file_name,
    persistent_buffers,
    read_manifest,
    resolve,
    same_tag,
)

if TYPE_CHECKING:
    from ._training import TrainingState

WRITE_BATCH_BYTES = 64 << 20
"""Partition writes queued to a store before waiting for them."""


def has_latest(engine: TrainingState, load_dir: str | os.PathLike[str]) -> bool:
    """Whether ``load_dir/latest`` exists, decided on every rank alike: some ranks seeing it and others
    not (a node-local folder not copied everywhere) is a `CheckpointArgumentError` on all of them, never
    some ranks loading while the others do not."""
    group, _, world = group_of(describe(engine.module))
    seen = all_gather(os.path.isfile(os.path.join(os.fspath(load_dir), LATEST)), group, world)
    if all(seen) or not any(seen):
        return bool(seen[0])
    raise CheckpointArgumentError(
        f"load_checkpoint: {os.path.join(os.fspath(load_dir), LATEST)!r} is there on rank(s) "
        f"{', '.join(str(r) for r, s in enumerate(seen) if s)} but not on "
        f"{', '.join(str(r) for r, s in enumerate(seen) if not s)}: every rank must see the same checkpoint"
    )


def load_checkpoint(
    engine: TrainingState,
    load_dir: str | os.PathLike[str],
    tag: str | None = None,
    *,
    load_optimizer_states: bool = True,
    load_module_only: bool = False,
    load_lr_scheduler_states: bool = True,
) -> Any:
    """See `zswap.Engine.load_checkpoint`. Returns the saved ``client_state``."""
    root = check_dir(load_dir, "load_checkpoint: load_dir")
    records = describe(engine.module)
    group, rank, world = group_of(records)
    same_tag(tag, "load_checkpoint", group, world)
    plan: _Plan | None = None
    error: BaseException | None = None
    try:
        folder, _ = resolve(root, tag)
        plan = _Plan(
            engine,
            records,
            folder,
            rank,
            world,
            optimizer=load_optimizer_states and not load_module_only,
            full=not load_module_only,
            scheduler=load_lr_scheduler_states,
        )
        plan.reader.verify()
        plan.load_state()
    except Exception as e:
        error = e
    try:
        agree(error, "load_checkpoint (validation)", group, world)
        assert plan is not None
        # Each rank resolved its tag itself (its own ``latest``, which a save may have replaced meanwhile,
        # or its own copy of the folder): one checkpoint, or none loads.
        tags = all_gather(plan.reader.folder.name, group, world)
        if len(set(tags)) > 1:
            raise CheckpointArgumentError(
                "load_checkpoint: the ranks resolved different checkpoints ("
                + ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
                + "): pass the same tag= on every rank, or give each the same 'latest'"
            )
        with deferred():  # a first Ctrl-C waits for the load to be whole (a second stops it, partly loaded)
            client_state = plan.apply()
        logging.getLogger(__name__).info("checkpoint loaded: %s (rank %d of %d)", folder, rank, world)
        return client_state
    finally:
        if plan is not None:
            plan.reader.close()


class _Plan:
    def __init__(
        self,
        engine: TrainingState,
        records: list[ParamRecord],
        folder: Path,
        rank: int,
        world: int,
        *,
        optimizer: bool,
        full: bool,
        scheduler: bool = True,
    ) -> None:
        self.engine, self.records, self.rank, self.world = engine, records, rank, world
        self.full = full
        self.scheduler = scheduler
        self.manifest = m = read_manifest(folder)
        check_model(m, records, folder)
        self.reader = r = Reader(folder, m)
        self.saved = {p["name"]: p for p in m["params"]}
        self.src = rank if rank < r.world else 0  # the saved rank whose small state this rank takes
        # Params: this rank's slice of each.
        self.params: list[tuple[ParamRecord, list[Piece]]] = []
        for rec in records:
            pcs = r.pieces(self.saved[rec.name], "params", rec.start, rec.partition_numel)
            r.need(pcs, rec.dtype)
            self.params.append((rec, pcs))
        self.buffers = self._plan_buffers(folder)
        self.state_file = file_name(self.src, r.world, "state")
        r.need_whole(self.state_file)  # a module-only load returns its client_state too
        self.optim: Any = None
        if optimizer and engine.optimizer is not None:
            self.optim = self._plan_optimizer(folder)
        self.masters: _masters.Plan = {}
        if self.optim is None and engine.optimizer is not None:  # the masters it holds: DeepSpeed's rules
            saved_opt = m["optimizer"] if full else None
            named = (
                None if saved_opt is None or saved_opt["kind"] != "zswap" else saved_opt["layout"][self.src]
            )
            state = None if named is None else {name for name, _, _ in named}
            self.masters = _masters.plan(engine.optimizer, self.params, r, self.saved, state)
        self.state: dict[str, Any] | None = None

    def load_state(self) -> None:
        """Unpickle ``state.pt`` (checksum verified) with ``weights_only=True`` and check what the load
        will use of it, before anything is written (a module-only load uses its ``client_state`` alone,
        which it returns as DeepSpeed does)."""
        path = self.reader.folder / self.state_file
        state = unpickle(self.reader.whole[self.state_file], path)
        needs = self._state_needs() if self.full else {"rng": False, "optimizer": None}
        self.state = check_state(state, path, needs)

    def _state_needs(self) -> dict[str, Any]:
        opt = self.engine.optimizer
        return {
            "rng": self.rank < self.reader.world,
            "optimizer": None if self.optim is None else (self.optim[0], len(opt.param_groups)),
        }

    def _plan_buffers(self, folder: Path) -> list[tuple[torch.Tensor, str]]:
        live = persistent_buffers(self.engine.module)
        saved = {b["name"]: b for b in self.manifest["buffers"]}
        out = []
        for name, b in live:
            s = saved.get(name)
            if s is None or list(b.shape) != s["shape"] or dtype_of(s["dtype"]) != b.dtype:
                found = "none" if s is None else f"{s['dtype']} {tuple(s['shape'])}"
                raise CheckpointMismatchError(
                    f"{folder} is a checkpoint of another model: buffer {name!r} is {found} there, "
                    f"{str(b.dtype).removeprefix('torch.')} {tuple(b.shape)} here"
                )
            self.reader.need_entry(file_name(0, self.reader.world, "params"), name, s["shape"])
            out.append((b, name))
        return out

    def _plan_optimizer(self, folder: Path) -> Any:
        opt = self.engine.optimizer
        saved = self.manifest["optimizer"]
        if saved is None:
            raise CheckpointMismatchError(
                f"{folder} holds no optimizer state; pass load_optimizer_states=False to load the rest"
            )
        by_id = {id(rec.p): rec.name for rec in self.records}
        groups = [[by_id.get(id(p), "?") for p in g["params"]] for g in opt.param_groups]
        zswap_kind = isinstance(opt, OffloadedAdamW)
        if (saved["kind"] == "zswap") != zswap_kind or saved["type"] != type(opt).__name__:
            raise CheckpointMismatchError(
                f"{folder} holds the state of a {saved['type']} optimizer; "
                f"this engine's is {type(opt).__name__}"
            )
        if groups != saved["groups"]:
            raise CheckpointMismatchError(
                f"{folder}: the optimizer's param groups differ from the saved ones "
                f"({[len(g) for g in saved['groups']]} params per group there, "
                f"{[len(g) for g in groups]} here)"
            )
        r = self.reader
        if not zswap_kind:
            if r.world != self.world:
                raise CheckpointMismatchError(
                    f"{folder} was saved by {r.world} ranks; the state of a {type(opt).__name__} (not "
                    f"zswap.optim.OffloadedAdamW) holds per-rank partitions and loads only at that world size"
                )
            name = file_name(self.rank, r.world, "optim")
            for entry in r.file(name).entries:
                r.need_entry(name, entry)
            return ("torch", name)
        flat = [n for g in groups for n in g]
        index = {n: i for i, n in enumerate(flat)}
        params = [p for g in opt.param_groups for p in g["params"]]
        layout = []
        reads: dict[int, list[tuple[str, list[Piece]]]] = {}
        for name, step, _ in saved["layout"][self.src]:
            i = index[name]
            rec = next(x for x in self.records if x.name == name)
            layout.append((i, int(step), opt.state_numel(i)))
            kinds = [k for k in STATE_KINDS if k != "master" or needs_master(params[i])]
            reads[i] = []
            for kind in kinds:
                pcs = r.pieces(self.saved[name], kind, rec.start, rec.partition_numel)
                r.need(pcs, torch.float32)
                reads[i].append((kind, pcs))
        return ("zswap", layout, reads)

    def _requires_grad_changes(self) -> tuple[list[str], list[str]]:
        """Names of params trainable here but frozen when the checkpoint was saved, and the reverse (the
        manifest's ``requires_grad``; absent from older checkpoints: no names)."""
        thawed: list[str] = []
        frozen: list[str] = []
        for rec in self.records:
            was = self.saved[rec.name].get("requires_grad")
            if isinstance(was, bool) and was != rec.p.requires_grad:
                (thawed if rec.p.requires_grad else frozen).append(rec.name)
        return thawed, frozen

    def _warn_requires_grad_changes(self) -> None:
        """Loading optimizer state into a model whose frozen params changed is allowed (unfreezing layers
        for a second phase is common) but never silent."""
        thawed, frozen = self._requires_grad_changes()
        if thawed:
            warnings.warn(
                f"{few(thawed)}: trainable here but frozen when the checkpoint was saved, which holds "
                "no optimizer state for them: their moments start at zero and their step count at 0",
                ZswapWarning,
                stacklevel=5,
            )
        if frozen:
            warnings.warn(
                f"{few(frozen)}: frozen here but trainable when the checkpoint was saved: their "
                "optimizer state is loaded and kept, unused while they are frozen",
                ZswapWarning,
                stacklevel=5,
            )

    # -- applying ------------------------------------------------------------------------------------

    def apply(self) -> Any:
        with no_torch_function(), torch.no_grad():
            self._load_params()
            for b, name in self.buffers:
                tmp = torch.empty(b.shape, dtype=b.dtype)
                self.reader.file(file_name(0, self.reader.world, "params")).read_elements(
                    name, 0, tmp.view(-1)
                )
                b.copy_(tmp)
            state = self.state
            if self.optim is not None:
                self._load_optimizer(state)
                self._warn_requires_grad_changes()
            _masters.apply(self.engine.optimizer, self.masters, self.reader)
        if state is None:
            return None
        if self.full:
            self._restore_small(state)
        return state["client_state"]

    def _load_params(self) -> None:
        queued: dict[int, Any] = {}
        queued_bytes = 0
        for rec, pcs in progress(self.params, "loading checkpoint", unit="param"):
            if rec.st is None:
                part = torch.empty(rec.numel, dtype=rec.dtype)
                self.reader.read(pcs, part)
                rec.p.data.copy_(part.view(rec.shape))
                continue
            st = rec.st
            engine = getattr(st.store, "engine", None)
            part = (
                engine.empty((st.partition_numel,), st.dtype)
                if engine is not None
                else torch.empty(st.partition_numel, dtype=st.dtype)
            )
            self.reader.read(pcs, part)
            if st.device.type != "cpu" and st.tier == "none":
                part = part.to(st.device)
            st.store.put(st.key, part)
            queued[id(st.store)] = st.store
            queued_bytes += part.numel() * part.element_size()
            if queued_bytes > WRITE_BATCH_BYTES:
                for store in queued.values():
                    store.wait_all()
                queued, queued_bytes = {}, 0
        for store in queued.values():
            store.wait_all()

    def _load_optimizer(self, state: Any) -> None:
        opt = self.engine.optimizer
        if self.optim[0] == "torch":
            name = self.optim[1]
            f = self.reader.file(name)
            skeleton = state["optimizer"]
            sd_state: dict[Any, dict[str, Any]] = {}
            for pid, st in skeleton["state"].items():
                out: dict[str, Any] = {}
                for k, v in st.items():
                    if isinstance(v, tuple) and len(v) == 2 and v[0] == "__tensor__":
                        e = f.entry(v[1])
                        t = torch.empty(e.shape, dtype=e.dtype)
                        f.read_elements(v[1], 0, t.view(-1))
                        out[k] = t
                    else:
                        out[k] = v
                sd_state[pid] = out
            opt.load_state_dict({"state": sd_state, "param_groups": skeleton["param_groups"]})
            return
        _, layout, reads = self.optim
        if state is not None:
            for ours, theirs in zip(opt.param_groups, state["optimizer"]["param_groups"], strict=True):
                ours.update(theirs)
            opt.skipped_steps = int(state["optimizer"]["skipped_steps"])
        opt.restore_layout(layout)
        kind_at = {k: j for j, k in enumerate(STATE_KINDS)}

        def fill(i: int, start: int, views: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> None:
            n = views[0].numel()
            for kind, pcs in reads[i]:
                view = views[kind_at[kind]]
                if view is None:
                    raise CheckpointCorruptError(f"optimizer state of param {i} has no {kind} record here")
                self.reader.read(window(pcs, start, n), view)

        opt.stream_state(fill, write=True, params=reads)

    def _restore_small(self, state: dict[str, Any]) -> None:
        e = self.engine
        m = self.manifest
        e.global_steps = int(m["global_steps"])
        e.skipped_steps = int(m["skipped_steps"])
        if hasattr(e, "micro_steps"):
            e.micro_steps = int(m.get("micro_steps", 0))
            # A load begins a new accumulation window (as DeepSpeed's does): of this run's
            # gradient_accumulation_steps, whatever the saved run's was, and with no gradient of the
            # window the load abandoned (the checkpoint holds none).
            e._window_from = e.micro_steps
            zero = getattr(e, "zero_grad", None)
            if callable(zero):
                zero()
        for attr in ("lr_scheduler", "loss_scaler"):
            if attr == "lr_scheduler" and not self.scheduler:
                continue  # load_lr_scheduler_states=False: the schedule stays where this run has it
            obj = getattr(e, attr, None)
            if obj is not None and state.get(attr) is not None:
                obj.load_state_dict(state[attr])
        if self.rank < self.reader.world:  # RNG streams belong to their rank
            set_rng_state(state["rng"])
