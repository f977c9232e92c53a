"""`python -m megatrain ...`: the same as the `megatrain` command (what torchrun launches)."""

import sys

from .cli import main

sys.exit(main())
