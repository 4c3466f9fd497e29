"""`python -m grpo_dist.config [--check CONFIG ...]` (grpo_dist/config/cli.py)."""

import sys

from grpo_dist.config.cli import main

sys.exit(main())
