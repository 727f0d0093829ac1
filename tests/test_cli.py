"""Smoke runs of the command line with tiny sizes (the real figures come from `make bench`)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from zswap.cli import main


def test_bench_prints_engine_next_to_baseline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "figures.json"
    args = ["bench", "--path", str(tmp_path), "--size", "8MiB", "--repeat", "1"]
    assert main([*args, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert figures["size"] == 8 << 20
    cases = ["fresh write", "rewrite", "read, touched memory", "read, untouched memory"]
    for kind in ("engine buffers", "torch tensors"):
        assert kind in text
        rows = figures["rows"][kind]
        assert [r["case"] for r in rows] == cases
        for r in rows:
            assert r["zswap"] > 0 and r["baseline"] > 0 and r["ratio"] == round(r["zswap"] / r["baseline"], 3)
            assert f"{r['case']:30}{r['zswap']:>8.2f}{r['baseline']:>10.2f}{r['ratio']:>7.2f}×" in text
        assert [r["baseline_case"] for r in rows] == ["fresh write", "rewrite", "read", "read"]
    assert figures["baseline"] and all(b["source"] in text for b in figures["baseline"])
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


def test_passes_too_small_to_measure_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """Below 1 MiB a pass measures no drive (tune printed an aio block from 0.00 GB/s everywhere), and a
    pass must hold the blocks it sweeps: refused with the text typed, exit status 2, before any work."""
    for command in ("bench", "tune"):
        line = _usage_error([command, "--size", "1KiB"], capsys)
        assert line == (
            f"zswap {command}: error: argument --size: '1KiB' is below 1MiB, too small a pass to measure a "
            f"drive (see zswap {command} --help)"
        )
    assert main(["tune", "--size", "1MiB", "--block-sizes", "256KiB", "4MiB", "8MiB"]) == 2
    assert capsys.readouterr().err.strip() == (
        "zswap tune: error: --block-sizes 4096KiB 8192KiB exceed --size (1024KiB): a pass must hold at least "
        "one block (see zswap tune --help)"
    )


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one stderr line of a usage error (exit status 2)."""
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


def test_missing_path_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _usage_error(["bench", "--path", str(tmp_path / "typo"), "--size", "1MiB"], capsys)
    assert line == (
        f"zswap bench: error: argument --path: '{tmp_path / 'typo'}' is not an existing directory "
        "(see zswap bench --help)"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["tune", "--block-sizes", "3000"],
            "argument --block-sizes: '3000' must be a power of two from 4096",
        ),
        (
            ["tune", "--block-sizes", "1MiB", "96KiB"],
            "argument --block-sizes: '96KiB' must be a power of two",
        ),
        (["tune", "--queue-depths", "4", "0"], "argument --queue-depths: 0 must be a positive integer"),
        (["bench", "--block-size", "1000"], "argument --block-size: '1000' must be a power of two from 4096"),
        (["bench", "--block-size", "128MiB"], "argument --block-size: '128MiB' must be a power of two"),
        (["bench", "--queue-depth", "0"], "argument --queue-depth: 0 must be a positive integer"),
        (["bench", "--queue-depth", "5000"], "argument --queue-depth: 5000 must be at most 4096"),
        (["bench", "--queue-depth", "many"], "argument --queue-depth: 'many' is not an integer"),
        (["bench", "--threads", "0"], "argument --threads: 0 must be a positive integer"),
        (["bench", "--repeat", "0"], "argument --repeat: 0 must be a positive integer"),
        (["demo", "--steps", "-1"], "argument --steps: -1 must be a positive integer"),
        (["bench", "--backend", "aio"], "argument --backend: invalid choice: 'aio'"),
    ],
)
def test_bad_values_are_one_line_usage_errors(argv, message, capsys):
    line = _usage_error(argv, capsys)
    assert line.startswith(f"zswap {argv[0]}: error: {message}"), line


def test_demo_config_typo_missing_file_and_bad_json(tmp_path, capsys):
    line = _usage_error(["demo", "--config", '{"aio": {"blok_size": 4096}}'], capsys)
    assert line == (
        "zswap demo: error: argument --config: unknown key 'blok_size' in aio; did you mean 'block_size'? "
        "(see zswap demo --help)"
    )
    missing = tmp_path / "ds_config.json"
    line = _usage_error(["demo", "--config", str(missing)], capsys)
    assert line == f"zswap demo: error: argument --config: '{missing}': no such file (see zswap demo --help)"
    line = _usage_error(["demo", "--config", '{"aio": '], capsys)
    assert line.startswith("zswap demo: error: argument --config: invalid JSON at line 1, column 9")
    bad = tmp_path / "bad.json"
    bad.write_text('{"fp16": {"enabled": true, "loss_scale_window": 0}}')
    line = _usage_error(["demo", "--config", str(bad)], capsys)
    assert line.startswith(f"zswap demo: error: argument --config: {bad}: fp16.loss_scale_window must be")


def test_a_path_no_file_can_be_made_in_is_refused(capsys):
    # /proc is a directory, but no swap or fio file can be created in it.
    line = _usage_error(["bench", "--path", "/proc", "--size", "1MiB"], capsys)
    assert line.startswith("zswap bench: error: argument --path: '/proc': cannot create a file there (")


def _failing_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    from zswap import bench

    def boom(*a: object, **k: object) -> None:
        raise OSError(28, "No space left on device", "/mnt/nvme0/zswap-swap")

    monkeypatch.setattr(bench, "run", boom)


def test_a_failure_while_running_is_one_line_and_status_1(monkeypatch, capsys):
    _failing_bench(monkeypatch)
    assert main(["bench", "--size", "1MiB"]) == 1
    err = capsys.readouterr().err
    assert err == (
        "zswap bench: error: [Errno 28] No space left on device: '/mnt/nvme0/zswap-swap' "
        "(--debug shows the traceback)\n"
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_termination_cleans_up_as_an_interrupt_does(signum, monkeypatch, tmp_path, capsys):
    """SIGTERM in fio's pass ended the process at once, leaving its file of --size bytes in the directory."""
    from zswap import bench

    def fio_pass(target: Path, *a: object) -> tuple[float, float]:
        target.write_bytes(b"x" * 4096)  # what fio had written so far
        os.kill(os.getpid(), signum)
        raise AssertionError("the signal raises before this")

    monkeypatch.setattr(bench.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(bench, "_fio_pass", fio_pass)
    before = signal.getsignal(signum)
    assert main(["bench", "--path", str(tmp_path), "--size", "64MiB"]) == 128 + signum
    assert capsys.readouterr().err == f"zswap bench: terminated ({signal.Signals(signum).name})\n"
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signum) is before  # put back


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(where, monkeypatch):
    _failing_bench(monkeypatch)
    argv = ["--debug", "bench"] if where == "before" else ["bench", "--debug"]
    with pytest.raises(OSError, match="No space left on device"):
        main(argv)


def test_runtime_errors_name_their_type_when_the_message_does_not(monkeypatch, capsys):
    from zswap import bench

    def boom(*a: object, **k: object) -> None:
        raise ValueError("bad thing")

    monkeypatch.setattr(bench, "run", boom)
    assert main(["bench", "--size", "1MiB"]) == 1
    assert (
        capsys.readouterr().err == "zswap bench: error: ValueError: bad thing (--debug shows the traceback)\n"
    )


# -- export and env on the same error path as every subcommand -----------------------------------------


def test_export_bad_shard_size_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _usage_error(["export", str(tmp_path), str(tmp_path / "out"), "--max-shard-size", "huge"], capsys)
    assert line == (
        "zswap export: error: argument --max-shard-size: 'huge' is not a size such as 5GB, 500MB or 1GiB "
        "(see zswap export --help)"
    )
    assert not (tmp_path / "out").exists()


def test_export_names_a_file_given_as_the_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    assert main(["export", str(f), str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == (
        "zswap export: error: [Errno 20] the checkpoint is not a directory (give the folder save_checkpoint "
        f"wrote): '{f}' (--debug shows the traceback)\n"
    )
    assert main(["export", str(tmp_path / "typo"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("zswap export: error: [Errno 2] checkpoint folder does not exist: ")
    assert "is not a directory" not in err and not (tmp_path / "out").exists()


def test_export_without_latest_names_the_tag_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "step2").mkdir()
    (tmp_path / "step4").mkdir()
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err == (
        "zswap export: error: [Errno 2] no 'latest' file names the checkpoint to export; pass --tag to name "
        f"one (tags there: step2, step4): '{tmp_path / 'latest'}' (--debug shows the traceback)\n"
    )
    assert "tag=" not in err


def test_export_runtime_failure_is_one_error_line_and_status_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "latest").write_text("step9")
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("zswap export: error: ") and err.endswith("(--debug shows the traceback)\n")
    assert "'step9' does not exist" in err and err.count("\n") == 1


@pytest.mark.parametrize("where", ["before", "after"])
def test_export_honours_debug(tmp_path: Path, where: str) -> None:
    from zswap.checkpoint import CheckpointNotFoundError

    (tmp_path / "latest").write_text("step9")
    args = ["export", str(tmp_path), str(tmp_path / "out")]
    with pytest.raises(CheckpointNotFoundError, match="step9"):
        main(["--debug", *args] if where == "before" else [*args, "--debug"])


def test_env_on_a_directory_no_file_can_be_made_in(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--path", "/proc"]) == 0
    text = capsys.readouterr().out
    assert "does not exist" not in text
    line = next(x for x in text.splitlines() if x.split()[:1] == ["O_DIRECT"])
    assert "/proc exists but is not usable as a swap directory: creating a file there fails" in line


def test_env_on_a_file_says_it_is_not_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "f"
    f.write_text("")
    line = _usage_error(["env", "--path", str(f)], capsys)
    assert line == f"zswap env: error: argument --path: '{f}' is not a directory (see zswap env --help)"


def test_demo_size_below_the_smallest_model_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # Once it built the smallest model (2 MiB) whatever the size asked, saying nothing.
    assert main(["demo", "--size", "1KiB"]) == 2
    assert capsys.readouterr().err == (
        "zswap demo: error: argument --size: 1,024 bytes is below the smallest demo model (2 layers × 128 "
        "wide, 2 MiB of fp32); give 2MiB or more (see zswap demo --help)\n"
    )


def test_estimate_needs_exactly_one_source(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate"]) == 2
    assert capsys.readouterr().err == (
        "zswap estimate: error: give exactly one of --params (e.g. 7B) and --model (a config.json or model "
        "folder) (see zswap estimate --help)\n"
    )
    line = _usage_error(["estimate", "--params", "7X"], capsys)
    assert line.startswith("zswap estimate: error: argument --params: '7X' is not a parameter count")


def test_export_into_the_checkpoint_is_a_usage_error_and_writes_nothing(tmp_path, capsys):
    import torch
    from torch import nn

    import zswap

    cfg = {
        "zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    with zswap.Init(cfg):
        m = nn.Linear(4, 2)
    with zswap.initialize(m, cfg) as engine:
        m(torch.randn(2, 4)).sum().backward()
        engine.step()
        engine.save_checkpoint(tmp_path / "ckpt")
    before = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    capsys.readouterr()
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "ckpt" / "hf")]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("zswap export: error: the output folder ") and "is inside the checkpoint folder" in err
    )
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == before
    # An output folder that cannot be made says why, not a bare errno.
    (tmp_path / "afile").write_text("")
    for out, why in [(tmp_path / "afile", "a file is in the way"), (Path("/proc/out"), "No such file")]:
        assert main(["export", str(tmp_path / "ckpt"), str(out)]) == 1
        err = capsys.readouterr().err
        assert (
            err.startswith("zswap export: error: [Errno ")
            and "cannot make the export's output folder (" in err
        )
        assert err.count("zswap export") == 1, err  # the command's name once, not again in the message
        assert why in err and str(out) in err, err


def test_empty_paths_and_unwritable_outputs_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``Path("")`` is the current directory: ``zswap export CKPT ''`` wrote there; ``bench --json`` into a
    missing folder failed only after the whole bench."""
    line = _usage_error(["export", str(tmp_path), ""], capsys)
    assert line == "zswap export: error: argument out_dir: an empty path (see zswap export --help)"
    line = _usage_error(["bench", "--json", str(tmp_path / "no" / "b.json")], capsys)
    assert line.startswith(
        f"zswap bench: error: argument --json: '{tmp_path / 'no'}' is not an existing directory"
    )


def test_demo_path_and_a_config_naming_another_swap_dir_disagree(tmp_path, capsys):
    """The config's nvme_path won and --path was still printed (and measured) as the swap dir."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    cfg = tmp_path / "c.json"
    cfg.write_text(
        json.dumps({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": str(b)}}})
    )
    assert main(["demo", "--size", "2MiB", "--path", str(a), "--config", str(cfg)]) == 2
    assert capsys.readouterr().err == (
        f"zswap demo: error: --path {a} and the config's nvme_path {b} disagree: name the swap directory in "
        "one of them (see zswap demo --help)\n"
    )


def test_bench_size_below_a_block_is_a_usage_error(tmp_path, capsys, monkeypatch):
    """Said before any settings are printed, exit status 2, naming whose block it is."""
    from zswap import bench

    monkeypatch.setattr(bench.shutil, "which", lambda name: "/usr/bin/fio")  # the check is fio's need
    assert main(["bench", "--path", str(tmp_path), "--size", "1MiB", "--block-size", "4MiB"]) == 2
    out = capsys.readouterr()
    assert out.out == ""  # nothing printed before the refusal
    assert out.err == (
        "zswap bench: error: --size 1048576 bytes is below --block-size (4096 KiB), which fio, the baseline, "
        "needs in one job: give at least 4 MiB (see zswap bench --help)\n"
    )
