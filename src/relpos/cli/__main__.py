"""``python -m relpos.cli`` (what ``torchrun -m relpos.cli`` runs): the ``relpos`` command line."""

import sys

from . import main

sys.exit(main())
