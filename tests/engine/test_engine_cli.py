"""``tinyserve generate`` prints the completions the offline API gives for the same prompts
and parameters (greedy, so the text is derived here rather than hard-coded)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.support.engine import run_batch
from tinyserve.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
# What the CLI builds from its defaults (temperature 0) and --max-tokens 8.
CLI_PARAMS = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=8, seed=None, stop=[])


def _cli(*args: str, cwd=None) -> str:
    exe = shutil.which("tinyserve", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "tinyserve.entrypoints.cli"]
    cmd += ["generate", *args, "--max-tokens", "8", "--dtype", "float32"]
    cmd += ["--kv-cache-memory", "64MiB"]
    env = {**os.environ, "TINYSERVE_NO_PROGRESS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.fixture(scope="module")
def expected(smol_engine):
    tok = smol_engine.tokenizer
    requests = [(f"cli{i}", tok.encode(p), CLI_PARAMS) for i, p in enumerate(PROMPTS)]
    got = run_batch(smol_engine, requests)
    texts = [tok.decode(got[f"cli{i}"].token_ids, skip_special_tokens=True) for i in range(3)]
    assert all(texts)
    return texts


@pytest.mark.slow
def test_generate_one_prompt(expected):
    assert _cli(PROMPTS[0]) == expected[0] + "\n"


@pytest.mark.slow
def test_generate_from_file(expected, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n\n", encoding="utf-8")  # blank lines are skipped
    want = "".join(f"### {p}\n{t}\n" for p, t in zip(PROMPTS, expected, strict=True))
    assert _cli("--file", str(path)) == want


def test_generate_without_prompt_fails_cleanly(tmp_path):
    from tinyserve.entrypoints.cli import main

    empty = tmp_path / "empty.txt"
    empty.write_text("\n", encoding="utf-8")
    assert main(["generate", "--file", str(empty)]) == 2


@pytest.mark.parametrize(
    "args, words",
    [(["--max-model-len", "-5", "hi"], "max_model_len must be >= 2, got -5"),  # torch's error
     (["--file", "/nonexistent/prompts.txt"], "No such file"),  # FileNotFoundError
     (["--max-tokens", "-1", "hi"], "max_tokens"),  # (told before the model loads)
     (["--device", "foo", "hi"], "foo")],  # torch's RuntimeError
)  # fmt: skip
def test_bad_generate_settings_are_one_line_not_a_traceback(capsys, args, words):
    from tinyserve.entrypoints.cli import main

    assert main(["generate", *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tinyserve generate: ") and words in err and "Traceback" not in err
    assert err.count("\n") == 1, err


def test_a_bad_speculative_config_is_a_usage_error(capsys):
    from tinyserve.entrypoints.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--speculative-config", '{"num_speculative_tokens": 0}', "hi"])
    assert e.value.code == 2
    assert "speculative_config: num_speculative_tokens must be" in capsys.readouterr().err


def test_speculation_is_suffix_by_default_and_off_turns_it_off():
    import argparse

    from tinyserve.engine.arg_utils import EngineArgs, add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).speculative_config.method == "suffix"
    for off in ("off", "none"):  # through EngineArgs, as `tinyserve serve` builds it
        ns = parser.parse_args(["--speculative-config", off])
        assert EngineArgs.from_namespace(ns).create_configs().speculative is None
    ngram = parser.parse_args(["--speculative-config", '{"method": "ngram"}'])
    assert ngram.speculative_config.method == "ngram"


def test_grammar_fast_forward_is_on_by_default_and_reaches_the_proposer():
    import argparse

    from tinyserve.engine.arg_utils import EngineArgs, add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).grammar_fast_forward is True
    ns = parser.parse_args(["--no-grammar-fast-forward", "--speculative-config", "off"])
    config = EngineArgs.from_namespace(ns).create_configs()
    assert (config.grammar_fast_forward, config.speculative) == (False, None)
