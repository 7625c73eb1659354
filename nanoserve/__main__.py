"""`python -m nanoserve ...` is the `nanoserve` command, for environments without the console script."""

import sys

from nanoserve.cli import main

sys.exit(main())
