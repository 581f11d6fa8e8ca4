"""Dump the logits every numerics path gives on fixed prompts, for a bitwise A/B between two
checkouts around a refactor of the model code (issue 38's "the same greedy tokens and logits
bitwise before and after"). Run it once per checkout, then compare:

    PYTHONPATH=/path/to/old python scripts/ab_logits.py old.pt
    PYTHONPATH=/path/to/new python scripts/ab_logits.py new.pt
    python scripts/ab_logits.py --compare old.pt new.pt

Models: tiny random Llama (llama3 RoPE, tied head) and Qwen2 (q/k/v bias) checkpoints built
with a fixed seed, and the default model's Q4_1 GGUF. Paths: the CPU kernels with the fused
step, without it, and the torch reference. Each: a 20-token prefill then 8 teacher-forced
decode steps through the paged cache, plus a batched step mixing a prefill with decodes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch


def _runs(model) -> dict[str, torch.Tensor]:
    from tinyserve.testing.checkpoints import random_tokens
    from tinyserve.testing.paged_runner import PagedRunner

    vocab = model.config.vocab_size
    tokens = random_tokens(28, seed=3, vocab=min(vocab, 256))
    runner = PagedRunner(model, block_size=4, num_blocks=64, seed=1)
    out = {"prefill": runner.step([("s", tokens[:20])])[0]}
    for pos in range(20, 28):
        out[f"decode{pos}"] = runner.step([("s", [tokens[pos]])], decode={"s"})[0]
    a, b = random_tokens(9, seed=4, vocab=min(vocab, 256)), random_tokens(5, seed=5, vocab=min(vocab, 256))
    runner.step([("a", a[:8]), ("b", b[:4])])
    mixed = runner.step([("a", a[8:]), ("b", b[4:]), ("c", tokens[:7])], decode={"a", "b"})
    out.update({f"mixed{i}": t for i, t in enumerate(mixed)})
    return out


def dump(path: str) -> None:
    from tinyserve.models.default_model import default_gguf_path
    from tinyserve.models.loader import load_model
    from tinyserve.testing.checkpoints import (
        LLAMA3_ROPE,
        build_hf,
        llama_config,
        qwen2_config,
        save_hf,
    )

    results: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory() as tmp:
        sources = {
            "llama": save_hf(build_hf(llama_config(rope_parameters=dict(LLAMA3_ROPE))), Path(tmp) / "l"),
            "qwen2": save_hf(build_hf(qwen2_config()), Path(tmp) / "q"),
            "smollm2_q4_1": default_gguf_path(),
        }
        paths = {
            "fused": dict(cpu_kernels=True, fused_step=True),
            "kernels": dict(cpu_kernels=True, fused_step=False),
            "torch": dict(cpu_kernels=False),
        }
        for name, src in sources.items():
            for pname, kw in paths.items():
                model, _ = load_model(src, dtype=torch.float32, **kw)
                for key, t in _runs(model).items():
                    results[f"{name}/{pname}/{key}"] = t
                print(name, pname, file=sys.stderr)
    torch.save(results, path)


def compare(old: str, new: str) -> int:
    a, b = torch.load(old), torch.load(new)
    bad = [k for k in a if k not in b or not torch.equal(a[k], b[k])]
    print(f"{len(a)} tensors, {len(a) - len(bad)} bitwise equal, {len(bad)} differ")
    for k in bad[:20]:
        print("  differs:", k)
    return 1 if bad or set(a) != set(b) else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?")
    p.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    args = p.parse_args()
    if args.compare:
        return compare(*args.compare)
    dump(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
