"""``python -m kvsched.cli``: the ``kvsched`` command."""

import sys

from kvsched.cli import main

sys.exit(main())
