"""HTTPS connections are held to the deadlines plain ones are: a TLS handshake to --timeout-headers,
a TLS close to the bytes it still has to send (not to the client's close_notify), and a stop's
deadline to a response its client reads slowly."""

from __future__ import annotations

import json
import signal
import socket
import ssl
import time

import httpx

from tests.server.conftest import REPO, ServerProcess

TLS = REPO / "tests" / "assets" / "tls"
CERT, KEY = str(TLS / "cert.pem"), str(TLS / "key.pem")
TRUSTS_CERT = ssl.create_default_context(cafile=CERT)
HTTPS = ("--ssl-certfile", CERT, "--ssl-keyfile", KEY)


def closed_after(sock: socket.socket, limit: float) -> float:
    """Seconds until the server closes `sock` (a read gives EOF or a reset), at most `limit`."""
    start = time.monotonic()
    sock.settimeout(limit)
    try:
        while sock.recv(4096):
            pass
    except (ConnectionResetError, socket.timeout):
        pass
    return time.monotonic() - start


def test_a_connection_that_never_finishes_its_tls_handshake_is_closed_at_the_header_deadline(server_model, tmp_path):
    # asyncio's own handshake timeout (60 s) held such connections, uncounted, past every deadline
    server = ServerProcess(server_model, tmp_path, *HTTPS, "--timeout-headers", "2", verify=TRUSTS_CERT)
    silent = socket.create_connection(("127.0.0.1", server.port))
    try:
        assert closed_after(silent, 20) < 6
    finally:
        silent.close()
        server.stop()


def test_a_tls_connection_closed_idle_frees_its_place_at_once(server_model, tmp_path):
    # closed by the keep-alive timeout, it waited up to 30 s for the client's close_notify and counted
    # against --max-connections all that time: new clients got 503
    server = ServerProcess(server_model, tmp_path, *HTTPS, "--timeout-keep-alive", "1", "--max-connections", "1",
                           verify=TRUSTS_CERT)
    raw = socket.create_connection(("127.0.0.1", server.port))
    held = TRUSTS_CERT.wrap_socket(raw, server_hostname="localhost")
    try:
        held.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert held.recv(65536).startswith(b"HTTP/1.1 200")
        time.sleep(2.5)   # the keep-alive timeout closes it; this client never answers the close_notify
        with httpx.Client(verify=TRUSTS_CERT, timeout=10) as client:
            reply = client.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
    finally:
        raw.close()
        server.stop()


def test_a_stop_cuts_a_slowly_read_response_at_its_deadline_without_a_traceback_and_exits_1(server_model, tmp_path):
    # uvicorn cancelled the handler at the deadline: a CancelledError traceback in the log, and exit
    # 0 although the response was cut
    server = ServerProcess(server_model, tmp_path, *HTTPS, "--shutdown-timeout", "4", verify=TRUSTS_CERT)
    # the prompt's logprobs echoed in each of 8 choices: some 10 MB of JSON, more than the kernel's buffers take
    body = json.dumps({"prompt": [100] * 1900, "max_tokens": 1, "echo": True, "logprobs": 20, "n": 8}).encode()
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # the answer's megabytes stay unread
    raw.connect(("127.0.0.1", server.port))
    reader = TRUSTS_CERT.wrap_socket(raw, server_hostname="localhost")
    try:
        reader.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(3)   # the engine's part takes a fraction of that: the rest waits on this reader
        server.proc.send_signal(signal.SIGTERM)
        stopping = time.monotonic()
        assert server.proc.wait(15) == 1
        assert time.monotonic() - stopping < 8
        log = server.log_path.read_text(errors="replace")
        assert "cutting 1 responses that their clients are still reading" in log
        assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    finally:
        raw.close()
        server.stop()
