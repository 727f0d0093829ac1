"""One rank of `test_runtime_hf.test_generate_over_two_ranks_whose_sequences_end_apart`:
``python _generate_dist_worker.py RANK WORLD INIT_FILE TMP``.

A tiny GPT-2 (then with PEFT's LoRA, where installed) partitioned over the ranks, each rank generating
from its own prompt with an end-of-sequence token only rank 0's greedy continuation produces: rank 0's
sequence ends after one token, rank 1's runs to ``max_new_tokens``. Each rank's tokens must be the plain
model's; once the engine is closed the model's ``generate`` is the class's again."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transformers

import zswap

PROMPTS = [[5, 6, 7], [50, 60, 70]]
NEW = 12


def main() -> None:
    rank, world, init_file, tmp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run(rank, tmp)
    finally:
        dist.destroy_process_group()


def run(rank: int, tmp: str) -> None:
    config = transformers.GPT2Config(
        vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(config).eval()
    prompts = [torch.tensor([p]) for p in PROMPTS]
    greedy = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": 0}
    free = [plain.generate(p, **greedy)[0, 3:].tolist() for p in prompts]
    eos = next(t for t in free[0][:2] if t not in free[1])  # ends rank 0's sequence, never rank 1's
    want = plain.generate(prompts[rank], eos_token_id=eos, **greedy)
    assert (want.shape[1] - 3 < NEW) == (rank == 0)  # the ranks' sequences end apart
    cfg = {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": tmp}}}
    torch.manual_seed(0)
    with zswap.Init(cfg):
        model = transformers.GPT2LMHeadModel(config).eval()
    with zswap.initialize(model, cfg):
        got = model.generate(prompts[rank], eos_token_id=eos, **greedy)
        assert torch.equal(got, want), (rank, got, want)
    assert "generate" not in vars(model)  # the class's again
    try:
        import peft
    except ImportError:
        return
    # PEFT's generate hands its arguments to the base model's: LoRA's B starts at zero, so the same tokens.
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    with zswap.initialize(lora, cfg):
        got = lora.generate(input_ids=prompts[rank], eos_token_id=eos, **greedy)
        assert torch.equal(got, want), (rank, got, want)


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
