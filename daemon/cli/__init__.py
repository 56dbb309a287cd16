"""The `obd` command: the client of the daemon's control socket, standard library only at import.

Nothing here imports the service (daemon's other modules build and run it), pydantic, anyio or
torch when `obd train list` runs; the commands that need more (`obd daemon`, `targets check`,
`pods`) import it when they run. The wire contract it shares with the service is
`daemon/common/wire.py`.
"""

from daemon.cli.main import main

__all__ = ["main"]
