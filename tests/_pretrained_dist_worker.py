"""One rank of test_pretrained.py's two-rank test: ``python _pretrained_dist_worker.py RANK WORLD INIT DIR``.

Both ranks load the same checkpoints with ``from_pretrained`` under ``zswap.Init`` (cpu and nvme tiers) and
with ``zswap.load_weights``. Every byte range read from the checkpoint files is recorded: a rank must read, of
each param, exactly the elements of its own partition. Gathered (all-gathered) weights must be the files'.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import zswap
import zswap._stfile as stfile
from zswap import param_state


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    init_file, root = sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import transformers
    from safetensors.torch import load_file

    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore", zswap.ZswapWarning)
    reads: list[tuple[str, int, int]] = []
    real = stfile.read_range

    def spy(entry: stfile.TensorEntry, start: int, out: torch.Tensor) -> None:
        reads.append((entry.name, start, out.numel()))
        real(entry, start, out)

    stfile.read_range = spy
    try:
        for name in ("ckpt", "llama"):
            ckpt = root / name
            files: dict[str, torch.Tensor] = {}
            for f in sorted(ckpt.glob("*.safetensors")):
                files.update(load_file(f))
            for tier in ("cpu", "nvme"):
                swap = root / f"swap{rank}"
                swap.mkdir(exist_ok=True)
                reads.clear()
                with zswap.Init({"offload_param": {"device": tier, "nvme_path": str(swap)}}):
                    m = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
                check(m, files, reads, rank, world, (name, tier))
                reads.clear()
                zswap.load_weights(m, ckpt)  # again, into the partitions that now exist
                check(m, files, reads, rank, world, (name, tier, "load_weights"))
        dist.barrier()
    finally:
        stfile.read_range = real
        dist.destroy_process_group()


def check(
    m: torch.nn.Module,
    files: dict[str, torch.Tensor],
    reads: list[tuple[str, int, int]],
    rank: int,
    world: int,
    what: tuple[str, ...],
) -> None:
    named = dict(m.named_parameters())
    by_name: dict[str, list[tuple[int, int]]] = {}
    for name, start, count in reads:
        by_name.setdefault(name, []).append((start, count))
    for name, t in files.items():
        st = param_state(named[name])
        assert st is not None and st.world_size == world, (what, name)
        part = -(-t.numel() // world)
        start = rank * part
        count = max(0, min(start + part, t.numel()) - start)
        want = [(start, count)] if count else []
        got = [r for r in by_name.get(name, []) if r[1]]
        assert got == want, (what, name, got, want)
    with zswap.GatheredParameters(list(named.values())):
        for name, t in files.items():
            assert torch.equal(named[name].data, t), (what, name)
    assert m.get_output_embeddings().weight is m.get_input_embeddings().weight, what


if __name__ == "__main__":
    main()
