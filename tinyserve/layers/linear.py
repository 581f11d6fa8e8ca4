"""The model's one matmul entry: torch's GEMM on the float weight, or, for the few-row
matmuls of a decode step, the GGUF block kernel when the loader attached the checkpoint's
quantised blocks (``module.quant``, see tinyserve/kernels/gguf_gemv.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinyserve.kernels.gguf_gemv import matmul as block_matmul

# Up to this many rows (tokens) the block kernel beats fp32 GEMM on this CPU: it reads each
# weight once for all rows but its arithmetic grows with them. Measured decode steps of
# SmolLM2, kernel vs fp32 (benchmarks/bench_step.py): 30.6 vs 56.5 ms at batch 1, 53.6 vs
# 86.3 at 8, 97.0 vs 143.6 at 16; a sweep above that: 160 vs 157 ms at 24.
QUANT_MAX_ROWS = 16


def linear(x: torch.Tensor, module: nn.Module, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ module.weight.T (+ bias)``: [num_tokens, in] -> [num_tokens, out]."""
    quant = getattr(module, "quant", None)
    if quant is not None and x.shape[0] <= QUANT_MAX_ROWS and x.dtype == torch.float32:
        y = block_matmul(x, quant)
        return y if bias is None else y + bias
    return F.linear(x, module.weight, bias)
