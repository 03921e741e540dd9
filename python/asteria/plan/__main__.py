"""``python3 -m asteria.plan``: runs the planner's command line (``asteria.plan.cli.main``)."""

import sys

from asteria.plan.cli import main

sys.exit(main())
