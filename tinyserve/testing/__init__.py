"""Test support shared by the suite (tests/) and the benchmarks (benchmarks/): tiny random
checkpoints, server launchers, an SSE client, statistics, the paged-cache driver of the
parity tests, and the soak, overload and fuzz drivers with their reports.

Nothing else in tinyserve imports this package; it may import anything in tinyserve.
"""
