"""One rank of test_hf_conversions.py's two-rank test: ``python _hfconv_dist_worker.py RANK WORLD INIT DIR``.

Both ranks load the same per-expert (legacy layout) Mixtral checkpoint with ``from_pretrained`` under
``zswap.Init`` (cpu and nvme tiers) and with ``zswap.load_weights``: each rank converts the experts from their
source tensors and keeps its own slice; the gathered weights must be a plain ``from_pretrained``'s.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import zswap
from zswap import param_state


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    init_file, root = sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore", zswap.ZswapWarning)
    ckpt = root / "ckpt"
    ref = {
        n: p.detach() for n, p in transformers.AutoModelForCausalLM.from_pretrained(ckpt).named_parameters()
    }
    try:
        for tier in ("cpu", "nvme"):
            swap = root / f"swap{rank}"
            swap.mkdir(exist_ok=True)
            with zswap.Init({"offload_param": {"device": tier, "nvme_path": str(swap)}}):
                m = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
            check(m, ref, world, tier)
            with zswap.GatheredParameters(list(m.parameters()), modifier_rank=0):  # other values
                for p in m.parameters():
                    p.data.zero_()  # then loaded back
            zswap.load_weights(m, ckpt)
            check(m, ref, world, f"{tier} load_weights")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def check(m: torch.nn.Module, ref: dict[str, torch.Tensor], world: int, what: str) -> None:
    named = dict(m.named_parameters())
    assert named.keys() == ref.keys(), what
    for name, p in named.items():
        st = param_state(p)
        assert st is not None and st.world_size == world, (what, name)
    with zswap.GatheredParameters(list(named.values())):
        for name, t in ref.items():
            assert torch.equal(named[name].data, t), (what, name)


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
