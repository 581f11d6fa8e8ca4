"""The image's HEALTHCHECK: GET /health on the port the server was started with.

The port and host come from the running ``tinyserve serve`` command line (the last
``--port``/``--host`` wins, as in argparse), so ``docker run IMAGE --port 8700`` is checked on
8700, not on the image's default 8321. Sends $TINYSERVE_API_KEY when set (for a server whose
--open-routes leave /health behind the key). Standard library only; exit 0 healthy, 1 not.
"""

import os
import sys
import urllib.request


def server_args() -> list[str]:
    for pid in sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if "serve" in argv and any(
            a.endswith("tinyserve") or a == "tinyserve.entrypoints.cli" for a in argv[:3]
        ):
            return argv
    return []


def option(argv: list[str], name: str, default: str) -> str:
    value = default
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def main() -> int:
    argv = server_args()
    port = option(argv, "--port", os.environ.get("TINYSERVE_PORT", "8321"))
    host = option(argv, "--host", "127.0.0.1")
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    req = urllib.request.Request(f"http://{host}:{port}/health")
    key = os.environ.get("TINYSERVE_API_KEY")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=4) as resp:
            return 0 if resp.status == 200 else 1
    except Exception as e:  # noqa: BLE001 - any failure is "unhealthy"
        print(f"unhealthy: {host}:{port}/health: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
