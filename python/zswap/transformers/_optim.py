"""The optimizer the Hugging Face Trainer builds, as zswap steps it; and what the Trainer's loop steps.

The Trainer builds its optimizer from the arguments (``optim``, ``learning_rate``, ``adam_*``), with two
param groups: weight decay for most params, none for biases and norms (``get_decay_parameter_names``). A
torch Adam / AdamW (or any optimizer when the zswap config has an ``optimizer`` section, which wins as under
DeepSpeed) becomes an `OffloadedAdamW` over the same groups with the same hyperparameters, its state where
the config's ``offload_optimizer`` puts it. Any other optimizer is used as given (its state in memory, in
the shape of each param's partition) — in float32 only: it would step bf16 / fp16 params themselves, with
no float32 master (`zswap.step.optim.adopt.refuse_without_masters`).

The Trainer's loop calls ``optimizer.step()`` once per accumulation window, after backward; `EngineStepper`
is what it holds as its optimizer, and that call runs ``engine.step()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..config import ZswapConfig
from ..errors import ConfigError
from ..parts.params import param_state
from ..step.optim import OffloadedAdamW
from ..step.optim.adopt import REFUSED, is_convertible, refuse_without_masters

ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
)
"""Optimizers whose update of an element depends on that element alone (and on per-step scalars): the
engine shows each param to them as its flat partition, which changes nothing of what they compute."""


def check_elementwise(optimizer: Any, where: str) -> None:
    """Refuse an optimizer whose update depends on a param's shape (Adafactor's factored moments, Muon's
    matrices …): stepped over flat partitions it would compute something else, and say nothing."""
    if type(optimizer) not in ELEMENTWISE:
        raise ConfigError(
            f"{where} is {type(optimizer).__name__}; zswap steps each param as its flat partition, which "
            "only an element-wise optimizer ("
            + ", ".join(c.__name__ for c in ELEMENTWISE)
            + ") computes the same over: use one of those, or AdamW (optim adamw_torch, or torch.optim.AdamW "
            "in optimizers=), which becomes zswap's offloaded AdamW"
        )


def to_zswap(client: torch.optim.Optimizer, cfg: ZswapConfig) -> Any:
    """The optimizer the engine steps in place of the Trainer's ``client``."""
    conf = cfg.optimizer
    if conf is None and not is_convertible(client):
        check_elementwise(client, "the optimizer TrainingArguments.optim builds")
        refuse_without_masters(
            client, cfg.dtype, "the optimizer TrainingArguments.optim builds", "Use an adamw optim"
        )
        return client
    name = type(client).__name__
    groups = []
    for i, group in enumerate(client.param_groups):
        for key in REFUSED:
            if group.get(key):
                raise ConfigError(
                    f"{name} param group {i}: {key}=True is not supported by zswap's offloaded AdamW "
                    "(which a torch Adam / AdamW becomes, also one in optimizers=): use an optim without it"
                )
        if conf is not None:  # the section's Adam knobs, whatever optimizer the arguments built (an SGD
            # has none: its groups gave torch's defaults in their place); lr and each group's decay agree
            # with it (`_fill`) and stay the groups'
            betas, eps, decoupled = conf.betas, conf.eps, conf.decoupled_weight_decay
        else:  # torch >= 2.6 keeps the flag in every group; before, AdamW alone decoupled
            betas, eps = group["betas"], group["eps"]
            decoupled = bool(group.get("decoupled_weight_decay", type(client) is torch.optim.AdamW))
        groups.append(
            {
                "params": list(group["params"]),
                "lr": float(group["lr"]),
                "betas": tuple(float(b) for b in betas),
                "eps": float(eps),
                "weight_decay": float(group.get("weight_decay", 0.0)),
                "decoupled_weight_decay": decoupled,
            }
        )
    lr, decay = float(client.param_groups[0]["lr"]), float(client.param_groups[0].get("weight_decay", 0.0))
    return OffloadedAdamW.from_config(groups, cfg, lr=lr, weight_decay=decay)


def flat_state(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` for an optimizer the engine steps as given, over each param's flat partition (one
    process: the whole param): a tensor saved in its param's shape (a plain Trainer's ``optimizer.pt``) is
    flattened, as the engine's own state dicts already are. Without it an SGD's momentum would meet the
    flat gradient at the first step, in a broadcasting error."""
    params = [p for group in opt.param_groups for p in group["params"]]
    state = {}
    for i, entry in state_dict["state"].items():
        st = param_state(params[i]) if isinstance(i, int) and i < len(params) else None
        state[i] = {
            k: v.reshape(-1)
            if st is not None
            and isinstance(v, torch.Tensor)
            and v.shape == st.shape
            and st.numel == st.partition_numel
            else v
            for k, v in entry.items()
        }
    return {**state_dict, "state": state}


class EngineStepper(torch.optim.Optimizer):
    """The Trainer's optimizer: ``step()`` is ``engine.step()`` (clipping, the update, zeroing the
    gradients); param groups, state and state dicts are the engine's optimizer's.

    ``Optimizer.__init__`` is not called (as Accelerate's own optimizer wrapper does not): it would hook
    ``step`` with torch's global step hooks, which refuse a step over managed params outside the engine.
    After each step `on_step` is called with the global gradient norm the engine saw."""

    def __init__(self, engine: Any, on_step: Callable[[float | None], None]) -> None:
        self.engine = engine
        self._on_step = on_step

    @property
    def optimizer(self) -> Any:
        return self.engine.optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.engine.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.engine.optimizer.param_groups = groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.engine.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.engine.optimizer.defaults = defaults

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.engine.optimizer.state

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.engine.step()
        self._on_step(self.engine.last_grad_norm)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        opt = self.engine.optimizer
        opt.load_state_dict(state_dict if isinstance(opt, OffloadedAdamW) else flat_state(opt, state_dict))

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"EngineStepper({self.engine.optimizer!r})"
