"""Smoke runs of the command line with tiny sizes (the real figures come from `make bench`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zswap.cli import main


def test_bench_prints_engine_next_to_baseline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "figures.json"
    args = ["bench", "--path", str(tmp_path), "--size", "8MiB", "--repeat", "1"]
    assert main([*args, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "raw disk:" in text and "zswap SwapEngine, engine buffers" in text and "×)" in text
    figures = json.loads(out.read_text())
    assert figures["size"] == 8 << 20
    assert figures["engine_buffers"]["write"] > 0 and figures["torch_tensors"]["read"] > 0
    assert figures["ratios"]["engine_buffers"]["write"] is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figures.json"]  # no swap or fio file left


def test_tune_prints_a_config_block(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["tune", "--path", str(tmp_path), "--size", "4MiB", "--block-sizes", "256KiB", "1MiB"]
    assert main([*args, "--queue-depths", "2", "8", "--repeat", "1"]) == 0
    text = capsys.readouterr().out
    block = json.loads(text[text.index("{") :])
    assert block["aio"]["block_size"] in (256 << 10, 1 << 20) and block["aio"]["queue_depth"] in (2, 8)


def test_bad_sizes_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["bench", "--size", "lots"])
    assert ei.value.code == 2
    assert "--size: 'lots' must be a size in bytes" in capsys.readouterr().err


def test_missing_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="is not an existing directory"):
        main(["bench", "--path", str(tmp_path / "typo"), "--size", "1MiB"])
