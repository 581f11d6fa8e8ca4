#!/usr/bin/env bash
# The issue-41 window A/B as run (2026-12-06): 8c47555 (before sliding windows) vs HEAD.
#   git archive 8c47555 | tar -x -C /tmp/ts_before_win
cd "$(dirname "$0")/../../.." && . .venv/bin/activate
exec benchmarks/step_ab.sh /tmp/ts_before_win benchmarks/results/window_ab
