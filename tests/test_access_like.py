"""Inside ``zswap.Init``, ``torch.*_like`` of a partitioned param is built from its record, not gathered.

transformers' ``_init_weights`` calls ``torch.empty_like(weight)`` on weights it has just loaded (DistilBERT's
sinusoidal position table) to build values it then does not copy in; each such call used to read the weight
back from the swap.
"""

from __future__ import annotations

import torch
from torch import nn

from zswap import Status, param_state

from ._init_helpers import make_init


def test_like_constructors_need_no_gather(tmp_path):
    init = make_init("nvme", tmp_path)
    with init:
        lin = nn.Linear(8, 4)
        w = lin.weight
        assert param_state(w).status is Status.NOT_AVAILABLE
        got = {
            "empty": torch.empty_like(w),
            "zeros64": torch.zeros_like(w, dtype=torch.float64),
            "ones": torch.ones_like(w, requires_grad=True),
            "full": torch.full_like(w, 3.0),
        }
        assert param_state(w).status is Status.NOT_AVAILABLE
        assert init._placement.store.engine.stats()["bytes_read"] == 0
        assert {k: (tuple(t.shape), t.dtype) for k, t in got.items()} == {
            "empty": ((4, 8), torch.float32),
            "zeros64": ((4, 8), torch.float64),
            "ones": ((4, 8), torch.float32),
            "full": ((4, 8), torch.float32),
        }
        assert torch.equal(got["zeros64"], torch.zeros(4, 8, dtype=torch.float64))
        assert torch.equal(got["full"], torch.full((4, 8), 3.0)) and got["ones"].requires_grad
        assert param_state(got["empty"]) is None  # a plain tensor, not a view of the param
        want = w.detach().clone()  # reading the data gathers it, as before
        assert init._placement.store.engine.stats()["bytes_read"] > 0 and want.shape == (4, 8)
