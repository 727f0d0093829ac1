"""DeepSpeed's config tests (``tests/unit/runtime/test_ds_config_dict.py``, ``zero/test_zero_config.py``)
and its ignored-key semantics, adapted: a config as a dict or a file, ``args.deepscale_config``, the batch
arithmetic and its errors, what each DeepSpeed key zswap does not read gets (honoured, refused, or named in
a warning), the deprecated ``cpu_offload`` switches, and ``bf16.check_grad_overflow``."""

from __future__ import annotations

import argparse
import json
import socket
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import zswap
import zswap.deepspeed as deepspeed
from zswap import ConfigError, load_config, param_state

from ._ds_common import TwoLayer, base_config, batches


@pytest.fixture
def quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        yield


def train(engine: Any, steps: int = 3) -> None:
    for x, y in batches(steps):
        engine.backward(engine(x, y))
        engine.step()


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    params = list(model.parameters())
    with zswap.GatheredParameters(params):
        return [p.detach().clone() for p in params]


@pytest.mark.parametrize("source", ["dict", "file"])
def test_a_config_as_a_dict_or_a_file_trains_the_same(source, tmp_path, quiet):
    cfg = base_config(bf16={"enabled": True})
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = TwoLayer()
    engine, *_ = deepspeed.initialize(
        config=cfg if source == "dict" else str(path), model=model, model_parameters=model.parameters()
    )
    with engine:
        assert all(param_state(p).dtype == torch.bfloat16 for p in model.parameters())
        for x, y in batches(3):
            engine.backward(engine(x.to(torch.bfloat16), y))
            engine.step()
        assert engine.global_steps == 3


def test_an_hjson_file_is_refused_naming_the_file_and_the_difference(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text("{\n  // DeepSpeed reads this with hjson\n  train_batch_size: 1\n}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: invalid JSON at line 2, column 3")
    assert "zswap reads strict JSON; DeepSpeed also accepts Hjson" in message


def test_the_deprecated_deepscale_config_argument(tmp_path, quiet):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(base_config()))
    args = argparse.ArgumentParser().parse_args(args=[])
    args.deepscale_config, args.local_rank = str(path), 0
    model = TwoLayer()
    engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    with engine:
        train(engine, 5)
        assert engine.global_steps == 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_dist_init_required_starts_a_group_of_one(monkeypatch, quiet):
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        # set, then removed: monkeypatch then also removes what init_distributed sets (os.environ.setdefault)
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    model = TwoLayer()
    engine, *_ = deepspeed.initialize(
        config=base_config(),
        model=model,
        model_parameters=model.parameters(),
        dist_init_required=True,
        distributed_port=_free_port(),
    )
    try:
        assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1
        with engine:
            train(engine, 2)
    finally:
        torch.distributed.destroy_process_group()


def test_dist_init_required_false_under_a_launch_with_no_group_is_refused(monkeypatch, quiet):
    """DeepSpeed asserts its backend is initialised; zswap built a one-rank engine on every rank, each
    training a model of its own."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = TwoLayer()
    refused = r"^dist_init_required=False, but the launcher set WORLD_SIZE=2"
    with pytest.raises(zswap.ZswapError, match=refused):
        deepspeed.initialize(config=base_config(), model=model, dist_init_required=False)
    assert not torch.distributed.is_initialized()


def test_without_an_optimizer_forward_works_and_step_says_what_is_missing(quiet):
    cfg = base_config()
    del cfg["optimizer"]
    model = TwoLayer()
    engine, optimizer, _, _ = deepspeed.initialize(config=cfg, model=model)
    with engine:
        assert optimizer is None
        x, y = next(batches(1))
        loss = engine(x, y)
        engine.backward(loss)
        with pytest.raises(
            zswap.ZswapError, match="no optimizer: pass optimizer= or add an 'optimizer' section"
        ):
            engine.step()


def test_no_model_is_a_type_error():
    with pytest.raises(TypeError, match="requires a model"):
        deepspeed.initialize(model=None, config=base_config())


# DeepSpeed's TestBatchConfig at two ranks: (train_batch_size, micro batch, GAS, consistent).
BATCHES = [(32, 16, 1, True), (32, 8, 2, True), (33, 17, 2, False), (32, 18, 1, False)]


@pytest.mark.parametrize(("batch", "micro", "gas", "ok"), BATCHES)
def test_batch_arithmetic_at_two_ranks(batch, micro, gas, ok):
    def resolve(**keys: Any) -> tuple[Any, ...]:
        return load_config(keys).batch.resolve(2)

    given = [
        {
            "train_batch_size": batch,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": gas,
        },
        {"train_batch_size": batch, "train_micro_batch_size_per_gpu": micro},
    ]
    if ok:
        given += [
            {"train_batch_size": batch, "gradient_accumulation_steps": gas},
            {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas},
        ]
        if gas == 1:
            given += [{"train_micro_batch_size_per_gpu": micro}, {"train_batch_size": batch}]
        for keys in given:
            assert resolve(**keys) == (batch, micro, gas), keys
        return
    if gas != 1:
        given.append({"train_batch_size": batch, "gradient_accumulation_steps": gas})
    for keys in given:
        refused = r"train_batch_size \(\d+\) (must equal|is not a multiple of) .* × world size \(2\)"
        with pytest.raises(ConfigError, match=refused):
            resolve(**keys)


def test_only_gas_is_enough_for_zswap():
    # DeepSpeed asks for a batch size as well; zswap needs one only for the data loader it builds.
    assert load_config({"gradient_accumulation_steps": 4}).batch.resolve(2) == (None, None, 4)


def test_the_loader_needs_a_micro_batch_size(quiet):
    model = TwoLayer()
    data = torch.utils.data.TensorDataset(torch.zeros(4, 10), torch.zeros(4, dtype=torch.long))
    cfg = {"gradient_accumulation_steps": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu"):
        deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters(), training_data=data)


@pytest.mark.parametrize(
    "key", ["stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"]
)
def test_gather_16bit_weights_on_save_is_what_zswap_always_does(key, recwarn):
    assert load_config({"zero_optimization": {key: True}}) == load_config({})
    assert not [w for w in recwarn if issubclass(w.category, zswap.ZswapWarning)]


@pytest.mark.parametrize(
    ("stage", "taken"),
    [(0, True), (3, True), ("3", True), (" 03", True), (2.0, True), (True, True), ("auto", True),
     (4, False), (-1, False), (2.5, False), ("x", False), ("AUTO", False)],
)  # fmt: skip
def test_the_stage_is_always_3_but_must_be_one_deepspeed_takes(stage, taken, recwarn):
    """zswap partitions as ZeRO stage 3 whatever ``stage`` says; below 3 it says so (a stage 1 / 2 script
    reads its params' data outside forward, which stage 3 leaves empty: before, silently); a value
    DeepSpeed's schema (``ZeroStageEnum``, lax) refuses is a `ConfigError` here too."""
    if taken:
        assert load_config({"zero_optimization": {"stage": stage}}) == load_config({})
        said = [str(w.message) for w in recwarn if issubclass(w.category, zswap.ZswapWarning)]
        if stage in (3, "3", " 03", "auto"):
            assert said == []
        else:
            assert said == [
                f"zero_optimization.stage is {stage!r}; zswap partitions every param as ZeRO stage 3 "
                "whatever the stage says (it offloads partitions): outside a forward a param's data is an "
                "empty placeholder (read it inside zswap.GatheredParameters; p.ds_numel is its size), and "
                "zero_optimization_stage() says 3"
            ]
    else:
        with pytest.raises(ConfigError, match=r"zero_optimization\.stage must be 0, 1, 2 or 3 .*, got "):
            load_config({"zero_optimization": {"stage": stage}})


@pytest.mark.parametrize("name", ["bf16", "bfloat16"])
def test_bf16_under_either_name(name):
    assert load_config({name: {"enabled": True}}).dtype == "bf16"


def test_tuning_keys_are_named_in_a_warning_at_initialize(tmp_path):
    cfg = base_config(zero_optimization={"stage": 3, "overlap_comm": True, "reduce_bucket_size": 5e8})
    model = TwoLayer()
    with pytest.warns(
        zswap.ZswapWarning, match="zero_optimization.overlap_comm, zero_optimization.reduce_bucket_size"
    ):
        engine, *_ = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
    engine.close()


def test_quantized_communication_is_refused_before_anything_is_built():
    cfg = base_config(zero_optimization={"stage": 3, "zero_quantized_weights": True})
    with pytest.raises(
        ConfigError, match=r"zero_optimization\.zero_quantized_weights must be false: zswap gathers"
    ):
        deepspeed.zero.Init(config_dict_or_path=cfg)


@pytest.mark.parametrize(
    ("switch", "section"), [("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param"),
                            ("cpu_offload_params", "offload_param")]
)  # fmt: skip
def test_deprecated_cpu_offload_switches_mean_the_cpu_tier(switch, section):
    cfg = load_config({"zero_optimization": {"stage": 3, switch: True}})
    assert getattr(cfg, section).device == "cpu"
    assert getattr(load_config({"zero_optimization": {switch: False}}), section).device == "none"
    with pytest.raises(ConfigError, match=f"zero_optimization.{switch} .*and .*{section} are both given"):
        load_config({"zero_optimization": {switch: True, section: {"device": "nvme", "nvme_path": "/x"}}})
    with pytest.raises(ConfigError, match=f"zero_optimization.{switch} must be true or false"):
        load_config({"zero_optimization": {switch: "yes"}})


def test_cpu_offload_trains_with_the_optimizer_on_the_cpu_tier(quiet):
    cfg = base_config(zero_optimization={"stage": 3, "cpu_offload": True})
    model = TwoLayer()
    engine, optimizer, _, _ = deepspeed.initialize(
        config=cfg, model=model, model_parameters=model.parameters()
    )
    with engine:
        assert isinstance(optimizer, zswap.optim.OffloadedAdamW) and optimizer.tier == "cpu"
        train(engine, 2)


def _poisoned_step(
    check: bool | None, front: str = "deepspeed"
) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
    bf16: dict[str, Any] = {"enabled": True}
    if check is not None:
        bf16["check_grad_overflow"] = check
    cfg = base_config(bf16=bf16, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10}})
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = TwoLayer()
    if front == "deepspeed":
        engine, *_ = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
    else:
        engine = zswap.initialize(model, cfg)
    train_x = [(x.to(torch.bfloat16), y) for x, y in batches(2)]
    engine.backward(engine(*train_x[0]))
    engine.step()
    before = weights(model)
    engine.backward(engine(*train_x[1]) * float("inf"))  # every gradient inf or nan
    engine.step()
    return engine, before, weights(model)


@pytest.mark.parametrize(
    ("check", "front"),
    [(True, "zswap"), (True, "deepspeed"), (False, "deepspeed"), (None, "deepspeed")],
)
def test_bf16_skips_a_step_whose_gradients_are_not_finite(check, front, quiet):
    """``check_grad_overflow`` under `zswap.initialize`; always under `zswap.deepspeed.initialize`, as
    DeepSpeed 0.19.8's ZeRO-3 does whatever the key says (its step skips a step whose norm is invalid)."""
    engine, before, after = _poisoned_step(check, front)
    with engine:
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        assert (engine.global_steps, engine.skipped_steps) == (2, 1)
        assert engine.lr_scheduler.last_batch_iteration == 0  # stepped after the first step only
        assert engine.stats()["steps_ordinary"] == 1  # the skipped step is not counted as one


@pytest.mark.parametrize("check", [False, None])
def test_without_the_check_zswap_initialize_steps_bf16_as_pytorch(check, quiet):
    engine, _, after = _poisoned_step(check, "zswap")
    with engine:
        assert not all(torch.isfinite(a).all() for a in after)
        assert (engine.global_steps, engine.skipped_steps) == (2, 0)


def test_check_overflow_is_the_old_name_of_check_grad_overflow():
    assert load_config({"bf16": {"check_overflow": True}}).bf16.check_grad_overflow is True
    with pytest.raises(ConfigError, match="disagree"):
        load_config({"bf16": {"check_overflow": True, "check_grad_overflow": False}})


def test_a_json_path_object_works(tmp_path):
    path = Path(tmp_path / "c.json")
    path.write_text(json.dumps({"train_batch_size": 4, "gradient_accumulation_steps": 2}))
    assert load_config(path).batch.resolve(1) == (4, 2, 2)


def test_only_a_train_batch_size_is_a_whole_batch_config(tmp_path):
    path = tmp_path / "minimal.json"
    path.write_text(json.dumps({"train_batch_size": 64}))
    assert load_config(path).batch.resolve(1) == (64, 64, 1)


def test_a_duplicate_key_in_a_file_is_an_error(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 24, "train_batch_size": 24}')
    with pytest.raises(ConfigError, match="duplicate key 'train_batch_size'"):
        load_config(path)


@pytest.mark.parametrize(
    ("key", "field"),
    [
        ("stage3_prefetch_bucket_size", "stage3_prefetch_bucket_size"),
        ("prefetch_bucket_size", "stage3_prefetch_bucket_size"),
        ("stage3_param_persistence_threshold", "stage3_param_persistence_threshold"),
        ("param_persistence_threshold", "stage3_param_persistence_threshold"),
        ("stage3_max_reuse_distance", "stage3_max_reuse_distance"),
        ("max_reuse_distance", "stage3_max_reuse_distance"),
    ],
)
def test_zero_field_names_and_their_stage3_aliases(key, field):
    assert getattr(load_config({"zero_optimization": {key: 12345}}).zero, field) == 12345


def test_empty_or_null_offload_sections_offload_nothing():
    for value in (None, {}):
        cfg = load_config({"zero_optimization": {"offload_param": value, "offload_optimizer": value}})
        assert cfg.offload_param.device == "none" and cfg.offload_optimizer.device == "none"


def test_pipeline_sets_both_directions():
    assert load_config({"offload_optimizer": {"pipeline": False}}).offload_optimizer.pipeline_read is False
    cfg = load_config(
        {"offload_optimizer": {"pipeline_read": True, "pipeline_write": False}}
    ).offload_optimizer
    assert (cfg.pipeline_read, cfg.pipeline_write) == (True, False)
