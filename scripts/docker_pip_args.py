"""This host's pip settings as ``docker build`` arguments (scripts/docker_smoke.sh uses it).

Reads the settings pip itself uses (``pip config list``: the global, user, site and PIP_*
environment scopes, the highest one winning per key, as pip does) and turns them into
``--build-arg PIP_INDEX_URL=...`` / ``PIP_EXTRA_INDEX_URL`` / ``PIP_FIND_LINKS`` /
``PIP_TRUSTED_HOST`` and ``--secret id=pip_cert,src=...`` (the CA bundle, mounted for the
install step only, never stored in a layer). Nothing of them is written into the repository.

An index or find-links folder on this machine's disk (``file://...`` or a plain path) is not
visible inside the build, so it is served read-only over HTTP on 127.0.0.1 for as long as
this process runs (the build runs with ``--network host``), and its build argument names
that loopback address instead.

    python3 scripts/docker_pip_args.py ARGS_FILE    # writes the arguments, one a line; serves until
                                            # SIGTERM/SIGINT (only when a folder needs serving)
"""

from __future__ import annotations

import functools
import http.server
import re
import signal
import socketserver
import subprocess
import sys
import threading
import zlib
from pathlib import Path
from urllib.parse import unquote, urlparse

SCOPES = {"global": 0, "user": 1, "site": 2, ":env:": 3}  # pip's order: later wins
KEYS = ("index-url", "extra-index-url", "find-links", "trusted-host", "cert")


def pip_settings() -> dict[str, str]:
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True, check=False).stdout  # fmt: skip
    best: dict[str, tuple[int, str]] = {}
    for line in out.splitlines():
        m = re.match(r"^(:env:|global|user|site)\.([a-z-]+)='(.*)'$", line.strip())
        if not m or m.group(2) not in KEYS:
            continue
        rank = SCOPES[m.group(1)]
        if m.group(2) not in best or rank >= best[m.group(2)][0]:
            best[m.group(2)] = (rank, m.group(3))
    return {k: v for k, (_, v) in best.items()}


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True  # the last run's connections in TIME_WAIT keep the port


class Mounts:
    """Local folders served under /0, /1, ... of one loopback HTTP server."""

    def __init__(self) -> None:
        self.roots: list[Path] = []

    def url(self, value: str, index: bool) -> str:
        """``value`` as a URL the build can reach: remote URLs unchanged; a local folder
        served (an index's parent too, for its ``../../files/`` links)."""
        if re.match(r"^https?://", value):
            return value
        path = Path(unquote(urlparse(value).path) if value.startswith("file:") else value)
        if not path.exists():
            return ""
        root = path.parent if index else path
        if root not in self.roots:
            self.roots.append(root)
        rel = path.name + "/" if index else ""
        return f"http://127.0.0.1:{{port}}/{self.roots.index(root)}/{rel}"

    def stable_port(self) -> int:
        """The same port for the same folders, run after run: the build arguments that name it
        stay the same, so Docker reuses the layers built with them (a new port each run made
        the torch layer reinstall, ~75 s, in every smoke and CUDA build)."""
        digest = zlib.crc32("\n".join(map(str, self.roots)).encode())
        return 20000 + digest % 20000

    def serve(self) -> int:
        roots = self.roots

        class Handler(http.server.SimpleHTTPRequestHandler):
            def translate_path(self, path: str) -> str:
                parts = urlparse(path).path.lstrip("/").split("/", 1)
                if not parts[0].isdigit() or int(parts[0]) >= len(roots):
                    return "/nonexistent"
                rest = unquote(parts[1] if len(parts) > 1 else "")
                target = (roots[int(parts[0])] / rest).resolve()
                if not str(target).startswith(str(roots[int(parts[0])].resolve())):
                    return "/nonexistent"
                return str(target)

            def log_message(self, *args) -> None:
                pass

        try:
            server = _Server(("127.0.0.1", self.stable_port()), functools.partial(Handler))
        except OSError:  # in use: any free port
            server = _Server(("127.0.0.1", 0), functools.partial(Handler))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server.server_address[1]


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    settings = pip_settings()
    mounts = Mounts()
    args: dict[str, str] = {}
    if "index-url" in settings:
        args["PIP_INDEX_URL"] = mounts.url(settings["index-url"], index=True)
    if "extra-index-url" in settings:
        urls = [mounts.url(u, index=True) for u in settings["extra-index-url"].split()]
        args["PIP_EXTRA_INDEX_URL"] = " ".join(u for u in urls if u)
    if "find-links" in settings:
        urls = [mounts.url(u, index=False) for u in settings["find-links"].split()]
        args["PIP_FIND_LINKS"] = " ".join(u for u in urls if u)
    trusted = settings.get("trusted-host", "").split()
    port = 0
    if mounts.roots:
        port = mounts.serve()
        trusted.append("127.0.0.1")
    if trusted:
        args["PIP_TRUSTED_HOST"] = " ".join(trusted)
    lines = [f"--build-arg={k}={v.format(port=port)}" for k, v in args.items() if v]
    cert = settings.get("cert")
    if cert and Path(cert).is_file():
        lines.append(f"--secret=id=pip_cert,src={cert}")
    Path(sys.argv[1]).write_text("".join(line + "\n" for line in lines))
    served = ", ".join(str(r) for r in mounts.roots) or "nothing"
    print(f"pip_args: {len(lines)} build arguments; serving {served} on 127.0.0.1:{port}",
          file=sys.stderr, flush=True)  # fmt: skip
    if not mounts.roots:
        return 0
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
