"""`zswap estimate`: exact bytes per rank for each tier choice, counts from a local config built on meta."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from zswap import estimate as est
from zswap.cli import main


def test_counts_parse_as_model_names_write_them() -> None:
    assert est.parse_count("7B") == 7_000_000_000
    assert est.parse_count("350m") == 350_000_000
    assert est.parse_count("1.5K") == 1500
    assert est.parse_count("1234567") == 1234567
    for bad in ("", "7X", "-3", "0"):
        with pytest.raises(ValueError):
            est.parse_count(bad)


def test_everything_on_nvme_bf16_four_ranks() -> None:
    e = est.estimate(7_000_000_000, world_size=4)
    part = 1_750_000_000
    assert e.rows == {
        "params": {"gpu": 0, "ram": 0, "nvme": part * 2},
        "gradients": {"gpu": 0, "ram": 0, "nvme": part * 2},
        "optimizer states": {"gpu": 0, "ram": 0, "nvme": part * 12},
    }
    assert e.total("nvme") == part * 16 == 28_000_000_000
    # Copy-on-write doubles the space in use; the files grow ahead of it by at most 1 GiB.
    assert e.swap_files() == 2 * 28_000_000_000 + (1 << 30)


def test_tiers_move_the_bytes_and_fp32_has_no_master_copy() -> None:
    e = est.estimate(est.ModelShape(1001, largest_layer=100), dtype="fp32", world_size=2,
                     offload_param="cpu", offload_optimizer="none")  # fmt: skip
    assert e.rows == {
        "params": {"gpu": 0, "ram": 501 * 4, "nvme": 0},  # the largest rank's padded share: ceil(1001 / 2)
        "gradients": {"gpu": 501 * 4, "ram": 0, "nvme": 0},
        "optimizer states": {"gpu": 501 * 8, "ram": 0, "nvme": 0},
        "working set": {"gpu": 2 * 100 * 4, "ram": 0, "nvme": 0},
    }
    assert e.total("gpu") == 501 * 12 + 800


@pytest.mark.parametrize(("kw", "message"), [
    ({"dtype": "int8"}, "dtype must be one of"),
    ({"offload_param": "disk"}, "offload_param must be one of"),
    ({"world_size": 0}, "world_size must be a positive integer"),
])  # fmt: skip
def test_bad_inputs_are_named(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        est.estimate(10, **kw)  # type: ignore[arg-type]


def _tiny_llama(folder: Path) -> Path:
    folder.mkdir()
    config = {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000, "tie_word_embeddings": False,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_local_config_is_counted_on_meta(tmp_path: Path) -> None:
    folder = _tiny_llama(tmp_path / "llama")
    shape = est.shape_from_config(folder / "config.json")
    # embed and lm_head 2 × 1000 × 64; per layer q,k,v,o 4 × 64², gate/up/down 3 × 64 × 128, 2 norms; norm
    assert shape.params == 2 * 64_000 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64 == 210_240
    assert shape.largest_layer == 64_000 and shape.name == "LlamaForCausalLM"
    assert est.shape_from_config(folder) == shape


def test_the_class_the_config_names_is_counted(tmp_path: Path) -> None:
    """An encoder-decoder's config also maps to a decoder-only ``*ForCausalLM``: the class in
    ``architectures`` is built, encoder included (before: BART's decoder alone, 31,936 of 51,200)."""
    transformers = pytest.importorskip("transformers")
    conf = transformers.BartConfig(
        vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        architectures=["BartForConditionalGeneration"],
    )  # fmt: skip
    conf.save_pretrained(tmp_path / "bart")
    shape = est.shape_from_config(tmp_path / "bart")
    with torch.device("meta"):
        want = sum(p.numel() for p in transformers.BartForConditionalGeneration(conf).parameters())
    assert shape.name == "BartForConditionalGeneration" and shape.params == want == 51_200


def test_a_config_file_of_another_name_is_that_file(tmp_path: Path) -> None:
    """``--model DIR/llama-70b.json`` counts that file's model, not the one of a ``config.json`` beside it
    (which it read, silently)."""
    folder = _tiny_llama(tmp_path / "llama")
    other = json.loads((folder / "config.json").read_text()) | {"num_hidden_layers": 5}
    (folder / "deeper.json").write_text(json.dumps(other))
    layer = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert est.shape_from_config(folder / "deeper.json").params == 2 * 64_000 + 5 * layer + 64
    (folder / "config.json").unlink()
    assert est.shape_from_config(folder / "deeper.json").params == 2 * 64_000 + 5 * layer + 64


def test_the_command_prints_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _tiny_llama(tmp_path / "llama")
    assert main(["estimate", "--model", str(folder), "--dtype", "fp32", "--offload-param", "cpu"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("LlamaForCausalLM: 210.24K params (210,240), largest layer 64.00K\n")
    rows = {line[:18].strip(): line[18:].split("  ") for line in text.splitlines()[4:9]}
    assert text.splitlines()[3].split() == ["per", "rank", "GPU", "CPU", "RAM", "NVMe"]
    assert [x.strip() for x in rows["params"] if x.strip()] == ["-", "821.25 KiB", "-"]
    assert [x.strip() for x in rows["total"] if x.strip()] == ["500.00 KiB", "821.25 KiB", "2.41 MiB"]
    assert "Model states only" in text


def test_the_command_reports_a_folder_without_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate", "--model", str(tmp_path)]) == 2
    assert f"argument --model: '{tmp_path}' has no config.json" in capsys.readouterr().err


def test_world_size_adds_the_whole_jobs_nvme(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "7B", "--world-size", "4"]) == 0
    text = capsys.readouterr().out
    assert "26.08 GiB" in text  # 1.75e9 × 16 B a rank
    assert "swap files, peak" in text and "53.15 GiB" in text  # 2 × that + 1 GiB of growth
    assert "NVMe, all ranks" in text and "212.62 GiB" in text


def test_largest_layer_with_a_model_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _tiny_llama(tmp_path / "llama")
    assert main(["estimate", "--model", str(folder), "--largest-layer", "1M"]) == 2
    assert "--largest-layer goes with --params" in capsys.readouterr().err
    assert main(["estimate", "--params", "1M", "--largest-layer", "1K", "--dtype", "fp32"]) == 0
    assert "working set" in capsys.readouterr().out


def test_counts_are_exact_integers_within_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    """A plain integer is that integer (it went through a float: 123456789012345678901 became …968), past
    100T is refused, and a largest layer bigger than the model is a usage error."""
    assert est.parse_count("12345678901234") == 12345678901234
    assert est.parse_count("1.5B") == 1_500_000_000
    with pytest.raises(ValueError, match=r"more than 100,000,000,000,000 params"):
        est.parse_count("123456789012345678901")
    assert main(["estimate", "--params", "1M", "--largest-layer", "7B"]) == 2
    assert "--largest-layer 7,000,000,000 is more than --params 1,000,000" in capsys.readouterr().err


def test_the_swap_files_of_a_run_stay_within_the_estimate(tmp_path: Path) -> None:
    """The estimate's disk figure once counted the bytes in use alone; a run's files reached twice and more
    (copy-on-write versions, freed space kept, the files' growth ahead of use)."""
    import torch

    import zswap

    for dtype in ("fp32", "bf16"):
        swap = tmp_path / dtype
        swap.mkdir()
        nvme = {"device": "nvme", "nvme_path": str(swap)}
        cfg = {
            "zero_optimization": {"offload_param": nvme, "offload_optimizer": nvme},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "bf16": {"enabled": dtype == "bf16"},
        }
        torch.manual_seed(0)
        with zswap.Init(cfg):
            model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
        engine = zswap.initialize(model, cfg)
        x = torch.randn(4, 512, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
        peak = 0
        files = zswap.param_state(model[0].weight).store.engine  # type: ignore[union-attr]
        for _ in range(6):
            engine.backward(model(x).float().square().mean())
            engine.step()
            peak = max(peak, files.stats()["allocated_bytes"])
        engine.close()
        bound = est.estimate(8 * (512 * 512 + 512), dtype=dtype).swap_files()
        assert 0 < peak <= bound, (dtype, peak, bound)
