"""``python -m workloads.traces``: the command line of ``workloads.traces.cli``."""

import sys

from .cli import main

sys.exit(main())
