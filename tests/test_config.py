"""`zswap.load_config`: sources, layouts, unknown keys, aliases, value checks, "auto", round trips."""

from __future__ import annotations

import copy
import errno
import gc
import json
import os
import pathlib
import pickle
import re
import types
import weakref
from typing import Any

import pytest

from zswap.config import (
    AioConfig,
    FP16Config,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    ZeroConfig,
    ZswapConfig,
    _keys,
    load_config,
    models,
    parse_json,
)
from zswap.config._load import MAX_FILE_BYTES
from zswap.errors import ConfigError, ZswapWarning

# HF_ZERO3_NVME and RICH hold DeepSpeed tuning keys zswap names in a ZswapWarning (tested on its own below).
pytestmark = pytest.mark.filterwarnings(
    "ignore:zswap ignores these DeepSpeed settings:zswap.errors.ZswapWarning"
)

# The ZeRO-3 + NVMe example of the Hugging Face transformers DeepSpeed guide, in the shape users copy it:
# "auto" wherever the Trainer fills a value in, DeepSpeed's float-written sizes, keys zswap ignores.
HF_ZERO3_NVME: dict[str, Any] = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 4,
            "fast_init": False,
        },
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 5,
            "buffer_size": 1e8,
            "max_in_cpu": 1e9,
        },
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "aio": {
        "block_size": 262144,
        "queue_depth": 32,
        "thread_count": 1,
        "single_submit": False,
        "overlap_events": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def write_json(path: pathlib.Path, content: Any) -> pathlib.Path:
    path.write_text(json.dumps(content, indent=2), encoding="utf-8")
    return path


def error_of(config: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config)
    return str(info.value)


# --- sources -------------------------------------------------------------------------------------------


def test_none_gives_the_defaults():
    cfg = load_config(None)
    assert cfg == load_config() == ZswapConfig() == load_config({})
    assert cfg.offload_param == OffloadParamConfig(device="none", max_in_cpu=0)
    assert cfg.offload_optimizer.pipeline_read and cfg.offload_optimizer.pipeline_write
    assert cfg.aio.backend == "auto" and cfg.aio.direct == "auto" and cfg.aio.checksum == "off"
    assert cfg.optimizer is None and cfg.dtype is None and cfg.torch_dtype() is None


def test_path_as_str_and_as_pathlib(tmp_path):
    path = write_json(tmp_path / "ds.json", {"aio": {"queue_depth": 16}})
    from_str = load_config(str(path))
    from_path = load_config(path)
    assert from_str == from_path
    assert from_path.aio.queue_depth == 16


def test_any_pathlike(tmp_path):
    path = write_json(tmp_path / "ds.json", {"aio": {"queue_depth": 16}})

    class Location:
        def __fspath__(self) -> str:
            return str(path)

    assert load_config(Location()).aio.queue_depth == 16


def test_a_loaded_config_is_returned_as_is():
    cfg = load_config({"aio": {"queue_depth": 16}})
    assert load_config(cfg) is cfg


@pytest.mark.parametrize("bad", [3, 2.5, ["ds.json"], b"ds.json", bytearray(b"{}"), object()])
def test_other_types_are_a_type_error_naming_the_accepted_ones(bad):
    with pytest.raises(TypeError) as info:
        load_config(bad)
    message = str(info.value)
    for accepted in ("str", "os.PathLike", "mapping", "ZswapConfig", "None"):
        assert accepted in message
    assert type(bad).__name__ in message


def test_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError) as info:
        load_config(path)
    assert info.value.errno == errno.ENOENT
    assert info.value.filename == str(path)
    assert str(path) in str(info.value)


def test_missing_relative_file_says_relative_to_what(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        load_config("ds.json")
    assert info.value.filename == "ds.json"
    assert str(tmp_path) in str(info.value)


def test_malformed_json_names_file_line_and_column(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{\n  "aio": {\n    "queue_depth": 8,\n  }\n}\n', encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith(f"{path}: invalid JSON at line 4, column 3: ")


@pytest.mark.parametrize("text", ["", "   ", "{", '{"aio": }', "{'aio': {}}"])
def test_other_malformed_json(tmp_path, text):
    path = tmp_path / "ds.json"
    path.write_text(text, encoding="utf-8")
    assert "invalid JSON at line 1" in error_of(path)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('{"aio": {}, "aio": {}}', "aio"),
        ('{"aio": {"queue_depth": 8, "queue_depth": 16}}', "queue_depth"),
        # at any depth, also inside sections zswap does not read
        ('{"scheduler": {"params": {"x": [{"a": 1, "a": 2}]}}}', "a"),
    ],
)
def test_duplicate_keys_are_an_error_naming_key_and_file(tmp_path, text, key):
    path = tmp_path / "ds.json"
    path.write_text(text, encoding="utf-8")
    message = error_of(path)
    assert message.startswith(f"{path}: duplicate key {key!r}")


@pytest.mark.parametrize(
    ("content", "kind"), [("[]", "array"), ('"x"', "string"), ("3", "number"), ("null", "null")]
)
def test_top_level_must_be_an_object(tmp_path, content, kind):
    path = tmp_path / "ds.json"
    path.write_text(content, encoding="utf-8")
    assert error_of(path) == f"{path}: the top level must be a JSON object, got a JSON {kind}"


def test_byte_order_mark_is_tolerated(tmp_path):
    path = tmp_path / "ds.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"aio": {"queue_depth": 4}}).encode())
    assert load_config(path).aio.queue_depth == 4


def test_only_a_regular_file_of_a_configs_size_is_read(tmp_path):
    """A FIFO blocked ``open`` forever and a device was read until memory ran out; a directory said
    ``Is a directory``. Each is refused before it is opened, naming the path."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, why in (
        (fifo, "not a regular file"),
        ("/dev/zero", "not a regular file"),
        (tmp_path, "a directory"),
    ):
        with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: {why}"):
            load_config(str(path))
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)
    with pytest.raises(ConfigError, match=r"more than a config file holds"):
        load_config(big)


def test_inline_json_is_read_as_strictly_as_a_file():
    """``zswap demo --config '{...}'``: the same parser as a file's, so a key given twice is refused (the
    last one silently won) and a top level that is not an object says so."""
    with pytest.raises(ConfigError, match="duplicate key 'a'"):
        parse_json('{"a": 1, "a": 2}')
    with pytest.raises(ConfigError, match="the top level must be a JSON object, got a JSON array"):
        parse_json("[1]")
    assert parse_json('{"train_batch_size": 4}') == {"train_batch_size": 4}


def test_non_utf8_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_bytes(b'{"aio": {"backend": "\xff"}}')
    assert error_of(path).startswith(f"{path}: not UTF-8 text")


def test_errors_from_a_file_name_the_file(tmp_path):
    path = write_json(tmp_path / "ds.json", {"aio": {"queue_depth": -3}})
    assert error_of(path) == f"{path}: aio.queue_depth must be a positive integer, got -3"


# --- a mapping is copied, never modified, never kept ---------------------------------------------------


def test_caller_mapping_is_not_modified():
    config = copy.deepcopy(HF_ZERO3_NVME)
    config["offload_param"] = config["zero_optimization"].pop("offload_param")  # mixed layouts are fine
    config["offload_param"]["nvme_path"] = ["/a", "/b"]
    before = copy.deepcopy(config)
    load_config(config)
    assert config == before


def test_changing_the_mapping_afterwards_changes_nothing():
    paths = ["/a", "/b"]
    config = {"offload_param": {"device": "nvme", "nvme_path": paths}, "aio": {"queue_depth": 8}}
    cfg = load_config(config)
    expected = cfg.to_dict()
    paths.append("/c")
    config["aio"]["queue_depth"] = 64
    config["offload_param"]["device"] = "cpu"
    assert cfg.to_dict() == expected
    assert cfg.offload_param.nvme_path == (pathlib.Path("/a"), pathlib.Path("/b"))


def test_no_reference_to_the_mapping_is_kept():
    class Dict(dict):
        pass

    class List(list):
        pass

    section = Dict(device="nvme", nvme_path=List(["/a"]))
    config = Dict(offload_param=section, optimizer=Dict(type="AdamW", params=Dict(betas=List([0.8, 0.9]))))
    refs = [weakref.ref(obj) for obj in (config, section, section["nvme_path"], config["optimizer"])]
    cfg = load_config(config)
    del config, section
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert cfg.optimizer is not None and cfg.optimizer.betas == (0.8, 0.9)


def test_any_mapping_type_is_read():
    proxy = types.MappingProxyType({"aio": types.MappingProxyType({"queue_depth": 4})})
    assert load_config(proxy).aio.queue_depth == 4


# --- layouts -------------------------------------------------------------------------------------------


def test_hugging_face_zero3_nvme_config_loads_as_is(tmp_path):
    cfg = load_config(HF_ZERO3_NVME)
    assert cfg == load_config(write_json(tmp_path / "ds.json", HF_ZERO3_NVME))
    nvme = (pathlib.Path("/local_nvme"),)
    assert cfg.offload_param == OffloadParamConfig(
        device="nvme",
        nvme_path=nvme,
        pin_memory=True,
        buffer_count=5,
        buffer_size=100_000_000,
        max_in_cpu=1_000_000_000,
    )
    assert cfg.offload_optimizer == OffloadOptimizerConfig(
        device="nvme", nvme_path=nvme, pin_memory=True, buffer_count=4
    )
    assert cfg.zero == ZeroConfig(
        stage3_max_live_parameters=10**9, stage3_max_reuse_distance=10**9, sub_group_size=10**9
    )
    assert cfg.zero.stage3_prefetch_bucket_size is None
    assert cfg.aio == AioConfig(block_size=262144, queue_depth=32, thread_count=1)
    assert cfg.optimizer == OptimizerConfig(type="AdamW")
    assert cfg.optimizer.lr is None and cfg.optimizer.weight_decay is None
    assert cfg.optimizer.betas == (0.9, 0.999) and cfg.optimizer.eps == 1e-8
    assert cfg.dtype is None
    assert cfg.fp16 == FP16Config()


def test_trimmed_layout_equals_deepspeed_layout():
    sections = {
        "offload_param": {"device": "nvme", "nvme_path": "/n"},
        "offload_optimizer": {"device": "cpu"},
    }
    knobs = {"stage3_max_live_parameters": 100, "sub_group_size": 1000}
    nested = load_config({"zero_optimization": {"stage": 3, **sections, **knobs}})
    top = load_config({**sections, **knobs})
    mixed = load_config({"zero_optimization": {"offload_param": sections["offload_param"]}, **knobs,
                         "offload_optimizer": sections["offload_optimizer"]})  # fmt: skip
    assert nested == top == mixed
    assert top.offload_param.device == "nvme" and top.zero.sub_group_size == 1000


@pytest.mark.parametrize("section", ["offload_param", "offload_optimizer"])
def test_a_section_both_nested_and_at_top_level_is_an_error(section):
    config = {section: {"device": "cpu"}, "zero_optimization": {section: {"device": "cpu"}}}
    assert error_of(config) == (
        f"{section} is given both as zero_optimization.{section} and at top level; keep one"
    )


def test_a_stage3_knob_both_nested_and_at_top_level_is_an_error():
    config = {"stage3_max_live_parameters": 5, "zero_optimization": {"stage3_max_live_parameters": 5}}
    assert error_of(config) == (
        "stage3_max_live_parameters is given both as zero_optimization.stage3_max_live_parameters "
        "and at top level; keep one"
    )
    config = {"stage3_prefetch_bucket_size": 5, "zero_optimization": {"prefetch_bucket_size": 5}}
    assert "zero_optimization.prefetch_bucket_size" in error_of(config)


def test_null_sections_and_keys_mean_not_given():
    config = {
        "zero_optimization": {"offload_param": None, "sub_group_size": None},
        "offload_param": {"device": "cpu", "nvme_path": None, "buffer_count": None},
        "aio": None,
        "optimizer": None,
        "bf16": None,
    }
    cfg = load_config(config)
    assert cfg == ZswapConfig(offload_param=OffloadParamConfig(device="cpu"))


def test_legacy_boolean_zero_optimization_is_accepted():
    assert load_config({"zero_optimization": True}) == ZswapConfig()


def test_everything_outside_zswaps_sections_is_ignored():
    # (batch sizes and the scheduler are read since issue 11: tests/test_accumulation.py, test_schedules.py)
    config = {
        "activation_checkpointing": {"partition_activations": "auto"},
        "zero_allow_untested_optimizer": True,
        "max_live_parameters": "not zswap's at top level",
        "comms_logger": {"enabled": "yes please"},
        7: "a key no JSON file can have",
    }
    assert load_config(config) == ZswapConfig()


# DeepSpeed keys zswap does not read, by kind (`zswap.config._keys`): silently ignored (zswap already does
# what they ask, or they only apply to other ZeRO stages), ignored with a ZswapWarning naming them (they
# tune DeepSpeed's own machinery and change no result), or accepted only at DeepSpeed's default.
SILENT = {
    "zero_optimization": [
        "stage", "legacy_stage1", "elastic_checkpoint",
        "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save", "cpu_offload_use_pin_memory",
    ],
}  # fmt: skip
WARNED = {
    "zero_optimization": [
        "contiguous_gradients", "overlap_comm", "reduce_scatter", "reduce_bucket_size",
        "allgather_partitions", "allgather_bucket_size", "round_robin_gradients", "offload_params",
        "zero_hpz_partition_size", "mics_shard_size", "mics_hierarchical_params_gather",
        "log_trace_cache_warnings", "module_granularity_threshold", "use_multi_rank_bucket_allreduce",
        "pipeline_loading_checkpoint", "override_module_apply", "stage3_model_persistence_threshold",
        "stage3_use_all_reduce_for_fetch_params", "parameter_alignment",
    ],
    "zero_optimization.offload_optimizer": ["fast_init", "ratio", "super_offload", "cpuadam_cores_perc"],
    "optimizer": ["legacy_fusion"],
    "optimizer.params": ["fused", "foreach"],
    "bf16": ["immediate_grad_update"],
}  # fmt: skip
DEFAULTS_ONLY = {
    "zero_optimization": {
        "load_from_fp32_weights": (True, False, "restores the fp32 master weights"),
        "zero_quantized_weights": (False, True, "quantizing changes results"),
        "zero_quantized_nontrainable_weights": (False, True, "quantizing changes results"),
        "zero_quantized_gradients": (False, True, "quantizing changes results"),
        "zeropp_loco_param": (None, {"err_beta": 0.8}, "LoCo has nothing to correct"),
        "zenflow": (None, {}, "ZenFlow"),
        "compute_grad_norm": (True, False, "DeepSpeed refuses it with stage 3"),
        "enable_sanity_checks": (False, True, "dropped with a ZswapWarning rather than raised"),
    },
    "optimizer.params": {"fp32_optimizer_states": (True, False, "moments in float32")},
    "bf16": {
        "bf16_master_weights_and_grads": (False, True, "fp32 master weights"),
        "bf16_optimizer_states": (False, True, "moments in fp32"),
    },
}


def _place(path: str, key: str, value: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"optimizer": {"type": "Adam"}} if path.startswith("optimizer") else {}
    node = config
    for part in path.split("."):
        node = node.setdefault(part, {})
    node[key] = value
    return config


def _without(path: str) -> dict[str, Any]:
    config = _place(path, "x", None)
    node: Any = config
    for part in path.split("."):
        node = node[part]
    del node["x"]
    return config


def test_every_deepspeed_key_is_of_one_kind():
    sections = [_keys.ZERO, _keys.OFFLOAD_OPTIMIZER, _keys.OPTIMIZER, _keys.OPTIMIZER_PARAMS, _keys.BF16]
    for spec in sections:
        kinds = [
            spec.ignored,
            spec.warned,
            frozenset(spec.defaults_only),
            spec.checked,
            frozenset(spec.fields),
        ]
        for i, a in enumerate(kinds):
            for b in kinds[i + 1 :]:
                assert not a & b, (spec.path, a & b)
    for path, keys in SILENT.items():
        assert all(k in _keys.ZERO.ignored for k in keys), path
    listed = {k for keys in WARNED.values() for k in keys}
    assert listed <= {k for spec in sections for k in spec.warned}


# Values DeepSpeed 0.19.8's schema (pydantic, lax) accepts and refuses, by the type it gives a key.
DS_ACCEPTS = {
    "bool": (True, 0, "false", "auto"),
    "int": (-1, 3, "7"),
    "int>0": (3, 5e8, "auto"),
    "int>=0": (0, 3.0),
    "fraction": (0, 0.5, True),
    None: (True, 3, "auto", {"x": [1]}, "complete nonsense"),  # untyped: any value
}
DS_REFUSES = {
    "bool": (2, "banana", [True]),
    "int": ("x", 1.5, {}),
    "int>0": (0, -3, "5e8"),
    "int>=0": (-1, 1.5),
    "fraction": (1.5, -0.1, "half"),
}


def _typed(path: str, key: str) -> str | None:
    specs = (_keys.ZERO, _keys.OFFLOAD_OPTIMIZER, _keys.OPTIMIZER, _keys.OPTIMIZER_PARAMS, _keys.BF16)
    return {spec.path: spec for spec in specs}[path].deepspeed_types.get(key)


@pytest.mark.parametrize(
    ("path", "key", "value"),
    [
        (p, k, v)
        for p, keys in SILENT.items()
        for k in keys
        for v in (DS_ACCEPTS[_typed(p, k)] if k != "stage" else (3, "auto"))  # test_ds_config: stage
    ],
)
def test_deepspeed_keys_zswap_already_honours_are_ignored_silently(path, key, value, recwarn):
    assert load_config(_place(path, key, value)) == load_config(_without(path))
    assert not [w for w in recwarn if issubclass(w.category, ZswapWarning)]


@pytest.mark.parametrize(
    ("path", "key", "value"),
    [(p, k, v) for p, keys in WARNED.items() for k in keys for v in DS_ACCEPTS[_typed(p, k)] if v != 0],
)
def test_deepspeed_tuning_keys_are_ignored_with_a_warning_naming_them(path, key, value):
    with pytest.warns(ZswapWarning, match=rf"zswap ignores these DeepSpeed settings.*: {path}\.{key}$"):
        cfg = load_config(_place(path, key, value))
    assert cfg == load_config(_without(path))


@pytest.mark.parametrize(
    ("path", "key", "value"),
    [
        (spec.path, k, v)
        for spec in (_keys.ZERO, _keys.OFFLOAD_OPTIMIZER, _keys.BF16)
        for k, kind in spec.deepspeed_types.items()
        for v in DS_REFUSES[kind]
    ],
)
def test_values_deepspeed_refuses_for_keys_zswap_does_not_read_are_refused(path, key, value):
    """Once accepted whatever they held ("overlap_comm": "banana"): a config DeepSpeed refuses is refused."""
    refused = rf"^{path}\.{key} must be .* \(DeepSpeed's schema refuses it too\), got"
    with pytest.raises(ConfigError, match=refused):
        load_config(_place(path, key, value))


def test_one_warning_names_every_ignored_key():
    config = {"zero_optimization": {"overlap_comm": True, "contiguous_gradients": True, "stage": 3},
              "aio": {"single_submit": True, "overlap_events": True}}  # fmt: skip
    with pytest.warns(ZswapWarning) as record:
        load_config(config)
    assert [str(w.message).split(": ", 1)[1] for w in record] == [
        "zero_optimization.overlap_comm, zero_optimization.contiguous_gradients, aio.single_submit"
    ]  # overlap_events at its default (true) and stage are what zswap does anyway: not named


@pytest.mark.parametrize("key", ["ignore_unused_parameters", "memory_efficient_linear"])
def test_keys_whose_default_zswap_follows_are_named_only_off_it(key, recwarn):
    assert load_config({"zero_optimization": {key: True}}) == ZswapConfig()
    assert not [w for w in recwarn if issubclass(w.category, ZswapWarning)]
    with pytest.warns(ZswapWarning, match=rf"zero_optimization\.{key}$"):
        assert load_config({"zero_optimization": {key: False}}) == ZswapConfig()


@pytest.mark.parametrize(
    ("path", "key", "default", "other", "why"),
    [(p, k, *spec) for p, keys in DEFAULTS_ONLY.items() for k, spec in keys.items()],
)
def test_deepspeed_keys_that_change_results_are_accepted_only_at_their_default(
    path, key, default, other, why
):
    for value in (default, None, "auto"):
        assert load_config(_place(path, key, value)) == load_config(_without(path))
    with pytest.raises(ConfigError, match=f"{path}.{key} .*{why}") as info:
        load_config(_place(path, key, other))
    assert repr(other)[:20] in str(info.value)


# --- unknown keys --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"zero_optimization": {"offload_param": {"nvme_pth": "/x"}}},
            "unknown key 'nvme_pth' in zero_optimization.offload_param; did you mean 'nvme_path'?",
        ),
        (
            {"offload_param": {"nvme_pth": "/x"}},
            "unknown key 'nvme_pth' in offload_param; did you mean 'nvme_path'?",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"pipline_read": True}}},
            "unknown key 'pipline_read' in zero_optimization.offload_optimizer; "
            "did you mean 'pipeline_read'?",
        ),
        (
            {"zero_optimization": {"stage3_prefetch_bucket_sise": 1}},
            "unknown key 'stage3_prefetch_bucket_sise' in zero_optimization; "
            "did you mean 'stage3_prefetch_bucket_size'?",
        ),
        (
            {"zero_optimization": {"offload_parm": {}}},
            "unknown key 'offload_parm' in zero_optimization; did you mean 'offload_param'?",
        ),
        ({"aio": {"queue_deph": 8}}, "unknown key 'queue_deph' in aio; did you mean 'queue_depth'?"),
        ({"aio": {"num_thread": 8}}, "unknown key 'num_thread' in aio; did you mean 'num_threads'?"),
        ({"optimizer": {"typ": "Adam"}}, "unknown key 'typ' in optimizer; did you mean 'type'?"),
        (
            {"optimizer": {"type": "Adam", "params": {"weight_decey": 0.1}}},
            "unknown key 'weight_decey' in optimizer.params; did you mean 'weight_decay'?",
        ),
        ({"bf16": {"enable": True}}, "unknown key 'enable' in bf16; did you mean 'enabled'?"),
        ({"fp16": {"loss_scal": 0}}, "unknown key 'loss_scal' in fp16; did you mean 'loss_scale'?"),
    ],
)
def test_unknown_key_names_key_section_and_closest_known_key(config, message):
    assert error_of(config) == message


def test_unknown_key_without_a_close_match_lists_what_zswap_reads():
    message = error_of({"bf16": {"xyzzy": 1}})
    assert (
        message
        == "unknown key 'xyzzy' in bf16; zswap reads 'enabled', 'check_grad_overflow', 'check_overflow'"
    )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        # DeepSpeed's TestFP16AdamTypes writes it there (DeepSpeed reads only optimizer.params.torch_adam)
        (
            {"optimizer": {"type": "Adam", "torch_adam": True, "params": {"lr": 1e-3}}},
            "unknown key 'torch_adam' in optimizer; it belongs in optimizer.params",
        ),
        (
            {"zero_optimization": {"nvme_path": "/tmp"}},
            "unknown key 'nvme_path' in zero_optimization; it belongs in "
            "zero_optimization.offload_optimizer or zero_optimization.offload_param",
        ),
        (
            {"optimizer": {"type": "Adam", "xyzzy": 1}},
            "unknown key 'xyzzy' in optimizer; zswap reads 'type', 'params'",
        ),
    ],
)
def test_a_key_of_a_subsection_one_level_up_is_named_where_it_belongs(config, message):
    assert error_of(config) == message


def test_non_string_key_inside_a_section():
    assert error_of({"aio": {1: 2}}) == "aio has a key that is not a string: 1"


@pytest.mark.parametrize(
    "section", ["aio", "optimizer", "bf16", "fp16", "offload_param", "zero_optimization"]
)
def test_a_section_must_be_an_object(section):
    assert error_of({section: [1]}) == f"{section} must be an object, got [1]"


# --- values: types and ranges --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"aio": {"queue_depth": -3}}, "aio.queue_depth must be a positive integer, got -3"),
        ({"aio": {"queue_depth": 0}}, "aio.queue_depth must be a positive integer, got 0"),
        ({"aio": {"queue_depth": 5000}}, "aio.queue_depth must be at most 4096, got 5000"),
        ({"aio": {"queue_depth": True}}, "aio.queue_depth must be a positive integer, got True"),
        ({"aio": {"queue_depth": 8.5}}, "aio.queue_depth must be a positive integer, got 8.5"),
        ({"aio": {"queue_depth": "8"}}, "aio.queue_depth must be a positive integer, got '8'"),
        ({"aio": {"thread_count": 300}}, "aio.thread_count must be at most 256, got 300"),
        ({"aio": {"num_threads": 0}}, "aio.num_threads must be a positive integer, got 0"),
        (
            {"aio": {"block_size": 3000}},
            "aio.block_size must be a power of two from 4096 to 67108864 (4 KiB to 64 MiB), got 3000",
        ),
        (
            {"aio": {"block_size": 12288}},
            "aio.block_size must be a power of two from 4096 to 67108864 (4 KiB to 64 MiB), got 12288",
        ),
        (
            {"aio": {"pinned_memory_budget": "lots"}},
            'aio.pinned_memory_budget must be a size in bytes (an integer, or a string such as "512MiB" '
            "or \"4M\"), got 'lots'",
        ),
        (
            {"aio": {"pinned_memory_budget": "1.3KiB"}},
            "aio.pinned_memory_budget must be a whole number of bytes ('1.3KiB' is 1331.2 bytes), "
            "got '1.3KiB'",
        ),
        (
            {"aio": {"backend": "uring"}},
            "aio.backend must be one of 'auto', 'io_uring', 'psync', got 'uring'",
        ),
        (
            {"aio": {"direct": "true"}},
            "aio.direct must be \"auto\", true or false (a JSON boolean, not a string), got 'true'",
        ),
        ({"aio": {"checksum": "md5"}}, "aio.checksum must be one of 'off', 'crc32c', got 'md5'"),
        (
            {"aio": {"use_gds": True}},
            "aio.use_gds must be false: GPUDirect Storage is not supported by zswap, got True",
        ),
        (
            {"offload_param": {"device": "disk"}},
            "offload_param.device must be one of 'none', 'cpu', 'nvme', got 'disk'",
        ),
        (
            {"offload_param": {"buffer_count": 0}},
            "offload_param.buffer_count must be a positive integer, got 0",
        ),
        (
            {"zero_optimization": {"offload_param": {"max_in_cpu": -1}}},
            "zero_optimization.offload_param.max_in_cpu must be a non-negative integer, got -1",
        ),
        (
            {"offload_param": {"max_in_cpu": 1e30}},
            "offload_param.max_in_cpu must be at most 9223372036854775807, got 1e+30",
        ),
        (
            {"offload_param": {"nvme_path": ""}},
            "offload_param.nvme_path must be a directory path or a non-empty list of distinct directory "
            "paths, got ''",
        ),
        (
            {"offload_param": {"nvme_path": []}},
            "offload_param.nvme_path must be a directory path or a non-empty list of distinct directory "
            "paths, got []",
        ),
        (
            {"offload_param": {"nvme_path": ["/a", 3]}},
            "offload_param.nvme_path must be a directory path or a non-empty list of distinct directory "
            "paths, got ['/a', 3]",
        ),
        (
            {"offload_optimizer": {"nvme_path": ["/a", "/a"]}},
            "offload_optimizer.nvme_path must be a directory path or a non-empty list of distinct "
            "directory paths ('/a' is listed twice), got ['/a', '/a']",
        ),
        (
            {"offload_optimizer": {"pin_memory": 1}},
            "offload_optimizer.pin_memory must be true or false, got 1",
        ),
        (
            {"stage3_max_live_parameters": -1},
            "stage3_max_live_parameters must be a non-negative integer, got -1",
        ),
        (
            {"zero_optimization": {"sub_group_size": 0}},
            "zero_optimization.sub_group_size must be a positive integer, got 0",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"lr": -1}}},
            "optimizer.params.lr must be a non-negative number, got -1",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"lr": "1e-4"}}},
            "optimizer.params.lr must be a non-negative number, got '1e-4'",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"lr": float("nan")}}},
            "optimizer.params.lr must be a non-negative number, got nan",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"eps": 0}}},
            "optimizer.params.eps must be a positive number, got 0",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.0]}}},
            "optimizer.params.betas must be a list of two numbers in [0, 1), got [0.9, 1.0]",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"betas": "0.9,0.99"}}},
            "optimizer.params.betas must be a list of two numbers in [0, 1), got '0.9,0.99'",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"weight_decay": -0.1}}},
            "optimizer.params.weight_decay must be a non-negative number, got -0.1",
        ),
        (
            {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}},  # the type, not momentum
            "optimizer.type must be one of 'Adam', 'AdamW', got 'SGD': zswap's offloaded optimizer is "
            "Adam / AdamW (its state on NVMe or in CPU memory). torch's SGD runs with its state in CPU "
            "memory: remove the optimizer section and pass it, initialize(..., "
            "optimizer=torch.optim.SGD(model.parameters(), ...))",
        ),
        (
            {"optimizer": {"type": "Lamb"}},
            "optimizer.type must be one of 'Adam', 'AdamW', got 'Lamb': zswap's offloaded optimizer is "
            "Adam / AdamW (its state on NVMe or in CPU memory). DeepSpeed's own others (Lamb, "
            "OneBitAdam...) are not implemented; an element-wise torch optimizer can be passed instead: "
            "initialize(..., optimizer=torch.optim.SGD(...))",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}},
            "unknown key 'max_grad_norm' in optimizer.params; clipping is the top-level gradient_clipping "
            "(as DeepSpeed says)",
        ),
        ({"optimizer": {"params": {"lr": 1e-3}}}, "optimizer.type is required"),
        ({"optimizer": {"type": "auto"}}, "optimizer.type must be one of 'Adam', 'AdamW', got 'auto'"),
        (
            {"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}},
            "optimizer.params.amsgrad must be false: AMSGrad is not supported by zswap, got True",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"amsgrad": "false"}}},
            "optimizer.params.amsgrad must be true or false (a JSON boolean, not a string), got 'false'",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"bias_correction": False}}},
            "optimizer.params.bias_correction must be true: Adam without bias correction is not supported "
            "by zswap, got False",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}},
            "optimizer.params.adam_w_mode is false, but optimizer.type 'AdamW' always decouples weight "
            "decay; remove adam_w_mode or use type 'Adam'",
        ),
        (
            {"fp16": {"initial_scale_power": 100}},
            "fp16.initial_scale_power must be at most 64, got 100",
        ),
        (
            {"fp16": {"enabled": True, "loss_scale_window": 0}},
            "fp16.loss_scale_window must be a positive integer, got 0",
        ),
        (
            {"fp16": {"enabled": True, "min_loss_scale": 0}},
            "fp16.min_loss_scale must be a positive number, got 0",
        ),
        (
            {"bf16": {"enabled": "yes"}},
            "bf16.enabled must be \"auto\", true or false (a JSON boolean, not a string), got 'yes'",
        ),
        ({"fp16": {"enabled": 1}}, 'fp16.enabled must be "auto", true or false, got 1'),
        (
            {"bf16": {"enabled": True}, "fp16": {"enabled": True}},
            "bf16.enabled and fp16.enabled are both true; enable one of them",
        ),
        (
            {"offload_param": {"device": "auto"}},
            "offload_param.device must be one of 'none', 'cpu', 'nvme', got 'auto'",
        ),
    ],
)
def test_wrong_type_or_range_names_key_and_value(config, message):
    assert error_of(config) == message


@pytest.mark.parametrize(
    ("path", "key"),
    [
        ("offload_param", "pin_memory"),
        ("offload_optimizer", "pin_memory"),
        ("offload_optimizer", "pipeline_read"),
        ("offload_optimizer", "pipeline"),
        ("aio", "single_submit"),
        ("aio", "overlap_events"),
        ("aio", "use_gds"),
        ("optimizer.params", "adam_w_mode"),
    ],
)
@pytest.mark.parametrize("text", ["false", "true", "False", "0"])
def test_a_boolean_written_as_a_string_is_rejected(path, key, text):
    message = error_of(_place(path, key, text))
    assert f"{key} must be true or false (a JSON boolean, not a string), got {text!r}" in message


def test_all_errors_are_reported_together():
    message = error_of({"aio": {"queue_depth": 0, "backend": "x"}, "offload_param": {"buffer_count": -1}})
    assert message.split("; ") == [
        "offload_param.buffer_count must be a positive integer, got -1",
        "aio.queue_depth must be a positive integer, got 0",
        "aio.backend must be one of 'auto', 'io_uring', 'psync', got 'x'",
    ]


def test_a_config_error_is_a_value_error_and_never_a_pydantic_one():
    from pydantic import ValidationError

    with pytest.raises(ConfigError) as info:
        load_config({"aio": {"queue_depth": "deep"}})
    assert isinstance(info.value, ValueError)
    assert not isinstance(info.value, ValidationError)
    assert info.value.__cause__ is None and info.value.__suppress_context__


# --- numbers and sizes ---------------------------------------------------------------------------------


def test_integral_floats_become_ints():
    cfg = load_config({"zero_optimization": {"stage3_prefetch_bucket_size": 5e8, "sub_group_size": 1e9}})
    assert cfg.zero.stage3_prefetch_bucket_size == 500_000_000
    assert type(cfg.zero.stage3_prefetch_bucket_size) is int
    assert type(cfg.zero.sub_group_size) is int


def test_ints_are_accepted_for_floats():
    cfg = load_config({"optimizer": {"type": "Adam", "params": {"lr": 1, "weight_decay": 0}}})
    assert cfg.optimizer is not None
    assert cfg.optimizer.lr == 1.0 and type(cfg.optimizer.lr) is float


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ("1GiB", 2**30),
        ("512MiB", 512 * 2**20),
        ("4M", 4 * 2**20),
        ("4k", 4096),
        ("1GB", 10**9),
        ("1.5GiB", 3 * 2**29),
        (" 64 KiB ", 64 * 1024),
        ("4096", 4096),
        (2**33, 2**33),
        (8e9, 8 * 10**9),
    ],
)
def test_byte_sizes(size, expected):
    assert load_config({"aio": {"pinned_memory_budget": size}}).aio.pinned_memory_budget == expected


def test_block_size_takes_a_size_string():
    assert load_config({"aio": {"block_size": "1MiB"}}).aio.block_size == 2**20


# --- aliases -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alias", ["thread_count", "num_threads", "intra_op_parallelism"])
def test_thread_count_aliases(alias):
    assert load_config({"aio": {alias: 6}}).aio.thread_count == 6


def test_aliases_with_the_same_value_are_fine():
    cfg = load_config({"aio": {"thread_count": 4, "num_threads": 4.0, "intra_op_parallelism": 4}})
    assert cfg.aio.thread_count == 4


def test_aliases_with_different_values_are_an_error_naming_both():
    message = error_of({"aio": {"thread_count": 4, "intra_op_parallelism": 8}})
    assert message == (
        "aio.thread_count and aio.intra_op_parallelism disagree (4 vs 8); give only one of them"
    )
    assert "disagree (True vs 1)" in error_of({"aio": {"num_threads": True, "thread_count": 1}})


def test_pipeline_sets_both_pipeline_flags():
    off = load_config({"offload_optimizer": {"pipeline": False}}).offload_optimizer
    assert (off.pipeline_read, off.pipeline_write) == (False, False)
    on = load_config({"offload_optimizer": {"pipeline": True, "pipeline_write": True}}).offload_optimizer
    assert (on.pipeline_read, on.pipeline_write) == (True, True)
    assert error_of({"offload_optimizer": {"pipeline": True, "pipeline_read": False}}) == (
        "offload_optimizer.pipeline and offload_optimizer.pipeline_read disagree (True vs False); "
        "give only one of them"
    )


def test_deepspeed_field_names_of_stage3_knobs():
    cfg = load_config({"zero_optimization": {"prefetch_bucket_size": 10, "max_live_parameters": 20}})
    assert cfg.zero.stage3_prefetch_bucket_size == 10 and cfg.zero.stage3_max_live_parameters == 20


def test_old_bf16_section_name():
    assert load_config({"bfloat16": {"enabled": True}}).dtype == "bf16"
    assert error_of({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}) == (
        "bf16 and bfloat16 (its old name) are both given; keep bf16"
    )


# --- "auto" and dtype ----------------------------------------------------------------------------------


def test_auto_in_zswaps_keys_means_zswap_picks():
    auto = "auto"
    config = {
        "offload_param": {"buffer_count": auto, "buffer_size": auto, "pin_memory": auto, "nvme_path": auto},
        "zero_optimization": {"stage3_max_live_parameters": auto, "sub_group_size": auto},
        "aio": {
            **dict.fromkeys(("block_size", "queue_depth", "thread_count", "pinned_memory_budget"), auto),
            **dict.fromkeys(("backend", "direct", "checksum"), auto),
        },
        "optimizer": {"type": "adamw", "params": dict.fromkeys(("lr", "weight_decay", "betas", "eps"), auto)},
    }
    cfg = load_config(config)
    assert cfg.offload_param == OffloadParamConfig()
    assert cfg.offload_param.buffer_count is None and cfg.offload_param.nvme_path is None
    assert cfg.zero == ZeroConfig() and cfg.aio == AioConfig()
    assert cfg.optimizer == OptimizerConfig(type="AdamW")
    assert cfg.optimizer.lr is None and cfg.optimizer.weight_decay is None


@pytest.mark.parametrize(
    ("bf16", "fp16", "dtype"),
    [
        (None, None, None),
        (True, None, "bf16"),
        (None, True, "fp16"),
        (True, False, "bf16"),
        (False, True, "fp16"),
        (False, False, "fp32"),
        (False, None, "fp32"),
        ("auto", None, None),
        ("auto", False, None),
        ("auto", "auto", None),
        (True, "auto", "bf16"),
    ],
)
def test_dtype_from_bf16_and_fp16(bf16, fp16, dtype):
    config = {name: {"enabled": flag} for name, flag in (("bf16", bf16), ("fp16", fp16)) if flag is not None}
    assert load_config(config).dtype == dtype


def test_torch_dtype():
    torch = pytest.importorskip("torch")
    assert load_config({"bf16": {"enabled": True}}).torch_dtype() is torch.bfloat16
    assert load_config({"fp16": {"enabled": True}}).torch_dtype() is torch.float16
    assert load_config({"fp16": {"enabled": False}}).torch_dtype() is torch.float32
    assert load_config({"bf16": {"enabled": "auto"}}).torch_dtype() is None


def test_fp16_loss_scale_knobs_are_kept():
    knobs = {"loss_scale": 128, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 4}
    cfg = load_config({"fp16": {"enabled": True, **knobs, "min_loss_scale": 0.5}})
    assert cfg.dtype == "fp16"
    assert cfg.fp16 == FP16Config(
        loss_scale=128.0, initial_scale_power=12, loss_scale_window=500, hysteresis=4, min_loss_scale=0.5
    )


@pytest.mark.parametrize("key", ["loss_scale_window", "min_loss_scale"])
@pytest.mark.parametrize("value", [0, -1])
def test_the_dynamic_scales_window_and_floor_must_be_positive(key, value):
    """DeepSpeed's precision config (tests/unit/runtime/test_precision_config_dynamic_scale.py): refused
    where the scale is dynamic, kept where nothing reads them — a static scale, fp16 off — as DeepSpeed
    0.19.8 keeps them for old configs."""
    want = "a positive integer, got" if key == "loss_scale_window" else "a positive number, got"
    assert error_of({"fp16": {"enabled": True, "loss_scale": 0, key: value}}).startswith(
        f"fp16.{key} must be {want}"
    )
    for fp16 in (
        {"enabled": True, "loss_scale": 128},
        {"enabled": False, "loss_scale": 0},
        {"enabled": "auto"},
    ):
        assert getattr(load_config({"fp16": {**fp16, key: value}}).fp16, key) == value


@pytest.mark.parametrize("key", ["loss_scale_window", "min_loss_scale"])
@pytest.mark.parametrize("value", [True, False, float("inf"), float("nan"), "abc"])
def test_the_dynamic_scales_window_and_floor_are_numbers(key, value):
    want = "an integer" if key == "loss_scale_window" else "a number"
    for fp16 in ({"enabled": True}, {"enabled": True, "loss_scale": 128}):
        assert error_of({"fp16": {**fp16, key: value}}) == f"fp16.{key} must be {want}, got {value!r}"


# --- optimizer -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "adam_w_mode", "expected_type", "decoupled"),
    [
        ("Adam", None, "Adam", True),  # DeepSpeed's Adam is AdamW unless adam_w_mode is false
        ("adam", True, "Adam", True),
        ("ADAM", False, "Adam", False),
        ("AdamW", None, "AdamW", True),
        ("adamw", True, "AdamW", True),
    ],
)
def test_optimizer_type_and_decoupled_weight_decay(kind, adam_w_mode, expected_type, decoupled):
    params = {"lr": 3e-4} if adam_w_mode is None else {"lr": 3e-4, "adam_w_mode": adam_w_mode}
    optimizer = load_config({"optimizer": {"type": kind, "params": params}}).optimizer
    assert optimizer is not None
    assert optimizer.type == expected_type and optimizer.decoupled_weight_decay is decoupled
    assert optimizer.lr == 3e-4


def test_optimizer_without_params_takes_defaults():
    assert load_config({"optimizer": {"type": "AdamW"}}).optimizer == OptimizerConfig(
        type="AdamW", betas=(0.9, 0.999), eps=1e-8
    )


def test_optimizer_flags_zswap_accepts():
    params = {"amsgrad": False, "bias_correction": True, "torch_adam": False, "fused": False}
    optimizer = load_config({"optimizer": {"type": "Adam", "params": params}}).optimizer
    assert optimizer == OptimizerConfig(type="Adam")


@pytest.mark.parametrize(
    ("kind", "extra", "decay"),
    [
        ("AdamW", {}, 0.01),  # DeepSpeed builds torch.optim.AdamW(**params): torch's default decay
        ("Adam", {}, 0.01),  # Adam decouples unless adam_w_mode is false: torch.optim.AdamW too
        ("Adam", {"adam_w_mode": False}, None),  # torch.optim.Adam: no decay by default, as zswap
        ("AdamW", {"weight_decay": 0.2}, 0.2),
        ("AdamW", {"weight_decay": "auto"}, None),  # filled by a keyword (the HF Trainer's)
    ],
)
def test_torch_adam_takes_torch_adamws_default_weight_decay(kind, extra, decay, recwarn):
    params = {"lr": 1e-3, "torch_adam": True, **extra}
    assert load_config({"optimizer": {"type": kind, "params": params}}).optimizer.weight_decay == decay
    assert (
        load_config({"optimizer": {"type": kind, "params": {**params, "torch_adam": False}}}).optimizer
        == (
            load_config(
                {
                    "optimizer": {
                        "type": kind,
                        "params": {k: v for k, v in params.items() if k != "torch_adam"},
                    }
                }
            )
        ).optimizer
    )
    assert not recwarn.list
    with pytest.raises(
        ConfigError, match=r"optimizer.params.torch_adam must be true or false, got 'yes please'"
    ):
        load_config({"optimizer": {"type": kind, "params": {**params, "torch_adam": "yes please"}}})


# --- the models ----------------------------------------------------------------------------------------


RICH = {
    "offload_param": {"device": "nvme", "nvme_path": ["/n0", "/n1"], "pin_memory": True, "max_in_cpu": 7},
    "offload_optimizer": {"device": "cpu", "pipeline_read": False, "buffer_count": 3},
    "stage3_prefetch_bucket_size": 0,
    "leaf_module": {"classes": "Block", "name_suffixes": ["mlp"]},
    "aio": {"block_size": "256KiB", "queue_depth": 64, "num_threads": 2, "backend": "psync", "direct": False,
            "checksum": "crc32c", "pinned_memory_budget": "2GiB", "single_submit": True},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "betas": [0.8, 0.95], "weight_decay": 0.01,
                                             "adam_w_mode": False}},
    "fp16": {"enabled": True, "loss_scale_window": 50},
}  # fmt: skip


@pytest.mark.parametrize("config", [{}, HF_ZERO3_NVME, RICH, {"bf16": {"enabled": False}}])
def test_round_trip_through_to_dict(config, tmp_path):
    cfg = load_config(config)
    assert load_config(cfg.to_dict()) == cfg
    assert load_config(write_json(tmp_path / "rt.json", cfg.to_dict())) == cfg


def test_to_dict_is_the_trimmed_layout():
    out = load_config(RICH).to_dict()
    assert set(out) == {
        "offload_param", "offload_optimizer", "aio", "optimizer", "bf16", "fp16",
        "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
        "stage3_max_reuse_distance", "sub_group_size", "leaf_module",
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "dataloader_drop_last", "managed_gradient_accumulation", "torch_autocast", "data_types",
        "communication_data_type",
    }  # fmt: skip
    assert out["leaf_module"] == {"classes": ["Block"], "names": [], "name_suffixes": ["mlp"]}
    assert "gradient_clipping" not in out  # absent stays absent ("auto" is the Hugging Face Trainer's)
    assert out["offload_param"]["nvme_path"] == ["/n0", "/n1"]
    assert out["offload_optimizer"]["nvme_path"] is None
    assert out["stage3_max_live_parameters"] == "auto"
    assert out["optimizer"] == {
        "type": "Adam",
        "params": {"lr": 1e-4, "betas": [0.8, 0.95], "eps": 1e-8, "weight_decay": 0.01, "adam_w_mode": False},
    }
    assert out["bf16"] == {"enabled": False, "check_grad_overflow": False} and out["fp16"]["enabled"] is True
    json.dumps(out)  # plain JSON values only


def test_repr_shows_only_what_differs_from_the_defaults():
    assert repr(ZswapConfig()) == "ZswapConfig()"
    cfg = load_config({"offload_param": {"device": "nvme", "nvme_path": "/n"}, "aio": {"queue_depth": 8}})
    text = repr(cfg)
    assert text == (
        "ZswapConfig(offload_param=OffloadParamConfig(device='nvme', nvme_path=(PosixPath('/n'),)), "
        "aio=AioConfig(queue_depth=8))"
    )


def test_configs_are_frozen_and_hashable():
    cfg = load_config(RICH)
    with pytest.raises(ValueError):
        cfg.aio = AioConfig()  # type: ignore[misc]
    with pytest.raises(ValueError):
        cfg.aio.queue_depth = 1  # type: ignore[misc]
    assert hash(cfg) == hash(load_config(RICH))
    assert {cfg: 1}[load_config(RICH)] == 1


def test_configs_survive_pickle_and_deepcopy():
    cfg = load_config(RICH)
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert copy.deepcopy(cfg) == cfg


def test_engine_kwargs():
    assert load_config(RICH).aio.engine_kwargs() == {
        "block_size": 256 * 1024,
        "queue_depth": 64,
        "threads": 2,
        "backend": "psync",
        "direct": False,
        "checksum": "crc32c",
        "pinned_memory_budget": 2 * 2**30,
    }
    assert AioConfig().engine_kwargs() == {"backend": "auto", "direct": "auto", "checksum": "off"}


def test_replace_validates_and_raises_config_error():
    cfg = load_config(RICH)
    assert cfg.offload_param.replace(device="cpu").device == "cpu"
    assert cfg.replace(dtype="bf16").dtype == "bf16"
    with pytest.raises(ConfigError) as info:
        cfg.aio.replace(queue_depth=0)
    assert str(info.value) == "queue_depth must be a positive integer, got 0"
    with pytest.raises(ConfigError) as info:
        cfg.replace(offload_param={"device": "tape"})
    assert str(info.value) == "offload_param.device must be one of 'none', 'cpu', 'nvme', got 'tape'"


def test_models_reject_unknown_fields():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        AioConfig(queue_dept=3)  # type: ignore[call-arg]


def test_the_section_table_matches_the_models():
    # Every key the loader hands to a model is a field of it, so a table edit cannot drop a key silently.
    pairs = [
        (_keys.OFFLOAD_PARAM, models.OffloadParamConfig),
        (_keys.OFFLOAD_OPTIMIZER, models.OffloadOptimizerConfig),
        (_keys.ZERO, models.ZeroConfig),
        (_keys.AIO, models.AioConfig),
    ]
    for spec, model in pairs:
        targets = {*spec.fields, *(t for ts in spec.aliases.values() for t in ts)}
        assert targets == set(model.model_fields), spec.path
    params = _keys.OPTIMIZER_PARAMS
    assert {*_keys.OPTIMIZER.fields, *params.fields, "decoupled_weight_decay"} == set(
        models.OptimizerConfig.model_fields
    )
    assert {*_keys.FP16.fields} - {"enabled"} == set(models.FP16Config.model_fields)


def test_public_names():
    import zswap

    assert zswap.load_config is load_config
    assert zswap.ZswapConfig is ZswapConfig
    assert {"load_config", "ZswapConfig"} <= set(zswap.__all__)


def test_gradient_clipping_is_read_from_the_top_level():
    assert load_config({"gradient_clipping": 1.0, "train_batch_size": 8}).gradient_clipping == 1.0
    auto = load_config({"gradient_clipping": "auto"})
    assert auto.gradient_clipping is None and auto.gradient_clipping_auto
    assert load_config(auto.to_dict()) == auto and load_config(load_config({}).to_dict()) == load_config({})
    cfg = load_config({"gradient_clipping": 0.5})
    assert load_config(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="gradient_clipping must be a non-negative number, got -1"):
        load_config({"gradient_clipping": -1})
    with pytest.raises(ConfigError, match="gradient_clipping must be a non-negative number, got 'false'"):
        load_config({"gradient_clipping": "false"})
