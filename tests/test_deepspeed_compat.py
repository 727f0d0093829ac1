"""`zswap.deepspeed`: a DeepSpeed script runs with only its import changed — DeepSpeed's signatures for
initialize (4-tuple, data loader, config sources), zero.Init, zero.GatheredParameters,
register_external_parameter; DeepSpeed keywords zswap does not support are a TypeError naming them."""

from __future__ import annotations

import argparse
import io
import json
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import zswap
import zswap.deepspeed as deepspeed
from zswap import ConfigError, param_state
from zswap.checkpoint import _torchsave

from .test_runtime import TinyLM, ids, sq

HYPER: dict[str, Any] = {"lr": 1e-2, "betas": [0.8, 0.95], "weight_decay": 0.1}


def ds_config(**extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
        "optimizer": {"type": "AdamW", "params": HYPER},
        **extra,
    }


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        yield


def test_a_deepspeed_training_script_runs_and_matches_torch_bitwise():
    cfg = ds_config()
    torch.manual_seed(0)
    ref = TinyLM()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = TinyLM()
    assert all(param_state(p) is not None for p in model.parameters())
    data = TensorDataset(ids(batch=12, seed=3))
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg, training_data=data
    )
    assert isinstance(engine, zswap.Engine) and optimizer is engine.optimizer and scheduler is None
    assert isinstance(optimizer, zswap.optim.OffloadedAdamW)
    # DeepSpeed's sampler under its launcher or init_distributed: a DistributedSampler, on one rank too
    # (the seed-0 order, not the global RNG's)
    assert isinstance(loader, DataLoader) and loader.batch_size == 3
    assert isinstance(loader.sampler, DistributedSampler) and loader.sampler.num_replicas == 1
    assert [i for (b,) in loader for i in b[:, 0].tolist()] == [
        int(x) for x in data.tensors[0][list(DistributedSampler(data, num_replicas=1, rank=0)), 0]
    ]
    batches = [b for (b,) in loader]
    assert len(batches) == 4 and all(b.shape == (3, 8) for b in batches)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, fused=True)
    with engine:
        for i, batch in enumerate(batches):
            loss = engine(batch)
            want = ref(batch)
            assert torch.equal(loss, want)
            engine.backward(sq(loss))
            (sq(want) / 2).backward()
            engine.step()
            if i % 2 == 1:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
                ref_opt.step()
                ref_opt.zero_grad()
        assert engine.global_steps == 2
        with zswap.GatheredParameters(list(model.parameters())):
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                assert torch.equal(p.data, q.data)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_the_engine_answers_deepspeeds_queries(dtype):
    cfg = ds_config(**({dtype: {"enabled": True}} if dtype != "fp32" else {}))
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = TinyLM()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    with engine:
        assert (engine.fp16_enabled(), engine.bfloat16_enabled()) == (dtype == "fp16", dtype == "bf16")
        assert engine.zero_optimization() and engine.zero_optimization_stage() == 3
        assert (engine.global_rank, engine.local_rank, engine.world_size, engine.dp_world_size) == (
            0,
            0,
            1,
            1,
        )
        assert engine.get_batch_info() == (6, 3, 2) and engine.mp_world_size == 1
        assert (
            engine.zero_offload_param() is engine.config.offload_param
            and engine.zero_offload_optimizer() is None
        )
        assert not engine.zero_cpu_offload() and not engine.zero_use_cpu_optimizer()
        with zswap.GatheredParameters(list(model.parameters())):
            want = {k: v.clone() for k, v in model.state_dict().items()}
        got = engine.module_state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
        model.wte.weight.requires_grad_(False)
        assert set(want) - set(engine.module_state_dict(exclude_frozen_parameters=True)) == {
            "wte.weight",
            "head.weight",  # tied to it
        }
        model.wte.weight.requires_grad_(True)
        with pytest.raises(AssertionError, match="no_sync context manager is incompatible") as raised:
            engine.no_sync()
        assert isinstance(raised.value, zswap.ZswapError)
        engine.destroy()
        assert engine.closed


def test_config_from_args_config_params_or_a_path(tmp_path: Path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 5}})))
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    assert args.deepspeed and args.deepspeed_config == str(path)
    for kwargs in ({"args": args}, {"config_params": str(path)}, {"config": path}):
        model = TinyLM()
        engine, _, loader, scheduler = deepspeed.initialize(model=model, **kwargs)
        with engine:
            assert loader is None and isinstance(scheduler, zswap.schedules.WarmupLR)
            assert engine.gradient_accumulation_steps() == 2
    with pytest.raises(
        TypeError, match=r"got a config from config and args\.deepspeed_config; pass exactly one"
    ):
        deepspeed.initialize(args=args, model=TinyLM(), config=ds_config())
    with pytest.raises(TypeError, match="needs a config"):
        deepspeed.initialize(model=TinyLM())
    with pytest.raises(TypeError, match="requires a model"):
        deepspeed.initialize(config=ds_config())


def test_optimizer_and_scheduler_callables_as_deepspeed_takes_them():
    model = TinyLM()
    made: dict[str, Any] = {}

    def make_opt(params: Any) -> torch.optim.Optimizer:
        made["params"] = list(params)
        return torch.optim.AdamW(made["params"], lr=0.5)

    def make_sched(opt: Any) -> Any:
        made["opt"] = opt
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    cfg = ds_config()
    del cfg["optimizer"]
    engine, opt, _, sched = deepspeed.initialize(
        model=model, optimizer=make_opt, lr_scheduler=make_sched, config=cfg
    )
    with engine:
        assert (
            made["params"] == list(model.parameters()) and made["opt"] is opt and sched is engine.lr_scheduler
        )
        for _ in range(2):
            engine.backward(sq(engine(ids())))
            engine.step()
        assert engine.get_lr() == [0.25]


def test_model_parameters_pick_what_the_config_optimizer_steps():
    model = TinyLM()
    groups = [
        {"params": [p for n, p in model.named_parameters() if "ln" not in n]},
        {"params": [p for n, p in model.named_parameters() if "ln" in n], "weight_decay": 0.0},
    ]
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config())
    with engine:
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    with pytest.raises(zswap.ZswapError, match="closed"):
        engine.step()


@pytest.mark.parametrize(
    ("kwargs", "name"), [({"mpu": object()}, "mpu"), ({"mesh_param": (2, 1)}, "mesh_param")]
)
def test_unsupported_initialize_keywords_are_type_errors_naming_them(kwargs, name):
    with pytest.raises(TypeError, match=rf"initialize: {name}=.* is not supported by zswap"):
        deepspeed.initialize(model=TinyLM(), config=ds_config(), **kwargs)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_thing'"):
        deepspeed.initialize(model=TinyLM(), config=ds_config(), no_such_thing=1)  # type: ignore[call-arg]


def test_training_data_needs_a_batch_size():
    cfg = ds_config()
    del cfg["train_micro_batch_size_per_gpu"]
    with pytest.raises(ConfigError, match="training_data needs a batch size"):
        deepspeed.initialize(model=TinyLM(), config=cfg, training_data=TensorDataset(torch.zeros(4, 2)))


def test_collate_fn_is_used():
    seen: list[int] = []

    def collate(items: list[Any]) -> torch.Tensor:
        seen.append(len(items))
        return torch.stack([x for (x,) in items])

    data = TensorDataset(ids(batch=7, seed=2))
    engine, _, loader, _ = deepspeed.initialize(
        model=TinyLM(), config=ds_config(), training_data=data, collate_fn=collate
    )
    with engine:
        assert [b.shape[0] for b in loader] == [3, 3, 1] and seen == [
            3,
            3,
            1,
        ]  # drop_last false, as DeepSpeed


def test_dist_init_is_left_alone_for_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for required in (None, False):
        engine, *_ = deepspeed.initialize(model=TinyLM(), config=ds_config(), dist_init_required=required)
        engine.close()
    assert not torch.distributed.is_initialized()


# -- zero -------------------------------------------------------------------------------------------------


def test_zero_init_takes_deepspeeds_keywords(tmp_path: Path):
    cfg = {"zero_optimization": {"offload_param": {"device": "cpu"}}, "bf16": {"enabled": True}}
    with deepspeed.zero.Init(config_dict_or_path=cfg, data_parallel_group=None, enabled=True):
        m = nn.Linear(4, 4)
    assert param_state(m.weight).dtype == torch.bfloat16 and param_state(m.weight).tier == "cpu"
    with deepspeed.zero.Init(config=cfg, dtype=torch.float32):  # config: the deprecated name
        m2 = nn.Linear(4, 4)
    assert param_state(m2.weight).dtype == torch.float32
    with deepspeed.zero.Init(enabled=False):
        m3 = nn.Linear(2, 2)
    assert param_state(m3.weight) is None
    plain = nn.Linear(3, 3)
    deepspeed.zero.Init(module=plain, config_dict_or_path=cfg, mem_efficient_linear=True)
    assert param_state(plain.weight) is not None
    nvme = {"zero_optimization": {"offload_param": {"device": "cpu", "nvme_path": str(tmp_path)}}}
    with deepspeed.zero.Init(config_dict_or_path=nvme, remote_device="nvme"):
        m4 = nn.Linear(4, 4)
    assert param_state(m4.weight).tier == "nvme"


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"mpu": object()}, "mpu"),
        ({"zero_param_parallel_group": object()}, "zero_param_parallel_group"),
        ({"zero_quantized_weights": True}, "zero_quantized_weights"),
        ({"zero_quantized_nontrainable_weights": True}, "zero_quantized_nontrainable_weights"),
        ({"sequence_data_parallel_group": object()}, "sequence_data_parallel_group"),
        ({"param_swapper": object()}, "param_swapper"),
        ({"tensor_overrides": []}, "tensor_overrides"),
    ],
)
def test_zero_init_refuses_what_zswap_does_not_support(kwargs, name):
    with pytest.raises(TypeError, match=rf"zero\.Init: {name}=.* is not supported by zswap"):
        deepspeed.zero.Init(**kwargs)


def test_zero_init_config_twice_is_refused():
    with pytest.raises(TypeError, match="both config_dict_or_path= and config="):
        deepspeed.zero.Init(config_dict_or_path={}, config={})


def test_pin_memory_follows_the_config_unless_set(monkeypatch):
    seen: list[Any] = []
    original = zswap.Init.__init__

    def spy(self: Any, config: Any = None, **kw: Any) -> None:
        seen.append(kw["pin_memory"])
        original(self, config, **kw)

    monkeypatch.setattr(zswap.Init, "__init__", spy)
    cfg = {"offload_param": {"device": "cpu", "pin_memory": True}}
    deepspeed.zero.Init(config_dict_or_path=cfg)  # the config decides (DeepSpeed)
    deepspeed.zero.Init(config_dict_or_path=cfg, pin_memory=True)
    deepspeed.zero.Init(remote_device="cpu")  # no config: the keyword's False
    assert seen == [None, True, False]


def test_gathered_parameters_with_fwd_module_and_modifier_rank():
    with zswap.Init({"offload_param": {"device": "cpu"}}):
        m = nn.Linear(3, 3)
    with deepspeed.zero.GatheredParameters(m.weight, modifier_rank=0, fwd_module=m):
        assert m.weight.shape == (3, 3)
        m.weight.data.fill_(2.0)
    with zswap.GatheredParameters(m.weight):
        assert torch.equal(m.weight.data, torch.full((3, 3), 2.0))
    with deepspeed.zero.GatheredParameters([m.weight], enabled=False):
        assert m.weight.numel() == 0
    with pytest.raises(TypeError, match=r"fwd_module must be an nn\.Module or None, not str"):
        deepspeed.zero.GatheredParameters(m.weight, fwd_module="m")  # type: ignore[arg-type]


def test_register_external_parameter_is_a_checked_no_op():
    with zswap.Init({"offload_param": {"device": "cpu"}}):
        m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    deepspeed.zero.register_external_parameter(m[1], m[0].weight)
    deepspeed.zero.unregister_external_parameter(m[1], m[0].weight)
    with pytest.raises(RuntimeError, match=r"parameter must be an nn\.Parameter, not Tensor") as ei:
        deepspeed.zero.register_external_parameter(m[1], torch.zeros(2))
    assert isinstance(ei.value, zswap.ZswapError)


def test_deepspeed_names_not_implemented_say_what_to_use():
    """DeepSpeed names zswap does not mirror say what to use, also where a script imports them by name."""
    from zswap.deepspeed.zero import TiledLinear, TiledLinearReturnBias

    for cls in (TiledLinear, TiledLinearReturnBias):
        with pytest.raises(
            NotImplementedError, match=rf"zero\.{cls.__name__}: zswap has none: .*torch\.nn\.Linear"
        ):
            cls(4, 4)
    with pytest.raises(AttributeError, match=r"ZeroParamStatus .*zswap\.param_state\(p\)"):
        deepspeed.zero.ZeroParamStatus  # noqa: B018
    with pytest.raises(AttributeError, match=r"has no attribute 'Tiled'$"):
        deepspeed.zero.Tiled  # noqa: B018
    with pytest.raises(AttributeError, match=r"zswap\.deepspeed\.moe: zswap has no DeepSpeed's MoE layer"):
        deepspeed.moe  # noqa: B018
    with pytest.raises(AttributeError, match=r"zswap\.deepspeed\.runtime: .*'scheduler' section"):
        deepspeed.runtime  # noqa: B018
    with pytest.raises(AttributeError, match=r"ops has no 'lamb': .*ops\.adam\.DeepSpeedCPUAdam"):
        deepspeed.ops.lamb  # noqa: B018
    assert deepspeed.__version__ == "0.19.8"


@pytest.mark.parametrize("offloaded", [True, False])
def test_deepspeeds_adam_classes_become_zswaps_adamw(offloaded, tmp_path):
    """``DeepSpeedCPUAdam`` / ``FusedAdam`` built by hand and passed to ``initialize`` (DeepSpeed-Chat's way)
    step as zswap's AdamW: bitwise torch's ``AdamW(fused=True)`` with the same values; settings zswap's
    AdamW lacks are refused by name."""
    from zswap.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    cfg = ds_config(gradient_accumulation_steps=1)
    del cfg["optimizer"]
    torch.manual_seed(0)
    ref = TinyLM()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = TinyLM()
    kind = DeepSpeedCPUAdam if offloaded else FusedAdam
    opt = kind(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    assert type(opt) is torch.optim.AdamW
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    assert isinstance(optimizer, zswap.optim.OffloadedAdamW)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, fused=True)
    with engine:
        for i in range(2):
            batch = ids(batch=3, seed=i)
            engine.backward(sq(engine(batch)))
            engine.step()
            sq(ref(batch)).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
            ref_opt.step()
            ref_opt.zero_grad()
        with zswap.GatheredParameters(list(model.parameters())):
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    assert type(DeepSpeedCPUAdam([nn.Parameter(torch.zeros(2))], adamw_mode=False)) is torch.optim.Adam
    with pytest.raises(TypeError, match=r"DeepSpeedCPUAdam: amsgrad=True is not supported"):
        DeepSpeedCPUAdam([nn.Parameter(torch.zeros(2))], amsgrad=True)
    with pytest.raises(TypeError, match=r"FusedAdam: bias_correction=False is not supported"):
        FusedAdam([nn.Parameter(torch.zeros(2))], bias_correction=False)


def test_deepspeed_io_follows_deepspeeds_loader():
    """``engine.deepspeed_io``: eval / predict routes in the dataset's order (DeepSpeed's unshuffled sampler;
    before: shuffled), the ``collate_fn`` given to ``initialize`` where none is given (before: torch's
    default), and ``loader.data_sampler`` as on DeepSpeed's loader (scripts call its ``set_epoch``)."""
    cfg = ds_config(gradient_accumulation_steps=1)
    model = TinyLM()

    def collate(rows: list[Any]) -> dict[str, torch.Tensor]:
        return {"ids": torch.stack([r[0] for r in rows])}

    data = TensorDataset(torch.arange(12).reshape(12, 1))
    engine, _, loader, _ = deepspeed.initialize(
        model=model, config=cfg, training_data=data, collate_fn=collate
    )
    with engine:
        assert isinstance(loader.data_sampler, DistributedSampler) and loader.data_sampler is loader.sampler
        loader.data_sampler.set_epoch(1)
        for route, ordered in (("eval", True), ("predict", True), ("train", False)):
            got = [int(i) for b in engine.deepspeed_io(data, route=route) for i in b["ids"][:, 0]]
            assert (got == list(range(12))) is ordered, route
            assert sorted(got) == list(range(12))


@pytest.mark.parametrize("required", ["True", "None"])
def test_init_distributed_required_makes_a_group_of_one(required, tmp_path):
    """Without a launcher, ``init_distributed()`` (``dist_init_required`` left ``None``, as DeepSpeed scripts
    call it) makes a group of one, so that the script's ``deepspeed.comm`` calls after it work (before:
    nothing, and the first of them failed with torch's "Default process group has not been
    initialized"); ``initialize`` alone makes none."""
    # In a fresh process: a process group cannot be undone in this one.
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import os, torch, torch.distributed as d, zswap.deepspeed as ds\n"
        "ds.initialize(model=torch.nn.Linear(2, 2), config={'train_batch_size': 1})\n"
        "assert not d.is_initialized()\n"
        f"ds.init_distributed(dist_init_required={required}, distributed_port={port})\n"
        "ds.comm.barrier()\n"
        "print(d.get_world_size(), d.get_backend(), os.environ['MASTER_PORT'])\n"
        "d.destroy_process_group()\n"
    )
    env = {
        k: v for k, v in __import__("os").environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_PORT")
    }
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "gloo", str(port)]


def test_a_failed_init_distributed_leaves_the_environment_as_it_was():
    """Without a launcher the group of one takes ``distributed_port`` (as DeepSpeed sets it, whatever
    ``MASTER_PORT`` the shell left); where that fails (the port taken) the environment is as before, so a
    retry with another port uses it (before: the first port stayed in ``MASTER_PORT``)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as taken, socket.socket() as free:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        free.bind(("127.0.0.1", 0))
        busy, port = taken.getsockname()[1], free.getsockname()[1]
        free.close()
        code = (
            "import os, datetime, torch.distributed as d, zswap.deepspeed as ds\n"
            "try:\n"
            f"    ds.init_distributed(distributed_port={busy}, timeout=datetime.timedelta(seconds=20))\n"
            "except Exception as e:\n"
            "    print('failed', os.environ.get('MASTER_PORT'), os.environ.get('WORLD_SIZE'))\n"
            f"ds.init_distributed(distributed_port={port})\n"
            "print(d.get_world_size(), os.environ['MASTER_PORT'])\n"
            "d.destroy_process_group()\n"
        )
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
        env["MASTER_PORT"] = "1"  # a stray one in the shell: distributed_port wins, as DeepSpeed's
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["failed", "1", "None", "1", str(port)]


def test_zero_init_ignores_mem_efficient_linear_false_with_a_warning():
    with pytest.warns(zswap.ZswapWarning, match=r"mem_efficient_linear=False is ignored"):
        init = deepspeed.zero.Init(mem_efficient_linear=False)
    with init:
        layer = nn.Linear(3, 2)
    assert param_state(layer.weight) is not None


class NormedLM(TinyLM):
    """TinyLM with BatchNorm buffers (floating ones and an integer count) beside its tied params."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(16)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_16bit_save_is_torch_saves_archive_written_one_param_at_a_time(tmp_path, monkeypatch, dtype):
    """``save_16bit_model`` writes, byte for byte, what ``torch.save`` writes for the same values in a plain
    model (tied weights one storage under both names, buffers, the state dict's metadata), and each param is
    gathered only once the one before it was written and let go: never two full values at once."""
    cfg = ds_config(**({"bf16": {"enabled": True}} if dtype == "bf16" else {}))
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = NormedLM()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    alive: list[Any] = []
    gathered = _torchsave.full_copy

    def one_at_a_time(p: torch.Tensor, st: Any) -> torch.Tensor:
        assert all(ref() is None for ref in alive), "a param gathered before the last one was let go"
        value = gathered(p, st)
        alive.append(weakref.ref(value))
        return value

    monkeypatch.setattr(_torchsave, "full_copy", one_at_a_time)
    with engine:
        engine.backward(sq(engine(ids(seed=2))))
        engine.step()
        assert engine.save_16bit_model(tmp_path) is True
    assert len(alive) == len(list(model.parameters()))  # the tied pair gathered once
    written = (tmp_path / "pytorch_model.bin").read_bytes()
    saved = torch.load(io.BytesIO(written), weights_only=True)
    tied = {saved[k].untyped_storage().data_ptr() for k in ("wte.weight", "head.weight")}
    assert len(tied) == 1
    plain = NormedLM().to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    plain.load_state_dict(saved)
    want = io.BytesIO()
    torch.save(plain.state_dict(), want)
    assert written == want.getvalue()


def test_the_engines_loader_and_16bit_save(tmp_path):
    """``deepspeed_io`` builds DeepSpeed's loader (micro batch, or the batch size given; shuffled; the
    config's drop_last); ``save_16bit_model`` writes the whole state dict in the params' dtype, tied names
    and buffers included, as ``torch.save`` of the plain model's would be; ``gradient_clipping()``."""
    cfg = ds_config(bf16={"enabled": True}, dataloader_drop_last=True, gradient_clipping=0.5)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = TinyLM()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    with engine:
        assert engine.gradient_clipping() == 0.5
        data = TensorDataset(ids(batch=8, seed=1))
        assert [len(b[0]) for b in engine.deepspeed_io(data)] == [3, 3]
        assert [len(b[0]) for b in engine.deepspeed_io(data, batch_size=4, route="eval")] == [4, 4]
        with pytest.raises(ValueError, match="route must be train, eval, predict or encode"):
            engine.deepspeed_io(data, route="test")
        engine.backward(sq(engine(ids(seed=2))))
        assert engine.save_16bit_model(tmp_path / "out") is True
        saved = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
        with zswap.GatheredParameters(list(model.parameters())):
            want = {k: v.clone() for k, v in model.state_dict().items()}
        assert list(saved) == list(want) and all(torch.equal(saved[k], v) for k, v in want.items())
        assert {v.dtype for k, v in saved.items() if k in dict(model.named_parameters())} == {torch.bfloat16}
        model.wte.weight.requires_grad_(False)  # (tied to the head: both names go)
        engine.save_16bit_model(tmp_path / "out", "frozen.bin", exclude_frozen_parameters=True)
        kept = torch.load(tmp_path / "out" / "frozen.bin", weights_only=True)
        assert set(want) - set(kept) == {"wte.weight", "head.weight"}
        assert engine.save_fp16_model(tmp_path / "out", "old_name.bin") is True  # DeepSpeed's old name
        assert torch.load(tmp_path / "out" / "old_name.bin", weights_only=True).keys() == want.keys()
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
            "frozen.bin",
            "old_name.bin",
            "pytorch_model.bin",
        ]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_client_optimizer_without_float32_masters_is_refused_in_half_precision(dtype):
    """DeepSpeed steps any client optimizer over float32 master weights; zswap keeps them for Adam / AdamW:
    an SGD would step the half-precision params themselves, losing updates below their precision."""
    cfg = {"train_micro_batch_size_per_gpu": 1, dtype: {"enabled": True}, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = TinyLM()
    with pytest.raises(
        ConfigError,
        match=rf"the config enables {dtype} and the client optimizer is SGD: DeepSpeed would step it over "
        "float32 master weights, which zswap keeps for Adam / AdamW only",
    ):
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    engine, optimizer, *_ = deepspeed.initialize(
        model=model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), config=cfg
    )
    assert isinstance(optimizer, zswap.optim.OffloadedAdamW)  # float32 masters in its records
    engine.close()
