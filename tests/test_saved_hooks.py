"""A user's saved-tensor hooks around a zswap model's forward (``torch.autograd.graph.saved_tensors_hooks``,
``save_on_cpu``, an activation offloader): zswap's own hooks go on top of them and pass them every tensor
but the params' views, which zswap keeps as references to re-gather — so no gathered weight is kept (or
copied) until backward, as without them, and the gradients are plain torch's."""

from __future__ import annotations

import pytest
import torch

from zswap import param_state

from .test_runtime import TinyLM, assert_same_grads, build, config, engine_for, ids, sq


def _managed_memory(t: torch.Tensor, params: list[torch.Tensor]) -> bool:
    """Whether ``t`` is a managed param or shares memory with one's gathered data."""
    base = t._base if t._base is not None else t
    ptrs = {p.untyped_storage().data_ptr() for p in params if p.numel() > 0}
    return (param_state(base) is not None and base.numel() > 0) or t.untyped_storage().data_ptr() in ptrs


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_users_saved_tensor_hooks_never_see_a_gathered_weight(tier, tmp_path):
    cfg = config(tier, tmp_path, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0)
    m, ref = build(TinyLM, cfg)
    params = list(m.parameters())
    seen: list[bool] = []
    unpacked = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(_managed_memory(t, params))
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        unpacked.append(t.shape)
        return t

    with engine_for(m, cfg) as engine:
        for _ in range(2):
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                out = m(ids())
            assert seen and not any(seen)  # activations only: the weights' views stayed zswap's
            sq(out).backward()
            sq(ref(ids())).backward()
            assert unpacked  # theirs unpacked what they packed
            assert_same_grads(m, ref)
            engine.zero_grad()
            ref.zero_grad()
            seen.clear()


def test_save_on_cpu_and_a_checkpoint_inside_train_as_plain_torch(tmp_path):
    """``save_on_cpu`` around the forward, non-reentrant checkpoints inside it (whose own hooks go on top of
    zswap's there): gradients bitwise plain torch's under the same two."""
    cfg = config("nvme", tmp_path, stage3_param_persistence_threshold=0)
    m, ref = build(lambda: TinyLM(reentrant=False), cfg)
    with engine_for(m, cfg) as engine:
        for _ in range(2):
            with torch.autograd.graph.save_on_cpu():
                out, want = m(ids()), ref(ids())
            assert torch.equal(out, want)
            sq(out).backward()
            sq(want).backward()
            assert_same_grads(m, ref)
            engine.zero_grad()
            ref.zero_grad()
