"""Device and dtype choice: bf16 where the hardware computes it natively, else fp32."""

from __future__ import annotations

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    if device is None or str(device) == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device 'mps' was asked for but MPS is not available")
    return dev


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16 in /proc/cpuinfo (Linux); anything else computes bf16 slowly."""
    from tinyserve.utils.cpu import cpu_flags

    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "mps":
            return torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(
            f"dtype {dtype!r} is not supported: use auto, float32, bfloat16 or float16"
        ) from None
