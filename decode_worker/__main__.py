"""`python -m decode_worker ...`: the same as `tandem decode ...`."""

import sys

from decode_worker.cli import main

sys.exit(main())
