"""A loopback TCP port that relays to another, for the fake Runpod's pods.

A pod's public SSH port lives only while its container runs: stopping the pod cuts every
connection and the port stops answering, and a resumed pod gets a new port. One relay per
running pod, in front of the test sshd, gives the fake exactly that.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class TcpRelay:
    """Listens on 127.0.0.1:<free port> and relays each connection to `upstream` until closed."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)  # the accept loop notices close() within this
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="tcp-relay", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._listener.getsockname()[:2]
        return host, port

    def _track(self, *socks: socket.socket) -> bool:
        with self._lock:
            if self._closed.is_set():
                return False
            self._sockets.update(socks)
            return True

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            if not self._track(client, server):
                client.close()
                server.close()
                return
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        """Stop listening and cut every relayed connection, as a stopped container does."""
        with self._lock:
            self._closed.set()
            socks, self._sockets = self._sockets, set()
        self._listener.close()
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self._thread.join(timeout=2)
