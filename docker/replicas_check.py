"""docker/compose.replicas.yaml under load: stopping one replica loses no request.

Run by ``scripts/docker_smoke.sh --replicas`` (after the image is built):

    python3 docker/replicas_check.py LOG_DIR

Builds the load balancer (docker/Dockerfile.lb on $BASE_IMAGE), brings up two replicas of
$IMAGE and HAProxy with docker-compose (or ``docker compose``), waits until HAProxy counts
both replicas up, then keeps CLIENTS clients sending short chat completions through it while
replica-1 is stopped (SIGTERM, as ``docker compose stop`` sends) and later started again.
Every request must succeed: the ones replica-1 had started drain there, the ones it had not
started go to replica-2 (haproxy.cfg: retry-on, redispatch). HAProxy must also mark the
stopped replica DOWN from its /health checks. Standard library only; exit 0 on success.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker" / "compose.replicas.yaml"
PROJECT = "tinyserve-replicas"
LB_PORT = int(os.environ.get("REPLICAS_LB_PORT", "8797"))
STATS_PORT = int(os.environ.get("REPLICAS_STATS_PORT", "8796"))
CLIENTS = 4


def compose_cmd() -> list[str]:
    """Compose v2 (the docker CLI plugin) where it answers, else docker-compose 1.29 (what
    apt gives); TINYSERVE_COMPOSE (e.g. "docker-compose") picks one."""
    if os.environ.get("TINYSERVE_COMPOSE"):
        return os.environ["TINYSERVE_COMPOSE"].split()
    v2 = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
    if v2.returncode == 0 or not shutil.which("docker-compose"):
        return ["docker", "compose"]
    return ["docker-compose"]


def sh(cmd: list[str], log, env=None, check=True) -> subprocess.CompletedProcess:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    res = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {res.returncode}")
    return res


def replica_states() -> dict[str, str]:
    url = f"http://127.0.0.1:{STATS_PORT}/stats;csv"
    text = urllib.request.urlopen(url, timeout=3).read().decode().lstrip("# ")
    return {r["svname"]: r["status"] for r in csv.DictReader(io.StringIO(text))
            if r["pxname"] == "tinyserve" and r["svname"].startswith("replica-")}  # fmt: skip


def wait_for(pred, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if pred():
                return time.monotonic() - t0
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.25)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def chat(model: str) -> tuple[bool, str, str]:
    body = {"model": model, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "Count from one to five."}]}  # fmt: skip
    req = urllib.request.Request(f"http://127.0.0.1:{LB_PORT}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            ok = resp.status == 200 and json.load(resp)["choices"][0]["message"]["content"] != ""
            return ok, resp.headers.get("X-Tinyserve-Replica", "?"), ""
    except Exception as e:  # noqa: BLE001 - any failure is a lost request
        return False, "?", repr(e)[:200]


def main() -> int:
    log_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tinyserve-docker-smoke")
    log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / "replicas.log", "w")
    env = dict(os.environ, TINYSERVE_LB_PORT=str(LB_PORT), TINYSERVE_LB_STATS_PORT=str(STATS_PORT))
    base = env.get("BASE_IMAGE", "debian:bookworm-slim")
    docker = env.get("DOCKER", "docker")
    cmd = compose_cmd()
    compose = [*cmd, "-p", PROJECT, "-f", str(COMPOSE_FILE)]
    say = lambda msg: print(f"docker_smoke: replicas: {msg}", flush=True)  # noqa: E731
    version = subprocess.run([*cmd, "version"], capture_output=True, text=True, check=False)
    say(f"{' '.join(cmd)}: {(version.stdout.strip().splitlines() or ['?'])[0]}")
    t0 = time.monotonic()
    for port in (LB_PORT, STATS_PORT):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
        except urllib.error.HTTPError:
            pass
        except OSError:
            continue  # free
        say(f"FAILED: port {port} already answers (set REPLICAS_LB_PORT / REPLICAS_STATS_PORT)")
        return 1
    try:
        sh([docker, "build", "-q", "-f", "docker/Dockerfile.lb", "--network", "host",
            "--build-arg", f"BASE_IMAGE={base}", "-t", "tinyserve-lb", str(ROOT)], log,
           env=dict(env, DOCKER_BUILDKIT="1"))  # fmt: skip
        sh([*compose, "down", "-v", "--remove-orphans"], log, env=env, check=False)
        sh([*compose, "up", "-d", "--no-build"], log, env=env)
        up = wait_for(lambda: set(replica_states().values()) == {"UP"} and len(replica_states()) == 2,
                      240, "both replicas UP in HAProxy")  # fmt: skip
        say(f"both replicas UP behind HAProxy {up:.1f} s after `up`")
        models = json.load(
            urllib.request.urlopen(f"http://127.0.0.1:{LB_PORT}/v1/models", timeout=10)
        )
        model = models["data"][0]["id"]

        results: list[tuple[float, bool, str, str]] = []
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                t = time.monotonic()
                ok, replica, err = chat(model)
                results.append((t, ok, replica, err))

        threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
        for th in threads:
            th.start()
        time.sleep(8)
        t_stop = time.monotonic()
        sh([*compose, "stop", "-t", "40", "replica-1"], log, env=env)
        stopped = time.monotonic() - t_stop
        down = wait_for(lambda: replica_states().get("replica-1") in ("DOWN", "MAINT"), 30,
                        "HAProxy to mark replica-1 DOWN")  # fmt: skip
        say(f"replica-1 stopped (SIGTERM, drained in {stopped:.1f} s); HAProxy shows it "
            f"{replica_states()['replica-1']}")  # fmt: skip
        time.sleep(6)
        sh([*compose, "start", "replica-1"], log, env=env)
        back = wait_for(lambda: replica_states().get("replica-1") == "UP", 120,
                        "replica-1 UP again")  # fmt: skip
        say(f"replica-1 started again, UP in HAProxy after {back:.1f} s")
        time.sleep(4)
        stop.set()
        for th in threads:
            th.join()
        del down
    except Exception as e:  # noqa: BLE001
        say(f"FAILED: {e}")
        sh([*compose, "logs", "--no-color"], log, env=env, check=False)
        return 1
    finally:
        if os.environ.get("REPLICAS_KEEP") != "1":
            sh([*compose, "logs", "--no-color"], log, env=env, check=False)
            sh([*compose, "down", "-v"], log, env=env, check=False)
        log.close()

    failed = [r for r in results if not r[1]]
    during = [r for r in results if t_stop <= r[0] <= t_stop + stopped + 10]
    served = {}
    for _, ok, replica, _ in results:
        served[replica] = served.get(replica, 0) + ok
    say(f"{len(results)} requests from {CLIENTS} clients, {len(failed)} failed; "
        f"{len(during)} sent while replica-1 stopped or was down; served by {served} "
        f"({time.monotonic() - t0:.0f} s in all)")  # fmt: skip
    for r in failed[:5]:
        say(f"  lost: {r[3]}")
    return 1 if failed or not during else 0


if __name__ == "__main__":
    sys.exit(main())
