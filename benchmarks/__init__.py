"""The benchmark scripts (each runs as ``python benchmarks/<name>.py``; tests import the
model-free parts as ``benchmarks.<name>``)."""
