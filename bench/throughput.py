"""`nanoserve bench throughput` as a script, for checkouts where nanoserve is not installed (the device).

The benchmark itself is nanoserve/benchmarks/throughput.py; `--help` lists its flags.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanoserve.benchmarks.throughput import main  # noqa: E402

if __name__ == "__main__":
    main()
