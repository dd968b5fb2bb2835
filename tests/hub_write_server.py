"""The Hugging Face Hub's write API for tests: a stdlib HTTP server in front of olah.

Repositories are bare git repositories, ``{mirrors}/{models|datasets|spaces}/{namespace}/{name}``,
the layout olah's offline mode serves (``mirrors-path``). This server answers what olah does not
(creating and deleting repositories, commits, branches, tags, listing, whoami) by running the git
CLI on those repositories, and forwards every other request to olah, so one endpoint serves
``HfApi``, ``snapshot_download`` and ``hf_hub_download`` alike.

Endpoints (``{repo}`` = ``{type}s/{namespace}/{name}``; writes need ``Authorization: Bearer
<token>``; errors carry the ``X-Error-Code`` huggingface_hub turns into its exceptions):

- ``GET /api/whoami-v2``
- ``POST /api/repos/create`` (an initial commit with ``.gitattributes``, as the Hub makes),
  ``DELETE /api/repos/delete``
- ``POST /api/validate-yaml`` (the README front matter must parse as a mapping)
- ``POST /api/{repo}/preupload/{rev}``: every file is uploaded ``regular`` (base64 inside the
  commit), ``oid`` is the git blob id at ``rev`` so unchanged files are skipped by the client
- ``POST /api/{repo}/commit/{branch}`` (NDJSON: ``header`` with ``parentCommit`` -> 412 when the
  branch moved, ``file``, ``deletedFile``, ``deletedFolder``)
- ``POST|DELETE /api/{repo}/branch/{branch}``, ``POST /api/{repo}/tag/{rev}``,
  ``DELETE /api/{repo}/tag/{tag}``
- ``GET /api/{type}s?filter=&search=&author=&sort=&direction=&limit=&full=&cardData=``: tags are
  the README card's ``tags`` plus its ``library_name``; every ``filter`` must be a tag
- Forwarded to olah: ``/api/{repo}`` (as ``/revision/main``: olah offline answers it only from its
  cache), ``revision``, ``tree``, ``paths-info``, ``commits``, ``refs``, ``resolve``. Before
  forwarding, a missing repository, revision or file is answered 404 ``RepoNotFound`` /
  ``RevisionNotFound`` / ``EntryNotFound`` as the Hub does (olah says 401 or 500), and ``tags``
  in revision answers is filled from the card (olah leaves it empty).

Not modelled: LFS and Xet uploads (``lfsFile`` is refused), pull requests, private repositories,
``.gitignore`` filtering, pagination, renames.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from huggingface_hub import RepoCard

AUTHOR = ("sgl-kvmap tests", "tests@sgl-kvmap.invalid")
NO_COMMIT = "0" * 40
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
TYPES = "models|datasets|spaces"
REPO = rf"/api/(?P<type>{TYPES})/(?P<ns>[^/]+)/(?P<name>[^/?]+)"
RESOLVE = (
    r"(/(?P<t>datasets|spaces))?/(?P<ns>[^/]+)/(?P<name>[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)"
)


class HubError(Exception):
    """An error answer: HTTP status, huggingface_hub's ``X-Error-Code`` and a message."""

    def __init__(self, status: int, code: str | None, message: str, **body):
        super().__init__(message)
        self.status, self.code, self.message, self.body = status, code, message, body


def not_found(code: str, what: str) -> HubError:
    return HubError(404, code, f"{what} not found")


class GitMirrors:
    """Bare git repositories under ``root/{type}/{namespace}/{name}``, committed by one author."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.lock = threading.Lock()
        self.env = {
            "GIT_AUTHOR_NAME": AUTHOR[0],
            "GIT_AUTHOR_EMAIL": AUTHOR[1],
            "GIT_COMMITTER_NAME": AUTHOR[0],
            "GIT_COMMITTER_EMAIL": AUTHOR[1],
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": "/dev/null",
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        }

    def path(self, repo_type: str, repo_id: str) -> Path:
        return self.root / repo_type / repo_id

    def run(self, repo: Path, *args: str, data: bytes | None = None, **env: str) -> bytes:
        """``git args`` on ``repo``: its standard output, or CalledProcessError."""
        environment = {**self.env, "GIT_DIR": str(repo), **env}
        return subprocess.run(
            ["git", *args], input=data, capture_output=True, env=environment, check=True
        ).stdout

    def git(self, repo: Path, *args: str, data: bytes | None = None, **env: str) -> str:
        return self.run(repo, *args, data=data, **env).decode().strip()

    def repo(self, repo_type: str, repo_id: str) -> Path:
        path = self.path(repo_type, repo_id)
        if not (path / "HEAD").is_file():
            raise not_found("RepoNotFound", f"Repository {repo_id}")
        return path

    def resolve(self, repo: Path, revision: str) -> str:
        try:
            return self.git(repo, "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}")
        except subprocess.CalledProcessError:
            raise not_found("RevisionNotFound", f"Revision {revision}") from None

    def object_type(self, repo: Path, sha: str, path: str) -> str | None:
        try:
            return self.git(repo, "cat-file", "-t", f"{sha}:{path}")
        except subprocess.CalledProcessError:
            return None

    def files(self, repo: Path, sha: str) -> dict[str, str]:
        """``path -> blob id`` of every file at commit ``sha``."""
        out = self.git(repo, "ls-tree", "-r", "-z", "--full-tree", sha)
        entries = (line.split("\t", 1) for line in out.split("\0") if line)
        return {path: meta.split()[2] for meta, path in entries}

    def read(self, repo: Path, sha: str, path: str) -> bytes | None:
        if self.object_type(repo, sha, path) != "blob":
            return None
        return self.run(repo, "cat-file", "blob", f"{sha}:{path}")

    def create(self, repo_type: str, repo_id: str) -> None:
        path = self.path(repo_type, repo_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.run(path, "init", "-q", "--bare", "-b", "main", str(path))
        self.commit(path, "main", {".gitattributes": GITATTRIBUTES}, [], "initial commit", None)

    def commit(
        self,
        repo: Path,
        branch: str,
        added: dict[str, bytes],
        deleted: list[str],
        message: str,
        expected_parent: str | None,
    ) -> str:
        """Commit ``added`` files and ``deleted`` paths (a trailing ``/`` deletes a folder)."""
        ref = f"refs/heads/{branch}"
        exists = self.git(repo, "for-each-ref", ref)
        parent = self.resolve(repo, ref) if exists else None
        if not exists and branch != "main":
            raise not_found("RevisionNotFound", f"Branch {branch}")
        if expected_parent is not None and expected_parent != parent:
            raise HubError(412, None, "A commit has happened since. Please refresh and try again.")
        files = self.files(repo, parent) if parent else {}
        for path in deleted:
            gone = [p for p in files if p == path or (path.endswith("/") and p.startswith(path))]
            if not gone:
                raise HubError(404, "EntryNotFound", f"A file with this name doesn't exist: {path}")
            for p in gone:
                del files[p]
        for path, content in added.items():
            if path.startswith("/") or ".." in path.split("/") or not path.strip("/"):
                raise HubError(400, None, f"invalid path in repo: {path!r}")
            files[path] = self.git(repo, "hash-object", "-w", "--stdin", data=content)
        with tempfile.TemporaryDirectory() as tmp:
            index = {"GIT_INDEX_FILE": f"{tmp}/index"}
            entries = "".join(f"100644 {oid}\t{path}\0" for path, oid in files.items())
            self.git(repo, "update-index", "-z", "--index-info", data=entries.encode(), **index)
            tree = self.git(repo, "write-tree", **index)
        parents = ["-p", parent] if parent else []
        sha = self.git(repo, "commit-tree", tree, *parents, "-m", message)
        self.git(repo, "update-ref", ref, sha, parent or NO_COMMIT)
        return sha

    def repo_ids(self, repo_type: str) -> list[str]:
        base = self.root / repo_type
        return sorted(
            f"{p.parent.name}/{p.name}" for p in base.glob("*/*") if (p / "HEAD").is_file()
        )


def card_data(text: str | None) -> dict:
    if not text:
        return {}
    return RepoCard(text, ignore_metadata_errors=True).data.to_dict()


def card_tags(data: dict) -> list[str]:
    tags = data.get("tags") or []
    tags = [tags] if isinstance(tags, str) else [str(t) for t in tags]
    library = data.get("library_name")
    return tags + ([library] if library and library not in tags else [])


def iso_date(seconds: str) -> str:
    moment = datetime.fromtimestamp(int(seconds), tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.000Z")


class HubHandler(BaseHTTPRequestHandler):
    """Routes write requests to ``self.server.mirrors`` and forwards the rest to olah."""

    protocol_version = "HTTP/1.1"
    server: HubWriteServer

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.dispatch()

    do_HEAD = do_POST = do_DELETE = do_PUT = do_GET

    ROUTES = [
        ("GET", r"/api/whoami-v2", "whoami"),
        ("POST", r"/api/repos/create", "create_repo"),
        ("DELETE", r"/api/repos/delete", "delete_repo"),
        ("POST", r"/api/validate-yaml", "validate_yaml"),
        ("GET", rf"/api/(?P<repo_type>{TYPES})", "list_repos"),
        ("POST", REPO + r"/preupload/(?P<rev>[^/]+)", "preupload"),
        ("POST", REPO + r"/commit/(?P<rev>[^/]+)", "commit"),
        ("POST", REPO + r"/branch/(?P<rev>[^/]+)", "create_branch"),
        ("DELETE", REPO + r"/branch/(?P<rev>[^/]+)", "delete_ref"),
        ("POST", REPO + r"/tag/(?P<rev>[^/]+)", "create_tag"),
        ("DELETE", REPO + r"/tag/(?P<rev>[^/]+)", "delete_ref"),
        ("GET|HEAD", REPO, "latest_info"),
        ("GET|HEAD", REPO + r"/revision/(?P<rev>[^/]+)", "revision_info"),
        ("GET", REPO + r"/commits/(?P<rev>[^/]+)", "commits"),
        ("GET|HEAD|POST", REPO + r"/(tree|paths-info)/(?P<rev>[^/]+)(?P<file>/.*)?", "read"),
        ("GET|HEAD", RESOLVE, "read"),
    ]

    def dispatch(self):
        url = urlsplit(self.path)
        self.query = parse_qs(url.query)
        self.body = self.read_body()
        try:
            for methods, pattern, name in self.ROUTES:
                match = re.fullmatch(pattern, url.path)
                if match and self.command in methods.split("|"):
                    return getattr(self, name)(**self.route_args(match))
            self.forward()
        except HubError as error:
            self.fail(error)
        except Exception as error:  # a bug here or in git: say so instead of dropping the line
            detail = getattr(error, "stderr", None) or b""
            self.fail(HubError(500, None, f"test Hub error: {error!r} {detail.decode()[-500:]}"))

    def fail(self, error: HubError) -> None:
        headers = {"X-Error-Message": error.message}
        if error.code:
            headers["X-Error-Code"] = error.code
        self.answer({"error": error.message, **error.body}, error.status, headers)

    def route_args(self, match: re.Match) -> dict:
        args = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
        if "ns" in args:
            repo_type = args.pop("type", None) or (args.pop("t", None) or "model") + "s"
            args["repo"] = self.server.mirrors.repo(
                repo_type, f"{args.pop('ns')}/{args.pop('name')}"
            )
        return args

    def read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            raise HubError(411, None, "chunked request bodies are not supported")
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def json(self) -> dict:
        return json.loads(self.body or b"{}")

    def answer(self, content, status: int = 200, headers: dict | None = None) -> None:
        data = json.dumps(content).encode()
        self.send_response(status)
        for key, value in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def require_token(self) -> None:
        given = self.headers.get("Authorization", "")
        if not given.startswith("Bearer "):
            raise HubError(401, None, "You must be authenticated to do this")
        if given.removeprefix("Bearer ") != self.server.token:
            raise HubError(401, None, "Invalid credentials in Authorization header")

    @property
    def base_url(self) -> str:
        return f"http://{self.headers.get('Host')}"

    def repo_url(self, repo_type: str, repo_id: str) -> str:
        prefix = "" if repo_type == "models" else f"/{repo_type}"
        return f"{self.base_url}{prefix}/{repo_id}"

    # --- accounts and repositories -------------------------------------------------------------

    def whoami(self):
        self.require_token()
        user = self.server.user
        token = {"displayName": "test-token", "role": "write"}
        auth = {"type": "access_token", "accessToken": token}
        self.answer(dict(type="user", name=user, fullname=user, orgs=[], auth=auth))

    def repo_of_payload(self) -> tuple[str, str]:
        payload = self.json()
        repo_type = (payload.get("type") or "model") + "s"
        namespace = payload.get("organization") or self.server.user
        return repo_type, f"{namespace}/{payload['name']}"

    def create_repo(self):
        self.require_token()
        repo_type, repo_id = self.repo_of_payload()
        url = self.repo_url(repo_type, repo_id)
        with self.server.mirrors.lock:
            if self.server.mirrors.path(repo_type, repo_id).exists():
                # the Hub's 409 names the repo's url, which create_repo(exist_ok=True) returns
                raise HubError(409, None, "You already created this repo", url=url)
            self.server.mirrors.create(repo_type, repo_id)
        self.answer({"url": url, "name": repo_id, "id": repo_id})

    def delete_repo(self):
        self.require_token()
        repo_type, repo_id = self.repo_of_payload()
        with self.server.mirrors.lock:
            shutil.rmtree(self.server.mirrors.repo(repo_type, repo_id))
        self.answer({})

    def validate_yaml(self):
        try:
            RepoCard(self.json().get("content", ""))
        except ValueError as error:
            self.answer({"errors": [{"message": str(error)}]}, 400)
            return
        self.answer({"errors": [], "warnings": []})

    def list_repos(self, repo_type: str):
        mirrors, query = self.server.mirrors, self.query
        wanted, search = query.get("filter", []), [s.lower() for s in query.get("search", [])]
        found = []
        for repo_id in mirrors.repo_ids(repo_type):
            if query.get("author", [repo_id.split("/")[0]])[0] != repo_id.split("/")[0]:
                continue
            if not all(s in repo_id.lower() for s in search):
                continue
            item = self.repo_item(mirrors.path(repo_type, repo_id), repo_id, "main")
            if item and set(wanted) <= set(item["tags"]):
                found.append(item)
        if sort := query.get("sort", [None])[0]:
            descending = query.get("direction", ["-1"])[0] == "-1"
            found.sort(key=lambda item: item.get(sort) or 0, reverse=descending)
        limit = int(query.get("limit", [len(found)])[0])
        for item in found:
            if "true" not in (query.get("full", []) + query.get("cardData", [])):
                item.pop("cardData")
            if "true" not in query.get("full", []):
                item.pop("siblings")
        self.answer(found[:limit])

    def repo_item(self, repo: Path, repo_id: str, revision: str) -> dict | None:
        mirrors = self.server.mirrors
        try:
            sha = mirrors.resolve(repo, revision)
        except HubError:
            return None
        data = card_data((mirrors.read(repo, sha, "README.md") or b"").decode())
        first = mirrors.git(repo, "rev-list", "--max-parents=0", "--format=%ct", sha).split()[-1]
        last = mirrors.git(repo, "log", "-1", "--format=%ct", sha)
        siblings = [{"rfilename": p} for p in mirrors.files(repo, sha)]
        item = dict(id=repo_id, _id=repo_id, modelId=repo_id, author=repo_id.split("/")[0], sha=sha)
        item.update(private=False, downloads=0, likes=0, tags=card_tags(data), cardData=data)
        item.update(lastModified=iso_date(last), createdAt=iso_date(first), siblings=siblings)
        return {**item, "library_name": data.get("library_name")}

    # --- commits and refs ------------------------------------------------------------------------

    def preupload(self, repo: Path, rev: str):
        self.require_token()
        mirrors = self.server.mirrors
        sha = mirrors.resolve(repo, rev)
        current = mirrors.files(repo, sha)
        paths = [f["path"] for f in self.json()["files"]]
        files = [
            dict(path=p, uploadMode="regular", shouldIgnore=False, oid=current.get(p))
            for p in paths
        ]
        self.answer({"files": files, "commitOid": sha})

    def commit(self, repo: Path, rev: str):
        self.require_token()
        if self.query.get("create_pr"):
            raise HubError(501, None, "pull requests are not implemented by the test Hub")
        lines = [json.loads(line) for line in self.body.splitlines() if line.strip()]
        header, added, deleted = {}, {}, []
        for line in lines:
            key, value = line["key"], line["value"]
            if key == "header":
                header = value
            elif key == "file" and value.get("encoding") == "base64":
                added[value["path"]] = base64.b64decode(value["content"])
            elif key in ("deletedFile", "deletedFolder"):
                deleted.append(value["path"].rstrip("/") + ("/" if key == "deletedFolder" else ""))
            else:
                raise HubError(400, None, f"{key} operations are not implemented by the test Hub")
        message = header.get("summary", "")
        if header.get("description"):
            message += "\n\n" + header["description"]
        with self.server.mirrors.lock:
            sha = self.server.mirrors.commit(
                repo, rev, added, deleted, message, header.get("parentCommit")
            )
        url = f"{self.repo_url(repo.parent.parent.name, self.repo_id(repo))}/commit/{sha}"
        self.answer({"success": True, "commitOid": sha, "commitUrl": url, "pullRequestUrl": None})

    def repo_id(self, repo: Path) -> str:
        return f"{repo.parent.name}/{repo.name}"

    def create_ref(self, repo: Path, ref: str, start: str, message: str | None = None) -> None:
        mirrors = self.server.mirrors
        sha = mirrors.resolve(repo, start)
        with mirrors.lock:
            if mirrors.git(repo, "for-each-ref", ref):
                raise HubError(409, None, f"{ref} already exists")
            if message:
                mirrors.git(repo, "tag", "-a", "-m", message, ref.removeprefix("refs/tags/"), sha)
            else:
                mirrors.git(repo, "update-ref", ref, sha, NO_COMMIT)
        self.answer({})

    def create_branch(self, repo: Path, rev: str):
        self.require_token()
        self.create_ref(repo, f"refs/heads/{rev}", self.json().get("startingPoint") or "main")

    def create_tag(self, repo: Path, rev: str):
        self.require_token()
        payload = self.json()
        self.create_ref(repo, f"refs/tags/{payload['tag']}", rev, payload.get("message"))

    def delete_ref(self, repo: Path, rev: str):
        self.require_token()
        kind = "heads" if "/branch/" in self.path else "tags"
        mirrors = self.server.mirrors
        with mirrors.lock:
            if not mirrors.git(repo, "for-each-ref", f"refs/{kind}/{rev}"):
                raise not_found("RevisionNotFound", f"Revision {rev}")
            mirrors.git(repo, "update-ref", "-d", f"refs/{kind}/{rev}")
        self.answer({})

    # --- reads, checked here and served by olah ------------------------------------------------

    def latest_info(self, repo: Path):
        self.revision_info(repo, "main", self.path.split("?")[0] + "/revision/main")

    def revision_info(self, repo: Path, rev: str, path: str | None = None):
        self.server.mirrors.resolve(repo, rev)
        status, headers, data = self.olah(path)
        if status == 200 and data:
            info = json.loads(data)
            info["tags"] = card_tags(info.get("cardData") or {})
            data = json.dumps(info).encode()
            headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
        self.relay(status, headers, data)

    def commits(self, repo: Path, rev: str):
        """Answered here: olah's commit items lack the ``authors[].user`` huggingface_hub reads."""
        sha = self.server.mirrors.resolve(repo, rev)
        log = self.server.mirrors.git(repo, "log", "-z", "--format=%H%n%an%n%ct%n%s%n%b", sha)
        items = []
        for entry in filter(None, log.split("\0")):
            commit, author, seconds, title, body = (entry.strip("\n") + "\n").split("\n", 4)
            authors = [{"user": author, "avatar": None}]
            date = iso_date(seconds)
            items.append(
                dict(id=commit, title=title, message=body.strip(), authors=authors, date=date)
            )
        self.answer(items)

    def read(self, repo: Path, rev: str, file: str | None = None):
        sha = self.server.mirrors.resolve(repo, rev)
        path = (file or "").strip("/")
        kind = self.server.mirrors.object_type(repo, sha, path) if path else "tree"
        if kind is None or ("/resolve/" in self.path and kind != "blob"):
            raise not_found("EntryNotFound", f"{path} at {rev}")
        url = urlsplit(self.path)
        tree_root = "/tree/" in url.path and not file  # olah routes /tree/{rev}/ only
        self.forward(url.path + "/" + (f"?{url.query}" if url.query else "") if tree_root else None)

    def olah(self, path: str | None = None) -> tuple[int, list, bytes]:
        connection = http.client.HTTPConnection(*self.server.olah_address, timeout=60)
        skip = {"host", "connection", "keep-alive", "transfer-encoding", "content-length"}
        headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
        try:
            connection.request(self.command, path or self.path, body=self.body, headers=headers)
            response = connection.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            connection.close()

    def forward(self, path: str | None = None) -> None:
        self.relay(*self.olah(path))

    def relay(self, status: int, headers: list, data: bytes) -> None:
        send_relayed(self, status, headers, data)


HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "server", "date", "content-length"}


def send_relayed(handler: BaseHTTPRequestHandler, status: int, headers: list, data: bytes) -> None:
    """Answer ``handler``'s request with an upstream answer (status, headers, body), its
    hop-by-hop headers dropped and its length recomputed (a HEAD keeps the upstream's)."""
    handler.send_response(status)
    length = str(len(data))
    for key, value in headers:
        if key.lower() == "content-length" and handler.command == "HEAD":
            length = value
        elif key.lower() not in HOP_HEADERS:
            handler.send_header(key, value)
    handler.send_header("Content-Length", length)
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(data)


class HubWriteServer(ThreadingHTTPServer):
    """The test Hub on ``127.0.0.1``: writes into ``mirrors``, reads forwarded to olah."""

    daemon_threads = True

    def __init__(self, mirrors: Path, olah_address: tuple[str, int], token: str, user: str):
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.mirrors = GitMirrors(mirrors)
        self.olah_address, self.token, self.user = olah_address, token, user

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start(self) -> HubWriteServer:
        threading.Thread(target=self.serve_forever, daemon=True, name="test-hub").start()
        return self
