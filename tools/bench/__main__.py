"""``python -m tools.bench``: the benchmark table (tools/bench/suite.py)."""

import sys

from tools.bench.suite import main

sys.exit(main())
