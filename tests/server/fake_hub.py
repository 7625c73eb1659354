"""A Hugging Face Hub on 127.0.0.1 for tests: the few routes `huggingface_hub.snapshot_download`
reads (a revision's commit, the file tree, each file), over repositories made of local files."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """`repos` maps a repository id to its files (name -> bytes); `gated` ids answer 403 as a gated
    repository does. `requests` records (method, path) of every request."""

    def __init__(self, repos: dict[str, dict[str, bytes]], gated: tuple[str, ...] = ()) -> None:
        self.repos, self.gated = repos, gated
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:   # noqa: N802 - http.server's name
                hub.requests.append((self.command, self.path))
                status, body, headers = hub.answer(self.path.split("?")[0])
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_HEAD = do_GET

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def downloaded(self) -> set[str]:
        """Names of the files whose bytes were fetched."""
        return {path.rsplit("/", 1)[1] for method, path in self.requests if method == "GET" and "/resolve/" in path}

    def answer(self, path: str) -> tuple[int, bytes, dict[str, str]]:
        for repo_id, files in self.repos.items():
            if repo_id in self.gated and repo_id in path:
                return 403, b"", {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to this repo is restricted"}
            if path.startswith(f"/api/models/{repo_id}/revision/"):
                revision = path.rsplit("/", 1)[1]
                if revision not in ("main", COMMIT):
                    return 404, b"", {"X-Error-Code": "RevisionNotFound"}
                return self._json({"id": repo_id, "sha": COMMIT, "siblings": [{"rfilename": f} for f in files]})
            if path.startswith(f"/api/models/{repo_id}/tree/"):
                return self._json([{"type": "file", "path": name, "size": len(data),
                                    "oid": hashlib.sha1(data).hexdigest()} for name, data in files.items()])
            if path.startswith(f"/{repo_id}/resolve/"):
                data = files.get(path.rsplit("/", 1)[1])
                if data is None:
                    return 404, b"", {"X-Error-Code": "EntryNotFound"}
                return 200, data, {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                                   "Content-Type": "application/octet-stream"}
        return 404, b"", {"X-Error-Code": "RepoNotFound"}

    @staticmethod
    def _json(value) -> tuple[int, bytes, dict[str, str]]:
        return 200, json.dumps(value).encode(), {"Content-Type": "application/json"}


def folder_files(folder: str | Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in Path(folder).iterdir() if p.is_file()}
