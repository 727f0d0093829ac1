"""`python -m zswap ...`: the same command line as the `zswap` script."""

import sys

from .cli import main

sys.exit(main())
