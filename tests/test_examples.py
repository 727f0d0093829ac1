"""The scripts in ``examples/`` run as a user would run them (a subprocess, tiny sizes, swap files in a
temp dir): they exit cleanly, print one finite loss per step, and keep params and optimizer state on NVMe.
The two-process Lightning run prints bitwise the losses of Lightning's own DDP with the same optimizer;
the Hugging Face script, given weights saved by ``save_pretrained``, starts from exactly those weights."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PYTHONPATH = str(Path(__file__).resolve().parent.parent / "python")
TIMEOUT = 600


def _run(script: str, *args: str, cwd: Path) -> str:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (PYTHONPATH, os.environ.get("PYTHONPATH")) if p),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, f"{script} {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _losses(out: str, steps: int) -> list[float]:
    found = [(int(s), float(v)) for s, v in re.findall(r"^step (\d+) loss (\S+)$", out, re.MULTILINE)]
    assert [s for s, _ in found] == list(range(1, steps + 1)), out
    losses = [v for _, v in found]
    assert all(math.isfinite(v) for v in losses), out
    return losses


def _offloaded(out: str) -> None:
    assert re.search(
        r"^params: [1-9]\d* elements partitioned, tier nvme; optimizer state on nvme", out, re.M
    ), out


def test_lightning_example(tmp_path):
    pytest.importorskip("lightning.pytorch", reason="the 'lightning' package is not installed")
    out = _run(
        "lightning_train.py",
        "--steps",
        "3",
        "--dim",
        "16",
        "--layers",
        "1",
        "--nvme",
        str(tmp_path),
        cwd=tmp_path,
    )
    _losses(out, 3)
    _offloaded(out)
    assert sorted(os.listdir(tmp_path)) == []  # swap files are unlinked at creation; nothing else written


@pytest.mark.dist
@pytest.mark.slow
def test_lightning_example_two_processes_equals_lightning_ddp(tmp_path):
    pytest.importorskip("lightning.pytorch", reason="the 'lightning' package is not installed")
    args = ("--steps", "3", "--dim", "16", "--layers", "1", "--devices", "2")
    ours = _run("lightning_train.py", *args, "--nvme", str(tmp_path), cwd=tmp_path)
    _offloaded(ours)
    ddp = _run("lightning_train.py", *args, "--strategy", "plain", cwd=tmp_path)
    assert _losses(ours, 3) == _losses(ddp, 3)


def test_hf_example_from_a_config(tmp_path):
    pytest.importorskip("transformers")
    out = _run(
        "hf_finetune.py",
        "--steps",
        "3",
        "--dim",
        "32",
        "--layers",
        "1",
        "--nvme",
        str(tmp_path),
        cwd=tmp_path,
    )
    _losses(out, 3)
    _offloaded(out)


def test_hf_example_from_saved_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    sys.path.insert(0, str(EXAMPLES))
    try:
        import hf_finetune
    finally:
        sys.path.remove(str(EXAMPLES))
    torch.manual_seed(1)
    saved = tmp_path / "tiny"
    hf_finetune.build(None, vocab=40, dim=32, layers=1).save_pretrained(saved)
    swap = tmp_path / "swap"
    swap.mkdir()
    out = _run(
        "hf_finetune.py",
        "--model",
        str(saved),
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--nvme",
        str(swap),
        cwd=tmp_path,
    )
    _losses(out, 2)
    _offloaded(out)
    # The plain model loaded from the same files gives the same first loss: the weights were loaded.
    chars = sorted(set(hf_finetune.TEXT))
    ids = torch.tensor([chars.index(c) for c in hf_finetune.TEXT]).unfold(0, 32, 16)[:2]
    plain = transformers.AutoModelForCausalLM.from_pretrained(saved).eval()
    with torch.no_grad():
        expected = plain(input_ids=ids, labels=ids).loss.item()
    assert re.search(rf"^initial loss {re.escape(repr(expected))}$", out, re.M), (expected, out)


README = EXAMPLES.parent / "README.md"


def test_readme_quickstart_is_the_example_and_prints_what_the_readme_shows(tmp_path):
    """The README's quickstart is `examples/quickstart.py` verbatim, and running it prints the README's
    output block (the losses are plain PyTorch's, so they are the same on every machine with this torch)."""
    readme = README.read_text()
    script = (EXAMPLES / "quickstart.py").read_text()
    assert f"```python\n{script}```" in readme
    shown = readme.split("`python examples/quickstart.py` prints:\n\n```\n", 1)[1].split("```", 1)[0]
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "TMPDIR": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py")], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == shown


def test_readme_is_short_and_names_the_two_setup_commands():
    readme = README.read_text()
    assert len(readme) <= 15_000
    assert "make demo" in readme and "make test" in readme
    for link in re.findall(r"\]\((docs/[^)]+|benches/README\.md)\)", readme):
        assert (README.parent / link).is_file(), link
