"""`obd ui`: a live web view of the caller's runs, served on 127.0.0.1 behind a random token.

Standard library only. The process runs as the user and talks to the daemon over its socket,
so it sees and acts on exactly what that user may. `hub` holds the one `watch` long poll and
fans its answers out, `feed` follows one run (record, log, metrics by offset), `server` is the
HTTP side (token, routes, server-sent events), and `static/` holds the page (no build step).
"""

DEFAULT_PORT = 8765  # `obd ui` without --port: this one, or the next free one
