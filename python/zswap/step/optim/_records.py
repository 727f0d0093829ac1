"""`Records`: an `OffloadedAdamW`'s records as the code that steps or restores them outside the optimizer
sees them (the early step in backward, checkpoint state), so none of it reaches into the optimizer.

Param ``i`` is the optimizer's ``i``-th param in walk order (`params`); its record segment lives in one
of `sub_groups` once it is placed (its first step, or a load); `steps` counts its applied steps, which
the AdamW bias correction reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ...store.storage import Transaction
    from ._layout import SubGroup
    from .adamw import OffloadedAdamW


class Records:
    __slots__ = ("_opt",)

    def __init__(self, opt: OffloadedAdamW) -> None:
        self._opt = opt

    @property
    def params(self) -> list[torch.Tensor]:
        """The optimizer's params in walk order (the list itself: `zswap.module_api` swaps resized ones)."""
        return self._opt._params

    @property
    def steps(self) -> list[int]:
        """Applied steps per param (the list itself; `set_step`, `reset_steps` change it)."""
        return self._opt._steps

    def set_step(self, i: int, n: int) -> None:
        self._opt._steps[i] = n

    def reset_steps(self, steps: list[int]) -> None:
        """Every param's step count at once (a loaded state: no seed left, `OffloadedAdamW.seed_masters`)."""
        self._opt._steps, self._opt._seeded = list(steps), {}

    @property
    def sub_groups(self) -> list[SubGroup]:
        """The records placed so far, in walk order (the list itself)."""
        return self._opt._sub_groups

    def placed(self, i: int) -> bool:
        return i in self._opt._placed

    @property
    def store(self) -> Any:
        """Where the records live (`zswap.optim._store`: memory or an NVMe namespace)."""
        return self._opt._store

    def place(self, indices: list[int]) -> None:
        """Give the params ``indices`` their place in the sub-groups (those without one yet)."""
        self._opt._place(indices)

    def update(
        self,
        sg: SubGroup,
        record: torch.Tensor,
        steps: dict[int, int],
        grads: dict[int, torch.Tensor],
        scale: float,
        txn: Transaction,
        targets: dict[int, torch.Tensor] | None = None,
    ) -> None:
        """The AdamW kernel over ``sg``'s segments whose param is in ``steps`` (`OffloadedAdamW._update`)."""
        self._opt._update(sg, record, steps, grads, scale, txn, targets=targets)
