"""The README's commands are the ones CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_ci_runs_the_readme_test_command():
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    test_cmds = [b for b in blocks if "pytest" in b]
    assert len(test_cmds) == 1, "the README must show exactly one test command"
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmds[0] in ci_lines, ".ci/run must run the README's test command verbatim"


def test_readme_setup_command_installs_torch_2_13_first():
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    setup = [b for b in blocks if "tinyserve serve" in b and "scripts/install.sh" in b]
    assert setup, "the README must show the set-up-and-serve command (through install.sh)"
    install = (ROOT / "scripts" / "install.sh").read_text()
    assert "torch==${TORCH_VERSION:-2.13.0}" in install
    assert install.index('pip install -q "$torch_spec"') < install.index("pip install -q $editable")


def test_ci_and_dockerfiles_share_the_install_script():
    assert "scripts/install.sh" in (ROOT / ".ci" / "run").read_text()
    for name in ("Dockerfile", "Dockerfile.cuda"):
        text = (ROOT / "docker" / name).read_text()
        # RUN [--mount=... (build secrets, caches)] ... scripts/install.sh ... --fetch-model
        assert re.search(r"^RUN .*?scripts/install\.sh[^\n]*--fetch-model", text, re.S | re.M), name
        assert '"serve", "--host", "0.0.0.0"' in text and "/health" in text, name
    assert "download.pytorch.org/whl/cpu" in (ROOT / "docker" / "Dockerfile").read_text()
    assert "nvidia/cuda" in (ROOT / "docker" / "Dockerfile.cuda").read_text()


def test_compose_file_serves_with_a_health_check():
    import yaml

    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    svc = compose["services"]["tinyserve"]
    assert svc["build"]["dockerfile"] == "docker/Dockerfile"
    assert "8321:8321" in svc["ports"] and "models:/models" in svc["volumes"]
    assert "/health" in " ".join(svc["healthcheck"]["test"])
    assert "models" in compose["volumes"]


def test_install_script_help_and_syntax():
    import subprocess

    script = str(ROOT / "scripts" / "install.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    out = subprocess.run(["bash", script, "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--fetch-model" in out.stdout
    bad = subprocess.run(["bash", script, "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown option" in bad.stderr
