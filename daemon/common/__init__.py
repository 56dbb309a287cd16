"""What the `obd` command and the service share, importing neither: the wire format (run states,
socket limits) and the paths (socket, state directory, config)."""
