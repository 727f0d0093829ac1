"""Progress bars and logging: which switch wins (`zswap._progress.enabled`), a bar on each long operation
when forced and none otherwise, and the `zswap` loggers' events. No prints in library code."""

from __future__ import annotations

import ast
import logging
import sys
from pathlib import Path

import pytest
import torch

import zswap
from zswap import _progress
from zswap.checkpoint import export

PACKAGE = Path(zswap.__file__).parent


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("ZSWAP_PROGRESS", "TQDM_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_switches_in_order(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert not _progress.enabled()  # not a terminal: off
    clean_env.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert _progress.enabled()
    clean_env.setenv("TQDM_DISABLE", "1")
    assert not _progress.enabled()
    clean_env.setenv("TQDM_DISABLE", "0")
    assert _progress.enabled()
    clean_env.setenv("ZSWAP_PROGRESS", "0")
    assert not _progress.enabled()
    clean_env.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    clean_env.setenv("ZSWAP_PROGRESS", "1")
    clean_env.setenv("TQDM_DISABLE", "1")
    assert _progress.enabled()  # forced wins over both


def test_transformers_switch_is_honoured(clean_env: pytest.MonkeyPatch) -> None:
    hf_logging = pytest.importorskip("transformers.utils.logging")
    clean_env.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    hf_logging.disable_progress_bar()
    try:
        assert not _progress.enabled()
    finally:
        hf_logging.enable_progress_bar()
    assert _progress.enabled()


def test_progress_yields_every_item_with_or_without_a_bar(
    clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert list(_progress.progress(range(5), "x")) == [0, 1, 2, 3, 4]
    assert capsys.readouterr().err == ""
    clean_env.setenv("ZSWAP_PROGRESS", "1")
    assert list(_progress.progress(iter(range(3)), "counting", unit="param")) == [0, 1, 2]
    assert "counting" in capsys.readouterr().err


def _config(tmp_path: Path) -> dict[str, object]:
    return {
        "zero_optimization": {
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }


def test_bars_and_log_events_of_a_training_run(
    tmp_path: Path,
    clean_env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    clean_env.setenv("ZSWAP_PROGRESS", "1")
    caplog.set_level(logging.INFO, logger="zswap")
    cfg = _config(tmp_path)
    with zswap.Init(cfg):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    engine = zswap.initialize(model, cfg)
    model(torch.randn(2, 8)).sum().backward()
    engine.step()
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(ckpt)
    engine.load_checkpoint(ckpt)
    engine.close()
    zswap.save_weights(model, tmp_path / "weights")
    export(ckpt, tmp_path / "exported")
    err = capsys.readouterr().err
    for desc in ("saving checkpoint", "loading checkpoint", "saving model.safetensors",
                 "exporting model.safetensors"):  # fmt: skip
        assert desc in err, desc
    messages = [(r.name, r.getMessage()) for r in caplog.records]
    assert all(name.startswith("zswap.") for name, _ in messages)
    text = "\n".join(m for _, m in messages)
    assert f"swap engine on {tmp_path}: backend " in text
    assert "budgets: 212 elements, " in text
    assert f"checkpoint saved: {ckpt / 'global_step1'} (rank 0 of 1)" in text
    assert f"checkpoint loaded: {ckpt / 'global_step1'} (rank 0 of 1)" in text
    assert f"weights saved: {tmp_path / 'weights'} (1 file(s))" in text
    assert f"exported {ckpt / 'global_step1'} to {tmp_path / 'exported'} (1 file(s))" in text


def test_no_bar_when_not_a_terminal(
    tmp_path: Path, clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with zswap.Init(_config(tmp_path)):
        model = torch.nn.Linear(8, 8)
    zswap.save_weights(model, tmp_path / "weights")
    assert capsys.readouterr().err == ""


def test_from_pretrained_under_init_shows_the_loading_bar(
    tmp_path: Path, clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=64,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    capsys.readouterr()
    clean_env.setenv("ZSWAP_PROGRESS", "1")
    with zswap.Init(_config(tmp_path)):
        transformers.LlamaForCausalLM.from_pretrained(tmp_path / "llama")
    assert "loading weights" in capsys.readouterr().err


def test_no_print_in_library_code() -> None:
    """Library modules log (`logging.getLogger("zswap")`) or write to a stream they are given; only the
    command line prints."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert offenders == []
