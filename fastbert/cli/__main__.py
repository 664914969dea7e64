"""`python -m fastbert.cli`: the `fastbert` command."""

import sys

from fastbert.cli import main

sys.exit(main())
