"""`python -m fastbert`: the `fastbert` command (this module belongs to the CLI, not the core)."""

from __future__ import annotations

import sys

from fastbert.cli import main

sys.exit(main())
