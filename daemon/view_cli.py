"""Commands that show runs rather than act on them (standard library only at import time).

The web view and plots are added here; each command sets `view` to a function
`(args, client) -> exit code`. Heavy imports (a plotting library) happen inside those functions.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_commands(train: Any, top: Any) -> None:
    """Add the view commands to `obd train` (`train`) and to `obd` (`top`)."""
    del train, top  # none yet


__all__ = ["add_commands", "argparse"]
