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
    setup = [b for b in blocks if "tinyserve serve" in b and "pip install" in b]
    assert setup, "the README must show the set-up-and-serve command"
    assert setup[0].index("torch==2.13.0") < setup[0].index("pip install -e")
