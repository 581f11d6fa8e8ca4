"""How far prompt-lookup speculation can go on a workload: the ceiling of issue 14's
one-stream target, measured rather than argued.

Greedy decoding fixes every token a request produces, with speculation or without
(tests/engine/test_spec_decode.py proves the identity). So the outputs of one plain run,
replayed through a proposer, tell without the model how many tokens each verification
step would yield:

* ``ngram``: the proposer as configured (spec_decode/ngram.py);
* ``ngram_k<k>_min<m>``: the same with other ``num_speculative_tokens`` /
  ``prompt_lookup_min``;
* ``earliest`` / ``vote``: other ways to pick among the matches — the earliest
  occurrence of the longest suffix instead of the latest; or token by token, the
  continuation that most often followed the longest suffix (llama.cpp's n-gram-cache idea),
  drafting past the end of one match; ``ngram_max<m>``: longer suffixes first;
* ``oracle``: at every step, among *all* earlier occurrences of *every* suffix of length
  1..prompt_lookup_max, the one whose continuation matches the output longest, up to
  2 x ``num_speculative_tokens`` drafts: an upper bound on any proposer that copies from
  the context (tree verification of several candidates included);
* ``suffix``: suffix decoding's chain (spec_decode/suffix.py, up to 16 drafts), from the
  request's own tokens and the earlier requests' outputs (a SuffixCache filled in request
  order, as the engine's is); ``suffix_tree<N>``: tree verification of the same sources —
  every continuation of the matched suffix's occurrences with path probability >=
  ``min_token_prob`` (both sources' tries merged), the N likeliest nodes (prefix-closed)
  verified in one step of 1 + N rows, accepted as deep as the output follows a branch
  (issue 40 deliver 1: measured before building the tree mask).

Each is priced in hindsight: a step drafts exactly the tokens that will be accepted, so no
rejected row is ever paid for — an upper bound on what any draft-length policy (the
adaptive one included) gets from that proposer. With the times measured here — each
request's prefill to its first token (``ttft``) and a step's cost by its row count (the
engine's own measured model, spec_decode/cost.py's ``StepCostModel.estimate``):

    bound = (ttft + (n - 1) t(1)) / (ttft + sum over the steps of t(1 + accepted))

and with verification rows free (every step costs t(1)): the ceiling whatever the kernels
do. ``full`` prices every proposal drafted in full instead (the non-adaptive policy). The
same requests also run with speculation on (the real adaptive policy), back to back with
the plain run, so the bounds can be checked against a measurement. Offline engine, prefix
caching off (every prompt prefilled in full, as the served benchmark's salted prompts are).

    python benchmarks/spec_ceiling.py [--workload grounded] [--num-requests 12]
        [--spec '{"method": "ngram", ...}'] [--out benchmarks/results/spec_ceiling.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from array import array
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import make_workload, new_salt  # noqa: E402
from bench_spec import SPEC  # noqa: E402
from machine import machine_info  # noqa: E402

from tinyserve import LLM, SamplingParams  # noqa: E402
from tinyserve.spec_decode.cost import StepCostModel  # noqa: E402
from tinyserve.spec_decode.ngram import propose  # noqa: E402
from tinyserve.spec_decode.suffix import (  # noqa: E402
    _SEP,
    SuffixCache,
    SuffixParams,
    best_draft,
    match,
    token_at,
)

GRID = [(2, 2), (8, 2), (4, 1), (8, 1), (16, 1)]  # (num_speculative_tokens, prompt_lookup_min)


def accepted(proposal: list[int], out: list[int], i: int) -> int:
    """Leading drafts of ``proposal`` that equal the output from position ``i``."""
    n = 0
    while n < len(proposal) and i + n < len(out) and proposal[n] == out[i + n]:
        n += 1
    return n


def earlier(ctx: list[int], size: int) -> list[int]:
    """Start positions, in order, of the earlier occurrences of ``ctx``'s last ``size``
    tokens (each followed by at least one token)."""
    n = len(ctx)
    return [s for s in range(n - size) if ctx[s : s + size] == ctx[n - size :]]


def longest(ctx: list[int], lo: int, hi: int) -> tuple[int, list[int]]:
    """The longest suffix length in hi..lo with earlier occurrences, and their starts
    ((0, []) when none)."""
    for size in range(min(hi, len(ctx) - 1), lo - 1, -1):
        if starts := earlier(ctx, size):
            return size, starts
    return 0, []


def propose_earliest(ctx: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The continuation of the earliest occurrence of the longest suffix (lo..hi tokens)."""
    size, starts = longest(ctx, lo, hi)
    return ctx[starts[0] + size : starts[0] + size + k] if starts else []


def propose_vote(ctx: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Token by token: the most frequent continuation of the longest suffix that occurred
    before (ties: the latest), appended and searched again."""
    c, drafts = list(ctx), []
    while len(drafts) < k:
        size, starts = longest(c, lo, hi)
        if not starts:
            break
        votes = Counter()
        for s in starts:
            votes[c[s + size]] += 1 + s / len(c)  # the latest wins a tie
        drafts.append(max(votes, key=votes.__getitem__))
        c.append(drafts[-1])
    return drafts


def oracle_proposal(ctx: list[int], out: list[int], i: int, k: int, lookup_max: int) -> list[int]:
    """The continuation of the earlier occurrence (any suffix length 1..lookup_max) that
    matches ``out[i:]`` longest, up to ``k`` tokens."""
    best: list[int] = []
    for size in range(min(lookup_max, len(ctx) - 1), 0, -1):
        for s in earlier(ctx, size):
            cand = ctx[s + size : s + size + k]
            if accepted(cand, out, i) > accepted(best, out, i):
                best = cand
    return best[: accepted(best, out, i)]


PROPOSERS = {"ngram": propose, "earliest": propose_earliest, "vote": propose_vote}
SUFFIX_K = 16  # suffix decoding's num_speculative_tokens default
SUFFIX_VARIANTS = [("suffix", None)] + [(f"suffix_tree{n}", n) for n in (4, 8, 16, 32)]


def suffix_trie(tokens: list[int], corpus, data: bytes, k: int, cfg: SuffixParams) -> dict:
    """Every continuation (path -> path probability >= min_token_prob, at most k deep, and
    max_spec_factor x the match) of the longest matched suffix's occurrences in one source:
    the counted suffix tree's subtree whose top path speculate() drafts."""
    own = corpus is tokens
    limit, alive = match(data, tokens, corpus, k, cfg.max_depth, cfg.max_spec_factor)
    nodes: dict[tuple, float] = {}
    stack = [((), alive, 1.0)] if alive else []
    while stack:
        path, alive, prob = stack.pop()
        if len(path) >= limit:
            continue
        groups: dict[int, list[int]] = {}
        for s in alive:
            if (t := token_at(corpus, s + len(path), list(path), own)) != _SEP:
                groups.setdefault(t, []).append(s)
        for t, group in groups.items():
            p = prob * len(group) / len(alive)
            if p >= cfg.min_token_prob:
                nodes[path + (t,)] = max(nodes.get(path + (t,), 0.0), p)
                stack.append((path + (t,), group, p))
    return nodes


def tree_proposal(tokens, cache: SuffixCache, k: int, budget: int, cfg: SuffixParams) -> set:
    """The ``budget`` likeliest nodes of both sources' tries, prefix-closed."""
    nodes = suffix_trie(tokens, tokens, array("i", tokens).tobytes(), k, cfg)
    if (shared := cache.corpus(None)) is not None:
        for path, p in suffix_trie(tokens, shared[0], shared[1], k, cfg).items():
            nodes[path] = max(nodes.get(path, 0.0), p)
    chosen: set[tuple] = set()
    for path in sorted(nodes, key=lambda q: (-nodes[q], len(q))):  # parents first
        if len(chosen) == budget:
            break
        if len(path) == 1 or path[:-1] in chosen:
            chosen.add(path)
    return chosen


def replay_suffix(prompt, out, cache: SuffixCache, budget: int | None) -> list[tuple[int, int]]:
    """(drafted, accepted) per step with suffix decoding's chain (``budget`` None) or a tree
    of ``budget`` nodes; the request's output joins ``cache`` afterwards (the caller's)."""
    cfg, steps, i = SuffixParams(), [], 1
    while i < len(out):
        room = min(SUFFIX_K, len(out) - i - 1)
        tokens = prompt + out[:i]
        if room < 1:
            steps.append((0, 0))
        elif budget is None:
            p = best_draft(tokens, cache, None, room, cfg)
            steps.append((len(p), accepted(p, out, i)))
        else:
            tree = tree_proposal(tokens, cache, room, budget, cfg)
            n = 0
            while i + n < len(out) and tuple(out[i : i + n + 1]) in tree:
                n += 1
            steps.append((len(tree), n))
        i += steps[-1][1] + 1
    return steps


def replay(prompt: list[int], out: list[int], method: str, cfg: dict) -> list[tuple[int, int]]:
    """(drafted, accepted) per step (0, 0: a plain decode step) for producing ``out`` after
    ``prompt``; the first token comes from the prefill."""
    k, lo, hi = cfg["num_speculative_tokens"], cfg["prompt_lookup_min"], cfg["prompt_lookup_max"]
    steps, i = [], 1
    while i < len(out):
        room = min(k if method != "oracle" else 2 * k, len(out) - i - 1)  # never past max_tokens
        ctx = prompt + out[:i]
        if room < 1:
            p = []
        elif method == "oracle":
            p = oracle_proposal(ctx, out, i, room, hi)
        else:
            p = PROPOSERS[method](ctx, room, lo, hi)
        n = accepted(p, out, i)
        steps.append((len(p), n))
        i += n + 1
    return steps


def price(steps: list[tuple[int, int]], cost: StepCostModel, ttft: float, n: int) -> dict:
    t1 = cost.estimate(1)
    plain = ttft + (n - 1) * t1
    return {
        "steps": len(steps),
        "tokens_per_step": (n - 1) / len(steps),
        "bound": plain / (ttft + sum(cost.estimate(1 + a) for _, a in steps)),
        "bound_free_rows": plain / (ttft + len(steps) * t1),
        "full": plain / (ttft + sum(cost.estimate(1 + d) for d, _ in steps)),
    }


def variants(cfg: dict) -> list[tuple[str, str, dict]]:
    """(name, proposer, config) of every proposal scheme priced."""
    out = [("ngram", "ngram", cfg), ("oracle", "oracle", cfg)]
    out += [(f"ngram_max{m}", "ngram", dict(cfg, prompt_lookup_max=m)) for m in (8, 16)]
    out += [("earliest", "earliest", cfg), ("vote", "vote", cfg)]
    return out + [
        (f"ngram_k{k}_min{lo}", "ngram", dict(cfg, num_speculative_tokens=k, prompt_lookup_min=lo))
        for k, lo in GRID
    ]


def run_one(llm: LLM, req) -> dict:
    """Prompt and output ids, ttft (a max_tokens=1 run) and the full run's time."""
    t = time.perf_counter()
    llm.chat([req.messages], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    ttft = time.perf_counter() - t
    params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    o = llm.chat([req.messages], params, use_tqdm=False)[0]
    total = time.perf_counter() - t
    return {"prompt": list(o.prompt_token_ids), "output": list(o.outputs[0].token_ids),
            "ttft_s": ttft, "total_s": total}  # fmt: skip


def run_both(off: LLM, on: LLM, reqs) -> tuple[list[dict], list[dict]]:
    """Each request off and on back to back, the order alternating (a drifting host moves
    both)."""
    plain, spec = [], []
    for i, r in enumerate(reqs):
        if i % 2:
            spec.append(run_one(on, r))
            plain.append(run_one(off, r))
        else:
            plain.append(run_one(off, r))
            spec.append(run_one(on, r))
    return plain, spec


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="default: the embedded default model")
    p.add_argument("--workload", default="grounded")
    p.add_argument("--num-requests", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spec", default=SPEC)
    p.add_argument("--out", default="benchmarks/results/spec_ceiling.json")
    args = p.parse_args()
    cfg = {**json.loads(SPEC), **json.loads(args.spec)}  # the n-gram variants' keys
    # Salted as bench_serving salts (a fresh nonce per run): the same prompts it serves.
    reqs = make_workload(args.workload, args.num_requests, args.seed, new_salt())
    kw = {"model": args.model} if args.model else {}
    off = LLM(**kw, enable_prefix_caching=False, speculative_config=None)
    on = LLM(**kw, enable_prefix_caching=False, speculative_config=json.loads(args.spec))
    warm = make_workload(args.workload, 1, args.seed + 1, new_salt())
    run_both(off, on, warm)
    plain, spec = run_both(off, on, reqs)
    for a, b in zip(plain, spec, strict=True):
        if a["output"] != b["output"]:
            sys.exit("speculation changed a greedy output: see tests/engine/test_spec_decode.py")
    cost = on.engine.core.scheduler.proposer.cost
    rows, cache = [], SuffixCache(10000, 1 << 16)
    for a, b in zip(plain, spec, strict=True):
        n = len(a["output"])
        row = {
            "output_tokens": n,
            "ttft_s": a["ttft_s"],
            "off_s": a["total_s"],
            "on_s": b["total_s"],
        }
        for name, method, c in variants(cfg):
            row[name] = price(replay(a["prompt"], a["output"], method, c), cost, a["ttft_s"], n)
        for name, budget in SUFFIX_VARIANTS:
            steps = replay_suffix(a["prompt"], a["output"], cache, budget)
            row[name] = price(steps, cost, a["ttft_s"], n)
        cache.add(None, a["output"])
        rows.append(row)

    def med(f):
        return statistics.median(f(r) for r in rows)

    summary = {
        "measured_on_off": med(lambda r: r["off_s"] / r["on_s"]),
        "ttft_share_off": med(lambda r: r["ttft_s"] / r["off_s"]),
        "step_cost_ms": {
            str(k): round(cost.estimate(k) * 1e3, 3) for k in cost.measured_rows if k <= 33
        },
    }
    methods = [name for name, _, _ in variants(cfg)] + [name for name, _ in SUFFIX_VARIANTS]
    for method in methods:
        for key in ("tokens_per_step", "bound", "bound_free_rows", "full"):
            summary[f"{method}_{key}"] = med(lambda r, m=method, k=key: r[m][k])
    result = {"machine": machine_info(), "workload": args.workload, "speculative_config": cfg,
              "num_requests": len(reqs), "summary": summary, "requests": rows}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    s = summary
    print(f"{args.workload}: {len(reqs)} requests, prefill {100 * s['ttft_share_off']:.0f}% of a "
          f"plain request; step ms by rows {s['step_cost_ms']}")  # fmt: skip
    print(f"measured on/off (offline, medians per request): {s['measured_on_off']:.2f}x")
    for m in methods:
        print(f"{m:15} tokens/step {s[f'{m}_tokens_per_step']:.2f}  bound {s[f'{m}_bound']:.2f}x  "
              f"with free verification rows {s[f'{m}_bound_free_rows']:.2f}x  "
              f"(every proposal in full: {s[f'{m}_full']:.2f}x)")  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
