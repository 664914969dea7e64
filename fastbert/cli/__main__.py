"""`python -m fastbert.cli`: the `fastbert` command."""

from __future__ import annotations

import sys

from fastbert.cli import main

sys.exit(main())
