"""bf16 on the test device (TINYSERVE_TEST_DEVICE; scripts/gpu_check.sh runs it on CUDA): a
SmolLM2-shaped random model (30 layers, 9 heads of 64, 3 KV heads, 49152 tokens) through our
loader, decoder and paged cache in bf16, against transformers' own bf16 on the same device.

The tolerance is transformers' own: both bf16 runs are compared with transformers in fp32,
and ours may be at most twice as far from it as transformers' bf16 is (plus 1e-3 of the
logits' scale): bf16 rounds differently in every kernel, so the honest bar is "no worse than
the reference's own bf16", not a fixed number."""

from __future__ import annotations

import pytest
import torch

from tinyserve.models.loader import load_model
from tinyserve.testing.checkpoints import build_hf, random_tokens, save_hf, smollm2_like_config
from tinyserve.testing.paged_runner import PagedRunner

PROMPT, DECODE = 24, 4


@pytest.fixture(scope="module")
def smollm2_like_hf(tmp_path_factory):
    hf = build_hf(smollm2_like_config(), seed=7, randomize=False, attn_implementation="eager")
    return save_hf(hf, tmp_path_factory.mktemp("smollm2_like")), hf


@torch.no_grad()
def _hf_logits(hf, tokens, device, dtype):
    model = hf.to(device=device, dtype=dtype)
    return model(torch.tensor([tokens], device=device)).logits[0].float().cpu()


@pytest.mark.slow
@pytest.mark.device
def test_bf16_smollm2_like_is_as_close_to_fp32_as_transformers_bf16(smollm2_like_hf, test_device):
    path, hf = smollm2_like_hf
    device = torch.device(test_device)
    tokens = random_tokens(PROMPT + DECODE, seed=3, vocab=49152)
    ref = _hf_logits(hf, tokens, device, torch.float32)
    hf_bf16 = _hf_logits(hf, tokens, device, torch.bfloat16)
    hf.to(device="cpu", dtype=torch.float32)

    ours, _ = load_model(path, dtype=torch.bfloat16, device=device)
    runner = PagedRunner(ours, block_size=16, num_blocks=8, seed=1)
    rows = [runner.step([("s", tokens[:PROMPT])])[0]]
    rows += [runner.step([("s", [t])], decode={"s"})[0] for t in tokens[PROMPT:]]
    got = torch.cat(rows)  # prefill, then teacher-forced decode

    scale = ref.abs().max()
    ours_err = (got - ref).abs().max()
    hf_err = (hf_bf16 - ref).abs().max()
    assert hf_err > 0  # bf16 really rounded
    assert ours_err <= 2 * hf_err + 1e-3 * scale, (float(ours_err), float(hf_err), float(scale))
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean()
    hf_agree = (hf_bf16.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree >= hf_agree - 0.15, (float(agree), float(hf_agree))
