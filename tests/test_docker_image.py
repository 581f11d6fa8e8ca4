"""The Docker image's pieces, checked without Docker (issue 42): prebuilt kernels found with no
compiler, the health check's port, the host pip settings turned into build arguments, the
Dockerfiles' and compose files' promises. scripts/docker_smoke.sh (CI) runs the real image."""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml

from scripts import docker_healthcheck, docker_pip_args

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="no C compiler to prebuild with")  # fmt: skip
def test_prebuilt_kernels_load_without_a_compiler(tmp_path, monkeypatch):
    from tinyserve.kernels import build

    out = tmp_path / "prebuilt"
    cache = tmp_path / "cache"
    build.main(["--out", str(out), "--cache", str(cache), "--levels", "avx2", "avx512",
                "--kernels", "ops"])  # fmt: skip
    names = sorted(p.name for p in out.glob("*.so"))
    assert [n.split("-")[:2] for n in names] == [["ops", "avx2"], ["ops", "avx512"]]
    assert sorted(p.name for p in cache.glob("*.so")) == names  # reusable build cache
    # At run time: no compiler, an empty cache folder, the prebuilt folder on the path.
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("TINYSERVE_KERNEL_DIR", f"{tmp_path / 'missing'}:{out}")
    path = build.built("ops", "avx2")
    assert path.parent == out and path.name in names
    # Without it the same call must compile, and there is no compiler: the error says so.
    monkeypatch.delenv("TINYSERVE_KERNEL_DIR")
    with pytest.raises((RuntimeError, OSError)):
        build.built("ops", "avx2")


def test_health_check_follows_the_servers_port():
    hc = docker_healthcheck
    argv = ["/opt/venv/bin/python3", "/opt/venv/bin/tinyserve", "serve", "--host", "0.0.0.0",
            "--port", "8321", "--port", "8700"]  # fmt: skip
    assert hc.option(argv, "--port", "1") == "8700"  # the last one wins, as in argparse
    assert hc.option(argv + ["--port=9000"], "--port", "1") == "9000"
    assert hc.option(["tinyserve", "serve"], "--port", "8321") == "8321"
    assert hc.option(argv, "--host", "127.0.0.1") == "0.0.0.0"


def test_pip_settings_become_build_arguments(tmp_path, monkeypatch):
    pa = docker_pip_args
    (tmp_path / "simple" / "demo").mkdir(parents=True)
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "demo-1.0-py3-none-any.whl").write_bytes(b"wheel")
    (tmp_path / "simple" / "demo" / "index.html").write_text(
        '<a href="../../files/demo-1.0-py3-none-any.whl">demo</a>'
    )
    listing = (
        f"global.extra-index-url='https://example.invalid/simple file://{tmp_path}/simple'\n"
        f"global.find-links='{tmp_path / 'files'}'\n"
        ":env:.find-links='/nonexistent/wheels'\n"
        "global.cert='/etc/ssl/certs/ca-certificates.crt'\n"
        "global.timeout='60'\n"
    )

    class Done:
        stdout = listing

    monkeypatch.setattr(pa.subprocess, "run", lambda *a, **k: Done())
    s = pa.pip_settings()
    assert s["find-links"] == "/nonexistent/wheels"  # the environment scope wins, as in pip
    assert "timeout" not in s
    m = pa.Mounts()
    assert m.url("https://example.invalid/simple", index=True) == "https://example.invalid/simple"
    assert m.url("/nonexistent/wheels", index=False) == ""  # nothing to serve: dropped
    idx = m.url(f"file://{tmp_path}/simple", index=True)
    links = m.url(str(tmp_path / "files"), index=False)
    port = m.serve()
    assert port == m.stable_port()  # the same arguments next run: Docker's layer cache holds
    idx, links = idx.format(port=port), links.format(port=port)
    assert idx.startswith("http://127.0.0.1:") and links.startswith("http://127.0.0.1:")
    page = urllib.request.urlopen(idx + "demo/", timeout=5).read().decode()
    whl = re.search(r'href="([^"]+)"', page).group(1)
    assert urllib.request.urlopen(idx + "demo/" + whl, timeout=5).read() == b"wheel"
    assert b"demo-1.0" in urllib.request.urlopen(links, timeout=5).read()
    with pytest.raises(urllib.error.HTTPError):  # nothing outside the served folders
        urllib.request.urlopen(idx.replace("/simple/", "/") + "..%2f..%2fetc/passwd", timeout=5)


def _stages(dockerfile: str) -> list[str]:
    return re.split(r"^FROM ", (DOCKER / dockerfile).read_text(), flags=re.M)[1:]


def test_cpu_dockerfile_keeps_build_settings_out_of_the_runtime():
    build, runtime = _stages("Dockerfile")
    assert "+cpu" in build and "torch.version.cuda" in build  # never a CUDA torch
    assert "--mount=type=secret,id=pip_cert" in build
    assert "tinyserve.kernels.build" in build  # every ISA level compiled at build time
    for word in ("PIP_", "TORCH_INDEX_URL", "TORCH_VERSION", "gcc", "pip_cert"):
        assert word not in runtime, word
    assert "TINYSERVE_KERNEL_DIR=/opt/tinyserve/kernels" in runtime
    assert 'CMD ["python3", "/opt/tinyserve/healthcheck.py"]' in runtime
    assert "ARG BASE_IMAGE" in (DOCKER / "Dockerfile").read_text().split("FROM")[0]


def test_cuda_dockerfile_has_what_triton_needs_at_run_time():
    text = (DOCKER / "Dockerfile.cuda").read_text()
    assert "ARG BASE_IMAGE=nvidia/cuda" in text
    assert re.search(r"python3-dev\b", text) and re.search(r"\bgcc\b", text)
    assert "Python.h" in text  # checked at build time
    assert "TORCH_INDEX_URL=${" not in text.split("ENV")[-1]


def test_compose_files():
    single = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["tinyserve"]
    assert single["restart"] == "unless-stopped" and "cpus" in single and "mem_limit" in single
    assert any("tinyserve.env" in f for f in single["env_file"])
    assert (DOCKER / "tinyserve.env.example").is_file()
    rep = yaml.safe_load((DOCKER / "compose.replicas.yaml").read_text())
    replicas = [n for n in rep["services"] if n.startswith("replica-")]
    assert (
        len(replicas) >= 2
        and rep["services"]["lb"]["build"]["dockerfile"] == "docker/Dockerfile.lb"
    )
    cfg = (DOCKER / "haproxy.cfg").read_text()
    assert "option httpchk GET /health" in cfg and "http-check expect status 200" in cfg
    assert "retry-on conn-failure" in cfg
    for name in replicas:
        assert re.search(rf"^\s*server {name} {name}:8321 check", cfg, re.M), name


def test_dockerignore_is_an_allowlist():
    lines = [ln for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln and ln[0] != "#"]
    assert lines[0] == "*"  # .git, .venv, caches and results stay out of the context
    for dockerfile in ("Dockerfile", "Dockerfile.cuda", "Dockerfile.lb"):
        for src in re.findall(
            r"^COPY (?!--from)(.+) \S+$", (DOCKER / dockerfile).read_text(), re.M
        ):
            for path in src.split():
                top = path.split("/")[0]
                assert any(ln.lstrip("!").rstrip("/") in (path, top) for ln in lines[1:]), path


def test_smoke_script_syntax_and_help():
    script = str(ROOT / "scripts" / "docker_smoke.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    out = subprocess.run(["bash", script, "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--replicas" in out.stdout
    assert "docker_smoke.sh" in (ROOT / ".ci" / "run").read_text()


def test_triton_decode_attention_is_checked_before_it_is_chosen(monkeypatch, caplog):
    """On CUDA, available() now runs the kernel once (a runtime without gcc or Python's
    headers cannot build Triton's launcher); here the same check on CPU tensors under the
    interpreter, and a failure turning the path off with the reason logged."""
    pytest.importorskip("triton")
    import torch

    from tinyserve.kernels import triton_attention as ta

    if not ta.available("cpu"):
        pytest.skip("Triton's interpreter is not usable in this process")
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    assert ta._runs_on_cuda.__wrapped__() is True

    def broken(*a, **k):
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(ta, "paged_decode_attention", broken)
    assert ta._runs_on_cuda.__wrapped__() is False
    assert "Triton decode attention off on CUDA" in caplog.text and "C compiler" in caplog.text
