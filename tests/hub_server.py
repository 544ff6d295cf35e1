"""A local stand-in for the Hugging Face Hub's HTTP API, so that publishing is tested over real HTTP.

It speaks the subset of the API that `huggingface_hub` and `transformers` use to create a repo, commit files and
download them again: `POST /api/repos/create`, `POST /api/validate-yaml`, the `preupload` call (every file is answered
`regular`, so its content travels inline in the NDJSON commit and no LFS or Xet storage is involved), the NDJSON
`commit`, and `HEAD` / `GET` on `resolve` URLs with the `X-Repo-Commit` and `ETag` headers the download cache keys on.
Errors carry the `X-Error-Code` header that `huggingface_hub` maps to its exception types. Requests to any other
route are answered 404 and recorded in `FakeHub.unhandled`, so a test notices when the clients start calling
something this server does not implement.

Writes need `Authorization: Bearer FakeHub.TOKEN`; `fail_next` makes one call of an endpoint fail with a status code.
"""

import base64
import hashlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
import yaml
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

REPO_KINDS = {"models": "model", "datasets": "dataset", "spaces": "space"}
URL_PREFIXES = {"model": "", "dataset": "datasets/", "space": "spaces/"}


@dataclass
class FakeRepo:
    repo_type: str
    private: bool
    sdk: str | None = None
    commits: list[tuple[str, dict[str, bytes]]] = field(default_factory=list)  # (oid, full snapshot), oldest first

    def snapshot(self, revision: str) -> tuple[str, dict[str, bytes]] | None:
        if revision == "main":
            return self.commits[-1]
        return next((commit for commit in self.commits if commit[0] == revision), None)


def git_blob_oid(content: bytes) -> str:
    """The id git (and the Hub, as the ETag of a regular file) gives a file's content."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def error(status: int, message: str, code: str | None = None, **headers) -> JSONResponse:
    headers = {"X-Error-Message": message, **headers}
    if code is not None:
        headers["X-Error-Code"] = code
    return JSONResponse({"error": message}, status_code=status, headers=headers)


class FakeHub:
    USER = "osprey-tester"
    TOKEN = "hf_osprey_test_token"

    def __init__(self):
        self.repos: dict[tuple[str, str], FakeRepo] = {}
        self.failures: dict[str, int] = {}
        self.unhandled: list[str] = []
        self.url = None
        self.app = self._build_app()

    def files(self, repo_id: str, repo_type: str = "model") -> dict[str, bytes]:
        """The files of `repo_id` at its latest commit."""
        return dict(self.repos[repo_type, repo_id].commits[-1][1])

    def fail_next(self, endpoint: str, status: int) -> None:
        """Answer the next call of `endpoint` ("create", "preupload", "commit" or "resolve") with `status`."""
        self.failures[endpoint] = status

    @contextmanager
    def serving(self) -> Iterator[str]:
        """Serves the API on a free port of 127.0.0.1 from a background thread; yields its base URL."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("The fake Hub server did not start.")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        try:
            yield self.url
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            sock.close()

    # --- helpers shared by the routes ----------------------------------------------------------------------------

    def _injected_failure(self, endpoint: str) -> Response | None:
        status = self.failures.pop(endpoint, None)
        return None if status is None else error(status, f"injected failure of {endpoint}")

    def _authorized(self, request: Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {self.TOKEN}"

    def _unauthorized(self) -> Response:
        return error(401, "Invalid credentials in Authorization header")

    def _readable_repo(self, request: Request, repo_type: str, repo_id: str) -> FakeRepo | Response:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None or (repo.private and not self._authorized(request)):
            return error(404, "Repository not found", "RepoNotFound")
        return repo

    # --- routes --------------------------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/api/repos/create")
        async def create_repo(request: Request):
            if (failure := self._injected_failure("create")) is not None:
                return failure
            if not self._authorized(request):
                return self._unauthorized()
            body = await request.json()
            repo_type = body.get("type") or "model"
            repo_id = f"{body.get('organization') or self.USER}/{body['name']}"
            url = f"{self.url}/{URL_PREFIXES[repo_type]}{repo_id}"
            if (repo_type, repo_id) in self.repos:
                return JSONResponse({"error": "You already created this repo", "url": url}, status_code=409)
            if repo_type == "space" and not body.get("sdk"):
                return error(400, "A Space needs an sdk")
            initial = {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"}
            repo = FakeRepo(repo_type, private=body.get("visibility") == "private", sdk=body.get("sdk"))
            repo.commits.append((hashlib.sha1(repo_id.encode()).hexdigest(), initial))
            self.repos[repo_type, repo_id] = repo
            return {"url": url, "name": repo_id}

        @app.post("/api/validate-yaml")
        async def validate_yaml(request: Request):
            content = (await request.json())["content"]
            parts = content.split("---\n")
            try:
                metadata = yaml.safe_load(parts[1]) if content.startswith("---\n") and len(parts) > 2 else {}
            except yaml.YAMLError as exc:
                return JSONResponse({"errors": [{"message": str(exc)}]}, status_code=400)
            if not isinstance(metadata, dict):
                return JSONResponse({"errors": [{"message": "metadata must be a mapping"}]}, status_code=400)
            return {"errors": [], "warnings": []}

        @app.post("/api/{kind}/{namespace}/{name}/preupload/{revision}")
        async def preupload(kind: str, namespace: str, name: str, revision: str, request: Request):
            if (failure := self._injected_failure("preupload")) is not None:
                return failure
            if not self._authorized(request):
                return self._unauthorized()
            repo = self._readable_repo(request, REPO_KINDS.get(kind, kind), f"{namespace}/{name}")
            if isinstance(repo, Response):
                return repo
            files = (await request.json())["files"]
            return {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}

        @app.post("/api/{kind}/{namespace}/{name}/commit/{revision}")
        async def commit(kind: str, namespace: str, name: str, revision: str, request: Request):
            if (failure := self._injected_failure("commit")) is not None:
                return failure
            if not self._authorized(request):
                return self._unauthorized()
            repo_id = f"{namespace}/{name}"
            repo = self._readable_repo(request, REPO_KINDS.get(kind, kind), repo_id)
            if isinstance(repo, Response):
                return repo
            if repo.snapshot(revision) is None:
                return error(404, f"Revision {revision} not found", "RevisionNotFound")
            files = dict(repo.commits[-1][1])
            for line in (await request.body()).splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                elif item["key"] == "deletedFile":
                    files.pop(item["value"]["path"], None)
                elif item["key"] != "header":
                    return error(400, f"This fake Hub does not support {item['key']!r} commit operations")
            oid = hashlib.sha1(repo.commits[-1][0].encode() + json.dumps(sorted(files)).encode()).hexdigest()
            repo.commits.append((oid, files))
            prefix = URL_PREFIXES[repo.repo_type]
            return {"commitUrl": f"{self.url}/{prefix}{repo_id}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}

        @app.get("/api/agent-harnesses")
        async def agent_harnesses():  # huggingface_hub's user-agent detection; no harness is registered here
            return {"standardEnvVars": [], "harnesses": {}}

        @app.get("/api/{kind}/{namespace}/{name}")
        @app.get("/api/{kind}/{namespace}/{name}/revision/{revision}")
        async def repo_info(kind: str, namespace: str, name: str, request: Request, revision: str = "main"):
            repo_id = f"{namespace}/{name}"
            repo = self._readable_repo(request, REPO_KINDS.get(kind, kind), repo_id)
            if isinstance(repo, Response):
                return repo
            if (snapshot := repo.snapshot(revision)) is None:
                return error(404, f"Revision {revision} not found", "RevisionNotFound")
            oid, files = snapshot
            siblings = [{"rfilename": path} for path in sorted(files)]
            return {"id": repo_id, "sha": oid, "private": repo.private, "sdk": repo.sdk, "siblings": siblings}

        @app.get("/api/{kind}/{namespace}/{name}/tree/{revision}")
        @app.get("/api/{kind}/{namespace}/{name}/tree/{revision}/{path:path}")
        async def tree(kind: str, namespace: str, name: str, revision: str, request: Request, path: str = ""):
            repo = self._readable_repo(request, REPO_KINDS.get(kind, kind), f"{namespace}/{name}")
            if isinstance(repo, Response):
                return repo
            if (snapshot := repo.snapshot(revision)) is None:
                return error(404, f"Revision {revision} not found", "RevisionNotFound")
            prefix = f"{path.strip('/')}/" if path.strip("/") else ""
            recursive = request.query_params.get("recursive", "").lower() == "true"
            entries = {}
            for file, content in sorted(snapshot[1].items()):
                if not file.startswith(prefix):
                    continue
                parts = file[len(prefix) :].split("/")
                for depth in range(1, len(parts) if recursive else min(len(parts), 2)):
                    folder = prefix + "/".join(parts[:depth])
                    entries[folder] = {"type": "directory", "path": folder, "oid": git_blob_oid(folder.encode())}
                if recursive or len(parts) == 1:
                    entries[file] = {"type": "file", "path": file, "size": len(content), "oid": git_blob_oid(content)}
            if prefix and not entries:
                return error(404, f"{path} does not exist on {revision}", "EntryNotFound")
            return list(entries.values())

        async def resolve(request: Request, repo_type: str, repo_id: str, revision: str, path: str):
            if (failure := self._injected_failure("resolve")) is not None:
                return failure
            repo = self._readable_repo(request, repo_type, repo_id)
            if isinstance(repo, Response):
                return repo
            snapshot = repo.snapshot(revision)
            if snapshot is None:
                return error(404, f"Revision {revision} not found", "RevisionNotFound")
            oid, files = snapshot
            if path not in files:
                return error(404, f"{path} not found", "EntryNotFound", **{"X-Repo-Commit": oid})
            content = files[path]
            return Response(content, headers={"X-Repo-Commit": oid, "ETag": f'"{git_blob_oid(content)}"'})

        @app.api_route("/{namespace}/{name}/resolve/{revision}/{path:path}", methods=["GET", "HEAD"])
        async def resolve_model_file(namespace: str, name: str, revision: str, path: str, request: Request):
            return await resolve(request, "model", f"{namespace}/{name}", revision, path)

        @app.api_route("/{kind}/{namespace}/{name}/resolve/{revision}/{path:path}", methods=["GET", "HEAD"])
        async def resolve_other_file(kind: str, namespace: str, name: str, revision: str, path: str, request: Request):
            return await resolve(request, REPO_KINDS.get(kind, kind), f"{namespace}/{name}", revision, path)

        @app.api_route("/{path:path}", methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"])
        async def unhandled(path: str, request: Request):
            self.unhandled.append(f"{request.method} /{path}")
            return error(404, f"The fake Hub does not implement {request.method} /{path}")

        return app
