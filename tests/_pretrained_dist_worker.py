"""One rank of test_pretrained.py's two-rank test: ``python _pretrained_dist_worker.py RANK WORLD INIT DIR``.

Both ranks load the same checkpoints with ``from_pretrained`` under ``zswap.Init`` (cpu and nvme tiers) and
with ``zswap.load_weights``. Every byte range read from the checkpoint files is recorded: a rank must read, of
each param, exactly the elements of its own partition, and the page-cache readahead may ask only for bytes
the rank reads. Gathered (all-gathered) weights must be the files'.
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

    advised: list[tuple[str, int, int]] = []
    read_bytes: list[tuple[str, int, int]] = []
    real_ra = stfile.Readahead

    class SpyReadahead(real_ra):  # type: ignore[misc,valid-type]
        def __init__(self, ranges, window=stfile.READAHEAD_BYTES):  # type: ignore[no-untyped-def]
            ranges = list(ranges)
            advised.extend(r for r in ranges if r is not None)
            super().__init__(ranges, window)

    def spy_bytes(entry: stfile.TensorEntry, start: int, out: torch.Tensor) -> None:
        size = entry.dtype.itemsize
        read_bytes.append((entry.path, entry.offset + start * size, out.numel() * size))
        spy(entry, start, out)

    stfile.read_range = spy_bytes
    stfile.Readahead = SpyReadahead
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
                for path, off, n in advised:  # the readahead asks only for bytes this rank reads
                    assert any(p == path and o <= off and off + n <= o + k for p, o, k in read_bytes), (
                        name,
                        tier,
                        path,
                        off,
                        n,
                    )
                assert advised, (name, tier)
                advised.clear()
                read_bytes.clear()
                reads.clear()
                zswap.load_weights(m, ckpt)  # again, into the partitions that now exist
                check(m, files, reads, rank, world, (name, tier, "load_weights"))
        dist.barrier()
    finally:
        stfile.read_range = real
        stfile.Readahead = real_ra
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
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
