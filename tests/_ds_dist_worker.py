"""One rank of the two-rank scenarios adapted from DeepSpeed's tests (tests/test_ds_zero_context.py):
``python _ds_dist_worker.py RANK WORLD INIT_FILE TMP``."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zswap
import zswap.deepspeed as deepspeed
from zswap import Status, param_state


def scatter_gather(rank: int, world: int) -> None:
    with deepspeed.zero.Init():
        layer = nn.Linear(6, 3)
    st = param_state(layer.weight)
    assert st.status is Status.NOT_AVAILABLE and layer.weight.numel() == 0
    assert st.world_size == world and st.partition_numel == 9  # 18 elements over 2 ranks
    plain = nn.Linear(6, 3)
    assert param_state(plain.weight) is None and plain.weight.numel() == 18
    with deepspeed.zero.GatheredParameters(layer.weight):
        assert param_state(layer.weight).status is Status.AVAILABLE and layer.weight.numel() == 18


def gather_update(rank: int, world: int) -> None:
    with deepspeed.zero.Init():
        layer = nn.Linear(4, 2)
    with deepspeed.zero.GatheredParameters(layer.weight, modifier_rank=1):
        assert param_state(layer.weight).status is Status.AVAILABLE
        if rank == 1:
            with torch.no_grad():
                layer.weight.zero_()
    assert param_state(layer.weight).status is Status.NOT_AVAILABLE
    with deepspeed.zero.GatheredParameters(layer.weight):
        assert torch.equal(layer.weight, torch.zeros(2, 4)), layer.weight


class ParentInitialisesChild(nn.Module):
    """DeepSpeed's TestZero3InitForParentWeightInitialization: a rank-dependent fill in ``__init__``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(12, 1)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            with torch.no_grad():
                module.weight.fill_(1 + dist.get_rank())


def params_are_rank_zeros(rank: int, world: int) -> None:
    """Under Init every rank holds rank 0's build, whatever its own random generator or writes gave."""
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0},
    }
    with deepspeed.zero.Init(config_dict_or_path=cfg, mem_efficient_linear=False, enabled=True):
        m = ParentInitialisesChild()
    st = param_state(m.linear.weight)
    assert st.partition_numel == 6
    with deepspeed.zero.GatheredParameters(m.linear.weight):
        assert torch.equal(m.linear.weight, torch.ones(1, 12)), m.linear.weight
    torch.manual_seed(100 + rank)  # a per-rank seed, as scripts that seed data order by rank do
    plain = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    want = [p.detach().clone() for p in plain.parameters()]
    for t in want:
        dist.broadcast(t, 0)  # rank 0's plain build
    torch.manual_seed(100 + rank)
    with zswap.Init(cfg):
        built = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
        with torch.no_grad():
            built[1].bias.data = torch.full((3,), float(rank))  # a rank-dependent write after partitioning
    want[3] = torch.zeros(3)
    with zswap.GatheredParameters(list(built.parameters())):
        for p, q in zip(built.parameters(), want, strict=True):
            assert torch.equal(p, q), (rank, p, q)


HYPER = {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
"""The config's AdamW in the scenarios that train against plain torch: fused AdamW's defaults at this lr."""


def linear_twins(cfg: dict) -> tuple[nn.Linear, nn.Linear, torch.optim.AdamW]:
    """A plain ``Linear(6, 5)``, the same built under ``Init(cfg)`` from the same seed, and a fused AdamW
    at `HYPER` over the plain one."""
    torch.manual_seed(0)
    ref = nn.Linear(6, 5)
    torch.manual_seed(0)
    with zswap.Init(cfg):
        model = nn.Linear(6, 5)
    return ref, model, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, fused=True)


def communication_dtype(rank: int, world: int, tmp: str) -> None:
    """``communication_data_type`` fp16 / bf16 for float32 params: each rank's gradient is rounded to it,
    the ranks sum and divide in it (fp16: divide, then sum), the average comes back in float32 (DeepSpeed's
    reduction); bitwise a plain AdamW given those averages."""
    for comm, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        path = Path(tmp) / comm
        path.mkdir(exist_ok=True)
        cfg = {
            "train_micro_batch_size_per_gpu": 1,
            "communication_data_type": comm,
            "optimizer": {"type": "AdamW", "params": HYPER},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(path)}},
        }
        ref, model, opt = linear_twins(cfg)
        with zswap.initialize(model, cfg) as engine:
            for s in range(2):
                seeds = [torch.Generator().manual_seed(10 * s + r) for r in range(world)]
                xs = [torch.randn(3, 6, generator=g) for g in seeds]
                engine.backward(engine(xs[rank]).pow(2).sum())
                engine.step()
                grads = []  # every rank's gradients, computed here for each
                for r in range(world):
                    ref.zero_grad()
                    ref(xs[r]).pow(2).sum().backward()
                    grads.append([p.grad.clone() for p in ref.parameters()])
                for i, p in enumerate(ref.parameters()):
                    first = dtype == torch.float16  # each rank's divided before the sum, as DeepSpeed's
                    each = [grads[r][i].to(dtype) / (world if first else 1) for r in range(world)]
                    total = each[0]
                    for g in each[1:]:
                        total = total + g
                    p.grad = (total if first else total / world).float()
                opt.step()
            with zswap.GatheredParameters(list(model.parameters())):
                for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                    assert torch.equal(p, q), (comm, rank, p, q)


def communication_fp32_for_bf16(rank: int, world: int, tmp: str) -> None:
    """bf16 params reduced in float32 with float32 accumulation: the averages stay float32 into the step;
    the update in backward is bitwise the ordinary step's."""
    runs = []
    for early in (True, False):
        path = Path(tmp) / f"fp32-{early}"
        path.mkdir(exist_ok=True)
        cfg = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 2,
            "bf16": {"enabled": True},
            "communication_data_type": "fp32",
            "data_types": {"grad_accum_dtype": "fp32"},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {
                "stage": 3,
                "stage3_param_persistence_threshold": 0,
                "offload_param": {"device": "nvme", "nvme_path": str(path)},
                "offload_optimizer": {"device": "nvme", "nvme_path": str(path)},
            },
        }
        torch.manual_seed(0)
        with zswap.Init(cfg):
            model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
        with zswap.initialize(model, cfg) as engine:
            engine.early_step = early
            for s in range(6):
                x = torch.randn(2, 8, generator=torch.Generator().manual_seed(10 * s + rank)).bfloat16()
                engine.backward(engine(x).float().pow(2).mean())
                engine.step()
            assert engine.stats()["steps_in_backward"] == (2 if early else 0), engine.stats()
            with zswap.GatheredParameters(list(model.parameters())):
                runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def sixteen_bit_save(rank: int, world: int, tmp: str) -> None:
    """``save_16bit_model`` over two ranks: every rank gathers each param as rank 0 writes it; the file
    holds every full value (odd sizes: the all-gathers' padding is not written) in bf16."""
    cfg = {
        "train_batch_size": 2,
        "bf16": {"enabled": True},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3},
    }
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    out = Path(tmp) / "sixteen"
    with engine:
        assert engine.save_16bit_model(out) is True
        with zswap.GatheredParameters(list(model.parameters())):
            want = {k: v.clone() for k, v in model.state_dict().items()}
    saved = torch.load(out / "pytorch_model.bin", weights_only=True)  # complete on every rank's return
    assert list(saved) == list(want) and all(torch.equal(saved[k], v) for k, v in want.items()), saved
    assert {v.dtype for v in saved.values()} == {torch.bfloat16}
    assert saved["2.weight"].untyped_storage().nbytes() == 15 * 2


def nan_on_one_rank(rank: int, world: int, tmp: str) -> None:
    """A NaN in rank 1's second batch only: the global norm is NaN on every rank, so every rank skips
    that step (DeepSpeed's ZeRO-3) and every rank ends where plain AdamW over the other steps' averaged
    gradients ends — bitwise without clipping; with it, to the rounding of the norm summed over ranks."""
    for clip in (0.0, 1.0):
        path = Path(tmp) / f"nan-{clip}"
        path.mkdir(exist_ok=True)
        nvme = {"device": "nvme", "nvme_path": str(path)}
        cfg = {
            "train_micro_batch_size_per_gpu": 3,
            "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": HYPER},
            "zero_optimization": {"stage": 3, "offload_param": nvme, "offload_optimizer": nvme},
        }
        ref, model, opt = linear_twins(cfg)
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
        with engine:
            for s in range(3):
                xs = [
                    torch.randn(3, 6, generator=torch.Generator().manual_seed(10 * s + r))
                    for r in range(world)
                ]
                if s == 1:
                    xs[1][0, 0] = float("nan")
                engine.backward(engine(xs[rank]).pow(2).sum())
                engine.step()
                if s == 1:
                    assert engine.get_global_grad_norm() == float("inf") and not engine.was_step_applied()
                    continue
                ref.zero_grad()
                for x in xs:  # the sum over ranks, then the average, as the ranks' reduction
                    ref(x).pow(2).sum().backward()
                for p in ref.parameters():
                    p.grad /= world
                norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip or float("inf"))
                opt.step()
                # (the ranks' squared partition norms summed: torch's norm up to rounding)
                assert engine.was_step_applied() and math.isclose(
                    engine.get_global_grad_norm(), norm, rel_tol=1e-6
                )
            assert (engine.skipped_steps, engine.global_steps) == (1, 3)
            with zswap.GatheredParameters(list(model.parameters())):
                for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                    # clipping: by a factor from that norm, so equal up to its rounding
                    same = torch.equal(p, q) if not clip else torch.allclose(p, q, rtol=1e-6, atol=0)
                    assert same, (clip, rank, (p - q).abs().max())


def main() -> None:
    rank, world, init_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zswap.ZswapWarning)
            scatter_gather(rank, world)
            gather_update(rank, world)
            params_are_rank_zeros(rank, world)
            communication_dtype(rank, world, sys.argv[4])
            communication_fp32_for_bf16(rank, world, sys.argv[4])
            sixteen_bit_save(rank, world, sys.argv[4])
            nan_on_one_rank(rank, world, sys.argv[4])
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
