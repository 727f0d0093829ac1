"""`zswap demo`: a GPT-style model several times larger than the memory its params may use, built straight
onto NVMe (a temp dir), run for inference and trained for a few steps on one fixed batch, with the figures
that show what moved and how fast next to the raw disk.

Everything is local: the model is the small transformer below, the data is random token ids.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import ZswapConfig, from_argument, load_config
from .errors import ZswapWarning
from .step.optim._layout import default_sub_group_size

DEFAULT_SIZE = 768 << 20
"""Bytes of fp32 params of the default model."""
LIVE_FRACTION = 6
"""The live-param budget is 1/LIVE_FRACTION of the model (but at least what its largest module needs)..."""
MAX_LIVE = DEFAULT_SIZE // 4 // LIVE_FRACTION
"""... and, in `run`, at most this many elements (128 MiB of fp32, what the default model gets): the
memory a demo needs does not grow with the model."""
SUB_GROUP = 1 << 23
"""Elements per optimizer sub-group at most, in `run` (32 MiB of fp32 each part; its ring of three records
holds at most 192 MiB whatever the model size)."""
BATCH, SEQ = 2, 64


@dataclass(frozen=True)
class Shape:
    vocab: int
    width: int
    layers: int
    heads: int
    seq: int

    @property
    def params(self) -> int:
        d = self.width
        return self.vocab * d + self.seq * d + self.layers * (12 * d * d + 13 * d) + 2 * d

    @classmethod
    def for_bytes(cls, size: int, *, strict: bool = False) -> Shape:
        """The widest shape (up to 1024) with at least two layers that holds about ``size`` bytes of fp32;
        below the smallest (2 × 128 wide) that one, or with ``strict`` a `ValueError` (`zswap demo`)."""
        elements = size // 4
        for width, vocab in ((1024, 8192), (512, 4096), (256, 2048), (128, 512)):
            per_layer = 12 * width * width + 13 * width
            layers = round((elements - vocab * width - SEQ * width) / per_layer)
            if layers >= 2:
                return cls(vocab, width, layers, width // 64, SEQ)
        smallest = cls(512, 128, 2, 2, SEQ)
        if not strict:
            return smallest
        raise ValueError(
            f"{size:,} bytes is below the smallest demo model ({smallest.layers} layers × "
            f"{smallest.width} wide, {_mib(smallest.params * 4)} of fp32); give 2MiB or more"
        )


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, pre-norm blocks, an LM head tied to the token embedding.
    ``checkpoint_blocks``: recompute each block's activations in backward instead of keeping them."""

    def __init__(
        self,
        shape: Shape,
        progress: Callable[[str], None] = lambda _: None,
        *,
        checkpoint_blocks: bool = False,
    ) -> None:
        super().__init__()
        self.checkpoint_blocks = checkpoint_blocks
        d = shape.width
        self.wte = nn.Embedding(shape.vocab, d)
        self.wpe = nn.Parameter(torch.zeros(shape.seq, d))
        blocks = []
        for i in range(shape.layers):
            progress(f"building: block {i + 1}/{shape.layers}")
            blocks.append(Block(d, shape.heads))
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, shape.vocab, bias=False)
        self.head.weight = self.wte.weight
        self.apply(_init)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids) + self.wpe[: ids.shape[1]]
        for block in self.blocks:
            if self.checkpoint_blocks and self.training and torch.is_grad_enabled():
                # Activation checkpointing: backward keeps each block's input, not its internals, so the
                # activations held stay about one block's whatever the depth (the memory bound of
                # benches/bench_memory.py is the same at 0.75, 3 and 6 GiB); the block runs twice.
                h = checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        return self.head(self.ln_f(h))


def _init(m: nn.Module) -> None:
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


def default_config(
    path: Path,
    shape: Shape,
    *,
    live_fraction: int = LIVE_FRACTION,
    lr: float = 1e-3,
    max_live: int | None = None,
    sub_group: int | None = None,
) -> dict[str, Any]:
    """Params and optimizer states on NVMe in ``path``; a live-param budget of 1/``live_fraction`` of the
    model, at most ``max_live`` elements (at least twice its largest module); optimizer sub-groups of
    about 1/32 of the model, at most ``sub_group`` elements (``None``: no cap; `run` caps both at
    `MAX_LIVE` and `SUB_GROUP`)."""
    largest = max(shape.vocab * shape.width, 4 * shape.width * shape.width) + shape.seq * shape.width
    live = shape.params // live_fraction if max_live is None else min(shape.params // live_fraction, max_live)
    live = max(live, 2 * largest)
    cfg: dict[str, Any] = {
        "zero_optimization": {
            "offload_param": {"device": "nvme", "nvme_path": str(path)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(path)},
            "stage3_max_live_parameters": live,
            "stage3_prefetch_bucket_size": live - largest,
            "stage3_param_persistence_threshold": 10 * shape.width,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
    }
    if sub_group is not None:
        cfg["zero_optimization"]["sub_group_size"] = min(sub_group, default_sub_group_size(shape.params))
    return cfg


def user_config(text: str, path: Path) -> ZswapConfig:
    """``--config``: a JSON file or a JSON string; a missing NVMe path is filled with ``path``."""
    cfg = load_config(from_argument(text))
    if cfg.offload_param.device == "nvme" and not cfg.offload_param.nvme_path:
        cfg = cfg.replace(offload_param=cfg.offload_param.replace(nvme_path=[str(path)]))
    if cfg.offload_optimizer.device == "nvme" and not cfg.offload_optimizer.nvme_path:
        cfg = cfg.replace(offload_optimizer=cfg.offload_optimizer.replace(nvme_path=[str(path)]))
    return cfg


def swap_dirs(cfg: ZswapConfig) -> list[str]:
    """The real paths of the NVMe directories ``cfg`` swaps params and optimizer states to, in order."""
    out: list[str] = []
    for section in (cfg.offload_param, cfg.offload_optimizer):
        if section.device != "nvme":
            continue
        for p in section.nvme_path or ():
            real = os.path.realpath(p)
            if real not in out:
                out.append(real)
    return out


class _Out:
    """Figures on their own lines; progress overwrites one line on a terminal and is dropped elsewhere."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.tty = out, out.isatty()

    def progress(self, line: str) -> None:
        if self.tty:
            self.out.write(f"\r\033[K{line}")
            self.out.flush()

    def say(self, line: str = "") -> None:
        self.out.write(("\r\033[K" if self.tty else "") + line + "\n")
        self.out.flush()


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run(path: Path, size: int, config: str | None, steps: int, out: TextIO | None = None) -> dict[str, Any]:
    """Build, infer, train; print as it goes (to ``out``, default stdout). Returns the main figures."""
    from . import Init, full_grad, initialize, param_state
    from .bench import baseline

    o = _Out(out or sys.stdout)
    rss_before = _rss_peak()
    shape = Shape.for_bytes(size)
    capped = default_config(path, shape, max_live=MAX_LIVE, sub_group=SUB_GROUP)
    cfg = user_config(config, path) if config else load_config(capped)
    model_bytes = shape.params * 4
    o.say(
        f"zswap demo: GPT-style model, {shape.layers} layers × {shape.width} wide, vocab {shape.vocab}: "
        f"{shape.params / 1e6:.1f}M params, {_mib(model_bytes)} of fp32"
    )
    path = Path((swap_dirs(cfg) or [str(path)])[0])  # a --config naming its own nvme_path swaps there
    o.say(f"  swap dir {path}")
    base_size = min(256 << 20, max(16 << 20, model_bytes // 2 >> 20 << 20))
    o.progress(f"raw disk baseline ({_mib(base_size)})...")
    rates = [r for r in baseline(path, base_size, 1 << 20, 16, 1) if not r.unavailable]
    raw = max(rates, key=lambda r: r.read)
    o.say(f"  raw disk ({raw.source}): write {raw.write:.2f} GB/s, read {raw.read:.2f} GB/s")

    torch.manual_seed(0)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ZswapWarning)  # a fallback (psync, buffered I/O) is printed below
        with Init(cfg):
            model = GPT(shape, o.progress, checkpoint_blocks=True)
        engine = initialize(model, cfg)
    build_s = time.perf_counter() - t0
    live = engine.stats()["max_live_elements"]
    store = param_state(model.wte.weight).store  # type: ignore[union-attr]
    swap = getattr(store, "engine", None)
    io_note = f"{swap.info['backend']}, direct I/O {swap.info['direct']}" if swap is not None else store.tier
    build_rss = _rss_peak()
    o.say(f"  built under zswap.Init in {build_s:.1f} s ({io_note}); peak RSS so far {_mib(build_rss)}")
    o.say(
        f"  live-param budget (stage3_max_live_parameters): {live / 1e6:.1f}M elements = {_mib(live * 4)}, "
        f"1/{shape.params / live:.1f} of the model; prefetch bucket "
        f"{engine.stats()['prefetch_bucket_elements'] / 1e6:.1f}M elements"
    )
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, shape.vocab, (BATCH, shape.seq), generator=g)
    batch = batch.to(engine.device)  # inputs live on the compute device (a GPU if any)
    o.say(f"  compute device: {engine.device}")
    figures: dict[str, Any] = {"params": shape.params, "model_bytes": model_bytes, "raw_read_gbs": raw.read}
    figures["build_rss"], figures["build_seconds"] = build_rss, build_s

    o.say(f"inference (batch {BATCH} × {shape.seq} tokens, no_grad): 3 passes")
    engine.stats(reset=True)
    model.eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(3):
            o.progress(f"inference pass {i + 1}/3...")
            model(batch)
    figures["inference"] = _phase(o, engine, time.perf_counter() - t0, 3, raw.read)
    figures["inference_rss"] = _rss_peak()
    o.say(f"  peak RSS after inference: {_mib(figures['inference_rss'])} (model: {_mib(model_bytes)})")

    model.train()
    has_optimizer = engine.optimizer is not None
    if has_optimizer:
        o.say(f"training: {steps} AdamW steps on one fixed batch (optimizer states on the offload tier)")
    else:
        steps = 1
        o.say("training: forward + backward only (the config has no 'optimizer' section)")
    engine.stats(reset=True)
    losses: list[float] = []
    t_all = time.perf_counter()
    for step in range(steps):
        o.progress(f"step {step + 1}/{steps}: forward + backward...")
        t0 = time.perf_counter()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, shape.vocab), batch[:, 1:].reshape(-1))
        loss.backward()
        losses.append(float(loss.detach()))
        if has_optimizer:
            o.progress(f"step {step + 1}/{steps}: optimizer...")
            engine.step()
            o.say(f"  step {step + 1}: loss {losses[-1]:.4f} ({time.perf_counter() - t0:.1f} s)")
        else:
            norm = math.sqrt(sum(float(gr.double().square().sum()) for p in model.parameters()
                                 if (gr := full_grad(p)) is not None))  # fmt: skip
            o.say(f"  loss {losses[-1]:.4f}, gradient norm {norm:.4f} ({time.perf_counter() - t0:.1f} s)")
            engine.zero_grad()
    figures["training"] = _phase(o, engine, time.perf_counter() - t_all, steps, raw.read)
    if "gpu_max_memory_allocated" in figures["training"]:
        t = figures["training"]
        o.say(
            f"  peak GPU memory {_mib(t['gpu_max_memory_allocated'])} (live budget "
            f"{_mib(t['gpu_live_budget_bytes'])} + prefetch bucket {_mib(t['gpu_prefetch_bucket_bytes'])} "
            "+ activations)"
        )
    figures["losses"] = losses
    if len(losses) > 1:
        trend = "down" if losses[-1] < losses[0] else "NOT down"
        o.say(f"  loss {losses[0]:.4f} → {losses[-1]:.4f}: {trend}")
    _memory_lines(o, figures["training"])
    figures["peak_rss"] = _rss_peak()
    o.say(
        f"peak RSS {_mib(figures['peak_rss'])} for a {_mib(model_bytes)} model, of which "
        f"{_mib(rss_before)} was Python and torch before the demo began; while training, gradients are "
        + (
            "on NVMe with the optimizer states"
            if cfg.offload_optimizer.device == "nvme"
            else f"kept in CPU memory ({_mib(model_bytes)})"
        )
    )
    engine.close()
    return figures


def _phase(o: _Out, engine: Any, wall: float, passes: int, raw_read: float) -> dict[str, Any]:
    s = engine.stats(reset=True)
    moved = s["bytes_read"] + s["bytes_written"]
    o.say(
        f"  {wall / passes:.2f} s per pass; moved {_gib(moved)} (read {_gib(s['bytes_read'])}, written "
        f"{_gib(s['bytes_written'])}), {s['bytes_read'] / wall / 1e9:.2f} GB/s read over the wall time "
        f"(raw disk {raw_read:.2f}); compute waited {s['fetch_wait_seconds']:.2f} s for params; prefetch hit "
        f"rate {s['prefetch_hit_rate']:.0%} of {s['fetches']} fetches; peak live "
        f"{s['peak_live_elements'] / 1e6:.1f}M elements"
    )
    return {**s, "wall_seconds": wall}


def _memory_lines(o: _Out, s: dict[str, Any]) -> None:
    """Where the memory went while training, from the ``mem_*`` lines of `zswap.Engine.stats`."""
    o.say(
        f"  memory while training (peaks): engine buffers {_mib(s['mem_peak_engine_buffers'])} = fetched "
        f"params {_mib(s['mem_peak_fetch_buffers'])} (pool limit {_mib(s['mem_fetch_pool_limit'])}) + "
        f"gradient partitions {_mib(s['mem_peak_grad_buffers'])} + optimizer ring "
        f"{_mib(s['mem_peak_optimizer_ring'])} + early-step copies "
        f"{_mib(s['mem_peak_early_step_buffers'])} + other {_mib(s['mem_peak_other_buffers'])} "
        "(sum of peaks; "
        f"their peak together {_mib(s['mem_peak_engine_buffers'])}); bounce buffers {_mib(s['mem_bounce'])}; "
        f"early-step gradients and small copies {_mib(s['mem_peak_early_step_tensors'])}; "
        f"write queue limit {_mib(s['mem_write_queue_limit'])}; undo arena {_mib(s['mem_undo_arena'])}; "
        f"glibc heap now {_mib(s['mem_heap_in_use'] + s['mem_heap_mapped'])} in use, "
        f"{_mib(s['mem_heap_free'])} free"
    )
