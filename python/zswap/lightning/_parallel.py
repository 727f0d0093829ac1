"""The process plumbing `ZswapStrategy` needs from Lightning: one process, or several started by
Lightning's own launcher, joined by a torch.distributed process group.

Not a ``DDPStrategy``: zswap reduce-scatters the gradients itself (no DDP wrapper), and Lightning treats
every ``DDPStrategy`` as distributed — it would swap a single process's sampler for a shuffling
``DistributedSampler``. Here a single process runs as Lightning's single-device strategy does (the
DataLoader's own sampler, no process group, no reseeding); with several, the launcher re-runs the script
for ranks 1… (``_SubprocessScriptLauncher``, DDP's default ``"popen"`` start), each rank joins the group
(gloo on CPU) and gets its shard of the data. The multiprocessing starts (``spawn`` / ``fork``) are not
offered: they send rank 0's ``state_dict`` back to the parent, which for partitioned params holds only
empty tensors.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only


class ProcessGroupStrategy(ParallelStrategy):
    """Ranks, launcher and collectives (barrier, broadcast, reduce) of a strategy that needs no module
    wrapper. ``process_group_backend`` defaults to the device's (gloo on CPU); ``timeout`` bounds every
    collective."""

    def __init__(
        self,
        *,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def world(self) -> int:
        """Processes over all nodes."""
        return self.num_nodes * self.num_processes

    @property
    def is_distributed(self) -> bool:
        """Whether Lightning should shard the data (a ``DistributedSampler``): only with several ranks."""
        return self.world > 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world, "rank": self.global_rank}

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.world > 1:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        if self.world > 1:
            reset_seed()  # every rank starts from the seed rank 0 was given
            backend = self._process_group_backend or _get_default_process_group_backend_for_device(
                self.root_device
            )
            self._process_group_backend = backend
            assert self.cluster_environment is not None
            _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.world)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def model_to_device(self) -> None:
        pass  # the engine places what it gathers; the module itself holds only partitions

    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor
