"""`OffloadedAdamW`: Adam/AdamW whose float32 master weights and moments live in CPU memory or on NVMe.

A step, in order:

1. Collect the params to update (``requires_grad`` and a gradient) and check them.
2. Decide on the gradients alone — before any optimizer state is read — whether to step at all (fp16
   gradients that are not finite skip it) and by how much to scale them (``max_grad_norm``: the global
   L2 norm clipped exactly as `torch.nn.utils.clip_grad_norm_` does).
3. Walk the state's sub-groups (`_layout`) through the store (`_store`): for NVMe, the next record is read
   and the previous written while the Rust kernel updates the current one in place and writes the new
   weights, cast to the param dtype, straight into ``p.data``.

The walk is one `zswap.storage` transaction (or joins the caller's, `Engine.step`): records are written
copy-on-write, the step counters move only at its commit, and whatever changes in memory (params, CPU
records) is saved to its undo log first when any I/O takes part — so a step that fails changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, cast

import torch

from ...errors import UnsupportedDtypeError
from ...parts.params import param_state
from ...store.storage import Transaction, step_transaction
from ._build import ParamGroup, PathArg, Pipeline, check_hyper, config_kwargs, make_store
from ._kernel import STEPPED_DTYPES, cpu_adam_step, group_hypers, torch_tail
from ._layout import SubGroup, cut, default_sub_group_size
from ._records import Records
from ._state import gather_state, scatter_state
from ._store import NvmeStore

StateVisit = Callable[[int, int, tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]], None]
"""``fn(param index, start, (exp_avg, exp_avg_sq, master or None))`` of `OffloadedAdamW.stream_state`."""


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW (or Adam with L2 decay) with its state on an offload tier, stepped by a SIMD CPU kernel.

    Args:
        params: params or param groups, as for any `torch.optim.Optimizer`. Params must be CPU tensors
            (float32, bfloat16 or float16); gradients may be any of those dtypes.
        lr, betas, eps, weight_decay: as `torch.optim.AdamW` (defaults 1e-3, (0.9, 0.999), 1e-8, 1e-2).
        decoupled_weight_decay: AdamW's ``p *= 1 - lr*wd`` (default) or, when false, Adam's
            ``g += wd*p``.
        device: ``"cpu"`` keeps the state in host memory; ``"nvme"`` keeps it in swap files behind a
            `zswap.SwapEngine`.
        nvme_path: for ``"nvme"``, a directory (or several, striped) for a new engine that this optimizer
            owns and closes in `close`.
        engine: for ``"nvme"``, an existing engine to use instead (shared; keys are prefixed per optimizer).
        sub_group_size: elements of state per sub-group, the unit moved to and from NVMe; default about
            1/32 of the state, between 1 Mi and 1e8 elements.
        pin_memory: keep the ``"cpu"`` tier's state in page-locked memory where CUDA is available
            (``offload_optimizer.pin_memory``); no effect without CUDA or on the ``"nvme"`` tier.
        pipeline: overlap the NVMe transfers with compute: True (read ahead and write behind, default),
            ``"read"`` or ``"write"`` for one of the two, False for neither.
        max_grad_norm: clip the gradients' global L2 norm to this, as `clip_grad_norm_` computes it; the
            scale is applied in float32 inside the kernel, so ``p.grad`` is left as it is.

    A float32 param is its own master; every other param gets a float32 master, seeded from the param on
    its first step (so a param changed behind the optimizer's back after that is overwritten). With
    float16 gradients a step whose gradients are not all finite is skipped: no state changes and
    `skipped_steps` counts it. `last_grad_norm` holds the global norm when it was computed.
    """

    scale_source: Callable[[], float] | None = None
    """The current fp16 loss scale of the engine that steps this optimizer, where it gave one
    (`zswap.deepspeed`'s engine): what `cur_scale` reports."""
    overflow = False
    """Whether the engine's last optimizer step was skipped for gradients that were not finite (DeepSpeed's
    ZeRO optimizers' ``overflow``; kept by `zswap.deepspeed`'s engine)."""

    transactional = True
    """Its step saves what it changes in memory to the step transaction's undo log itself (so
    `zswap.train.bridge.step_partitions` need not)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        decoupled_weight_decay: bool = True,
        device: Literal["cpu", "nvme"] = "cpu",
        nvme_path: PathArg | Sequence[PathArg] | None = None,
        engine: Any = None,
        sub_group_size: int | None = None,
        pipeline: Pipeline = True,
        pin_memory: bool = False,
        max_grad_norm: float | None = None,
    ) -> None:
        check_hyper(lr, betas, eps, weight_decay)
        if sub_group_size is not None and (
            isinstance(sub_group_size, bool) or not isinstance(sub_group_size, int) or sub_group_size <= 0
        ):
            raise ValueError(f"sub_group_size must be a positive int, got {sub_group_size!r}")
        if max_grad_norm is not None and not float(max_grad_norm) > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        self._params: list[torch.Tensor] = []
        self._group_of: list[int] = []
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "decoupled_weight_decay": bool(decoupled_weight_decay),
        }
        super().__init__(params, defaults)
        self._store = make_store(device, nvme_path, engine, pipeline, pin_memory)
        self._sub_group_size = sub_group_size
        self._sub_groups: list[SubGroup] = []
        self._placed: dict[int, int] = {}  # param index -> its numel, once it has a place in the sub-groups
        self._steps: list[int] = [0] * len(self._params)
        self._seeded: dict[int, Callable[[], bool]] = {}  # `seed_masters`: whether each seed still holds
        self.records = Records(self)
        """Its records as the early step and checkpoint state use them (`zswap.optim._records`)."""
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None

    @classmethod
    def from_config(
        cls,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        config: Any = None,
        *,
        lr: float | None = None,
        weight_decay: float | None = None,
        engine: Any = None,
        max_grad_norm: float | None = None,
    ) -> OffloadedAdamW:
        """The optimizer a zswap / DeepSpeed config describes (its ``optimizer``, ``offload_optimizer``,
        ``zero_optimization.sub_group_size`` and ``aio`` sections). `config` is anything
        `zswap.load_config` takes. `lr` / `weight_decay` fill in values the config leaves "auto" (and win
        over the config's); `engine` is used instead of building one from ``aio`` and ``nvme_path``.
        Raises `zswap.ConfigError` when the config leaves ``lr`` "auto" and no `lr` is given."""
        kwargs, owned = config_kwargs(config, lr=lr, weight_decay=weight_decay, engine=engine)
        try:
            opt = cls(params, max_grad_norm=max_grad_norm, **kwargs)
        except BaseException:
            if owned:
                kwargs["engine"].close_if_unused()
            raise
        if owned:
            cast(NvmeStore, opt._store).owns_engine = True
        return opt

    # -- torch.optim.Optimizer -------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        merged = {**self.defaults, **param_group}
        check_hyper(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"])
        super().add_param_group(ParamGroup(param_group))  # torch keeps the dict it is given
        added = self.param_groups[-1]["params"]
        for p in added:  # (a frozen one is never stepped: torch's optimizers take it too)
            st = param_state(p)
            dtype, shape = (st.dtype, tuple(st.shape)) if st is not None else (p.dtype, tuple(p.shape))
            if p.requires_grad and dtype not in STEPPED_DTYPES:
                del self.param_groups[-1]
                raise UnsupportedDtypeError(
                    f"OffloadedAdamW steps float32, bfloat16 and float16 params: a param of shape {shape} in "
                    f"param group {len(self.param_groups)} is {dtype}; cast the model to one of them "
                    "(model.float()) before building the optimizer"
                )
        self._params.extend(added)
        self._group_of.extend([len(self.param_groups) - 1] * len(added))
        if hasattr(self, "_steps"):  # not yet during __init__
            self._steps.extend([0] * len(added))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, grad_scale: float | None = None) -> Any:
        """One optimizer step over every param with ``requires_grad`` and a gradient; returns what
        `closure` returned (it is called with grad enabled, as in torch).

        `grad_scale` multiplies every gradient (in float32, inside the kernel) on top of any clipping:
        for a caller that removes a loss scale, or that clips by a norm taken over more params than
        this call sees (stepping in chunks)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = self._collect()
        if not todo:
            return loss
        scale = self._grad_scale(todo, 1.0 if grad_scale is None else float(grad_scale))
        if scale is None:
            self.skipped_steps += 1
            return loss
        with step_transaction() as txn:
            layout = (len(self._sub_groups), dict(self._placed), self._sub_group_size)

            def unplace() -> None:  # a failed first step places nothing: the retry places the same
                del self._sub_groups[layout[0] :]
                self._placed, self._sub_group_size = layout[1], layout[2]

            txn.on_abort(unplace)
            self._place(todo)
            steps = {i: self._steps[i] + 1 for i in todo}  # the counters move only when the step commits
            grads = {i: _flat(cast(torch.Tensor, self._params[i].grad)) for i in todo}
            walk = [sg for sg in self._sub_groups if any(s.param in steps for s in sg.segments)]
            if self._store.tier == "nvme":
                txn.uses(cast(NvmeStore, self._store).storage)

            def update(sg: SubGroup, record: torch.Tensor) -> None:
                self._update(sg, record, steps, grads, scale, txn)

            def commit() -> None:
                for i, n in steps.items():
                    self._steps[i] = n

            txn.on_commit(commit)
            self._store.stream(walk, update, txn=txn)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: ``{"state": {index: {"step", "exp_avg", "exp_avg_sq"[, "master"]}},
        "param_groups": [...]}``, all tensors on CPU, moments float32 in the param's shape. Gathered from
        the store record by record."""
        for pre in self._optimizer_state_dict_pre_hooks.values():
            pre(self)
        state = gather_state(self)
        groups = []
        index = 0
        for g in self.param_groups:
            groups.append(
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": list(range(index, index + len(g["params"]))),
                }
            )
            index += len(g["params"])
        out: dict[str, Any] = {"state": state, "param_groups": groups}
        for post in self._optimizer_state_dict_post_hooks.values():
            res = post(self, out)
            if res is not None:
                out = res
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class or of `torch.optim.Adam`/`AdamW` (moments are converted to
        float32; a missing master is taken from the param). Params without an entry start afresh."""
        for pre in self._optimizer_load_state_dict_pre_hooks.values():
            res = pre(self, state_dict)
            if res is not None:
                state_dict = res
        scatter_state(self, state_dict)
        for post in self._optimizer_load_state_dict_post_hooks.values():
            post(self)

    # -- zswap -----------------------------------------------------------------------------------

    @property
    def cur_scale(self) -> float:
        """DeepSpeed's ZeRO optimizers' ``cur_scale`` (and ``loss_scale``): the fp16 loss scale losses are
        multiplied by (`scale_source`); 1.0 without fp16 or outside `zswap.deepspeed`."""
        return 1.0 if self.scale_source is None else self.scale_source()

    @property
    def loss_scale(self) -> float:
        """`cur_scale`, under DeepSpeed's other name for it."""
        return self.cur_scale

    @property
    def tier(self) -> str:
        """Where the state lives: "cpu" or "nvme"."""
        return self._store.tier

    @property
    def sub_groups(self) -> tuple[SubGroup, ...]:
        """The state's records so far (a param gets its place on its first step), in walk order."""
        return tuple(self._sub_groups)

    # -- checkpoints (zswap.checkpoint) ------------------------------------------------------------

    def state_numel(self, i: int) -> int:
        """Elements of param ``i``'s state: its local partition for a param zswap partitioned (which is
        what `zswap.Engine` shows the optimizer while it steps), else the param's own size."""
        p = self._params[i]
        st = param_state(p)
        return st.partition_numel if st is not None else p.numel()

    def state_layout(self) -> list[tuple[int, int, int]]:
        """(param index, steps taken, elements of state) of each param with state, in the order the records
        hold them (the order `stream_state` visits them)."""
        order: dict[int, None] = {}
        for sg in self._sub_groups:
            for seg in sg.segments:
                order.setdefault(seg.param)
        return [(i, self._steps[i], self._placed[i]) for i in order if self._steps[i] > 0]

    def stream_state(self, fn: StateVisit, *, write: bool, params: Iterable[int] | None = None) -> None:
        """Calls ``fn(i, start, (exp_avg, exp_avg_sq, master or None))`` for each segment of state (the
        float32 views of elements ``start:start+len`` of param ``i``'s state), record by record, in
        `state_layout` order with a param's segments in increasing ``start``. With ``write`` each record is
        written back after its visit. ``params``: only the records holding these params. A param placed but
        with no step taken (its state reset by `restore_layout` from a checkpoint that had none for it) has
        no state to visit: its first step starts it afresh."""
        wanted = None if params is None else set(params)

        def visits(i: int) -> bool:  # (a seed only where asked for by name: it is no state to save)
            return (wanted is None or i in wanted) and (
                self._steps[i] > 0 or (wanted is not None and self.seeded(i))
            )

        walk = [sg for sg in self._sub_groups if any(visits(s.param) for s in sg.segments)]

        def visit(sg: SubGroup, record: torch.Tensor) -> None:
            for seg, views in sg.slices(record):
                if visits(seg.param):
                    fn(seg.param, seg.start, views)

        self._store.stream(walk, visit, write=write)

    def seed_masters(self, fn: StateVisit, seeds: Mapping[int, Callable[[], bool]]) -> None:
        """Give the params ``seeds`` names that have taken no step a place, and have ``fn(i, start, views)``
        write each one's float32 master into its record: their first step starts the moments afresh from
        that master instead of the param, while ``seeds[i]()`` says the param is as it was (a write to it
        since — `GatheredParameters`, loaded weights — makes it start from the param again). For a load
        that keeps a checkpoint's masters, not its moments (`zswap.checkpoint._masters`). `restore_layout`,
        `load_state_dict` and `close` drop the seeds; a checkpoint saved before that first step holds the
        param, not the seed (it holds state only for params that stepped)."""
        wanted = {i for i in seeds if self._steps[i] == 0}
        if not wanted:
            return
        self._place(sorted(wanted))
        walk = [sg for sg in self._sub_groups if any(s.param in wanted for s in sg.segments)]

        def visit(sg: SubGroup, record: torch.Tensor) -> None:
            for seg, views in sg.slices(record):
                if seg.param in wanted:
                    fn(seg.param, seg.start, views)

        self._store.stream(walk, visit, write=True)
        self._seeded.update((i, seeds[i]) for i in wanted)

    def seeded(self, i: int) -> bool:
        """Whether param ``i``'s first step will start from a master `seed_masters` put in its record."""
        seed = self._seeded.get(i)
        return self._steps[i] == 0 and seed is not None and seed()

    def restore_layout(self, entries: Sequence[tuple[int, int, int]]) -> None:
        """Give each ``(param index, steps taken, elements)`` of a checkpoint its place in the records and its
        step count; every other param starts afresh. `stream_state` with ``write=True`` then fills them."""
        for i, step, numel in entries:
            if not 0 <= i < len(self._params) or step < 1 or numel != self.state_numel(i):
                raise ValueError(
                    f"param {i}: saved state of {numel} elements after {step} steps does not fit "
                    f"(the param's state has {self.state_numel(i) if 0 <= i < len(self._params) else 0})"
                )
        self._place(sorted(i for i, _, _ in entries))
        self._steps, self._seeded = [0] * len(self._params), {}
        for i, step, _ in entries:
            self._steps[i] = step

    def close(self) -> None:
        """Frees the state (and closes the engine if this optimizer built it). Idempotent."""
        self._store.close()
        self._sub_groups.clear()
        self._placed.clear()
        self._steps, self._seeded = [0] * len(self._params), {}

    def overwrites(self, params: Iterable[torch.Tensor]) -> set[int]:
        """``id`` of each of ``params`` that its next step here stores whole without reading it: a param
        with a float32 master past its first step (its records hold the master; the kernel steps that and
        rounds it into the param, which it only writes). A caller that loads such a param only to have
        it stepped need not read it (`zswap.train.bridge`), as long as it writes it back only where the
        step ran (`skipped_steps` unchanged)."""
        mastered = {s.param for sg in self._sub_groups if sg.has_master for s in sg.segments}
        index = {id(p): i for i, p in enumerate(self._params)}
        out = set()
        for p in params:
            i = index.get(id(p))
            if i is not None and i in mastered and self._steps[i] > 0 and p.requires_grad:
                out.add(id(p))
        return out

    # -- internals -------------------------------------------------------------------------------

    def _collect(self) -> list[int]:
        todo = []
        for i, p in enumerate(self._params):
            if p.grad is None:  # as torch: a param frozen after its gradient came is stepped
                continue
            g = p.grad
            if g.layout != torch.strided:
                raise TypeError(f"param {i}: OffloadedAdamW does not support {g.layout} gradients")
            if p.device.type != "cpu" or g.device.type != "cpu":
                raise ValueError(
                    f"param {i}: OffloadedAdamW updates CPU params, got {p.device} (grad {g.device})"
                )
            if g.shape != p.shape:
                raise ValueError(
                    f"param {i}: grad shape {tuple(g.shape)} differs from param {tuple(p.shape)}"
                )
            if not p.data.is_contiguous():
                raise ValueError(f"param {i} (shape {tuple(p.shape)}) must be contiguous")
            placed = self._placed.get(i)
            if placed is not None and placed != p.numel():
                raise ValueError(
                    f"param {i} has {p.numel()} elements but its optimizer state {placed}: "
                    "a param must keep its size from its first step on"
                )
            todo.append(i)
        return todo

    def _grad_scale(self, todo: list[int], extra: float) -> float | None:
        """The factor every gradient is multiplied by (`extra`, then clipping), or None to skip the step.
        Reads gradients only."""
        grads = [cast(torch.Tensor, self._params[i].grad) for i in todo]
        check_finite = any(
            g.dtype == torch.float16 or self._params[i].dtype == torch.float16
            for i, g in zip(todo, grads, strict=True)
        )
        self.last_grad_norm = None
        if self.max_grad_norm is None and not check_finite:
            return extra
        # The same reductions as clip_grad_norm_ (per-tensor norms, then the norm of those), in float32
        # so that float16 gradients cannot overflow the sum.
        norms = [torch.linalg.vector_norm(g, 2.0, dtype=torch.float32) for g in grads]
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        if check_finite and not torch.isfinite(total):
            self.last_grad_norm = float(total)
            return None
        if extra != 1.0:
            total = total * extra  # the norm of the scaled gradients
        self.last_grad_norm = float(total)
        if self.max_grad_norm is None:
            return extra
        coef = torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)
        return float(coef * extra)

    def _place(self, todo: list[int]) -> None:
        new = [i for i in todo if i not in self._placed]
        if not new:
            return
        if self._sub_group_size is None:
            total = sum(self.state_numel(i) for i in new)
            self._sub_group_size = default_sub_group_size(total)
        prefix = self._store.prefix
        for group in sorted({self._group_of[i] for i in new}):
            members = [(i, self._params[i], self.state_numel(i)) for i in new if self._group_of[i] == group]
            for sg in cut(prefix, len(self._sub_groups), group, members, self._sub_group_size):
                self._sub_groups.append(sg)
        self._placed.update((i, self.state_numel(i)) for i in new)

    def _update(
        self,
        sg: SubGroup,
        record: torch.Tensor,
        steps: dict[int, int],
        grads: dict[int, torch.Tensor],
        scale: float,
        txn: Transaction,
        targets: dict[int, torch.Tensor] | None = None,
    ) -> None:
        """Run the kernel on each segment of ``sg`` whose param is in ``steps``; the updated weights go to
        the param itself, or to ``targets[i]`` (a flat copy of param i) where given."""
        hypers = group_hypers(self.param_groups[sg.group])
        for seg, (m, v, w) in sg.slices(record):
            step = steps.get(seg.param)
            if step is None:
                continue
            if targets is not None:
                pf = targets[seg.param][seg.start : seg.stop]
            else:
                pf = self._params[seg.param].detach().view(-1)[seg.start : seg.stop]  # shares p's version
            txn.save(pf)  # a param in memory changes in place: put back if the step fails
            if step == 1:  # fresh state, as torch creates it on a param's first step
                m.zero_()
                v.zero_()
                if w is not None and not self.seeded(seg.param):
                    w.copy_(pf)
            cpu_adam_step(
                pf,
                grads[seg.param][seg.start : seg.stop],
                w,
                m,
                v,
                step=step,
                **hypers,
                grad_scale=scale,
                tail_from=self._tail_in(seg),
            )

    def _tail_in(self, seg: Any) -> int:
        """Where, in ``seg``, the scalar tail of its whole param falls in torch's fused AdamW (whose
        results the kernel reproduces element for element): a partitioned param's tail is that of the
        full tensor, so only the rank holding its end has one."""
        p = self._params[seg.param]
        st = param_state(p)
        numel, offset = (st.numel, st.rank * st.partition_numel) if st is not None else (p.numel(), 0)
        return max(0, torch_tail(numel) - offset - seg.start)


def _flat(g: torch.Tensor) -> torch.Tensor:
    return g.contiguous().view(-1)
