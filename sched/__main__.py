"""``python -m streamlane.sched`` is the ``streamlane`` command."""

import sys

from .cli import main

sys.exit(main())
