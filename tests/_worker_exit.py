"""How a multi-process test worker ends once its rank's work is done and checked.

Seen this stop, with torch 2.15 and gloo: a rank that finished every collective, passed its barrier and
called ``destroy_process_group`` sometimes dies afterwards with "terminate called without an active
exception" (SIGABRT) while the interpreter runs C++ static destructors — about one full suite run in two,
never in a dozen runs of the same test alone. That teardown is torch's, after everything the test checks,
so a worker leaves with ``os._exit(0)`` once ``main`` returned; an exception in ``main`` still exits non-zero
with its traceback. Remove this when the teardown is understood.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


def run_then_exit(main: Callable[[], object]) -> None:
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
