"""`python -m nanoserve.healthcheck`: exit 0 when the server on 127.0.0.1:$PORT answers /health
with 200, over HTTP or, when it serves HTTPS (--ssl-certfile), over TLS. The image's HEALTHCHECK;
it imports neither torch nor the web stack, since it runs every 30 s beside the server."""

from __future__ import annotations

import http.client
import os
import ssl
import sys


def healthy(port: int, timeout: float = 4.0) -> bool:
    for connection in (http.client.HTTPConnection, _local_tls):
        conn = connection("127.0.0.1", port, timeout=timeout)
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


def _local_tls(host: str, port: int, timeout: float) -> http.client.HTTPSConnection:
    # the probe runs beside the server: the certificate names the public host, not 127.0.0.1, so
    # it is not checked; what is asked is only whether this server answers
    return http.client.HTTPSConnection(host, port, timeout=timeout, context=ssl._create_unverified_context())


def main() -> None:
    sys.exit(0 if healthy(int(os.environ.get("PORT", "8000"))) else 1)


if __name__ == "__main__":
    main()
