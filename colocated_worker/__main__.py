"""`python -m colocated_worker ...`: the same as `tandem colocated ...`."""

import sys

from colocated_worker.cli import main

sys.exit(main())
