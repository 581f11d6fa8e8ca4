"""Shared fixtures. The default model (SmolLM2-135M GGUF) is fetched once into the cache
folder by scripts/fetch_default_model.sh (CI does this before the tests)."""

from __future__ import annotations

import faulthandler
import os

import pytest

# Triton decides at import whether its library functions are compiled or interpreted, and
# torch._dynamo imports it early; so, unless the tests target CUDA, interpreter mode is set
# before anything imports it: the CUDA decode-attention kernel then runs on CPU tensors
# (tests/kernels/test_triton_attention.py, kernels/triton_attention.py).
if not os.environ.get("TINYSERVE_TEST_DEVICE", "cpu").startswith("cuda"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """On a crash (a segmentation fault in native code), print the crashing thread's Python
    stack only: pytest's handler prints every thread, and CI's log keeps only the head and
    tail of that, which cut the crashing frame out of stop 19's report."""
    from _pytest.faulthandler import fault_handler_stderr_fd_key

    if fault_handler_stderr_fd_key in config.stash:
        faulthandler.enable(file=config.stash[fault_handler_stderr_fd_key], all_threads=False)


@pytest.fixture(scope="session")
def smollm2_gguf_path():
    from tinyserve.models.default_model import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf_path):
    """transformers' own reading of the default GGUF, float32: the parity tests' reference
    (loaded once a session: transformers dequantizes it in ~13 s)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path):
    from transformers import AutoTokenizer

    from tinyserve.models.default_model import tokenizer_dir_for

    return AutoTokenizer.from_pretrained(str(tokenizer_dir_for(smollm2_gguf_path)))


@pytest.fixture(scope="session")
def test_device() -> str:
    """The device of the tests marked ``device`` (``TINYSERVE_TEST_DEVICE``, default cpu;
    tinyserve/testing/device.py); they skip, saying why, where it is absent."""
    from tinyserve.testing.device import device_under_test, unavailable_reason

    name = device_under_test()
    reason = unavailable_reason(name)
    if reason is not None:
        pytest.skip(reason)
    return name


@pytest.fixture
def fresh_cache(tmp_path):
    """An empty cache folder for a subprocess ($TINYSERVE_CACHE_DIR: nothing calibrated,
    downloaded or converted yet) that shares only the compiled kernels with this run's cache:
    they are named by a hash of their sources and flags, so sharing cannot make them stale,
    and gemm.c alone takes ~30 s to compile."""
    from tinyserve.utils.cache import cache_dir

    kernels = cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    fresh = tmp_path / "cache"
    fresh.mkdir()
    (fresh / "kernels").symlink_to(kernels, target_is_directory=True)
    return fresh
