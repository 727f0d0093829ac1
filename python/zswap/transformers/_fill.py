"""A zswap / DeepSpeed config with its ``"auto"`` values filled from Hugging Face ``TrainingArguments``.

The same mapping transformers applies to a DeepSpeed config (``HfTrainerDeepSpeedConfig``: its
``trainer_config_process`` when the arguments are known, ``trainer_config_finalize`` once the number of
training steps is): an ``"auto"`` key takes the argument's value; a key given explicitly must equal it, or
the run stops with every mismatch listed (a config and a command line that disagree would train one of the
two ways silently). A key absent from the config stays absent; an ``optimizer`` section without ``betas``
or ``eps`` steps with their defaults, so arguments asking for others are a mismatch too. The caller's
mapping is never modified: filling works on a deep copy.

=====================================  ===========================================
config key                             from ``TrainingArguments``
=====================================  ===========================================
``train_micro_batch_size_per_gpu``     ``per_device_train_batch_size``
``gradient_accumulation_steps``        ``gradient_accumulation_steps``
``train_batch_size``                   world size × micro batch × accumulation steps
``gradient_clipping``                  ``max_grad_norm``
``optimizer.params.lr``                ``learning_rate``
``optimizer.params.betas``             ``[adam_beta1, adam_beta2]``
``optimizer.params.eps``               ``adam_epsilon``
``optimizer.params.weight_decay``      ``weight_decay``
``scheduler.params.warmup_min_lr``     0 (``"auto"`` only; no argument to match)
``scheduler.params.warmup_max_lr``     ``learning_rate``
``fp16.enabled`` / ``bf16.enabled``    ``fp16 or fp16_full_eval`` / ``bf16 or bf16_full_eval``
``scheduler.params.total_num_steps``   the training steps (at `finalize`)
``scheduler.params.warmup_num_steps``  ``get_warmup_steps(steps)``, at least 1 (at `finalize`)
=====================================  ===========================================
"""

from __future__ import annotations

from typing import Any

from ..config import raw_dict
from ..errors import ConfigError


class Filler:
    """Fills one private copy of a config; `mismatches` collects the explicit values that disagree."""

    def __init__(self, config: Any) -> None:
        self.config = raw_dict(config, "zswap_config")
        self.mismatches: list[str] = []

    def _node(self, dotted: str) -> tuple[dict[str, Any] | None, str]:
        *path, key = dotted.split(".")
        node: Any = self.config
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                return None, key
        return (node if isinstance(node, dict) else None), key

    def match(self, dotted: str, value: Any, arg: str, must_match: bool = True) -> None:
        """``"auto"`` → ``value``; an explicit value must equal it (when ``must_match``)."""
        node, key = self._node(dotted)
        if node is None or key not in node:
            return
        if node[key] == "auto":
            node[key] = value
        elif must_match and node[key] is not None and node[key] != value:
            self.mismatches.append(f"- {dotted}={node[key]!r} vs TrainingArguments {arg}={value!r}")

    def unset(self, key: str, value: Any, default: Any, arg: str, section_name: str = "optimizer") -> None:
        """A key absent from a section (``optimizer``, ``scheduler``) takes ``default`` (as under DeepSpeed):
        the argument, if it asks for another value, would be dropped without a word."""
        section = self.config.get(section_name)
        if not isinstance(section, dict):
            return
        params = section.get("params")
        given = params if isinstance(params, dict) else {}
        if key not in given and value != default:
            self.mismatches.append(
                f"- {section_name}.params.{key} unset (so {default!r}) vs TrainingArguments {arg}={value!r}"
            )

    def only(self, dotted: str, value: Any) -> None:
        """``"auto"`` → ``value``; anything else is kept."""
        node, key = self._node(dotted)
        if node is not None and node.get(key) == "auto":
            node[key] = value

    def check(self) -> None:
        if self.mismatches:
            raise ConfigError(
                "zswap_config disagrees with the TrainingArguments:\n"
                + "\n".join(self.mismatches)
                + '\nset these keys to "auto" (filled from the arguments) or make the two agree'
            )


def process(config: Any, args: Any) -> dict[str, Any]:
    """Stage one (``trainer_config_process``): what the arguments alone decide."""
    f = Filler(config)
    _betas_as_list(f.config)  # before matching: a tuple never equals the list it is compared with
    batch = args.per_device_train_batch_size
    gas = args.gradient_accumulation_steps
    auto_batch = bool(getattr(args, "auto_find_batch_size", False))
    f.match("train_micro_batch_size_per_gpu", batch, "per_device_train_batch_size", not auto_batch)
    f.match("gradient_accumulation_steps", gas, "gradient_accumulation_steps")
    f.match(
        "train_batch_size", args.world_size * batch * gas, "train_batch_size (calculated)", not auto_batch
    )
    f.match("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    f.match("optimizer.params.lr", args.learning_rate, "learning_rate")
    f.match("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    f.match("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    f.match("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    # Absent, lr and weight_decay are the arguments' (each param group's); betas and eps the section's
    # defaults, whatever the arguments say.
    f.unset("betas", [args.adam_beta1, args.adam_beta2], [0.9, 0.999], "adam_beta1+adam_beta2")
    f.unset("eps", args.adam_epsilon, 1e-8, "adam_epsilon")
    f.only("scheduler.params.warmup_min_lr", 0)
    f.match("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    if (f.config.get("scheduler") or {}).get("type") == "WarmupDecayLR":  # absent: DeepSpeed's 0.001
        f.unset("warmup_max_lr", args.learning_rate, 0.001, "learning_rate", "scheduler")
    f.match("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval")
    f.match("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval")
    f.check()
    return f.config


def finalize(config: dict[str, Any], args: Any, num_training_steps: int) -> dict[str, Any]:
    """Stage two (``trainer_config_finalize``): the schedule's step counts, once they are known. Returns a
    new dict; ``config`` is left as it is (the stage-one result is reused by later ``train`` calls)."""
    f = Filler(config)
    f.match("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
    warmup = max(1, args.get_warmup_steps(num_training_steps))
    f.match(
        "scheduler.params.warmup_num_steps", warmup, "warmup steps (warmup_steps / warmup_ratio, at least 1)"
    )
    f.check()
    return f.config


def _betas_as_list(config: dict[str, Any]) -> None:
    # JSON has lists, the arguments a tuple-like pair: compare and store one spelling.
    params = (config.get("optimizer") or {}).get("params")
    if isinstance(params, dict) and isinstance(params.get("betas"), tuple):
        params["betas"] = list(params["betas"])
