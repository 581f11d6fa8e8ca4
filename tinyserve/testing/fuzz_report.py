"""The fuzz drivers' results as the JSON figures benchmarks/results/fuzz.json and
docs/reliability.md are made of."""

from __future__ import annotations

import time


def tally_summary(tally) -> dict:
    """A :class:`tinyserve.testing.fuzz.Tally` as figures (lists cut to 20)."""
    return {
        "cases": tally.cases,
        "status_counts": {str(k): v for k, v in sorted(tally.statuses.items())},
        "num_5xx": len(tally.server_errors),
        "server_errors": tally.server_errors[:20],
        "num_bad_error_shapes": len(tally.bad_shapes),
        "bad_error_shapes": tally.bad_shapes[:20],
        "num_unexpected_status": len(tally.unexpected),
        "unexpected_status": tally.unexpected[:20],
    }


def hostile_result(tally, transport_errors: list[str], healthy: bool, wall: float) -> dict:
    return {
        **tally.summary(),
        "num_transport_errors": len(transport_errors),
        "transport_errors": transport_errors[:20],
        "healthy_after": healthy,
        "wall_s": round(wall, 1),
    }


def schemathesis_result(run, healthy: bool, wall: float) -> dict:
    """``run``: the driver's state (tally, per_op, unsendable, transport_errors, ...)."""
    return {
        **run.tally.summary(),
        "operations": run.per_op,
        "unsendable_cases": run.unsendable,
        "num_transport_errors": len(run.transport_errors),
        "transport_errors": run.transport_errors[:20],
        "max_examples": run.max_examples,
        "seed": run.seed,
        "healthy_after": healthy,
        "wall_s": round(wall, 1),
    }


def fuzz_result(hostile: dict, st: dict, idle: dict, code: int, log: str, machine: dict) -> dict:
    """The whole of benchmarks/results/fuzz.json."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "hostile": hostile,
        "schemathesis": st,
        "after": idle,
        "server_exit_code": code,
        "traceback_in_server_log": "Traceback" in log,
        "machine": machine,
    }
