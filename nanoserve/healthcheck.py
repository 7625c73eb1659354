"""`python -m nanoserve.healthcheck`: exit 0 when the server answers /health with 200, over HTTP or,
when it serves HTTPS (--ssl-certfile), over TLS. The image's HEALTHCHECK; it imports neither torch
nor the web stack, since it runs every 30 s beside the server.

Where it asks is where the server listens: the image's entrypoint makes `nanoserve serve` PID 1
with `--port $PORT` first, and a `--port`, `--host` or `--uds` given after the image name wins
there, so those are read from PID 1's command line (NANOSERVE_HEALTHCHECK_PID names another
process); $PORT on 127.0.0.1 where that process is no `nanoserve serve`.
"""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import sys
from dataclasses import dataclass

DEFAULT_PORT = 8000


@dataclass(frozen=True)
class Address:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    uds: str | None = None


def healthy(address: Address, timeout: float = 4.0) -> bool:
    for tls in (False, True):
        conn = _connection(address, tls, timeout)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except (http.client.HTTPException, ConnectionResetError, ssl.SSLError):
            continue   # the wrong protocol for this port: try the other one
        except OSError:
            return False   # nothing listens, or it timed out
        finally:
            conn.close()
    return False


def _connection(address: Address, tls: bool, timeout: float) -> http.client.HTTPConnection:
    # the probe runs beside the server: the certificate names the public host, not 127.0.0.1, so
    # it is not checked; what is asked is only whether this server answers
    conn = (http.client.HTTPSConnection(address.host, address.port, timeout=timeout,
                                        context=ssl._create_unverified_context()) if tls
            else http.client.HTTPConnection(address.host, address.port, timeout=timeout))
    if address.uds is not None:
        def connect_unix() -> None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(address.uds)
            conn.sock = conn._context.wrap_socket(sock, server_hostname="localhost") if tls else sock
        conn.connect = connect_unix
    return conn


def served_address(cmdline: list[str], port_env: str | None) -> Address:
    """Where a `nanoserve serve` with this command line listens, as seen from beside it."""
    port = _port(port_env) if port_env else DEFAULT_PORT
    at = cmdline.index("serve") if "serve" in cmdline else 0
    if not any("nanoserve" in part for part in cmdline[:at]):
        return Address(port=port)   # PID 1 is no nanoserve server (an init, a shell): $PORT it is
    args = cmdline[at + 1:]
    uds = _last(args, "--uds")
    if uds:
        return Address(uds=uds)
    host = _last(args, "--host") or ""
    given = _last(args, "--port")
    # a server on every address answers on loopback; one bound to a single address only there
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return Address(host=host, port=_port(given) if given else port)


def _last(args: list[str], flag: str) -> str | None:
    """The last value given to `flag` (argparse keeps the last), as `--flag V` or `--flag=V`."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def _port(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        sys.exit(f"nanoserve.healthcheck: the port {text!r} is not a number")


def _cmdline(pid: str) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [part.decode(errors="replace") for part in f.read().split(b"\0") if part]
    except OSError:   # no /proc (not Linux), or no such process
        return []


def main() -> None:
    cmdline = _cmdline(os.environ.get("NANOSERVE_HEALTHCHECK_PID", "1"))
    sys.exit(0 if healthy(served_address(cmdline, os.environ.get("PORT"))) else 1)


if __name__ == "__main__":
    main()
