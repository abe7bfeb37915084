"""`python -m tandem_client` is the `tandem` command."""

import sys

from tandem_client.cli import main

sys.exit(main())
