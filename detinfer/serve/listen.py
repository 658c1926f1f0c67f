"""The server's listening side: a checked address and port, uvicorn with read, stall and drain timeouts.

What a slow or hostile connection can hold is bounded here, below the app: request headers must arrive within
HEADER_TIMEOUT_S of the connection (or of the previous response on a kept-alive one), an idle kept-alive
connection is closed after KEEP_ALIVE_S, and a connection whose peer acknowledges none of the bytes waiting for it
for ``--send-timeout`` seconds is closed (a stall watch that counts the bytes the kernel accepted too: on Linux the
socket's unacknowledged bytes and TCP_INFO's ``bytes_acked``; elsewhere only the bytes asyncio still holds), which
cancels its request as a disconnect does. On SIGTERM / Ctrl-C the server stops accepting and tells the app
(serving.Server.begin_drain: queued requests 503, running ones cancelled with a 503 after ``drain_s``), then
closes what is still open at ``drain_s`` + DRAIN_GRACE_S and exits within ``drain_s`` + 1 s. The body read timeout
lives in the app (protocol.read_json), where it can answer 408.
"""

from __future__ import annotations

import asyncio
import fcntl
import ipaddress
import socket
import struct
import sys
import termios
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import InputError

HEADER_TIMEOUT_S = 10.0  # seconds a client has to send a request's headers
KEEP_ALIVE_S = 5  # seconds an idle kept-alive connection stays open (uvicorn's default)
DEFAULT_DRAIN_S = 5.0  # seconds a shutdown waits for running requests before cancelling them
DRAIN_GRACE_S = 0.5  # seconds after the drain for the cancelled requests' errors to go out before connections close
_TCPI_BYTES_ACKED = struct.Struct("=Q"), 120  # struct tcp_info's u64 tcpi_bytes_acked (Linux >= 4.1) and its offset
_TCP_INFO_LEN = 232


def _stalled_bytes(transport: asyncio.Transport) -> tuple[int, int | None]:
    """(bytes waiting for the peer: asyncio's buffer plus the kernel's unsent or unacknowledged bytes, the bytes the
    peer acknowledged so far or None where the kernel does not say)."""
    pending = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is None or not sys.platform.startswith("linux"):
        return pending, None
    try:
        outq = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]  # SIOCOUTQ
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except OSError:
        return pending, None
    fmt, offset = _TCPI_BYTES_ACKED
    acked = fmt.unpack_from(info, offset)[0] if len(info) >= offset + fmt.size else None
    return pending + outq, acked


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for the request headers (h11 and uvicorn have none: a client sending
    one header byte every few seconds would hold its connection forever)."""

    header_timeout = HEADER_TIMEOUT_S
    send_timeout = 30.0  # seconds the peer may acknowledge nothing of what waits for it
    _header_timer: asyncio.TimerHandle | None = None
    _stall_timer: asyncio.TimerHandle | None = None
    _pending_before = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()
        self._progress: tuple[float, int | None] = (time.monotonic(), None)
        self._watch_stall()

    def _watch_stall(self) -> None:
        """Every tick: close the connection when bytes wait for the peer and it acknowledged none for send_timeout."""
        if self.transport.is_closing():
            return
        now, (last, acked_before) = time.monotonic(), self._progress
        pending, acked = _stalled_bytes(self.transport)
        if acked is None:  # no kernel counters: progress is asyncio's buffer shrinking
            progressed = pending < self._pending_before
        else:
            progressed = acked != acked_before
        if pending == 0 or progressed:
            self._progress = (now, acked)
        elif now - last > self.send_timeout:
            self.transport.abort()  # the app sees a disconnect: its stream is cancelled and the slot released
            return
        self._pending_before = pending
        self._stall_timer = self.loop.call_later(min(1.0, self.send_timeout / 4), self._watch_stall)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()  # the next request on this kept-alive connection gets the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._stall_timer):
            if timer is not None:
                timer.cancel()
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


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, which tells the app when shutdown begins and closes what is left after the drain."""

    def __init__(self, config: uvicorn.Config, begin_drain, drain_s: float):
        super().__init__(config)
        self.begin_drain, self.drain_s = begin_drain, drain_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.begin_drain()
        asyncio.get_running_loop().call_later(self.drain_s + DRAIN_GRACE_S, self._close_connections)
        await super().shutdown(sockets)

    def _close_connections(self) -> None:
        """Connections still open after the drain and its grace (a client that does not read its error) are closed,
        so no request task is left for uvicorn to cancel (a cancelled task logs a traceback)."""
        for connection in list(self.server_state.connections):
            connection.transport.abort()


def serve(app, sock: socket.socket, *, drain_s: float = DEFAULT_DRAIN_S, header_timeout: float = HEADER_TIMEOUT_S) -> None:
    """Run ``app`` (from app.create_app) with uvicorn on the bound ``sock`` until SIGTERM / SIGINT, then drain (see
    the module docstring); a connection that does not send its request headers within ``header_timeout`` s is
    closed, and so is one that acknowledges nothing for the app's ``send_timeout`` s."""
    server = app.state.server
    protocol = type("TimedH11", (TimedH11Protocol,), {"header_timeout": header_timeout,
                                                      "send_timeout": server.settings.send_timeout})  # fmt: skip
    config = uvicorn.Config(app, http=protocol, timeout_keep_alive=KEEP_ALIVE_S, log_level="info",
                            timeout_graceful_shutdown=drain_s + 1.5 * DRAIN_GRACE_S)  # type: ignore[arg-type]  # fmt: skip
    _DrainingServer(config, server.begin_drain, drain_s).run(sockets=[sock])
