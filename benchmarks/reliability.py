#!/usr/bin/env python
"""Regenerate docs/reliability.md: run the soak and overload (benchmarks/soak.py), the fuzzers
(benchmarks/fuzz.py) and the fault / security tests, then write what was tried, how many
times and what held.

    python benchmarks/reliability.py            # everything (about 15 minutes on 2 cores)
    python benchmarks/reliability.py --parts tests   # rerun one part, reuse the others' JSON
    python benchmarks/reliability.py --reuse    # re-render from benchmarks/results/*.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "reliability.md"
# Hand-written parts, included as they are: the limits table and the contention figures.
LIMITS = ROOT / "benchmarks" / "reliability_limits.md"
CONTENTION = ROOT / "benchmarks" / "reliability_contention.md"

# The fault and security tests whose outcomes the document lists (file -> what they prove).
# (One pytest run per file: the engine and entrypoints tests import helpers from their own
# conftest by name, which only works when one directory's conftest is loaded.)
FAULT_TESTS = {
    "tests/engine/test_engine_robustness.py": "random aborts, an exception inside a step",
    "tests/entrypoints/test_http_errors.py": "auth, 413, 429, 503, one failing request, logs",
    "tests/entrypoints/test_async_engine_thread.py": "the engine thread: aborts, queue bound, death",
    "tests/entrypoints/test_concurrency.py": "client disconnects free their blocks",
    "tests/entrypoints/test_serve_cli.py": "SIGTERM drain and grace period, real subprocess",
    "tests/entrypoints/test_security.py": "the key on unknown paths and under other schemes, "
    "routes opened only by flags, regexes that blow up refused before the engine (4 fields), "
    "specs past the size limits, grammars that crashed the server served, a grammar past the "
    "parser's row limit a 400 (streamed: an error event)",
    "tests/structured/test_sandbox.py": "grammars that kill a compile thread (checked first, in "
    "a throwaway process) kill only the sandbox child; past the time limit it is killed",
    "tests/worker/test_contention.py": "kernel threads given up to a busy neighbour and taken "
    "back, not after idle",
}


def run(cmd: list[str]) -> int:
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT)


def run_fault_tests() -> dict:
    t0 = time.monotonic()
    codes, tests = [], []
    for i, path in enumerate(FAULT_TESTS):
        xml = RESULTS / f"reliability_tests_{i}.xml"
        codes.append(
            run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    path,
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    f"--junitxml={xml}",
                ]
            )  # fmt: skip
        )
        for case in ET.parse(xml).getroot().iter("testcase"):
            failed = case.find("failure") is not None or case.find("error") is not None
            skipped = case.find("skipped") is not None
            outcome = "failed" if failed else "skipped" if skipped else "passed"
            tests.append({"file": path, "name": case.get("name"), "outcome": outcome,
                          "seconds": float(case.get("time", 0))})  # fmt: skip
        xml.unlink()
    code = max(codes)
    result = {"exit_code": code, "wall_s": round(time.monotonic() - t0, 1), "tests": tests,
              "machine": machine_info()}  # fmt: skip
    (RESULTS / "reliability_tests.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _held(failures: list[str]) -> str:
    return "**held**" if not failures else "**FAILED**: " + "; ".join(failures)


def grammar_soak_section() -> list[str]:
    """From benchmarks/grammar_soak.py's JSON, when it has been run."""
    path = RESULTS / "grammar_soak.json"
    if not path.exists():
        return []
    g = json.loads(path.read_text())
    kinds: dict[str, dict[str, int]] = {}
    for key, count in g["status"].items():
        kind, status = key.rsplit(" ", 1)
        kinds.setdefault(kind, {})[status] = count
    failed = [name for name, ok in g["checks"].items() if not ok]
    return [
        "## Hostile structured outputs (`benchmarks/grammar_soak.py`)",
        "",
        f"A real `tinyserve serve` (SmolLM2-135M, `--max-num-seqs 16`), {g['clients']} clients "
        f"for {g['minutes']:g} minutes (run {g['date']}, {g['machine']['cpu_model']}): deep and "
        "recursive schemas, `$ref` and Lark rule chains up to the size limit and past it, huge "
        "alternations and choice lists, GBNF nested past its converter's depth, ReDoS and "
        "deeply grouped regexes, hostile tool parameters, a distinct random schema every few "
        "requests (the compile cache churns), streams hung up mid-answer, and a plain JSON "
        "request as a control every tenth.",
        "",
        "| kind | statuses |",
        "|---|---|",
        *[f"| {kind} | {statuses} |" for kind, statuses in sorted(kinds.items())],
        "",
        f"Requests: {sum(g['status'].values())}, hang-ups {g['hang_ups']}; 5xx: "
        f"{len(g['errors_5xx'])}; transport errors: {len(g['transport_errors'])}; server RSS "
        f"after warm-up -> end {g['rss_warm_mib']} -> {g['rss_end_mib']} MiB "
        f"({g['rss_growth']:+.1%}; limit +10%); threads {g['threads_min_max'][0]}-"
        f"{g['threads_min_max'][1]}. Result: {_held(failed)}",
        "",
    ]


def render(soak: dict, fuzz: dict, faults: dict) -> str:
    s, o = soak["soak"], soak.get("overload")
    h, st = fuzz["hostile"], fuzz["schemathesis"]
    c = s["config"]
    lines = [
        "# Reliability: what was tried, how many times, what held",
        "",
        "Generated by `python benchmarks/reliability.py` (do not edit by hand: the limits and "
        "contention sections come from `benchmarks/reliability_limits.md` and "
        "`reliability_contention.md`); the raw figures are in `benchmarks/results/soak.json`, "
        "`fuzz.json`, `grammar_soak.json` and `reliability_tests.json`. "
        f"Soak run {soak['date']}, fuzz run {fuzz['date']}; machine: {platform.machine()}, "
        "2 vCPUs, no GPU. The suite runs smaller versions of the same code "
        "(tests/reliability/) on every CI run.",
        "",
        LIMITS.read_text(),
        "## Soak (`benchmarks/soak.py`)",
        "",
        f"A real `tinyserve serve` (SmolLM2-135M, default settings but `--max-num-seqs "
        f"{max(64, c['concurrency'] * 2)}`): {s['requests']} streaming requests at "
        f"{c['concurrency']} concurrent, chat and completions, max_tokens from "
        f"{list(c['max_tokens_choices'])}, temperatures 0 / 0.7 / 1, {s['with_n2']} with `n=2`, "
        f"{s['with_stop']} with stop strings, and {s['disconnected']} clients "
        f"({c['disconnect_frac']:.0%} planned) hanging up at a random point of their stream.",
        "",
        "| check | figure |",
        "|---|---|",
        f"| wall time | {s['wall_s']} s |",
        f"| statuses | {s['status_counts']} |",
        f"| 5xx responses | {s['num_5xx']} |",
        f"| transport errors | {s['num_transport_errors']} |",
        f"| completed streams (`[DONE]`, a finish_reason per choice) | {s['completed']} |",
        f"| streams that ended without `[DONE]` | {s['num_unfinished_streams']} |",
        f"| output tokens streamed (completed requests) | {s['output_tokens_streamed']} |",
        f"| completed requests whose streamed token count != usage | {s['num_usage_mismatches']} |",
        f"| afterwards: running / waiting requests | {s['after']['running']:.0f} / "
        f"{s['after']['waiting']:.0f} |",
        f"| afterwards: free / total KV blocks (prefix-cached count as free) | "
        f"{s['after']['free_blocks']:.0f} / {s['after']['total_blocks']:.0f} "
        f"(leaked: {s['after']['leaked_blocks']:.0f}) |",
        f"| server RSS middle -> end | {s['rss_mid_mb']} -> {s['rss_end_mb']} MiB "
        f"({s['rss_growth']:+.2%}; limit +5%) |",
        f"| server exit code after SIGTERM | {s.get('server_exit_code')} |",
        "",
        f"Result: {_held(s['failures'])}",
        "",
    ]
    if o:
        lines += [
            "## Overload",
            "",
            f"`tinyserve serve --max-num-seqs 8 --max-queued-requests 8`; {o['clients']} "
            f"clients send a streaming request ({o['max_tokens']} tokens) at the same instant "
            "over connections opened beforehand (raw sockets, so the figure is the server's).",
            "",
            "| check | figure |",
            "|---|---|",
            f"| statuses | {o['status_counts']} |",
            f"| admitted (8 running + 8 waiting at most) | {o['admitted']}, all completed: "
            f"{o['admitted_completed'] == o['admitted']} |",
            f"| refused with 429 | {o['rejected_429']} |",
            f"| 429s with the OpenAI error shape and `Retry-After` | "
            f"{o['rejected_with_error_shape_and_retry_after']} |",
            f"| 429 latency, median / max | {o['median_429_latency_s']} / "
            f"{o['max_429_latency_s']} s |",
            f"| admitted requests' e2e, median | {o['median_admitted_e2e_s']} s |",
            f"| afterwards: running / waiting / leaked blocks | {o['after']['running']:.0f} / "
            f"{o['after']['waiting']:.0f} / {o['after']['leaked_blocks']:.0f} |",
            "",
            f"Result: {_held(o['failures'])}",
            "",
        ]
    lines += [
        "## Fuzzing the HTTP API (`benchmarks/fuzz.py`)",
        "",
        "The server runs the real engine over a 2-layer random Llama with SmolLM2's tokenizer "
        "and chat template, so that the valid requests the fuzzers make finish in milliseconds "
        "(only the weights differ from the default model's server); `--max-request-bytes` "
        "1 MiB.",
        "",
        f"**Schemathesis** (from PyPI) against the server's own `/openapi.json`, positive and "
        f"negative generation for each operation, up to {st['max_examples']} examples each, "
        f"seed {st['seed']}:",
        "",
        "| operation, mode | cases |",
        "|---|---|",
        *[f"| {k} | {v['cases']} |" for k, v in st["operations"].items()],
        "",
        f"{st['cases']} cases in {st['wall_s']} s; statuses {st['status_counts']}; "
        f"**5xx: {st['num_5xx']}**; 4xx without the OpenAI error shape: "
        f"{st['num_bad_error_shapes']}; `/health` 200 afterwards: {st['healthy_after']}. "
        f"Result: {_held(st['failures'])}",
        "",
        f"**Hand-written hostile requests** ({h['cases']} cases, each with the status it must "
        "get): invalid JSON, empty and non-object bodies, invalid UTF-8, lone surrogates, NUL "
        "characters, nesting 100 000 deep, 1 M-character prompts and messages, 100 000 token "
        "ids, 10 MB bodies (with Content-Length and chunked), NaN / Infinity / 1e400, n = 10^6, "
        "max_tokens = 10^9 and 10^30, 10 000 stop strings, negative top_k, empty and missing "
        "messages, unknown roles, tool messages and `tools`, 10 000 messages, out-of-vocab and "
        "non-integer token ids, wrong methods, path traversal, wrong content types, a lying "
        "Content-Length, and every request field of both endpoints set to values of the wrong "
        "type.",
        "",
        f"Statuses {h['status_counts']}; **5xx: {h['num_5xx']}**; unexpected statuses: "
        f"{h['num_unexpected_status']}; 4xx without the error shape: "
        f"{h['num_bad_error_shapes']}; `/health` 200 afterwards: {h['healthy_after']}; "
        f"afterwards running {fuzz['after']['num_requests_running']:.0f}, free blocks "
        f"{fuzz['after']['kv_cache_free_blocks']:.0f} / "
        f"{fuzz['after']['kv_cache_total_blocks']:.0f}. Result: {_held(h['failures'])}. "
        "(Status 0 is the one case where the server closes the connection without an answer: "
        "a Content-Length longer than the body, which never completes.)",
        "",
        *grammar_soak_section(),
        "## Engine faults and security (tests)",
        "",
        f"`python -m pytest <file>` for each file below: worst exit code {faults['exit_code']}, "
        f"{sum(t['outcome'] == 'passed' for t in faults['tests'])} passed, "
        f"{sum(t['outcome'] == 'failed' for t in faults['tests'])} failed, "
        f"{sum(t['outcome'] == 'skipped' for t in faults['tests'])} skipped, "
        f"{faults['wall_s']} s.",
        "",
        "| file | what it proves | passed / run |",
        "|---|---|---|",
    ]
    for path, what in FAULT_TESTS.items():
        ts = [t for t in faults["tests"] if t["file"] == path]
        lines.append(f"| `{path}` | {what} | {sum(t['outcome'] == 'passed' for t in ts)} / "
                     f"{len(ts)} |")  # fmt: skip
    lines += [
        "",
        "What those tests hold to: an exception inside one engine step fails only that step's "
        "requests (with the error in the stream / a 500 body) and the engine serves the next "
        "ones; when the engine thread dies `/health` answers 503 within a second, new requests "
        "get 503 and open streams end with an `engine_dead` error; SIGTERM stops accepting "
        "connections, lets in-flight streams finish within `--shutdown-timeout`, cuts the "
        "ones that run longer, and the process exits 0; with `--api-key` every path — every "
        "route, `/metrics`, the engine view, the OpenAPI document and paths the server does not "
        "have — answers 401 without `Authorization: Bearer` (an ASGI guard that runs before any "
        "route or body parsing, `http_guards.APIKeyGuard`), compared in constant time "
        "(`hmac.compare_digest`), except the paths the operator leaves open: `--open-routes` "
        "(default `/health,/,/playground/*`: the liveness probe and the playground's static "
        "files, which hold no data) and `--metrics-no-key` (since issue 37; before, `/metrics` "
        "was open unless `--metrics-require-key`, now a no-op); the key never reaches the log; "
        "prompts reach it only with `--log-requests`; the default bind is 127.0.0.1.",
        "",
        "Failed tests: "
        + (
            ", ".join(f"`{t['name']}`" for t in faults["tests"] if t["outcome"] == "failed")
            or "none"
        )
        + ".",  # fmt: skip
        "",
        CONTENTION.read_text(),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--parts",
        default="soak,fuzz,tests",
        help="what to run before rendering (comma-separated; the rest is read from results)",
    )
    p.add_argument("--reuse", action="store_true", help="run nothing, only re-render")
    args = p.parse_args(argv)
    parts = set() if args.reuse else set(args.parts.split(","))
    RESULTS.mkdir(parents=True, exist_ok=True)
    bench = str(ROOT / "benchmarks")
    codes = []
    if "soak" in parts:
        codes.append(run([sys.executable, f"{bench}/soak.py"]))
    if "fuzz" in parts:
        codes.append(run([sys.executable, f"{bench}/fuzz.py"]))
    if "tests" in parts:
        faults = run_fault_tests()
    else:
        faults = json.loads((RESULTS / "reliability_tests.json").read_text())
    soak = json.loads((RESULTS / "soak.json").read_text())
    fuzz = json.loads((RESULTS / "fuzz.json").read_text())
    DOC.write_text(render(soak, fuzz, faults))
    print(f"wrote {DOC}")
    return 1 if any(codes) or faults["exit_code"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
