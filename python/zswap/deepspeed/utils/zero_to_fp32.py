"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` over zswap's checkpoints: a checkpoint folder's weights in
float32, offline — in memory, written out, or loaded into a plain model (`zswap.checkpoint.fp32`: a
low-precision param is its float32 master where the checkpoint holds one, as DeepSpeed's are; every name of
a tied param is a key; the persistent buffers are keys too). The folder is ``engine.save_checkpoint``'s
``save_dir``; ``tag`` defaults to the one its ``latest`` file names.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

from ...checkpoint.fp32 import fp32_state_dict, write_state_dict
from ...errors import ZswapError
from ...parts.params import param_state


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """``name → float32 tensor`` of the checkpoint (integer and boolean buffers at their dtype), all in
    memory.
    ``exclude_frozen_parameters``: without the params that did not require grad at the save, as DeepSpeed's.
    ``lazy_mode`` is accepted and reads every tensor at once: DeepSpeed's lazy values are read at their
    ``.contiguous()``, which these answer too."""
    del lazy_mode  # the values are read now; what a lazy caller does with them works the same
    return fp32_state_dict(checkpoint_dir, tag, exclude_frozen=exclude_frozen_parameters)


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    max_shard_size: int | str = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """The checkpoint's float32 weights written to ``output_dir``: ``pytorch_model.bin`` (``torch.save``),
    or ``model.safetensors`` with ``safe_serialization``; numbered shards and their index past
    ``max_shard_size``. (`zswap.checkpoint.export` streams the params to safetensors in their own dtype,
    one chunk in memory at a time, where the model is larger than memory.)"""
    state = fp32_state_dict(checkpoint_dir, tag, exclude_frozen=exclude_frozen_parameters)
    write_state_dict(state, output_dir, max_shard_size=max_shard_size, safetensors=safe_serialization)


def load_state_dict_from_zero_checkpoint(
    model: nn.Module, checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> nn.Module:
    """``model``, a plain one, moved to the CPU with the checkpoint's float32 weights loaded, strictly
    (DeepSpeed's load is not: a key missing on either side would go unnoticed); returned. A model whose
    params zswap partitions is a `zswap.ZswapError`: it loads with ``engine.load_checkpoint``."""
    if any(param_state(p) is not None for p in model.parameters()):
        raise ZswapError(
            "load_state_dict_from_zero_checkpoint loads into a plain model; this one's params are "
            "partitioned by zswap: load the checkpoint with engine.load_checkpoint (or its weights with "
            "zswap.load_weights)"
        )
    state = fp32_state_dict(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=True)
    return model


def main(argv: list[str] | None = None) -> int:
    """DeepSpeed's ``zero_to_fp32.py`` command line (``python -m zswap.deepspeed.utils.zero_to_fp32
    CHECKPOINT_DIR OUTPUT_DIR``, or the script `zswap.deepspeed`'s ``save_checkpoint`` leaves in its folder):
    its arguments, `convert_zero_checkpoint_to_fp32_state_dict`'s work. An error is one line, status 1
    (``-d`` / ``--debug``: the traceback)."""
    p = argparse.ArgumentParser(
        prog="zero_to_fp32.py", description="A zswap checkpoint's float32 weights, written as Hugging Face's."
    )
    p.add_argument("checkpoint_dir", help="the folder save_checkpoint wrote (save_dir)")
    p.add_argument("output_dir", help="where the weights go (pytorch_model.bin, or safetensors)")
    p.add_argument("--max_shard_size", default="5GB", help="shards past this size (default 5GB)")
    p.add_argument("--safe_serialization", action="store_true", help="safetensors files")
    p.add_argument("-t", "--tag", help="the checkpoint under checkpoint_dir (default: the one latest names)")
    p.add_argument("--exclude_frozen_parameters", action="store_true", help="only the params trained")
    p.add_argument("-d", "--debug", action="store_true", help="show the traceback of an error")
    args = p.parse_args(argv)
    try:
        convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir,
            args.output_dir,
            max_shard_size=args.max_shard_size,
            safe_serialization=args.safe_serialization,
            tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
        )
    except (OSError, ValueError, ZswapError) as e:
        if args.debug:
            raise
        sys.stderr.write(f"zero_to_fp32.py: error: {e}\n")
        return 1
    sys.stdout.write(f"zero_to_fp32.py: float32 weights written to {args.output_dir}\n")
    return 0


__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]


if __name__ == "__main__":
    sys.exit(main())
