"""The model's one matmul entry: torch's GEMM on the float weight, or, for the few-row
matmuls of a decode step, the GGUF block kernel when the loader attached the checkpoint's
quantised blocks (``module.quant``, see tinyserve/kernels/gguf_gemv.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Up to this many rows (tokens) the block kernel beats fp32 GEMM on this CPU: it reads each
# weight once for all rows but its arithmetic grows with them. Measured decode steps of
# SmolLM2 (kernel vs fp32): 29 vs 59 ms at batch 1, 46 vs 91 at 8, 107 vs 132 at 16,
# 160 vs 157 at 24 (benchmarks/bench_step.py).
QUANT_MAX_ROWS = 16


def linear(x: torch.Tensor, module: nn.Module, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ module.weight.T (+ bias)``: [num_tokens, in] -> [num_tokens, out]."""
    quant = getattr(module, "quant", None)
    if quant is not None and x.shape[0] <= QUANT_MAX_ROWS and x.dtype == torch.float32:
        from tinyserve.kernels.gguf_gemv import matmul

        y = matmul(x, quant)
        return y if bias is None else y + bias
    return F.linear(x, module.weight, bias)
