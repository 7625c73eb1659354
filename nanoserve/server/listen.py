"""The listening socket, taken before anything slow: a port in use, or a Unix socket's path that is
not free, is refused before the engine's process starts or the web stack loads."""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import stat


def bind_socket(host: str, port: int, uds: str | None = None) -> socket.socket:
    """Take the port (or the Unix socket's path) now, before the model loads, so that a busy one fails
    at once, not after it.

    The socket listens at once: connections made while the model loads wait in its backlog. A socket
    only bound would not hold the port against a second server (Linux lets two SO_REUSEADDR sockets
    bind one port while neither listens), and on a Unix socket it would refuse the second server's
    probe, which then took the path over as a dead server's."""
    if uds is not None:
        return _bind_unix_socket(uds)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen()
    except OSError as exc:
        sock.close()
        raise SystemExit(f"nanoserve: error: cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def _bind_unix_socket(path: str) -> socket.socket:
    """A socket left by a server that died is taken over; one that a live server answers on, or a
    file that is not a socket, is refused."""
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise SystemExit(f"nanoserve: error: cannot listen on {path}: it exists and is not a socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)   # nothing answers: a dead server's
            else:
                raise SystemExit(f"nanoserve: error: cannot listen on {path}: another server answers there")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen()
    except OSError as exc:
        sock.close()
        raise SystemExit(f"nanoserve: error: cannot listen on {path}: {exc.strerror or exc}") from None
    # the file goes when this process exits, whether it served or stopped first (a flag refused after
    # the bind, a Ctrl-C while loading), unless another file has replaced it by then
    atexit.register(_remove_socket_file, path, os.lstat(path).st_ino)
    return sock


def _remove_socket_file(path: str, inode: int) -> None:
    with contextlib.suppress(OSError):
        if os.lstat(path).st_ino == inode:
            os.unlink(path)
