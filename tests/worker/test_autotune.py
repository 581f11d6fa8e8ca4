"""``--dtype auto`` on a CPU: the choice rule, the per-CPU cache, and the start-up log."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tinyserve.kernels import gemm
from tinyserve.models.loader import layer_matmuls
from tinyserve.testing.checkpoints import build_hf, llama_config, save_hf
from tinyserve.worker import autotune


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    return save_hf(build_hf(llama_config()), tmp_path_factory.mktemp("llama"))


@pytest.fixture
def measuring(monkeypatch):
    """Calibrate on any CPU: as if it had native bf16 (else nothing is measured), and trust
    the timings whatever the machine's load (the load rule has its own tests)."""
    from tinyserve.worker import device

    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(autotune, "BUSY_SHARE", float("inf"))


def test_choice_minimises_the_worst_ratio_and_prefers_the_invariant_path():
    k, b = "float32+kernels", "bfloat16"
    # bf16 faster only at prefill, much slower at decode: the kernels win.
    assert (
        autotune.choose({k: {1: 1.0, 16: 2.0, 128: 10.0}, b: {1: 3.0, 16: 3.0, 128: 8.0}})[0] == k
    )
    # bf16 faster everywhere by 5%: within the 10% preference for the invariant path.
    t = {k: {1: 1.0, 16: 2.0, 128: 10.0}, b: {1: 0.95, 16: 1.9, 128: 9.5}}
    assert autotune.choose(t)[0] == k
    # bf16 twice as fast everywhere (a CPU with native bf16 and a dense checkpoint): bf16.
    t = {k: {1: 2.0, 16: 4.0, 128: 20.0}, b: {1: 1.0, 16: 2.0, 128: 10.0}}
    pick, why = autotune.choose(t)
    assert pick == b and "bfloat16" in why and "@128" in why


@pytest.mark.skipif(not gemm.available(), reason="needs the AVX2 kernels")
def test_calibration_is_measured_once_per_cpu_and_cached(tmp_path, monkeypatch, measuring):
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_LLC_BYTES", 4 << 20)  # small weights: a fast test
    calls = []
    real = autotune._measure
    monkeypatch.setattr(autotune, "_measure", lambda *a: calls.append(a) or real(*a))
    layer = (("q4_1", 256, 128), ("f32", 128, 256))
    first = autotune.choose_cpu_dtype(layer)
    assert first.dtype in (torch.float32, torch.bfloat16)
    assert first.reason.startswith("measured in")
    assert set(first.timings_ms) == {"float32+kernels", "bfloat16"}
    second = autotune.choose_cpu_dtype(layer)
    assert second.reason.startswith("cached calibration") and second.dtype == first.dtype
    assert len(calls) == 1  # the second start measured nothing
    cache = json.loads((tmp_path / "calibration.json").read_text())
    (key,) = cache
    from tinyserve.utils.cpu import cpu_model_name

    assert key.startswith(cpu_model_name()) and key.endswith("|q4_1:256x128,f32:128x256")


@pytest.mark.skipif(not gemm.available(), reason="needs the AVX2 kernels")
def test_engine_logs_the_dtype_choice_and_why(
    tiny_llama_dir, tmp_path, monkeypatch, caplog, measuring
):
    from tinyserve.engine.llm_engine import LLMEngine

    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_LLC_BYTES", 4 << 20)
    with caplog.at_level(logging.INFO):
        engine = LLMEngine(model=str(tiny_llama_dir), num_blocks=16, load_tokenizer=False)
    lines = [r.getMessage() for r in caplog.records if "--dtype auto ->" in r.getMessage()]
    assert len(lines) == 1 and "float32+kernels" in lines[0], lines
    cfg = engine.model_config
    layer = layer_matmuls(str(tiny_llama_dir))
    assert layer[2] == ("f32", 2 * cfg.intermediate_size, cfg.hidden_size)  # gate/up
    # a float checkpoint with --quantization int8 is held as Q8_0 blocks (choose_linear_methods)
    assert {kind for kind, _, _ in layer_matmuls(str(tiny_llama_dir), "int8")} == {"q8_0"}
    cached = autotune.choose_cpu_dtype(layer)
    assert cached.reason.startswith("cached") and engine.executor.dtype == cached.dtype
    # A flag still overrides: no calibration at all.
    caplog.clear()
    with caplog.at_level(logging.INFO):
        LLMEngine(model=str(tiny_llama_dir), num_blocks=16, load_tokenizer=False, dtype="float32")
    assert not any("--dtype auto" in r.getMessage() for r in caplog.records)


def test_layer_matmuls_of_the_default_gguf_name_its_blocks(smollm2_gguf_path):
    """What the calibration times is the layer the engine runs: SmolLM2's q/k/v, o, gate/up
    and down with the GGUF's own block kinds."""
    heads, kv, hd, h, inter = 9, 3, 64, 576, 1536
    assert layer_matmuls(smollm2_gguf_path) == (
        ("q4_1", (heads + 2 * kv) * hd, h),
        ("q4_1", h, heads * hd),
        ("q4_1", 2 * inter, h),
        ("q4_1", h, inter),
    )
    assert layer_matmuls(smollm2_gguf_path, "int8")[0][0] == "q4_1"  # a GGUF keeps its blocks


@pytest.mark.skipif(not gemm.available(), reason="needs the AVX2 kernels")
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_calibration_leaves_no_openmp_team_behind(fresh_cache):
    """The kernels' OpenMP team of the thread that calibrated would outlive it and, with more
    libgomp threads than CPUs, stop the engine's team spinning between kernel calls (served
    TPOT doubled): the calibration runs in a thread that exits. A fresh process, so that no
    earlier test has left a team in this one."""
    code = (
        "import os\n"
        "from tinyserve.kernels import gemm\n"
        "from tinyserve.worker import autotune\n"
        "from tinyserve.worker import device\n"
        "device.cpu_has_native_bf16 = lambda: True  # measure on any CPU\n"
        "autotune.BUSY_SHARE = float('inf')\n"
        "gemm.library()\n"
        "n = lambda: len(os.listdir('/proc/self/task'))\n"
        "before = n()\n"
        "c = autotune.choose_cpu_dtype((('q4_1', 256, 128), ('f32', 128, 256)))\n"
        "assert c.reason.startswith('measured'), c.reason\n"
        "import time\n"
        "for _ in range(50):  # a released team's threads exit a moment after their master\n"
        "    if n() == before: break\n"
        "    time.sleep(0.1)\n"
        "print(before, n())\n"
    )
    env = {**os.environ, "TINYSERVE_CACHE_DIR": str(fresh_cache), "TINYSERVE_KERNEL_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(int, out.stdout.split())
    assert after == before


def test_without_native_bf16_nothing_is_measured(tmp_path, monkeypatch):
    """bf16 is emulated there (5-10x slower than the kernels at every shape): the kernels,
    without a measurement a busy machine could get wrong."""
    from tinyserve.worker import device

    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(autotune, "_measure", lambda *a: pytest.fail("measured"))
    c = autotune.choose_cpu_dtype((("q4_1", 256, 128),))
    assert c.dtype == torch.float32 and "not measured" in c.reason and "bf16" in c.reason
    assert not (tmp_path / "calibration.json").exists()


def _fake_load(monkeypatch, others_per_call: float):
    """cpu_time_snapshot as if other processes used ``others_per_call`` CPU seconds between
    two calls (this process: none)."""
    clock = [0.0]

    def snapshot():
        clock[0] += others_per_call
        return clock[0], 0.0

    monkeypatch.setattr(autotune, "cpu_time_snapshot", snapshot)


def test_a_disturbed_calibration_is_retried_then_not_trusted(tmp_path, monkeypatch, caplog):
    from tinyserve.worker import device

    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)
    calls = []
    fast_bf16 = {"float32+kernels": {1: 30.0, 16: 30.0, 128: 40.0},
                 "bfloat16": {1: 2.0, 16: 20.0, 128: 170.0}}  # fmt: skip
    monkeypatch.setattr(autotune, "_measure", lambda *a: calls.append(a) or fast_bf16)
    layer = (("q4_1", 256, 128),)
    _fake_load(monkeypatch, 1e6)  # others busy on every CPU for the whole sweep
    with caplog.at_level(logging.WARNING):
        c = autotune.choose_cpu_dtype(layer)
    assert c.dtype == torch.float32 and "not cached" in c.reason, c.reason
    assert len(calls) == 2  # measured once more before giving up
    assert not (tmp_path / "calibration.json").exists()
    assert any("calibration disturbed" in r.getMessage() for r in caplog.records)
    # A quiet machine: the same timings are trusted and cached (here they pick bf16).
    _fake_load(monkeypatch, 0.0)
    c = autotune.choose_cpu_dtype(layer)
    assert c.dtype == torch.bfloat16 and c.reason.startswith("measured in")
    assert len(calls) == 3 and (tmp_path / "calibration.json").exists()


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc/stat")
def test_cpu_time_snapshot_sees_another_process_busy():
    from tinyserve.utils.cpu import cpu_time_snapshot, others_cpu_seconds

    before = cpu_time_snapshot()
    spin = "import time\nt = time.time()\nwhile time.time() - t < 1.0: pass\n"
    subprocess.run([sys.executable, "-c", spin], check=True)
    others = others_cpu_seconds(before, cpu_time_snapshot())
    assert others is not None and others >= 0.5, others  # the child's ~1 s of CPU
    assert others_cpu_seconds(None, before) is None


def test_the_kernels_best_candidate_is_preferred_to_torchs_bf16():
    k, bk, b = autotune.KERNELS, autotune.BF16_KERNELS, autotune.TORCH_BF16
    t = {k: {1: 2.0, 16: 4.0, 128: 20.0}, bk: {1: 1.0, 16: 2.1, 128: 10.5},
         b: {1: 1.1, 16: 2.0, 128: 10.0}}  # fmt: skip
    assert autotune.choose(t)[0] == bk  # torch's bf16 within 10%: the invariant bf16 kernels
    t[bk] = {1: 1.0, 16: 3.0, 128: 15.0}
    assert autotune.choose(t)[0] == b  # 1.5x faster at a prefill chunk: torch's
    del t[b]
    assert autotune.choose(t)[0] == bk  # between the kernels' two: the faster
    assert autotune.choose({k: t[bk], bk: t[k]})[0] == k


@pytest.mark.skipif(
    not gemm.bf16_available(), reason="needs a CPU with AVX512-BF16 (bf16 weights' tiles)"
)
def test_a_bf16_checkpoint_may_be_held_in_bf16_on_the_kernels(
    tiny_llama_dir, tmp_path, monkeypatch, caplog, measuring
):
    """``--dtype auto`` on a bf16 safetensors checkpoint: the kernels holding its weights in
    bf16 are a candidate (not for a float32 checkpoint, whose weights they would round); when
    they win, the engine runs float32 with ``quantization`` bf16, every linear on them."""
    from tinyserve.engine.llm_engine import LLMEngine
    from tinyserve.sampling_params import SamplingParams

    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = save_hf(build_hf(llama_config()).to(torch.bfloat16), tmp_path / "bf16")
    seen = []

    def sweep(candidates):  # the bf16 kernels fastest
        seen.append(sorted(candidates))
        return {c: {r: 1.0 if c == autotune.BF16_KERNELS else 2.0 for r in autotune.ROWS}
                for c in candidates}  # fmt: skip

    monkeypatch.setattr(autotune, "_sweep", sweep)
    with caplog.at_level(logging.INFO):
        engine = LLMEngine(model=str(path), num_blocks=16, load_tokenizer=False)
    assert seen == [["bfloat16", "bfloat16+kernels", "float32+kernels"]]
    assert engine.executor.dtype == torch.float32 and engine.executor.load.quantization == "bf16"
    methods = {m.method.name for m in engine.executor.model.linear_layers().values()}
    assert methods == {"kernel-bf16"}
    assert any("float32 + bf16 weights" in r.getMessage() for r in caplog.records)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    while engine.has_unfinished():
        engine.step()
    assert engine.executor.kv_dtype == torch.bfloat16  # as torch's bf16 path cached them
    # A float32 checkpoint is not offered it, even where its config.json says bfloat16 (the
    # stored dtype is read from the safetensors header); nor with float32 activations asked.
    claims = tmp_path / "claims"
    shutil.copytree(tiny_llama_dir, claims)
    cfg = json.loads((claims / "config.json").read_text())
    (claims / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    seen.clear()
    LLMEngine(model=str(claims), num_blocks=16, load_tokenizer=False)
    LLMEngine(model=str(path), num_blocks=16, load_tokenizer=False, kernel_activations="float32")
    assert seen == [["bfloat16", "float32+kernels"]] * 2
    # An asked-for quantization runs on the kernels, in float32, nothing measured.
    seen.clear()
    e = LLMEngine(model=str(path), num_blocks=16, load_tokenizer=False, quantization="int8")
    assert seen == [] and e.executor.dtype == torch.float32


def test_an_input_width_the_kernels_cannot_take_is_not_measured(
    tmp_path, monkeypatch, caplog, measuring
):
    """A layer whose input width is not a multiple of 32 (here the MLP's 112) has no kernel
    weight to time: ``--dtype auto`` raised AttributeError at start-up; now float32, the
    kernels on the layers they take, nothing measured — and ``--quantization`` says which
    layers it does not apply to."""
    from tinyserve.engine.llm_engine import LLMEngine

    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(autotune, "_sweep", lambda c: pytest.fail("measured"))
    path = save_hf(
        build_hf(llama_config(intermediate_size=112)).to(torch.bfloat16), tmp_path / "odd"
    )
    with caplog.at_level(logging.INFO):
        engine = LLMEngine(model=str(path), num_blocks=16, load_tokenizer=False)
        assert engine.executor.dtype == torch.float32
        LLMEngine(model=str(path), num_blocks=16, load_tokenizer=False, quantization="int8")
    logs = [r.getMessage() for r in caplog.records]
    assert any("not a multiple of 32" in m and "not measured" in m for m in logs)
    layers = engine.model_config.num_hidden_layers  # each one's down_proj
    assert any(f"--quantization int8 does not apply to {layers} of" in m for m in logs), logs
