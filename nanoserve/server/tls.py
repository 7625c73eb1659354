"""HTTPS: the certificate files `serve` is given (vLLM's --ssl-* flags), checked before the model loads."""

from __future__ import annotations

import asyncio
import fcntl
import ssl
import struct
import termios
from collections.abc import Iterable
from dataclasses import dataclass

# --ssl-cert-reqs: whether clients must present a certificate, as ssl.CERT_NONE / OPTIONAL / REQUIRED
CERT_REQS = {0: ssl.CERT_NONE, 1: ssl.CERT_OPTIONAL, 2: ssl.CERT_REQUIRED}


@dataclass(frozen=True)
class TLSFiles:
    certfile: str
    keyfile: str
    ca_certs: str | None = None   # the CAs that client certificates must chain to
    cert_reqs: int = 0             # a key of CERT_REQS

    def check(self) -> None:
        """Raise ValueError naming the file at fault: uvicorn would only find it once the model had
        loaded, and then print a traceback."""
        if self.cert_reqs not in CERT_REQS:
            raise ValueError(f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got {self.cert_reqs}")
        if self.cert_reqs and self.ca_certs is None:
            raise ValueError("--ssl-cert-reqs asks clients for certificates: give --ssl-ca-certs to check them by")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            # an encrypted key would make OpenSSL ask for its password on the terminal, where a
            # server under a supervisor has none: it is refused instead
            context.load_cert_chain(self.certfile, self.keyfile, password=_no_password)
        except (OSError, ssl.SSLError, ValueError) as exc:
            raise ValueError(f"cannot use --ssl-certfile {self.certfile!r} with --ssl-keyfile {self.keyfile!r}: "
                             f"{getattr(exc, 'strerror', None) or exc} (a PEM certificate and its unencrypted "
                             "PEM private key are needed)") from None
        if self.ca_certs is not None:
            try:
                context.load_verify_locations(self.ca_certs)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"cannot use --ssl-ca-certs {self.ca_certs!r}: {exc.strerror or exc}") from None

    def uvicorn_options(self) -> dict:
        return dict(ssl_certfile=self.certfile, ssl_keyfile=self.keyfile, ssl_ca_certs=self.ca_certs,
                    ssl_cert_reqs=CERT_REQS[self.cert_reqs])


def _no_password() -> str:
    raise ValueError("the private key is encrypted")


def tls_files(certfile: str | None, keyfile: str | None, ca_certs: str | None = None,
              cert_reqs: int = 0) -> TLSFiles | None:
    """The checked files, or None (plain HTTP) when neither certificate nor key is given."""
    if certfile is None and keyfile is None:
        if ca_certs is not None or cert_reqs:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs apply to HTTPS: give --ssl-certfile and --ssl-keyfile")
        return None
    if certfile is None or keyfile is None:
        raise ValueError("HTTPS needs both --ssl-certfile and --ssl-keyfile")
    files = TLSFiles(certfile, keyfile, ca_certs, cert_reqs)
    files.check()
    return files


def closed_but_waiting(transport: asyncio.BaseTransport) -> bool:
    """Whether `transport` is a TLS connection that is closing with every byte it was given sent and
    acknowledged: what is left is the wait for the client's close_notify, which asyncio (and uvloop)
    allow 30 s (ssl_shutdown_timeout). A pooled client connection never sends one, so a server stopping
    with an idle HTTPS client took 30 s to close it. False where it cannot tell (the bytes still in the
    kernel's send queue are read with TIOCOUTQ, Linux's; a client that reads slowly keeps them there)."""
    if not transport.is_closing() or transport.get_extra_info("sslcontext") is None:
        return False
    try:
        queued = fcntl.ioctl(transport.get_extra_info("socket").fileno(), termios.TIOCOUTQ, b"\0" * 4)
        return transport.get_write_buffer_size() == 0 and struct.unpack("i", queued)[0] == 0
    except (AttributeError, OSError, ValueError):   # no socket, not Linux, or already gone
        return False


async def end_waiting_tls_closes(connections: Iterable, every_s: float = 0.25) -> None:
    """Until cancelled: abort each connection found closed_but_waiting on two checks in a row (the
    second one makes sure nothing was moving between the TLS layer and the socket). Run for as long as
    the server serves HTTPS: a connection closed by a timeout or by the stop is let go once its last
    bytes are out, not when its client answers, and its --max-connections place with it."""
    waiting: set = set()
    while True:
        await asyncio.sleep(every_s)
        found = {c for c in list(connections) if getattr(c, "transport", None) and closed_but_waiting(c.transport)}
        for connection in found & waiting:
            connection.transport.abort()
        waiting = found
