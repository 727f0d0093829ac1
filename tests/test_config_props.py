"""Property tests for `zswap.load_config`: whatever it is given, it answers with a config, a `ConfigError` or
a `TypeError`; it never modifies its input; and a loaded config survives ``to_dict`` and JSON unchanged."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from zswap.config import ZswapConfig, _keys, load_config
from zswap.errors import ConfigError

# Drawn configs hold DeepSpeed tuning keys now and then; the warning naming them is tested in test_config.py.
pytestmark = pytest.mark.filterwarnings(
    "ignore:zswap ignores these DeepSpeed settings:zswap.errors.ZswapWarning"
)

SETTINGS = settings(deadline=None, max_examples=200)

SECTIONS = {
    "zero_optimization": _keys.ZERO,
    "offload_param": _keys.OFFLOAD_PARAM,
    "offload_optimizer": _keys.OFFLOAD_OPTIMIZER,
    "aio": _keys.AIO,
    "optimizer": _keys.OPTIMIZER,
    "bf16": _keys.BF16,
    "bfloat16": _keys.BF16,
    "fp16": _keys.FP16,
}

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-2, max_value=5000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.5, 1e-3, 5e8, 1e9, 4096.0, 0.0]),
    st.sampled_from(
        ["auto", "AUTO", "true", "false", "nvme", "cpu", "none", "AdamW", "adam", "1GiB", "4M", ""]
    ),
    st.sampled_from(["io_uring", "psync", "crc32c", "off", "/tmp/x", "1.5KiB", "-3", "\0"]),
    st.text(max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=8), inner, max_size=4),
    ),
    max_leaves=12,
)


def known_keys(name: str) -> list[str]:
    return list(SECTIONS[name].known())


def known_keys_params() -> list[str]:
    return list(_keys.OPTIMIZER_PARAMS.known())


@st.composite
def section_bodies(draw: st.DrawFn, name: str) -> Any:
    """A section: mostly a dict of known keys (sometimes a misspelled or random one), sometimes not a dict."""
    if draw(st.integers(0, 9)) == 0:
        return draw(json_values)
    keys = known_keys(name)
    body: dict[str, Any] = {}
    for _ in range(draw(st.integers(0, 6))):
        key = draw(st.sampled_from(keys))
        odd = draw(st.integers(0, 29))  # now and then a misspelled or a random key
        if odd == 0:
            key = key[:-1]
        elif odd == 1:
            key = draw(st.text(max_size=6))
        if key in ("offload_param", "offload_optimizer"):
            body[key] = draw(section_bodies(key))
        elif key == "params":
            body[key] = draw(
                st.one_of(
                    st.dictionaries(st.sampled_from(known_keys_params()), json_values, max_size=5),
                    json_values,
                )
            )
        else:
            body[key] = draw(json_values)
    return body


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    """A raw config mixing zswap's sections (either layout), stage-3 knobs at top level and foreign keys."""
    config: dict[str, Any] = {}
    for name in draw(st.lists(st.sampled_from(sorted(SECTIONS)), max_size=6, unique=True)):
        config[name] = draw(section_bodies(name))
    for knob in draw(st.lists(st.sampled_from(_keys.STAGE3_KNOBS), max_size=2, unique=True)):
        config[knob] = draw(json_values)
    config.update(draw(st.dictionaries(st.text(max_size=10), json_values, max_size=3)))
    return config


def load_or_error(config: Any) -> ZswapConfig | None:
    """The config, or None after a `ConfigError`; any other exception fails the test."""
    try:
        cfg = load_config(config)
    except ConfigError as exc:
        assert not isinstance(exc, ValidationError)
        assert str(exc)
        return None
    assert isinstance(cfg, ZswapConfig)
    return cfg


@SETTINGS
@given(configs())
def test_a_mapping_gives_a_config_or_a_config_error_and_is_never_modified(config):
    before = copy.deepcopy(config)
    cfg = load_or_error(config)
    assert config == before
    if cfg is not None:
        hash(cfg)
        repr(cfg)
        assert load_config(cfg.to_dict()) == cfg


@settings(deadline=None, max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(configs())
def test_a_json_file_gives_a_config_or_a_config_error(tmp_path, config):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    cfg = load_or_error(path)
    if cfg is not None:
        assert cfg == load_config(config)


@SETTINGS
@given(
    st.one_of(
        st.integers(),
        st.floats(),
        st.binary(),
        st.lists(st.text()),
        st.tuples(st.integers()),
        st.sets(st.integers()),
        st.booleans(),
    )
)
def test_anything_else_is_a_type_error(value):
    try:
        load_config(value)
    except TypeError as exc:
        assert "os.PathLike" in str(exc)
    else:
        raise AssertionError(f"load_config accepted {value!r}")


# Valid values, to check that every valid config round-trips exactly.
counts = st.one_of(st.integers(1, 2**40), st.just("auto"), st.none())
paths = st.one_of(
    st.none(),
    st.sampled_from(["/mnt/nvme0", "relative/dir"]),
    st.lists(st.sampled_from(["/a", "/b", "/c", "/d"]), min_size=1, max_size=3, unique=True),
)
offload = st.fixed_dictionaries(
    {},
    optional={
        "device": st.sampled_from(["none", "cpu", "nvme", "NVMe"]),
        "nvme_path": paths,
        "pin_memory": st.booleans(),
        "buffer_count": counts,
    },
)
valid_configs = st.fixed_dictionaries(
    {},
    optional={
        "offload_param": offload.map(
            lambda d: {**d, "max_in_cpu": 10**9} if d.get("device") == "nvme" else {**d, "buffer_size": 1e8}
        ),
        "offload_optimizer": offload,
        "stage3_prefetch_bucket_size": st.one_of(st.integers(0, 10**12), st.just(5e8), st.just("auto")),
        "sub_group_size": counts,
        "aio": st.fixed_dictionaries(
            {},
            optional={
                "block_size": st.sampled_from([4096, 2**20, "256KiB", "auto"]),
                "queue_depth": st.integers(1, 4096),
                "intra_op_parallelism": st.integers(1, 256),
                "backend": st.sampled_from(["auto", "io_uring", "psync"]),
                "direct": st.sampled_from(["auto", True, False]),
                "checksum": st.sampled_from(["off", "crc32c"]),
                "pinned_memory_budget": st.sampled_from([1, 2**30, "4GiB", "auto"]),
            },
        ),
        "optimizer": st.fixed_dictionaries(
            {"type": st.sampled_from(["Adam", "AdamW", "adamw"])},
            optional={
                "params": st.fixed_dictionaries(
                    {},
                    optional={
                        "lr": st.one_of(st.floats(0, 1), st.just("auto")),
                        "betas": st.tuples(st.floats(0, 0.999), st.floats(0, 0.999)).map(list),
                        "eps": st.floats(1e-12, 1e-3),
                        "weight_decay": st.one_of(st.floats(0, 1), st.just("auto")),
                    },
                )
            },
        ),
        "bf16": st.fixed_dictionaries({"enabled": st.sampled_from([True, False, "auto"])}),
        "fp16": st.fixed_dictionaries(
            {"enabled": st.sampled_from([False, "auto"])},
            optional={"loss_scale": st.floats(0, 2**16), "hysteresis": st.integers(1, 10)},
        ),
    },
)


@SETTINGS
@given(valid_configs)
def test_every_valid_config_loads_and_round_trips(config):
    cfg = load_config(config)
    assert load_config(cfg.to_dict()) == cfg
    assert load_config(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.replace() == cfg
