"""The server's listening side: a checked address and port, uvicorn with read and drain timeouts.

What a slow or hostile connection can hold is bounded here, below the app: request headers must arrive within
HEADER_TIMEOUT_S of the connection (or of the previous response on a kept-alive one), an idle kept-alive
connection is closed after KEEP_ALIVE_S, and on SIGTERM / Ctrl-C the server drains for at most ``drain_s``
seconds (requests still running are then cancelled) before it exits. The body read timeout lives in the app
(server.py), where it can answer 408.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import InputError

HEADER_TIMEOUT_S = 10.0  # seconds a client has to send a request's headers
KEEP_ALIVE_S = 5  # seconds an idle kept-alive connection stays open (uvicorn's default)
DEFAULT_DRAIN_S = 5.0  # seconds a shutdown waits for running requests before cancelling them


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for the request headers (h11 and uvicorn have none: a client sending
    one header byte every few seconds would hold its connection forever)."""

    header_timeout = HEADER_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()  # the next request on this kept-alive connection gets the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_deadline)

    def _header_deadline(self) -> None:
        waiting_for_headers = self.cycle is None or self.cycle.response_complete
        if waiting_for_headers and not self.transport.is_closing():
            self.transport.close()


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port``; InputError (one line) for a port outside 1..65535, a host that
    is neither an IP address nor a resolvable name, or an address that cannot be bound (in use, not local...)."""
    if not 1 <= port <= 65535:
        raise InputError(f"--port {port} is out of range; use 1..65535")
    try:
        family = socket.AF_INET6 if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address) else socket.AF_INET
    except ValueError:
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        except (socket.gaierror, UnicodeError) as e:
            raise InputError(f"--host {host!r} is neither an IP address nor a name this machine resolves ({e})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def serve(app, sock: socket.socket, *, drain_s: float = DEFAULT_DRAIN_S, header_timeout: float = HEADER_TIMEOUT_S) -> None:
    """Run ``app`` with uvicorn on the bound ``sock`` until SIGTERM / SIGINT, then drain for at most ``drain_s`` s;
    a connection that does not send its request headers within ``header_timeout`` s is closed."""
    protocol = type("TimedH11", (TimedH11Protocol,), {"header_timeout": header_timeout})
    config = uvicorn.Config(app, http=protocol, timeout_keep_alive=KEEP_ALIVE_S, log_level="info",
                            timeout_graceful_shutdown=drain_s)  # type: ignore[arg-type]  # fmt: skip
    uvicorn.Server(config).run(sockets=[sock])
