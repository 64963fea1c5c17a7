"""Listening sockets: made here, with the options every activator listener needs.

TCP_NODELAY is set on the listener and inherited by every accepted socket on Linux:
without it a keep-alive response written in two pieces meets the client's delayed ACK
and stalls ~40 ms. SO_REUSEADDR lets a restart bind at once; SO_REUSEPORT is for
processes that share a port. A connection's read side is shut (to end a wait on it) in
a way that keeps its TLS layer whole (``shutdown_keeping_tls``). A leaf module: it imports nothing of activator's.
"""

from __future__ import annotations

import socket


class CannotListen(OSError):
    """A listener that could not be made; its text names the address (``cannot listen on
    127.0.0.1:8080: Address already in use``)."""

    def __init__(self, host: str, port: int, error: OSError) -> None:
        super().__init__(error.errno, error.strerror or str(error))
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def __str__(self) -> str:
        return f"cannot listen on {self.address}: {self.strerror}"


def listen_socket(host: str, port: int, *, reuse_port: bool = False, backlog: int = 1024) -> socket.socket:
    """A non-blocking listening TCP socket with TCP_NODELAY on ``host:port``; raises
    ``CannotListen``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as error:
        sock.close()
        raise CannotListen(host, port, error) from error
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def shutdown_keeping_tls(sock: socket.socket, how: int) -> None:
    """``shutdown(how)`` of a connection, leaving a TLS layer on it alone.

    ``shutdown`` on a TLS socket drops its TLS state (anything sent after it would go out
    in clear), so the TCP socket is shut down through a duplicate of its descriptor: the
    shutdown is the connection's, the TLS object is untouched. Does not yield.
    """
    try:
        twin = socket.fromfd(sock.fileno(), sock.family, sock.type)
    except (OSError, ValueError):
        return  # closed already
    try:
        twin.shutdown(how)
    except OSError:
        pass
    finally:
        twin.close()
