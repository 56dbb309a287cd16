"""The service: the daemon's parts (the socket server, the queue, the followers, the store, ...),
assembled by `daemon.service.daemon.Daemon`. The `obd` command never imports it; the commands that
run obd's machinery in their own process reach it through `daemon/cli/machinery.py`."""
