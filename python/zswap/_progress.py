"""Progress bars (tqdm) for zswap's long operations: loads under `Init`, `save_weights`, checkpoints, export.

One switch decides whether a bar is shown, in this order:

1. ``ZSWAP_PROGRESS=1`` forces bars on, ``ZSWAP_PROGRESS=0`` off;
2. ``TQDM_DISABLE`` set to anything but ``""`` / ``"0"`` / ``"false"`` turns them off (tqdm's own switch);
3. when transformers is already imported, its switch (``transformers.utils.logging.disable_progress_bar()``
   / ``HF_HUB_DISABLE_PROGRESS_BARS``) is honoured — zswap never imports transformers for this;
4. only rank 0 of a started ``torch.distributed`` group shows one;
5. otherwise a bar is shown only when stderr is a terminal (logs and CI output stay clean).

Call sites stay one line: ``for x in progress(items, "saving checkpoint", unit="param"):``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

_OFF = ("", "0", "false", "no", "off")


def enabled() -> bool:
    """Whether a progress bar would be shown now (see the module docstring for the order of the switches)."""
    forced = os.environ.get("ZSWAP_PROGRESS")
    if forced is not None and forced.strip() != "":
        return forced.strip().lower() not in _OFF
    if os.environ.get("TQDM_DISABLE", "").strip().lower() not in _OFF:
        return False
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None and not hf_logging.is_progress_bar_enabled():
        return False
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return False
    return sys.stderr is not None and sys.stderr.isatty()


def progress(
    items: Iterable[T], desc: str, *, total: int | None = None, unit: str = "it", **options: Any
) -> Iterator[T]:
    """`items`, iterated under a tqdm bar when `enabled()`, else as they are (no tqdm object is made)."""
    if not enabled():
        yield from items
        return
    from tqdm.auto import tqdm

    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with tqdm(items, desc=desc, total=total, unit=unit, leave=False, dynamic_ncols=True, **options) as bar:
        yield from bar
