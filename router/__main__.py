"""`python -m router ...`: the same as `tandem router ...`."""

import sys

from router.cli import main

sys.exit(main())
