"""``python -m moriio_fsm.cli``: the same command line as ``moriio-fsm``."""

import sys

from . import main

sys.exit(main())
