"""RMSNorm, computed in float32 like the reference implementation, optionally fused with the
residual add before it (vLLM's ``norm(x, residual) -> (normed, x + residual)``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinyserve.kernels import ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.use_kernel = False  # tinyserve/kernels/ops.c; set once by the loader

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)``; the kernel
        path writes the sum into ``residual`` itself (the layer stack owns that tensor)."""
        if self.use_kernel:
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            return ops.rms_norm(x, self.weight, self.eps, residual), residual
        if residual is not None:
            residual = x + residual
            return self.plain(residual), residual
        return self.plain(x)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """The norm over the last dim of ``x`` (any leading shape), in torch."""
        if x.dtype == torch.float32:  # one fused op; same arithmetic as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        variance = xf.pow(2).mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(variance + self.eps)
        if self.weight.dtype == torch.float32:  # Gemma's (models/gemma3.py): scaled in float32,
            return (xf * self.weight).to(dtype)  # then rounded, as transformers' Gemma3RMSNorm
        return self.weight * xf.to(dtype)  # Llama's: rounded, then scaled in the model's dtype
