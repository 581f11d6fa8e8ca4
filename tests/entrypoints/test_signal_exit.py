"""The serve command's uvicorn server returns normally after SIGTERM or SIGINT (a drain,
then exit status 0), rather than dying of the re-raised signal; a second SIGINT forces it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# In a child process: a bare ASGI app behind _DrainingServer, signalled once it has started.
SCRIPT = """
import os, signal, sys, threading, time
import uvicorn
from tinyserve.entrypoints.api_server import _DrainingServer

async def app(scope, receive, send):
    raise RuntimeError("no request expected")

sigs = [getattr(signal, name) for name in sys.argv[1:]]
server = _DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off"))

def signal_when_started():
    while not server.started:
        time.sleep(0.02)
    for sig in sigs:
        os.kill(os.getpid(), sig)
        time.sleep(0.05)

threading.Thread(target=signal_when_started, daemon=True).start()
server.run()
print("returned", server.should_exit, server.force_exit, flush=True)
"""


@pytest.mark.parametrize(
    ("signals", "forced"),
    [(["SIGTERM"], False), (["SIGINT"], False), (["SIGTERM", "SIGTERM"], False),
     (["SIGINT", "SIGINT"], True)],
)  # fmt: skip
def test_server_returns_after_signals(signals, forced):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, *signals],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.split() == ["returned", "True", str(forced)]
    assert proc.returncode != -signal.SIGTERM
