"""A stand-in for the Hugging Face Hub on localhost, for test_hub.py: the endpoints huggingface_hub's snapshot_download
calls (a repo's revision, its file tree, then a HEAD and a GET of each file, answered with the X-Repo-Commit and ETag
headers it needs), and the answers the Hub gives for a gated repo (401, X-Error-Code GatedRepo, when its licence is
not accepted) and a missing one (404, RepoNotFound). huggingface_hub picks its error class by X-Error-Code alone."""

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

API = re.compile(r"/api/(model|dataset)s/([^/]+/[^/]+)/(revision|tree)/([^/]+)")
RESOLVE = re.compile(r"/(datasets/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)")


class FakeHub:
    """repos: {(kind, "owner/name"): {"files": {path: bytes}, "gated": bool}}, kind "model" or "dataset"; served at
    self.url until close(). self.fetched lists the files that were downloaded (GET)."""

    def __init__(self, repos):
        self.repos, self.fetched = {}, []
        for key, spec in repos.items():
            commit = hashlib.sha1(repr((key, sorted(spec["files"].items()))).encode()).hexdigest()
            self.repos[key] = dict(spec, commit=commit)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.hub, self.server.daemon_threads = self, True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def send(self, code, body, headers=()):
        body = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        for key, value in [("Content-Length", str(len(body))), *headers]:
            self.send_header(key, value)
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    def error(self, code, kind, message):
        self.send(code, {"error": message}, [("X-Error-Code", kind), ("X-Error-Message", message)])

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        path, hub = unquote(urlsplit(self.path).path), self.server.hub
        api, resolve = API.fullmatch(path), RESOLVE.fullmatch(path)
        if not (api or resolve):
            return self.error(404, "EntryNotFound", f"no route for {path}")
        kind = api[1] if api else "dataset" if resolve[1] else "model"
        repo_id = (api or resolve)[2]
        repo = hub.repos.get((kind, repo_id))
        if repo is None:
            return self.error(404, "RepoNotFound", "Repository not found")
        if api and api[3] == "revision":
            return self.send(200, {"id": repo_id, "sha": repo["commit"], "gated": "manual" if repo["gated"] else False})
        if api:  # the whole tree, files and the folders they sit in
            files = [{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                     for p, b in sorted(repo["files"].items())]  # fmt: skip
            folders = {p.rsplit("/", 1)[0] for p in repo["files"] if "/" in p}
            return self.send(200, files + [{"type": "directory", "path": d, "oid": "0" * 40} for d in sorted(folders)])
        if repo["gated"]:
            return self.error(401, "GatedRepo", f"Access to {kind} {repo_id} is restricted: accept its conditions.")
        if (name := resolve[4]) not in repo["files"]:
            return self.error(404, "EntryNotFound", "Entry not found")
        body = repo["files"][name]
        hub.fetched += [f"{repo_id}/{name}"] if self.command == "GET" else []
        self.send(200, body, [("X-Repo-Commit", repo["commit"]), ("ETag", f'"{hashlib.sha256(body).hexdigest()}"')])
