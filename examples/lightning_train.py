"""Train a small character-level language model with Lightning, its params and optimizer states on NVMe.

    python examples/lightning_train.py                      # a few steps, one process
    python examples/lightning_train.py --devices 2          # two processes, Lightning's own launcher
    python examples/lightning_train.py --nvme /mnt/nvme     # swap to a real drive (default: a temp dir)

The model is built in ``configure_model``, which ``ZswapStrategy`` runs under ``zswap.Init``: each layer
is partitioned and written to the NVMe directory as it is built, so the full model never sits in RAM.
``configure_optimizers`` returns a plain ``torch.optim.AdamW``; the strategy turns it into zswap's offloaded
AdamW with the same hyperparameters, its moments and fp32 master weights on NVMe too. ``--strategy plain``
runs the same module with Lightning's own strategy (DDP for several devices) and the same optimizer
(``fused=True``), for comparison: the losses printed are the same, bit for bit.
"""

from __future__ import annotations

import argparse
import tempfile

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import zswap
from zswap.lightning import ZswapStrategy

TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
    "in want of a wife. However little known the feelings or views of such a man may be on his first "
    "entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that "
    "he is considered as the rightful property of some one or other of their daughters."
)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class CharLM(pl.LightningModule):
    """Predicts each next character from a window of the previous ones (embeddings, MLP blocks)."""

    def __init__(self, vocab: int, dim: int, layers: int, context: int, lr: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:  # Lightning calls this at every fit / validate / test / predict
            return
        h = self.hparams
        self.model = nn.Sequential(
            nn.Embedding(h.vocab, h.dim),
            nn.Flatten(1),
            nn.Linear(h.context * h.dim, h.dim),
            *[Block(h.dim) for _ in range(h.layers)],
            nn.LayerNorm(h.dim),
            nn.Linear(h.dim, h.vocab),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        if self.global_rank == 0:
            print(f"step {self.global_step + 1} loss {loss.item()!r}", flush=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01, fused=True)


def dataset(context: int) -> tuple[TensorDataset, int]:
    chars = sorted(set(TEXT))
    ids = torch.tensor([chars.index(c) for c in TEXT])
    windows = ids.unfold(0, context + 1, 1)
    return TensorDataset(windows[:, :-1], windows[:, -1]), len(chars)


def zswap_config(nvme: str) -> dict:
    """A DeepSpeed-style config, as Lightning users hold one: params and optimizer states on NVMe."""
    return {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
        },
        "train_micro_batch_size_per_gpu": "auto",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--context", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    parser.add_argument("--nvme", help="directory for the swap files (default: a new temp dir)")
    parser.add_argument("--strategy", choices=["zswap", "plain"], default="zswap")
    args = parser.parse_args()

    pl.seed_everything(0, verbose=False)
    data, vocab = dataset(args.context)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    module = CharLM(vocab, args.dim, args.layers, args.context, args.lr)
    with tempfile.TemporaryDirectory(prefix="zswap-example-") as tmp:
        if args.strategy == "zswap":
            strategy: object = ZswapStrategy(zswap_config(args.nvme or tmp))
        else:
            strategy = "ddp" if args.devices > 1 else "auto"
        trainer = pl.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=args.devices,
            max_steps=args.steps,
            accumulate_grad_batches=args.accumulate,
            default_root_dir=tmp,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, loader)
        if trainer.global_rank == 0 and args.strategy == "zswap":
            assert module.model is not None
            states = [zswap.param_state(p) for p in module.model.parameters()]
            on = sorted({s.tier for s in states if s is not None})
            elements = sum(s.numel for s in states if s is not None)
            print(
                f"params: {elements} elements partitioned, tier {', '.join(on)}; optimizer state on "
                f"{trainer.optimizers[0].tier}"
            )


if __name__ == "__main__":
    main()
