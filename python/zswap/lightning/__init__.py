"""zswap for Lightning 2.x: ``Trainer(strategy=zswap.lightning.ZswapStrategy(config))``, or
``Trainer(strategy="zswap")`` (the default config) once this module is imported.

Needs the ``lightning`` package (``pip install 'zswap[lightning]'``). Modules: ``_strategy`` (the strategy:
Lightning's hooks mapped onto ``Init`` / ``initialize`` / the Engine), ``_precision`` (backward, optimizer
step and clipping through the engine; the param dtype), ``_summary`` (the model summary with the real size
of partitioned params); the module's Adam/AdamW is turned into zswap's offloaded AdamW, its lr schedulers
re-pointed, by ``zswap.step.optim.adopt``.
"""

from __future__ import annotations

try:
    import lightning.pytorch
    import lightning.pytorch.strategies
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "zswap.lightning needs the 'lightning' package (Lightning 2.x): pip install 'zswap[lightning]'"
    ) from exc

from ._precision import ZswapPrecision
from ._strategy import ZswapStrategy
from ._summary import ZswapSummary

# Lightning discovers only its own strategies' names; a third-party one registers itself when imported.
ZswapStrategy.register_strategies(lightning.pytorch.strategies.StrategyRegistry)

__all__ = ["ZswapPrecision", "ZswapStrategy", "ZswapSummary"]
