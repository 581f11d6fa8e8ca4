"""What the tests share besides fixtures: engine drivers (engine.py), HTTP API helpers
(api.py), kernel helpers (kernels.py), grammar walks (structured.py), the model-free
FakeEngine (fake_engine.py) and the tensor-parallel rank body (tp_ranks.py). Imported as
``tests.support.<module>`` (pytest's ``pythonpath`` puts the repository root on sys.path);
conftest files hold fixtures only, and no test module imports another."""
