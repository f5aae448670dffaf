"""`python -m kvstore`: the `kvstore` command."""

import sys

from kvstore.tools.cli import main

sys.exit(main())
