"""`zswap bench` says which settings it ran with and why (tiny sizes, the crate's raw loop instead of fio:
what is checked is the printed settings, never a speed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from zswap import bench
from zswap.cli import main
from zswap.swap import SwapEngine

NAMES = [
    "block size", "queue depth", "worker rings", "engine buffers", "bounce buffers", "engine buffer reads",
    "fresh read destinations", "drive",
]  # fmt: skip


@pytest.fixture
def no_fio(monkeypatch: pytest.MonkeyPatch) -> None:
    real = shutil.which
    monkeypatch.setattr(bench.shutil, "which", lambda name: None if name == "fio" else real(name))


def _bench(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[str, dict[str, object]]:
    out = tmp_path / "figures.json"
    work = tmp_path / "work"
    work.mkdir()
    args = ["bench", "--path", str(work), "--size", "1MiB", "--repeat", "1", "--json", str(out), *extra]
    assert main(args) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_bench_runs_with_the_engines_pick_and_prints_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_fio: None
) -> None:
    with SwapEngine(tmp_path) as e:
        info = dict(e.info)
    text, figures = _bench(tmp_path, capsys)
    assert (figures["block_size"], figures["queue_depth"]) == (info["block_size"], info["queue_depth"])
    assert f"block {info['block_size'] >> 10} KiB, queue depth {info['queue_depth']}," in text
    settings = figures["settings"]
    assert isinstance(settings, dict)
    assert list(settings) == NAMES
    lines = text.splitlines()
    start = lines.index("settings (fio runs with the same block size and queue depth):")
    for line, (name, (value, why)) in zip(lines[start + 1 :], settings.items(), strict=False):
        assert line == f"  {name:24}{value:>12}  {why}"
    block_value, block_why = settings["block size"]
    assert block_value == f"{info['block_size'] >> 10} KiB"
    assert f"{block_value}: {block_why}" == info["block_size_reason"]
    depth_value, depth_why = settings["queue depth"]
    assert f"{depth_value}: {depth_why}" == info["queue_depth_reason"]
    assert settings["worker rings"] == [str(info["threads"]), bench.settings(info, False)["worker rings"][1]]
    assert settings["engine buffers"][0] == info["buffer_pages"]
    pages = "huge pages" if info["huge_destinations"] else "base pages"
    assert settings["fresh read destinations"] == [pages, info["huge_destinations_reason"]]
    reads = "zero-copy" if info["zero_copy_reads"] else "bounced"
    assert settings["engine buffer reads"] == [reads, info["zero_copy_reads_reason"]]


def test_given_settings_are_reported_as_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_fio: None
) -> None:
    text, figures = _bench(tmp_path, capsys, "--block-size", "256KiB", "--queue-depth", "3", "--threads", "1")
    settings = figures["settings"]
    assert isinstance(settings, dict)
    assert settings["block size"] == ["256 KiB", "given"]
    assert settings["queue depth"] == ["3", "given"]
    assert settings["worker rings"] == ["1", "given"]
    assert (figures["block_size"], figures["queue_depth"]) == (256 << 10, 3)
    assert "block 256 KiB, queue depth 3, best of 1" in text


def test_a_given_block_size_keeps_the_picked_bytes_in_flight(tmp_path: Path) -> None:
    with SwapEngine(tmp_path) as e:
        pick = dict(e.info)
    half = pick["block_size"] // 2
    with SwapEngine(tmp_path, block_size=half) as e:
        assert e.info["block_size_reason"] == f"{half >> 10} KiB: given"
        assert e.info["queue_depth"] == max(4, pick["queue_depth"] * 2)
        assert e.info["queue_depth_reason"].startswith(f"{e.info['queue_depth']}: ")


def test_settings_without_a_block_device() -> None:
    info: dict[str, object] = {
        "block_size_reason": "1024 KiB: no block device", "queue_depth_reason": "16: 16 MiB in flight",
        "threads": 2, "buffer_pages": "small", "bounce_pages": "small", "bounce_bytes": 16 << 20,
        "bounce_spare": 1, "fixed_buffers": False, "huge_destinations": False,
        "huge_destinations_reason": "THP off", "queue_limits": None, "zero_copy_reads": True,
        "zero_copy_reads_reason": "zero-copy",
    }  # fmt: skip
    s = bench.settings(info, threads_given=False)
    assert s["drive"][0] == "none"
    assert s["engine buffers"] == ("small", bench._PAGES["small"])
    assert s["bounce buffers"] == (
        "small, 16 MiB",
        "not registered (the kernel refused): plain READ / WRITE; one per slot and 1 spare per ring: the "
        "next block is copied while every slot is in flight",
    )
    assert s["fresh read destinations"][0] == "base pages"
    assert s["engine buffer reads"] == ("zero-copy", "zero-copy")
    assert s["block size"] == ("1024 KiB", "no block device")


def test_engine_buffers_row_says_how_much_of_a_buffer_the_kernel_backs_with_huge_pages() -> None:
    info: dict[str, object] = {
        "block_size_reason": "4096 KiB: x", "queue_depth_reason": "4: x", "threads": 2, "buffer_pages": "thp",
        "bounce_pages": "thp", "bounce_bytes": 24 << 20, "bounce_spare": 0, "fixed_buffers": True,
        "huge_destinations": False, "huge_destinations_reason": "x", "queue_limits": None,
        "buffer_huge_share": 0.25, "zero_copy_reads": False, "zero_copy_reads_reason": "virtio",
    }  # fmt: skip
    s = bench.settings(info, threads_given=False)
    assert s["engine buffers"] == (
        "thp",
        bench._PAGES["thp"] + "; measured: 25% of a fresh engine buffer in huge pages (smaps)",
    )
    assert s["bounce buffers"][1].endswith("; one per slot: a block's copy waits for a free slot")


def test_huge_share_reads_the_kernels_backing_of_an_engine_buffer(tmp_path: Path) -> None:
    import torch

    with SwapEngine(tmp_path) as e:
        buf = e.empty((8 << 20) // 4, torch.float32)
        share = bench.huge_share(buf.data_ptr(), 8 << 20)
        if e.info["buffer_pages"] == "small":
            assert share == 0.0
        else:
            assert share is not None and 0.0 <= share <= 1.0
    assert bench.huge_share(0, 4096) is None  # no mapping holds page 0
