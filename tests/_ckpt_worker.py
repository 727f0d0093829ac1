"""One process (or one rank) of the checkpoint tests: ``python _ckpt_worker.py RANK WORLD INIT_FILE RUN_DIR``.

``RUN_DIR/spec.json`` says what to do: ``{"phase", "root", "cases": [{"name", "model", "ptier", "otier"}]}``.

- ``ref``: train `K` steps, save a checkpoint (``root/ckpt/NAME``), train on to `N`, keep the losses of steps
  K..N-1 (``root/ref/NAME.rankR.json``, as float.hex) and the final weights (``root/ref_w/NAME``).
- ``resume``: a model built from another seed, loaded from ``root/ckpt/NAME`` (any world size), must report
  the saved client_state and step count, then give bitwise the reference losses and final weights.
- ``resave``: load ``root/SRC/NAME`` (saved at another world size) and save it again to ``root/DST/NAME``,
  plus its weights to ``root/DST_w/NAME``: the test compares the two checkpoints' contents.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zswap
from tests.test_runtime import MLP

K, N = 2, 4


def make(model: str) -> torch.nn.Module:
    if model == "mlp":
        return MLP()
    from tests.test_hf_models import MODELS

    return MODELS[model]()


def config(case: dict[str, Any], root: Path, rank: int) -> dict[str, Any]:
    swap = root / "swap" / f"rank{rank}"
    swap.mkdir(parents=True, exist_ok=True)
    return {
        "zero_optimization": {
            "offload_param": {"device": case["ptier"], "nvme_path": str(swap)},
            "offload_optimizer": {"device": case["otier"], "nvme_path": str(swap)},
            "sub_group_size": 3000,  # several records per model, some params across two
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.8, 0.95], "weight_decay": 0.1}},
        "gradient_clipping": 0.5,
    }


def build(case: dict[str, Any], root: Path, rank: int, seed: int) -> tuple[torch.nn.Module, zswap.Engine]:
    cfg = config(case, root, rank)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            m = make(case["model"])
        m.train()
        return m, zswap.initialize(m, cfg)


def step(m: torch.nn.Module, engine: zswap.Engine, model: str, i: int, rank: int) -> float:
    g = torch.Generator().manual_seed(1000 * i + rank)
    if model == "mlp":
        x = torch.randn(4, 12, generator=g)
        loss = (m(x + 0.01 * torch.randn_like(x))).square().mean()  # the global RNG takes part, as dropout's
    else:
        ids = torch.randint(0, 128, (2, 12), generator=g)
        loss = m(input_ids=ids, labels=ids).loss  # GPT-2's dropout draws from the global RNG
    loss.backward()
    engine.step()
    return loss.item()


def run(phase: str, case: dict[str, Any], root: Path, rank: int, spec: dict[str, Any]) -> None:
    name, model = case["name"], case["model"]
    if phase == "ref":
        m, engine = build(case, root, rank, seed=0)
        with engine:
            for i in range(K):
                step(m, engine, model, i, rank)
            engine.save_checkpoint(root / "ckpt" / name, client_state={"case": name, "rank": rank})
            losses = [step(m, engine, model, i, rank).hex() for i in range(K, N)]
            (root / "ref").mkdir(exist_ok=True)
            (root / "ref" / f"{name}.rank{rank}.json").write_text(json.dumps(losses))
            zswap.save_weights(m, root / "ref_w" / name)
        return
    m, engine = build(case, root, rank, seed=123)
    with engine:
        if phase == "resume":
            cs = engine.load_checkpoint(root / "ckpt" / name)
            saved_world = json.loads(
                (root / "ckpt" / name / f"global_step{K}" / "manifest.json").read_text()
            )["world_size"]
            assert cs == {"case": name, "rank": rank if rank < saved_world else 0}, cs
            assert engine.global_steps == K, engine.global_steps
            losses = [step(m, engine, model, i, rank).hex() for i in range(K, N)]
            want = json.loads((root / "ref" / f"{name}.rank{rank}.json").read_text())
            assert losses == want, f"{name} rank {rank}: losses {losses} after resume, {want} uninterrupted"
            zswap.save_weights(m, root / "res_w" / name)
            if rank == 0:
                a = (root / "ref_w" / name / "model.safetensors").read_bytes()
                b = (root / "res_w" / name / "model.safetensors").read_bytes()
                assert a == b, f"{name}: weights after resume differ from the uninterrupted run's"
        else:
            engine.load_checkpoint(root / spec["src"] / name)
            engine.save_checkpoint(root / spec["dst"] / name)
            zswap.save_weights(m, root / f"{spec['dst']}_w" / name)


def main() -> None:
    rank, world, init_file, run_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    spec = json.loads((run_dir / "spec.json").read_text())
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        if any(c["model"] != "mlp" for c in spec["cases"]):
            import transformers

            transformers.logging.set_verbosity_error()
        for case in spec["cases"]:
            run(spec["phase"], case, Path(spec["root"]), rank, spec)
    finally:
        if world > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
