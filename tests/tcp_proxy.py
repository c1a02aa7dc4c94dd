"""A TCP proxy in front of one server, for one engine of the store tests:
`cut()` drops its connections and holds new ones unanswered (a partition:
the engine's reads time out, nothing is refused) until `heal()`."""

from __future__ import annotations

import contextlib
import socket
import threading


class Proxy:
    """A TCP proxy in front of one server, for one engine: `cut()` drops its
    connections and holds new ones unanswered until `heal()`."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.cut_off = False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closing = False
        self._thread = threading.Thread(target=self._accept, daemon=True, name="proxy")
        self._thread.start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._socks.append(client)
                if self.cut_off:
                    continue  # held: the engine's reads time out
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=2)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks.append(upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if self.cut_off:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _drop(self) -> None:
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def cut(self) -> None:
        """Partition: what was on its way is lost, new connections hang."""
        self.cut_off = True
        self._drop()

    def heal(self) -> None:
        self.cut_off = False
        self._drop()  # the held ones: the engine reconnects

    def close(self) -> None:
        self._closing = True
        self._drop()
        self.listener.close()
