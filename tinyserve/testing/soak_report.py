"""The soak and overload drivers' results as the JSON figures benchmarks/results/soak.json
and docs/reliability.md are made of."""

from __future__ import annotations

import json
import re
from dataclasses import asdict

from tinyserve.testing.stats import median


def _tally_outcomes(plans, outcomes) -> dict:
    t = {"statuses": {}, "mismatches": [], "unfinished": [], "transport_errors": [],
         "completed": 0, "disconnected": 0, "n2": 0, "stops": 0, "tokens": 0}  # fmt: skip
    for plan, o in zip(plans, outcomes, strict=True):
        t["statuses"][str(o.status)] = t["statuses"].get(str(o.status), 0) + 1
        t["n2"] += plan.body.get("n", 1) == 2
        t["stops"] += "stop" in plan.body
        if o.error and o.status is None:
            t["transport_errors"].append((plan.index, o.error))
        if o.disconnected:
            t["disconnected"] += 1
            continue
        if o.status != 200:
            continue
        if not o.completed or len(o.finish_per_choice) != plan.body.get("n", 1):
            t["unfinished"].append(plan.index)
            continue
        t["completed"] += 1
        streamed = sum(o.tokens_per_choice.values())
        t["tokens"] += streamed
        if o.usage != streamed:
            t["mismatches"].append({"request": plan.index, "streamed": streamed, "usage": o.usage})
    return t


def _after(idle: dict) -> dict:
    return {
        "running": idle["num_requests_running"],
        "waiting": idle["num_requests_waiting"],
        "free_blocks": idle["kv_cache_free_blocks"],
        "total_blocks": idle["kv_cache_total_blocks"],
        "leaked_blocks": idle["kv_cache_total_blocks"] - idle["kv_cache_free_blocks"],
    }


def summarize_soak(cfg, plans, outcomes, idle, wall, rss_mid, rss_end) -> dict:
    t = _tally_outcomes(plans, outcomes)
    statuses = t["statuses"]
    num_5xx = sum(v for k, v in statuses.items() if k != "None" and int(k) >= 500)
    growth = None if not (rss_mid and rss_end) else (rss_end - rss_mid) / rss_mid
    return {
        "config": asdict(cfg),
        "wall_s": round(wall, 1),
        "requests": len(plans),
        "with_n2": t["n2"],
        "with_stop": t["stops"],
        "completed": t["completed"],
        "disconnected": t["disconnected"],
        "output_tokens_streamed": t["tokens"],
        "status_counts": statuses,
        "num_5xx": num_5xx,
        "transport_errors": t["transport_errors"][:10],
        "num_transport_errors": len(t["transport_errors"]),
        "unfinished_streams": t["unfinished"][:10],
        "num_unfinished_streams": len(t["unfinished"]),
        "usage_mismatches": t["mismatches"][:10],
        "num_usage_mismatches": len(t["mismatches"]),
        "after": _after(idle),
        "rss_mid_mb": None if rss_mid is None else round(rss_mid / 2**20, 1),
        "rss_end_mb": None if rss_end is None else round(rss_end / 2**20, 1),
        "rss_growth": None if growth is None else round(growth, 4),
    }


def _well_shaped_429(r: dict) -> bool:
    try:
        err = json.loads(r["body"]).get("error")
    except ValueError:
        err = None
    return bool(
        isinstance(err, dict)
        and err.get("type") == "rate_limit_error"
        and err.get("message")
        and r["headers"].get("retry-after")
    )


def summarize_overload(recs: list[dict], clients: int, max_tokens: int, idle: dict) -> dict:
    ok, rejected = [], []
    for r in recs:
        if r["status"] == 200:
            m = re.findall(r'"completion_tokens":\s*(\d+)', r["body"])
            r["usage"] = int(m[-1]) if m and "data: [DONE]" in r["body"] else None
            ok.append(r)
        elif r["status"] == 429:
            rejected.append(r)
    statuses = sorted({r["status"] for r in recs})
    after = _after(idle)
    return {
        "clients": clients,
        "max_tokens": max_tokens,
        "status_counts": {str(s): sum(r["status"] == s for r in recs) for s in statuses},
        "admitted": len(ok),
        "admitted_completed": sum(r["usage"] == max_tokens for r in ok),
        "rejected_429": len(rejected),
        "rejected_with_error_shape_and_retry_after": sum(map(_well_shaped_429, rejected)),
        "max_429_latency_s": round(max((r["headers_s"] for r in rejected), default=0.0), 3),
        "median_429_latency_s": median([r["headers_s"] for r in rejected], 3),
        "median_admitted_e2e_s": median([r["e2e_s"] for r in ok], 3),
        "after": {k: after[k] for k in ("running", "waiting", "leaked_blocks")},
    }
