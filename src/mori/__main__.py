"""``python -m mori``: the ``mori`` command line."""

import sys

from mori.cli.main import main

sys.exit(main())
