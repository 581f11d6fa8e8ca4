"""A request's logits are bitwise the same alone, batched with 1-63 others (in its prefill
step and in every decode step), and after a prefix-cache hit: one numeric path per layer
whatever the row count (the CPU kernels' contract; docs/architecture.md). SmolLM2, the
default configuration (the GGUF's blocks, activations rounded to bf16 where the CPU has
AVX512-BF16 — multiplied on AMX tiles where it has AMX-BF16 — else float32; the block-table
attention, in bf16 products beside bf16 activations), and --decode-activations int8."""

from __future__ import annotations

import random

import pytest
import torch

from tinyserve.kernels import attention, gemm
from tinyserve.models.loader import load_model
from tinyserve.testing.paged_runner import PagedRunner

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not gemm.available() or attention.library() is None,
        reason="the batch-invariant path needs the AVX2 kernels (x86 CPU with AVX2/FMA/F16C)",
    ),
]

PROMPT_LEN, DECODE_STEPS, BLOCK = 40, 6, 16


@pytest.fixture(scope="module")
def model(smollm2_gguf_path):
    net, _ = load_model(smollm2_gguf_path, torch.float32, "cpu")
    assert net.attention_backend == "kernel"
    return net


@pytest.fixture(scope="module")
def target():
    rng = random.Random(0)
    return [rng.randrange(100, 49000) for _ in range(PROMPT_LEN + DECODE_STEPS)]


@pytest.fixture(scope="module")
def alone(model, target):
    return PagedRunner(model, BLOCK, num_blocks=16).prefill_then_decode(target, PROMPT_LEN)


@pytest.mark.skipif(not gemm.amx_active(), reason="needs a CPU with AMX-BF16 (and the tile state)")
def test_on_an_amx_cpu_these_tests_run_the_tiles(model):
    names = {layer.method.name for layer in model.linear_layers().values()}
    assert names == {"kernel-q4_1+bf16", "kernel-q8_0+bf16"}  # every matmul: gemm_amx.h
    assert model.attention_method.tiles  # attention_amx.h, in every layer:
    assert all(layer.self_attn.method is model.attention_method for layer in model.model.layers)
    assert model.model.step_plan is not None  # ... in the fused step too (its entry points)


@pytest.mark.skipif(not gemm.bf16_available() or not attention.uses_bf16_products(64),
                    reason="needs a CPU with AVX512-BF16")  # fmt: skip
def test_beside_bf16_activations_these_tests_run_bf16_attention_products(model):
    """SmolLM2's heads of 64 on AVX512-BF16: attention_dp.h's dot products (attention_amx.h's
    tiles on AMX) in every layer."""
    assert all(getattr(layer.method, "bf16", False) for layer in model.linear_layers().values())
    assert model.attention_method.tiles
    assert all(layer.self_attn.method is model.attention_method for layer in model.model.layers)


@pytest.mark.parametrize("batch", [1, 7, 33, 64])
def test_logits_alone_equal_logits_batched(model, target, alone, batch):
    rng = random.Random(batch)
    others = {f"o{i}": [rng.randrange(100, 49000) for _ in range(rng.randint(2, 20))]
              for i in range(batch - 1)}  # fmt: skip
    runner = PagedRunner(model, BLOCK, num_blocks=8 * batch + 16, seed=batch)
    # One step prefills everyone (the target's chunk among the others' prompts) ...
    order = list(others.items())
    at = rng.randrange(len(order) + 1)
    chunks = order[:at] + [("t", target[:PROMPT_LEN])] + order[at:]
    rows = [runner.step(chunks)[at]]
    # ... then every sequence decodes one token per step: `batch` rows per step.
    for tok in target[PROMPT_LEN:]:
        step = [(seq, [rng.randrange(100, 49000)]) for seq, _ in order]
        step.insert(at, ("t", [tok]))
        rows.append(runner.step(step, decode={seq for seq, _ in step})[at])
    batched = torch.cat(rows)
    assert torch.equal(batched, alone), f"max |diff| {(batched - alone).abs().max():.3g}"


def test_logits_alone_equal_logits_after_a_prefix_cache_hit(model, target, alone):
    runner = PagedRunner(model, BLOCK, num_blocks=16, seed=3)
    cached = 2 * BLOCK  # two whole blocks computed by an earlier request
    runner.step([("earlier", target[:cached] + [7, 8, 9])])
    runner.share_prefix("t", "earlier", cached)
    rows = [runner.step([("t", target[cached:PROMPT_LEN])])[0]]
    for tok in target[PROMPT_LEN:]:
        rows.append(runner.step([("t", [tok])], decode={"t"})[0])
    hit = torch.cat(rows)
    assert torch.equal(hit, alone[cached:])


# ---- --decode-activations int8: the same invariance, and its distance from the float path


@pytest.fixture(scope="module")
def int8_model(smollm2_gguf_path):
    net, _ = load_model(smollm2_gguf_path, torch.float32, "cpu", decode_activations="int8")
    names = {m.method.name for m in net.linear_layers().values()}
    bf16 = "+bf16" if gemm.bf16_available() else ""  # prompt rows: the default activations
    assert names == {f"kernel-q4_1{bf16}+int8-decode", f"kernel-q8_0{bf16}+int8-decode"}
    return net


@pytest.mark.skipif(not gemm.q8_available(), reason="needs the AVX2 integer kernel")
def test_int8_decode_logits_alone_equal_batched_and_prefix_cached(int8_model, target, alone):
    float_alone = alone
    alone = PagedRunner(int8_model, BLOCK, num_blocks=16).prefill_then_decode(target, PROMPT_LEN)
    rng = random.Random(5)
    others = [f"o{i}" for i in range(32)]
    runner = PagedRunner(int8_model, BLOCK, num_blocks=8 * 33 + 16, seed=5)
    prompts = [(s, [rng.randrange(100, 49000) for _ in range(rng.randint(2, 20))]) for s in others]
    rows = [runner.step([*prompts[:9], ("t", target[:PROMPT_LEN]), *prompts[9:]])[9]]
    for tok in target[PROMPT_LEN:]:
        step = [(s, [rng.randrange(100, 49000)]) for s in others]
        step.insert(9, ("t", [tok]))
        rows.append(runner.step(step, decode={s for s, _ in step})[9])
    assert torch.equal(torch.cat(rows), alone)
    cached = PagedRunner(int8_model, BLOCK, num_blocks=16, seed=6)
    cached.step([("earlier", target[: 2 * BLOCK] + [5, 6])])
    cached.share_prefix("t", "earlier", 2 * BLOCK)
    rows = [cached.step([("t", target[2 * BLOCK : PROMPT_LEN])])[0]]
    rows += [cached.step([("t", [tok])], decode={"t"})[0] for tok in target[PROMPT_LEN:]]
    assert torch.equal(torch.cat(rows), alone[2 * BLOCK :])
    # Decode rows really take the other path: the float default differs there, not before.
    assert torch.equal(float_alone[:PROMPT_LEN], alone[:PROMPT_LEN])
    assert not torch.equal(float_alone[PROMPT_LEN:], alone[PROMPT_LEN:])


# Rounded activations, measured on this model teacher-forced on chat answers against torch's
# fp32 path: logits within 2.5% (int8 decode rows; |error| per matmul <= sum_b dx_b / 2 *
# |w|_1, test_cpu_kernels.py) and 0.92% (bf16 rows: one rounding of 2^-9 per activation) of
# their range, KL <= 0.011 and 0.0021 nats, every argmax the same. Asserted with 2x margin.
ROUNDED = {
    "int8-decode": ({"decode_activations": "int8", "kernel_activations": "float32"}, 0.05, 0.022),
    "bf16": ({"kernel_activations": "bfloat16"}, 0.02, 0.0045),
}


@pytest.mark.parametrize("mode", list(ROUNDED))
def test_rounded_activations_stay_close_to_the_float_reference_on_chat_text(
    mode, smollm2_gguf_path
):
    """Errors compound over 30 layers; int8 rounds decode rows only, so prompt rows stay
    float (1e-3); bf16 rounds every row."""
    from tinyserve.models.loader import load_tokenizer, resolve_model_source

    if not (gemm.q8_available() if mode == "int8-decode" else gemm.bf16_available()):
        pytest.skip(f"{mode} needs " + ("the AVX2 integer kernel" if mode == "int8-decode"
                                        else "a CPU with AVX512-BF16"))  # fmt: skip
    kwargs, max_rel, max_kl = ROUNDED[mode]
    net, _ = load_model(smollm2_gguf_path, torch.float32, "cpu", **kwargs)
    ref, _ = load_model(smollm2_gguf_path, torch.float32, "cpu", cpu_kernels=False)
    tok = load_tokenizer(resolve_model_source(smollm2_gguf_path))
    chats = [("Tell me one fact about the Moon.", "The Moon drifts away from Earth, about four "
              "centimetres every year."),
             ("What is the capital of France?", "The capital of France is Paris, known for "
              "the Eiffel Tower and its museums.")]  # fmt: skip
    agree = total = 0
    for question, answer in chats:
        msgs = [{"role": "user", "content": question}]
        prompt = _ids(tok.apply_chat_template(msgs, add_generation_prompt=True))
        full = _ids(tok.apply_chat_template(msgs + [{"role": "assistant", "content": answer}]))
        n = len(prompt) if mode == "int8-decode" else 0  # the rows that are rounded from
        got = PagedRunner(net, 4, num_blocks=64).prefill_then_decode(full, len(prompt))
        want = PagedRunner(ref, 4, num_blocks=64).prefill_then_decode(full, len(prompt))
        assert n == 0 or (got[:n] - want[:n]).abs().max() < 1e-3
        span = (want[n:].amax(-1) - want[n:].amin(-1))[:, None]
        assert ((got[n:] - want[n:]).abs() / span).max() < max_rel
        assert not torch.equal(got[n:], want[n:])  # the rounding is there
        lw, lg = torch.log_softmax(want[n:], -1), torch.log_softmax(got[n:], -1)
        assert (lw.exp() * (lw - lg)).sum(-1).max() < max_kl
        agree += int((got[n:].argmax(-1) == want[n:].argmax(-1)).sum())
        total += len(full) - n
    assert agree >= 0.9 * total


def _ids(enc) -> list[int]:
    return [int(t) for t in (enc["input_ids"] if not isinstance(enc, list) else enc)]
