"""`zswap.initialize`'s ``offload_param`` and ``aio`` against where `zswap.Init` put the model's params.

Params built under `Init` were placed by Init's config (tier, swap directories, the swap engine's settings);
`initialize` partitions only the params no Init did (`zswap.build.init.partition_rest`). An ``offload_param``
device or ``nvme_path``, or an ``aio`` section, that `initialize`'s config gives and that differs from what
the built params got would be accepted and not honoured, so it is refused, naming the key. Keys the config
leaves out are not compared (``initialize(model, {})`` takes the model as it was built); the rest of
``offload_param`` (``buffer_count``, ``buffer_size``, ``max_in_cpu``) is `initialize`'s to apply."""

from __future__ import annotations

import os

from torch import nn

from ..config import ZswapConfig
from ..errors import ConfigError
from ..parts.params import NvmeStore, param_state
from ..step.stepping import few
from ..store import storage as _storage

_ADVICE = "give zswap.Init and zswap.initialize the same config (or leave the key out of initialize's)"


def check(cfg: ZswapConfig, module: nn.Module) -> None:
    """Raise a `ConfigError` where ``cfg`` gives a placement the params ``module`` was built with differ
    from (see the module docstring)."""
    built = [(n, st) for n, p in module.named_parameters() if (st := param_state(p)) is not None]
    if not built:
        return
    asked = cfg.offload_param.model_fields_set
    want = cfg.offload_param.device
    if "device" in asked:
        elsewhere = [n for n, st in built if st.tier != want]
        if elsewhere:
            tiers = sorted({st.tier for _, st in built if st.tier != want})
            raise ConfigError(
                f"zero_optimization.offload_param.device is {want!r} but {few(elsewhere)} were built under "
                f"zswap.Init on {' / '.join(map(repr, tiers))}, where they stay: {_ADVICE}"
            )
    stores = {id(st.store): st.store for _, st in built if isinstance(st.store, NvmeStore)}
    storages = [s.storage for s in stores.values() if s.storage.paths]
    if "nvme_path" in asked and cfg.offload_param.nvme_path and storages:
        dirs = tuple(os.path.realpath(os.fspath(p)) for p in cfg.offload_param.nvme_path)
        other = sorted({d for s in storages if s.paths != dirs for d in s.paths})
        if other:
            raise ConfigError(
                f"zero_optimization.offload_param.nvme_path is {', '.join(dirs)} but the params were built "
                f"under zswap.Init swapping to {', '.join(other)}, where they stay: {_ADVICE}"
            )
    if cfg.aio.model_fields_set and storages:
        mine = _storage.settings(cfg.aio)
        theirs = next((s.settings for s in storages if s.settings is not None and s.settings != mine), None)
        if theirs is not None:
            new, old = dict(mine), dict(theirs)
            diff = sorted(k for k, v in new.items() if old.get(k) != v)
            raise ConfigError(
                f"the aio section asks for {', '.join(f'{k}={new[k]!r}' for k in diff)} but the params were "
                f"built under zswap.Init with {', '.join(f'{k}={old.get(k)!r}' for k in diff)}, and their "
                f"swap engine keeps those settings: {_ADVICE}"
            )
