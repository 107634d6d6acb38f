"""``python -m cp_ops ...`` = ``cp-ops ...`` (see :mod:`cp_ops.cli.main`)."""

import sys

from .cli.main import main

sys.exit(main())
