"""Hugging Face models run through zswap.initialize: logits, loss and every gradient bitwise those of the
plain model built from the same seed. Tiny configs from config objects: nothing is downloaded."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import zswap
from zswap import Status, full_grad, param_state

transformers = pytest.importorskip("transformers")

from .conftest import run_ranks  # noqa: E402
from .test_hf_models import MODELS  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_transformers")


def _build(model: str, cfg: dict) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    ref = MODELS[model]()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            m = MODELS[model]()
    return m, ref


@pytest.mark.parametrize("checkpointing", [None, True, False])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_logits_loss_and_grads_bitwise(model, tier, checkpointing, tmp_path):
    cfg = {
        "offload_param": {"device": tier, **({"nvme_path": str(tmp_path)} if tier == "nvme" else {})},
        "zero_optimization": {"stage3_param_persistence_threshold": 0},
    }
    m, ref = _build(model, cfg)
    for net in (m, ref):
        if checkpointing is not None:
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
        net.train()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        engine = zswap.initialize(m, cfg)
    with engine:
        for seed in (1, 2):  # the second pass follows the recorded trace, with prefetch
            torch.manual_seed(seed)  # GPT-2's dropout draws the same masks in both
            out = m(input_ids=ids, labels=ids, use_cache=False)
            torch.manual_seed(seed)
            want = ref(input_ids=ids, labels=ids, use_cache=False)
            assert torch.equal(out.logits, want.logits) and torch.equal(out.loss, want.loss)
            out.loss.backward()
            want.loss.backward()
        names = [n for n, _ in ref.named_parameters()]
        for name, p, q in zip(names, m.parameters(), ref.parameters(), strict=True):
            assert p.grad is None, name
            assert torch.equal(full_grad(p), q.grad), name
            assert param_state(p).status is Status.NOT_AVAILABLE, name
        assert engine.stats()["prefetch_hits"] > 0


@pytest.mark.parametrize("model", sorted(MODELS))
def test_generate_under_no_grad(model, tmp_path):
    cfg = {"offload_param": {"device": "cpu"}}
    m, ref = _build(model, cfg)
    m.eval()
    ref.eval()
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    with zswap.initialize(m, cfg), torch.no_grad():
        got = m.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        want = ref.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


@pytest.mark.dist
def test_generate_over_two_ranks_whose_sequences_end_apart(tmp_path):
    """A rank whose sequences ended keeps running the model until every rank's have (transformers'
    ``synced_gpus``, which zswap's engine makes the default over several ranks): without it the other
    rank's next gathers wait for a rank that stopped. See `_generate_dist_worker.py`."""
    run_ranks(Path(__file__).with_name("_generate_dist_worker.py"), tmp_path)
