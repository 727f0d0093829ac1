"""Fine-tune a Hugging Face causal language model with its params and optimizer states on NVMe.

    python examples/hf_finetune.py                          # a tiny Llama built from a config object
    python examples/hf_finetune.py --model ./my-checkpoint  # weights saved by save_pretrained
    python examples/hf_finetune.py --nvme /mnt/nvme         # swap to a real drive (default: a temp dir)

The model is built (or loaded) under ``zswap.Init``, which partitions each module's params and writes them
to the NVMe directory as the module is built; ``zswap.initialize`` hooks the model up and builds the
offloaded AdamW from the config's ``optimizer`` section, its moments and fp32 master weights on NVMe too.
The loop is plain PyTorch: ``loss.backward()`` then ``engine.step()``. Text is tokenised per character
(no tokenizer download needed).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings

import torch
import transformers

import zswap

TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
    "in want of a wife. However little known the feelings or views of such a man may be on his first "
    "entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that "
    "he is considered as the rightful property of some one or other of their daughters."
)


def config(nvme: str, lr: float) -> dict:
    """A Hugging Face / DeepSpeed style config; keys outside zswap's sections are accepted as they are."""
    return {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
            "stage3_param_persistence_threshold": "auto",
        },
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
        "train_micro_batch_size_per_gpu": "auto",
    }


def build(model_path: str | None, vocab: int, dim: int, layers: int) -> torch.nn.Module:
    if model_path is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(model_path)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=2 * dim,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a directory written by save_pretrained (default: a tiny Llama)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--nvme", help="directory for the swap files (default: a new temp dir)")
    args = parser.parse_args()
    if args.model is not None and not os.path.isdir(args.model):
        parser.error(f"--model {args.model!r} is not a directory (one written by save_pretrained)")

    torch.manual_seed(0)
    chars = sorted(set(TEXT))
    ids = torch.tensor([chars.index(c) for c in TEXT])
    windows = ids.unfold(0, args.seq, args.seq // 2)
    with tempfile.TemporaryDirectory(prefix="zswap-example-") as tmp:
        cfg = config(args.nvme or tmp, args.lr)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zswap.ZswapWarning)  # a temp dir on tmpfs: buffered I/O
            with zswap.Init(cfg):
                model = build(args.model, len(chars), args.dim, args.layers)
        with zswap.initialize(model, cfg) as engine:  # on the GPU when there is one, else the CPU
            windows = windows.to(engine.device)  # inputs go where the modules compute
            with torch.no_grad():  # before any step: the loss of the weights as built or loaded
                first = windows[: args.batch_size]
                print(f"initial loss {model.eval()(input_ids=first, labels=first).loss.item()!r}", flush=True)
            model.train()
            for step in range(1, args.steps + 1):
                batch = windows[torch.randint(len(windows), (args.batch_size,)).to(windows.device)]
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                engine.step()
                print(f"step {step} loss {loss.item()!r}", flush=True)
            stats = engine.stats()
            tiers = sorted({st.tier for p in model.parameters() if (st := zswap.param_state(p)) is not None})
            print(
                f"params: {stats['model_elements']} elements partitioned, tier {', '.join(tiers)}; optimizer "
                f"state on {engine.optimizer.tier}; {stats['bytes_read']} bytes read from swap"
            )


if __name__ == "__main__":
    main()
