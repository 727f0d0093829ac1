"""`DeepSpeedEngine`: the engine `zswap.deepspeed.initialize` returns — a `zswap.Engine` whose checkpoint
methods take DeepSpeed's arguments and return what DeepSpeed's return, plus the few DeepSpeed engine queries
scripts call. zswap's own `Engine` keeps its own shapes (``load_checkpoint`` returns the client state)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from ..checkpoint._atomic import LATEST
from ..errors import ZswapWarning
from ..train import runtime
from ._args import refuse


class DeepSpeedEngine(runtime.Engine):
    """A `zswap.Engine` with DeepSpeed's checkpoint signatures:

    - ``save_checkpoint(save_dir, tag=None, client_state={}, save_latest=True,
      exclude_frozen_parameters=False)`` returns ``True``;
    - ``load_checkpoint(load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
      load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None)`` returns
      ``(checkpoint folder, client_state)``, and ``(None, None)`` with a `ZswapWarning` when no tag is given
      and ``load_dir/latest`` does not exist — DeepSpeed's "nothing to resume from", so a script that
      always tries to resume runs its first time too. Any other failure (a tag that does not exist, another
      model, a corrupt file) raises, as in `zswap.Engine.load_checkpoint`.

    ``load_module_strict=False``, ``custom_load_fn`` and ``exclude_frozen_parameters=True`` are not
    supported: a `TypeError` naming the argument.
    """

    def save_checkpoint(
        self,
        save_dir: Any,
        tag: Any = None,
        client_state: Any = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        refuse(
            "DeepSpeedEngine.save_checkpoint", exclude_frozen_parameters=(exclude_frozen_parameters, False)
        )
        tag = None if tag is None else str(tag)  # DeepSpeed takes any tag and formats it
        super().save_checkpoint(save_dir, tag, client_state or {}, save_latest=bool(save_latest))
        return True

    def load_checkpoint(
        self,
        load_dir: Any,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, Any]:
        refuse(
            "DeepSpeedEngine.load_checkpoint",
            load_module_strict=(load_module_strict, True),
            custom_load_fn=(custom_load_fn, None),
        )
        if tag is None and load_dir not in (None, "") and not (Path(os.fspath(load_dir)) / LATEST).is_file():
            warnings.warn(
                f"load_checkpoint: no {LATEST!r} file in {os.fspath(load_dir)!r}: nothing loaded, "
                f"returning (None, None) as DeepSpeed does (pass tag= to load a given checkpoint)",
                ZswapWarning,
                stacklevel=2,
            )
            return None, None
        tag = None if tag is None else str(tag)
        client_state = super().load_checkpoint(
            load_dir,
            tag,
            load_optimizer_states=load_optimizer_states,
            load_module_only=load_module_only,
            load_lr_scheduler_states=load_lr_scheduler_states,
        )
        if tag is None:
            tag = (Path(os.fspath(load_dir)) / LATEST).read_text().strip()
        return os.path.join(os.fspath(load_dir), tag), client_state

    def empty_partition_cache(self) -> None:
        """Release every param the engine holds gathered between iterations (persistent small params are
        fetched again, as after a step)."""
        self._check_open()
        self._sched.drop_all()
        self._sched.fetch_persistent([s for s in self._slots.values() if s.persistent])

    def train_batch_size(self) -> int | None:
        """Samples per optimizer step over all ranks (the config's, or derived; ``None`` if it gives none)."""
        return self.config.batch.resolve(self._world())[0]

    def train_micro_batch_size_per_gpu(self) -> int | None:
        """Samples per forward/backward on this rank (the config's, or derived; ``None`` if it gives none)."""
        return self.config.batch.resolve(self._world())[1]

    def get_global_grad_norm(self) -> float | None:
        """The gradients' global L2 norm seen by the last step (``None`` when that step did not need it)."""
        return self.last_grad_norm

    def _world(self) -> int:
        from ..step import stepping

        return stepping.world_size(self._items)


__all__ = ["DeepSpeedEngine"]
