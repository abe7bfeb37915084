"""`python -m prefill_worker ...`: the same as `tandem prefill ...`."""

import sys

from prefill_worker.cli import main

sys.exit(main())
