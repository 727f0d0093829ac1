"""Exact resume: save after step K, load into a model built in a new process (from another seed), and the
next steps give bitwise the losses and weights of the run that never stopped — params and optimizer states
each on cpu or nvme; MLP, tiny GPT-2 (dropout on) and Llama; one process and two gloo ranks. Another world
size: a 2-rank checkpoint loads into 1 rank and back, and re-saving gives the same full tensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from .conftest import run_ranks

WORKER = Path(__file__).with_name("_ckpt_worker.py")


def phase(
    tmp_path: Path, run: str, world: int, phase: str, cases: list[dict[str, Any]], **extra: str
) -> None:
    d = tmp_path / run
    d.mkdir()
    (d / "spec.json").write_text(json.dumps({"phase": phase, "root": str(tmp_path), "cases": cases, **extra}))
    run_ranks(WORKER, d, world=world, timeout=300)


def case(model: str, ptier: str, otier: str) -> dict[str, str]:
    return {"name": f"{model}-{ptier}-{otier}", "model": model, "ptier": ptier, "otier": otier}


ONE_PROCESS = [
    case("mlp", "cpu", "cpu"),
    case("mlp", "nvme", "nvme"),
    case("mlp", "cpu", "nvme"),
    case("mlp", "nvme", "cpu"),
    case("gpt2", "nvme", "nvme"),
    case("llama", "cpu", "nvme"),
]


def test_exact_resume_in_a_new_process(tmp_path):
    pytest.importorskip("transformers")
    phase(tmp_path, "ref", 1, "ref", ONE_PROCESS)
    phase(tmp_path, "resume", 1, "resume", ONE_PROCESS)


def full(ckpt: Path, kind: str) -> dict[str, torch.Tensor]:
    """Every param's full flat ``kind`` (params, exp_avg...) read with plain safetensors, from all ranks."""
    tag = ckpt / (ckpt / "latest").read_text().strip()
    m = json.loads((tag / "manifest.json").read_text())
    world = m["world_size"]
    out = {}
    for p in m["params"]:
        numel = 1
        for d in p["shape"]:
            numel *= d
        parts = []
        for r in range(p["partition"]["ranks"]):
            with safe_open(str(tag / f"rank{r:05d}-of-{world:05d}.{kind}.safetensors"), "pt") as f:
                if p["name"] in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                    parts.append(f.get_tensor(p["name"]))
        if parts:
            out[p["name"]] = torch.cat(parts)[:numel]
    return out


@pytest.mark.dist
def test_two_ranks_resume_exactly_and_move_to_one_rank_and_back(tmp_path):
    pytest.importorskip("transformers")
    cases = [case("mlp", "nvme", "nvme"), case("gpt2", "cpu", "nvme")]
    phase(tmp_path, "ref", 2, "ref", cases)
    phase(tmp_path, "resume", 2, "resume", cases)
    phase(tmp_path, "to1", 1, "resave", cases, src="ckpt", dst="one")
    phase(tmp_path, "back2", 2, "resave", cases, src="one", dst="two")
    for c in cases:
        for kind in ("params", "exp_avg", "exp_avg_sq"):
            want = full(tmp_path / "ckpt" / c["name"], kind)
            assert want, (c, kind)
            for other in ("one", "two"):
                got = full(tmp_path / other / c["name"], kind)
                assert got.keys() == want.keys(), (c, kind, other)
                for name, t in want.items():
                    assert torch.equal(got[name], t), f"{c['name']} {kind} {name}: differs after {other}"
        # Weights too: all three folders hold the same full weights.
        a = (tmp_path / "one_w" / c["name"] / "model.safetensors").read_bytes()
        assert a == (tmp_path / "two_w" / c["name"] / "model.safetensors").read_bytes(), c
