"""structlog set-up: key-value events, JSON lines when stderr is not a terminal.

Every line the daemon writes goes through the same renderer, the libraries' included (and
Python's warnings, through `logging.captureWarnings`): the
standard `logging` root gets one handler that formats their records like obd's own events, so
a log meant for a machine is all JSON. Libraries speak at WARNING and above unless the level is
`debug` (asyncssh logs whole remote commands at INFO; the runpod SDK turns INFO on for
everyone when it is imported, which a root that already has a handler makes a no-op).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

LEVELS = ("debug", "info", "warning", "error")


def configure(level: str = "info", json_output: bool | None = None) -> None:
    if level not in LEVELS:
        raise ValueError(f"log level {level!r}: use one of {', '.join(LEVELS)}")
    if json_output is None:
        json_output = not sys.stderr.isatty()
    renderer: Any = structlog.processors.JSONRenderer() if json_output else structlog.dev.ConsoleRenderer()
    stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            stamp,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=renderer,
            foreign_pre_chain=[structlog.stdlib.add_logger_name, structlog.stdlib.add_log_level, stamp],
        )
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
    # Python's warnings (a library's DeprecationWarning at import: asyncssh's DSA with cryptography
    # 51) go through the same handler, as JSON lines, not as bare text on stderr.
    logging.captureWarnings(True)
