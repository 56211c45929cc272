"""A local stand-in for the Hugging Face Hub, the parts ``huggingface_hub`` 2.x asks for when it
pulls one file, so pulls are tested with no internet (``HF_ENDPOINT`` points here).

Run as a process: ``python tests/fakes/hub_server.py CONFIG.json``; it prints its port on the
first line of stdout and serves until killed. It serves one request at a time (HTTP/1.0, one
connection per request), so it needs no threads. CONFIG is::

    {"repos": {"owner/name": {"file.gguf": "/path/of/its/bytes", ...}},
     "control": "/path/of/faults.json", "log": "/path/of/requests.jsonl"}

The Hub's API shape it serves (what the library reads, in ``hf_api.model_info`` and
``file_download.get_hf_file_metadata`` / ``http_get``):

- ``GET /api/models/<repo>/revision/<rev>``: ``{"id", "sha", "siblings": [{"rfilename",
  "size", "lfs": {"sha256", "size", "pointerSize"}}]}``.
- ``HEAD|GET /<repo>/resolve/<rev>/<file>``: ``X-Repo-Commit``; ``ETag`` and, as for LFS files,
  ``X-Linked-Etag`` (the sha256) and ``X-Linked-Size``; ``Content-Length``; a ``Range:
  bytes=N-`` GET is answered 206 with ``Content-Range``. Unknown repos and files are 404 with
  ``X-Error-Code`` as the Hub sends.

Faults, read from the control file (JSON) before every file GET, each consumed once it has
acted: ``{"drop_after": N}`` sends the headers of the whole file, then N bytes, then closes the
connection; ``{"fail_next": K}`` answers the next K file GETs (after that drop, if any) with 503; ``{"wrong_etag": true}``
announces a checksum the bytes do not have. Hostile answers (kept until changed): ``{"etag":
"../../x"}`` and ``{"commit": "..."}`` replace the ETag and ``X-Repo-Commit`` of every file
answer; ``{"extra_siblings": ["../../y.gguf"]}`` adds those names to the repo's listing. Every request is appended to the log file as a
JSON line ``{"method", "path", "range"}``.
"""

from __future__ import annotations

import hashlib
import json
import socket
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    config: dict

    def log_message(self, format: str, *args: object) -> None:  # keep stderr quiet
        pass

    def _record(self) -> None:
        with open(self.config["log"], "a") as log:
            log.write(json.dumps({"method": self.command, "path": self.path,
                                  "range": self.headers.get("Range")}) + "\n")

    def _faults(self) -> dict:
        path = Path(self.config["control"])
        return json.loads(path.read_text()) if path.exists() else {}

    def _set_faults(self, faults: dict) -> None:
        Path(self.config["control"]).write_text(json.dumps(faults))

    def _json(self, status: int, body: object, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _not_found(self, code: str) -> None:
        self._json(404, {"error": f"{code}: not found"}, {"X-Error-Code": code,
                                                         "X-Repo-Commit": COMMIT})

    def do_GET(self) -> None:
        self._record()
        path = unquote(urlparse(self.path).path)
        if path.startswith("/api/models/"):
            return self._model_info(path[len("/api/models/"):])
        if "/resolve/" in path:
            return self._file(path)
        self._not_found("RepoNotFound")

    do_HEAD = do_GET

    def _model_info(self, rest: str) -> None:
        repo_id, _, _ = rest.partition("/revision/")
        files = self.config["repos"].get(repo_id)
        if files is None:
            return self._not_found("RepoNotFound")
        siblings = [{"rfilename": name, "size": 7} for name in self._faults().get("extra_siblings", [])]
        for name, source in files.items():
            data = Path(source).read_bytes()
            siblings.append({"rfilename": name, "size": len(data),
                             "lfs": {"sha256": hashlib.sha256(data).hexdigest(),
                                     "size": len(data), "pointerSize": 134}})
        self._json(200, {"id": repo_id, "sha": COMMIT, "siblings": siblings})

    def _file(self, path: str) -> None:
        repo_id, _, rest = path.lstrip("/").partition("/resolve/")
        _, _, filename = rest.partition("/")
        files = self.config["repos"].get(repo_id)
        if files is None:
            return self._not_found("RepoNotFound")
        if filename not in files:
            return self._not_found("EntryNotFound")
        data = Path(files[filename]).read_bytes()
        faults = self._faults()
        sha = hashlib.sha256(data).hexdigest()
        if faults.get("wrong_etag"):
            sha = hashlib.sha256(b"other bytes").hexdigest()
        if self.command == "GET" and faults.get("fail_next", 0) > 0 and "drop_after" not in faults:
            self._set_faults(faults | {"fail_next": faults["fail_next"] - 1})
            return self._json(503, {"error": "unavailable"})
        start = 0
        wanted = self.headers.get("Range")
        if wanted and wanted.startswith("bytes=") and wanted.endswith("-"):
            start = int(wanted[len("bytes="):-1])
        etag = faults.get("etag", sha)
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", faults.get("commit", COMMIT))
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Linked-Etag", f'"{etag}"')
        self.send_header("X-Linked-Size", str(len(data)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if self.command == "HEAD":
            return
        body = data[start:]
        drop_after = faults.get("drop_after")
        if drop_after is not None:
            self._set_faults({k: v for k, v in faults.items() if k != "drop_after"})
            self.wfile.write(body[:drop_after])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)  # mid-body: the client sees it cut
            return
        self.wfile.write(body)


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    HubHandler.config = config
    server = HTTPServer(("127.0.0.1", 0), HubHandler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
