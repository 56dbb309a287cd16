"""Commands that show runs rather than act on them: `obd train plot` and `obd ui` (standard library at import).

Each command sets `view` to a function `(args, client) -> exit code`. What they need beyond the
client (the plotting code, the web server, matplotlib for `--png`) is imported inside them, so
`obd train list` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

from daemon.cli.common import EXIT_ERROR, EXIT_USAGE
from daemon.cli.ui import DEFAULT_PORT as DEFAULT_UI_PORT


def add_commands(train: Any, top: Any) -> None:
    """Add `plot` to `obd train` (`train`) and `ui` to `obd` (`top`)."""
    p = train.add_parser(
        "plot",
        help="plot a metric against the step: in the terminal, or into an SVG/PNG file",
        description="Plot a metric of one or more runs against the step. A resumed run continues the curve of "
        "the run it was resumed from; snapshots (S) and resumes (R) are marked.",
    )
    p.add_argument(
        "ids", nargs="+", metavar="RUN", help="run ids, prefixes, names or `last`; a sweep: each of its members"
    )
    p.add_argument("--metric", default="loss", help="a key of the log lines: loss (default), learning_rate, grad_norm…")
    out = p.add_mutually_exclusive_group()
    out.add_argument(
        "--json", action="store_true", help="print the curves' points, snapshot and resume marks as JSON, no chart"
    )
    out.add_argument("--svg", metavar="FILE", help="write an SVG image (needs nothing installed)")
    out.add_argument(
        "--png", metavar="FILE", help="write a PNG image (needs matplotlib: pip install 'obd-train[plot]')"
    )
    p.add_argument("--width", type=int, help="terminal chart width in columns (default: the terminal's)")
    p.add_argument("--height", type=int, default=16, help="terminal chart height in rows (default: 16)")
    p.set_defaults(view=plot_command)

    ui = top.add_parser(
        "ui",
        help="serve a live web view of your runs on 127.0.0.1 (open it through `ssh -L` from elsewhere)",
        description="Serve a live web view of the runs you may see, on 127.0.0.1 only, behind a random token.",
    )
    ui.add_argument(
        "--port", type=int, help=f"port on 127.0.0.1 (default: {DEFAULT_UI_PORT}, or the next free one; 0: any)"
    )
    ui.set_defaults(view=ui_command)


def plot_command(args: argparse.Namespace, client: Any) -> int:
    """`obd train plot`: one curve per RUN, in the terminal or into a file."""
    from daemon.cli import plot

    try:
        metric = plot.safe_metric(args.metric)
        curves = []
        for ref in args.ids:  # a run, or a sweep: each of its members
            found, notes = plot.load_curves(client, ref, metric)
            curves += found
            for note in notes:
                print(f"obd: {note}", file=sys.stderr)
        if args.json:
            print(json.dumps([curve_json(c, metric) for c in curves], indent=1))
        elif args.svg:
            _write(args.svg, plot.svg_chart(curves, metric))
            print(f"wrote {args.svg}")
        elif args.png:
            plot.write_png(curves, metric, args.png)
            print(f"wrote {args.png}")
        else:
            width = args.width or min(120, shutil.get_terminal_size((80, 24)).columns)
            color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
            print(plot.terminal_chart(curves, metric, width=width, height=args.height, color=color))
    except plot.PlotError as exc:
        print(exc if str(exc).startswith("obd:") else f"obd: {exc}", file=sys.stderr)
        return EXIT_USAGE if exc.usage else EXIT_ERROR
    except BrokenPipeError:
        raise  # the reader went away (`| head`): the command's exit code says so (141)
    except OSError as exc:
        print(f"obd: cannot write the image: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return 0


def curve_json(curve: Any, metric: str) -> dict[str, Any]:
    """One curve of `plot --json`: the chain's runs and `[step, value]` pairs, oldest first."""
    return {
        "run_id": curve.run_id,
        "label": curve.label,
        "metric": metric,
        "runs": curve.runs,
        "points": [list(p) for p in curve.points],
        "snapshots": [list(p) for p in curve.snapshots],
        "resumes": [list(p) for p in curve.resumes],
        "note": curve.note or None,
    }


def _write(path: str, text: str) -> None:
    """Write the image whole, or not at all (a temporary file renamed into place)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def status_sparkline(client: Any, record: dict[str, Any], width: int = 40) -> str | None:
    """The line `obd train status` adds on a terminal: the recent loss as a sparkline, or None."""
    from daemon.cli import plot
    from daemon.cli.client import RequestFailed

    try:
        values = plot.recent_values(client, record["id"], "loss", width)
    except RequestFailed:
        return None  # the target cannot be read now; status said what it knows
    if len(values) < 2:
        return None
    return f"loss      {plot.sparkline(values)}  {values[0]:.4g} → {values[-1]:.4g} (last {len(values)} logged)"


def ui_command(args: argparse.Namespace, client: Any) -> int:
    """`obd ui`: serve the web view until Ctrl-C."""
    from daemon.cli.ui.server import serve

    return serve(client.path, args.port)


__all__ = ["add_commands", "plot_command", "status_sparkline", "ui_command"]
