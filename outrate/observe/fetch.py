"""Reading one HTTP page within a deadline and a size cap (`outrate top`'s scrape).

urllib bounds each socket operation by its timeout, not the whole request:
a server that sends a byte a second never trips it, and one that streams
without end is read until memory runs out. Here `timeout` is a deadline for
everything (connect, TLS handshake, headers, body, redirects) and one
scrape reads at most `max_bytes`: urllib still does HTTP, redirects and TLS
verification; each read of the socket goes through `_Reader`, which checks
both first.
"""

from __future__ import annotations

import http.client
import io
import socket
import ssl
import time
import urllib.error
import urllib.request
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from outrate.errors import OutrateError


class PageError(OutrateError):
    """The page cannot be read; the message says why in a few words."""


MAX_PAGE_BYTES = 16 * 1024 * 1024
"""The most one scrape reads (headers, body and any redirect's): vLLM's page
with a thousand series is a few hundred KB; a server that streams without
end is cut off here."""


class _TooLarge(Exception):
    pass


@dataclass(slots=True)
class _Scrape:
    """One scrape's deadline and byte budget, shared by each connection it
    opens (a redirect opens another)."""

    deadline: float
    bytes_left: int

    def seconds_left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        return left


_SCRAPE: ContextVar[_Scrape] = ContextVar("outrate_top_scrape")
"""The scrape in progress on this thread: http.client builds the connection
and the response itself, so this is how they learn its limits."""


class _Reader(io.RawIOBase):
    """A socket's bytes, each read within the scrape's deadline and byte budget.
    A socket timeout bounds one read: a server sending a byte a second never
    trips it, and http.client reads headers a line at a time."""

    def __init__(self, sock: socket.socket, scrape: _Scrape) -> None:
        self._sock, self._scrape = sock, scrape
        self._io = sock.makefile("rb", buffering=0)  # holds the socket open until closed

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._io.fileno()

    def readinto(self, buffer: Any) -> int | None:
        scrape = self._scrape
        if scrape.bytes_left <= 0:
            raise _TooLarge
        self._sock.settimeout(scrape.seconds_left())
        n = self._io.readinto(memoryview(buffer)[: scrape.bytes_left])
        scrape.bytes_left -= n or 0
        return n

    def close(self) -> None:
        self._io.close()
        super().close()


class _Response(http.client.HTTPResponse):
    def __init__(self, sock: socket.socket, *args: Any, **kwargs: Any) -> None:
        super().__init__(sock, *args, **kwargs)
        self.fp.close()
        self.fp = io.BufferedReader(_Reader(sock, _SCRAPE.get()))

    def read(self, amt: int | None = None) -> bytes:
        """In pieces: never one buffer of the size the server announces."""
        if amt is not None:
            return super().read(amt)
        chunks = []
        while chunk := super().read(1 << 16):
            chunks.append(chunk)
        if self.length:
            raise http.client.IncompleteRead(b"".join(chunks), self.length)
        return b"".join(chunks)


class _Connection(http.client.HTTPConnection):
    """Connects within what is left of the scrape; answers with `_Response`."""

    response_class = _Response

    def connect(self) -> None:
        self.timeout = _SCRAPE.get().seconds_left()
        super().connect()


class _TLSConnection(_Connection, http.client.HTTPSConnection):
    pass


class _TLSContext(ssl.SSLContext):
    def wrap_socket(self, sock: socket.socket, *args: Any, **kwargs: Any) -> ssl.SSLSocket:
        sock.settimeout(_SCRAPE.get().seconds_left())  # the handshake within what is left
        return super().wrap_socket(sock, *args, **kwargs)


@cache
def _tls_context() -> _TLSContext:
    context = _TLSContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies, as urllib's default does
    context.load_default_certs()
    return context


class _HTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_Connection, req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_TLSConnection, req, context=_tls_context())


def _opener() -> urllib.request.OpenerDirector:
    """urllib's default opener, less what this module does not bound: no
    proxies (the engine is local or on the cluster network, never behind
    HTTP_PROXY), and no FTP or file URLs (a redirect to one is an error)."""
    opener = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.ProxyHandler({}),
        urllib.request.UnknownHandler(),
        _HTTPHandler(),
        _HTTPSHandler(),
        urllib.request.HTTPDefaultErrorHandler(),
        urllib.request.HTTPRedirectHandler(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(handler)
    return opener


_OPENER = _opener()


def fetch(url: str, timeout: float, max_bytes: int = MAX_PAGE_BYTES) -> str:
    """The page at `url` as text, or a PageError saying why not in a few words.
    `timeout` is for the whole scrape (connect, headers and body, redirects
    included), and it reads at most `max_bytes`."""
    request = urllib.request.Request(url, headers={"Accept": "text/plain;version=0.0.4"})
    token = _SCRAPE.set(_Scrape(time.monotonic() + timeout, max_bytes))
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            body: bytes = response.read()
    except urllib.error.HTTPError as e:
        raise PageError(f"cannot read {url}: HTTP {e.code} {_printable(e.reason)}") from e
    except urllib.error.URLError as e:
        raise PageError(f"cannot read {url}: {_reason(e.reason)}") from e
    except (OSError, http.client.HTTPException) as e:  # while reading headers or body
        raise PageError(f"cannot read {url}: {_reason(e)}") from e
    except _TooLarge as e:
        raise PageError(f"cannot read {url}: response larger than {max_bytes / 2**20:g} MiB") from e
    finally:
        _SCRAPE.reset(token)
    return body.decode("utf-8", errors="replace")


def metric_families(text: str, error: type[OutrateError]) -> list[Metric]:
    """A Prometheus text page's families; `error` ("is not a Prometheus
    metrics page") where the parser cannot read it."""
    try:
        return list(text_string_to_metric_families(text))
    except (ValueError, IndexError, KeyError) as e:  # the parser is lax but not total
        raise error("is not a Prometheus metrics page") from e


def _reason(reason: object) -> str:
    if isinstance(reason, TimeoutError):
        return "timed out"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    if isinstance(reason, http.client.HTTPException) and not isinstance(reason, OSError):
        return f"not a valid HTTP response ({type(reason).__name__})"
    return _printable(str(reason))


def _printable(text: str, limit: int = 80) -> str:
    """What a server wrote, as one short line of plain characters."""
    text = "".join(c if c.isprintable() else "?" for c in text[: limit + 1])
    return text if len(text) <= limit else text[:limit] + "..."
