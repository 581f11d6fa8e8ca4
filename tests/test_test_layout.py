"""The tests' own shape, checked on the source with ``ast``: shared helpers live in the
``tests.support`` package, so that

(a) no test module imports another test module or a conftest (``from conftest import``
    depends on which conftest pytest loaded first: two test folders in one run clash);
(b) conftest files hold fixtures and pytest hooks only;
(c) nothing under tests/ reaches a file by path (``sys.path.insert``,
    ``spec_from_file_location``): benchmarks are imported as the ``benchmarks`` package.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _sources(root: Path = TESTS) -> dict[str, ast.Module]:
    return {
        str(p.relative_to(root.parent)): ast.parse(p.read_text(), str(p))
        for p in sorted(root.rglob("*.py"))
    }


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module]
    return []


def import_violations(sources: dict[str, ast.Module]) -> list[str]:
    problems = []
    for rel, tree in sources.items():
        for node in ast.walk(tree):
            for name in _imported(node):
                last = name.split(".")[-1]
                if last == "conftest" or last.startswith("test_"):
                    problems.append(f"{rel}:{node.lineno}: imports {name}")
    return problems


def _is_fixture_or_hook(node: ast.AST) -> bool:
    if node.name.startswith("pytest_"):
        return True
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if ast.unparse(target) in ("pytest.fixture", "fixture"):
            return True
    return False


def conftest_violations(sources: dict[str, ast.Module]) -> list[str]:
    problems = []
    for rel, tree in sources.items():
        if not rel.endswith("conftest.py"):
            continue
        for node in tree.body:
            if isinstance(node, ast.ClassDef) or (
                isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and not _is_fixture_or_hook(node)
            ):
                problems.append(f"{rel}:{node.lineno}: {node.name} is not a fixture or hook")
    return problems


def path_violations(sources: dict[str, ast.Module]) -> list[str]:
    problems = []
    for rel, tree in sources.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                called = ast.unparse(node.func)
                if called.endswith(("sys.path.insert", "sys.path.append")) or called.endswith(
                    "spec_from_file_location"
                ):
                    problems.append(f"{rel}:{node.lineno}: {called}")
    return problems


def test_no_test_module_imports_another_or_a_conftest():
    problems = import_violations(_sources())
    assert not problems, problems


def test_conftest_files_hold_fixtures_and_hooks_only():
    problems = conftest_violations(_sources())
    assert not problems, problems


def test_nothing_is_imported_by_path():
    problems = path_violations(_sources())
    assert not problems, problems


def test_the_checks_catch_what_they_should():
    fake = {
        "tests/a/test_x.py": ast.parse(
            "from conftest import MODEL\nimport test_y\nfrom tests.b.test_z import f\n"
            "from tests.support.api import MODEL\n"
        ),
        "tests/a/conftest.py": ast.parse(
            "import pytest\n@pytest.fixture\ndef ok(): pass\n"
            "@pytest.fixture(scope='session')\ndef ok2(): pass\n"
            "def pytest_configure(config): pass\ndef helper(): pass\nclass C: pass\n"
        ),
        "tests/test_b.py": ast.parse(
            "import sys, importlib.util\nsys.path.insert(0, 'benchmarks')\n"
            "importlib.util.spec_from_file_location('m', 'benchmarks/m.py')\n"
        ),
    }
    assert [p.split(": ")[1] for p in import_violations(fake)] == [
        "imports conftest", "imports test_y", "imports tests.b.test_z"
    ]  # fmt: skip
    assert [p.split(": ")[1] for p in conftest_violations(fake)] == [
        "helper is not a fixture or hook", "C is not a fixture or hook"
    ]  # fmt: skip
    assert len(path_violations(fake)) == 2
