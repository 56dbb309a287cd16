"""`python -m daemon.cli`: the `obd` command."""

import sys

from daemon.cli.main import main

sys.exit(main())
