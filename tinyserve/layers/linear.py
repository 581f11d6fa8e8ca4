"""Linear layers in vLLM's vocabulary, each owning its weight loader, its tensor-parallel
shard math and one :class:`LinearMethod` fixed at load time.

* ``QKVParallelLinear``           q/k/v fused by output rows (shards "q", "k", "v");
                                  column-parallel: each rank holds whole heads
* ``MergedColumnParallelLinear``  gate/up fused (shards "gate", "up"); column-parallel
* ``RowParallelLinear``           o_proj / down_proj: input columns split over the ranks,
                                  one all-reduce after the matmul
* ``VocabParallelEmbedding`` / ``ParallelLMHead``   replicated on every rank (no vocab
                                  split: the sampler then needs no gather)

Methods: :class:`DenseMethod` (torch's GEMM on the float weight, any dtype/device) and
:class:`PackedMethod` (tinyserve/kernels/gemm.c on a GGUF's Q4_1/Q8_0 blocks, int8 with
per-channel scales, a dense weight in bf16, or the float32 weight itself). The packed method
serves every row count with one summation order per output, so a token's numbers do not
depend on its batch.

Every ``forward`` takes ``num_decode``: the step's first rows that are generated (decode)
tokens (the model runner orders them first). With ``--decode-activations int8`` on a GGUF's
blocks those rows go through kernels/qgemm.c, activations rounded to int8 per block of 32 as
llama.cpp does (a decode matmul is bound by unpacking weights; integer dots do 4x the work per
instruction), and prompt rows through the float kernel (compute-bound: faster in float on
AVX2). The path depends only on the row's own token, never on the batch: invariance holds.
Opt-in, because rounding activations moves the logits (greedy text can leave the float
reference's).

``--kernel-activations bfloat16`` (the default, "auto", where the CPU has AVX512-BF16) rounds
the rows the float kernel serves to bf16 and multiplies them with the exact weights on
vdpbf16ps (kernels/gemm_bf16.h): 2x the float kernel on prefill-sized row counts, one
summation order for every row count (still batch-invariant). The error is one bf16 rounding
of each activation (relative 2^-9), far under the 4-bit weights' own; ``float32`` keeps the
logits those of the float reference. bf16 weights (``--quantization bf16``) are served with
bf16 activations only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinyserve.distributed.parallel_state import TPGroup
from tinyserve.kernels import gemm
from tinyserve.kernels.gemm import PackedWeight
from tinyserve.kernels.rows import KINDS as ROW_KINDS
from tinyserve.kernels.rows import kernel_rows


class ShardShapeError(ValueError):
    """A checkpoint tensor (this rank's slice of it) does not fit its destination."""

    def __init__(self, got: list[int], expected: list[int], sliced: bool) -> None:
        super().__init__(f"shape {got} does not fit {expected}")
        self.got, self.expected, self.sliced = got, expected, sliced


# ------------------------------------------------------------------ methods


class LinearMethod:
    """How a layer computes ``x @ W.T (+ bias)``; chosen once when the model is loaded."""

    name = "base"

    def apply(self, layer: LinearBase, x: torch.Tensor, num_decode: int = 0) -> torch.Tensor:
        """``x`` [M, in] -> [M, out]; rows ``[:num_decode]`` are generated tokens."""
        raise NotImplementedError


class DenseMethod(LinearMethod):
    name = "dense"

    def apply(self, layer, x, num_decode=0):
        return F.linear(x, layer.weight, layer.bias)


DECODE_ACTIVATIONS = ("int8", "float32")
KERNEL_ACTIVATIONS = ("float32", "bfloat16")  # or "auto": resolve_kernel_activations


def bf16_activations(kind: str, asked: bool) -> bool:
    """Whether gemm.c multiplies a weight of ``kind`` with activations rounded to bf16: a
    GGUF's blocks where ``asked`` (--kernel-activations), bf16 weights always (the only way
    gemm_bf16.h serves them), float32 weights never."""
    return kind == gemm.BF16 or (asked and kind in (gemm.Q4_1, gemm.Q8_0))


class PackedMethod(LinearMethod):
    """The CPU kernel on a packed weight (float32 activations in and out). With
    ``int8_decode`` (GGUF blocks only), decode rows take the int8-activation kernel; with
    ``bf16`` (GGUF blocks, AVX512-BF16) the other rows are rounded to bf16 (gemm_bf16.h)."""

    def __init__(self, packed: PackedWeight, int8_decode: bool = False, bf16: bool = False):
        blocks = packed.kind in (gemm.Q4_1, gemm.Q8_0)
        self.int8_decode = int8_decode and blocks
        self.bf16 = bf16_activations(packed.kind, bf16 and gemm.bf16_available())
        self.kernel = packed.kernel  # gemm.c's layout
        # The checkpoint's layout only where qgemm.c reads it (int8 decode rows): otherwise
        # it is dropped with the loader's copy, so the blocks are held once.
        self.packed = packed if self.int8_decode else None
        self.name = f"kernel-{packed.kind}" + ("+bf16" if self.bf16 and blocks else "")
        self.name += "+int8-decode" if self.int8_decode else ""

    def apply(self, layer, x, num_decode=0):
        if self.int8_decode and num_decode > 0:
            x = x.contiguous()
            y = torch.empty(x.shape[0], self.kernel.shape[0], dtype=torch.float32)
            gemm.matmul_q8(x[:num_decode], self.packed, out=y[:num_decode])
            if num_decode < x.shape[0]:
                gemm.matmul(x[num_decode:], self.kernel, out=y[num_decode:], bf16=self.bf16)
        else:
            y = gemm.matmul(x, self.kernel, bf16=self.bf16)
        return y if layer.bias is None else y + layer.bias


def copy_weight(dest: torch.Tensor, src: torch.Tensor, sliced: bool = False) -> None:
    if tuple(src.shape) != tuple(dest.shape):
        raise ShardShapeError(list(src.shape), list(dest.shape), sliced)
    dest.copy_(src)


QUANTIZATIONS = ("int8", "bf16")  # weight-only, for a dense checkpoint's float weights


def check_quantization(quantization, cpu_kernels: bool, dtype, device) -> None:
    """ValueError (naming the field) for a ``quantization`` that cannot be honoured: int8 and
    bf16 run only through the CPU kernels, in float32 on the CPU; bf16 on their bf16 tiles
    (AVX512-BF16 or AMX)."""
    if quantization in (None, "none"):
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported: use none, int8 or bf16")
    if not (cpu_kernels and dtype == torch.float32 and torch.device(device).type == "cpu"):
        raise ValueError(
            f"quantization: {quantization} runs through the CPU kernels only (device cpu, dtype "
            "float32, without --no-cpu-kernels)"
        )
    if not gemm.available():
        raise ValueError(
            f"quantization: {quantization} needs the CPU kernels, which cannot be built here"
        )
    if quantization == "bf16" and not gemm.bf16_available():
        raise ValueError("quantization: bf16 weights need a CPU with AVX512-BF16 or AMX-BF16")


def resolve_kernel_activations(kernel_activations: str) -> str:
    """``auto``: bfloat16 where gemm.c has its bf16 tiles (AVX512-BF16), else float32."""
    if kernel_activations == "auto":
        return "bfloat16" if gemm.bf16_available() else "float32"
    if kernel_activations not in KERNEL_ACTIVATIONS:
        raise ValueError(
            f"kernel_activations {kernel_activations!r}: use auto or one of "
            + ", ".join(KERNEL_ACTIVATIONS)
        )
    return kernel_activations


def choose_linear_methods(
    layers: dict[str, nn.Module],
    packed: dict[str, PackedWeight],
    use_kernels: bool,
    quantization: str | None = None,
    decode_activations: str = "float32",
    kernel_activations: str = "float32",
) -> dict[str, int]:
    """Fix every layer's method once. With ``use_kernels`` (CPU, float32, kernels built):
    the checkpoint's own blocks where ``packed`` has them (decode rows with int8 activations
    if ``decode_activations="int8"``, the other rows rounded to bf16 if ``kernel_activations``
    resolves to "bfloat16"), else int8 weights when asked, else the float32
    weight — all through the batch-invariant kernels. Without: torch's GEMM. Returns how many
    layers got each method. ``quantization`` is checked by check_quantization first."""
    if decode_activations not in DECODE_ACTIVATIONS:
        raise ValueError(
            f"decode_activations {decode_activations!r}: use one of {', '.join(DECODE_ACTIVATIONS)}"
        )
    kernel_activations = resolve_kernel_activations(kernel_activations)
    if quantization == "bf16" and kernel_activations == "float32":
        raise ValueError(
            "kernel_activations: float32 cannot serve bf16 weights (--quantization bf16 runs "
            "the matmuls' activations in bf16)"
        )
    int8_decode = decode_activations == "int8" and gemm.q8_available()
    bf16 = kernel_activations == "bfloat16"
    counts: dict[str, int] = {}
    for name, layer in layers.items():
        method: LinearMethod = DenseMethod()
        if use_kernels and gemm.available():
            w = packed.get(name)
            own_blocks = w is not None
            if w is None and quantization == "int8":
                w = gemm.quantize_int8(layer.weight.data)
            if w is None and quantization == "bf16":
                w = gemm.from_dense_bf16(layer.weight.data)
            if w is None:
                w = gemm.from_dense(layer.weight.data)
            if w is not None and w.shape == tuple(layer.weight.shape):
                method = PackedMethod(w, int8_decode and own_blocks, bf16 and own_blocks)
                if w.kind != gemm.F32 and not own_blocks:
                    _drop_float_copy(layer)
        layer.set_method(method)
        counts[method.name] = counts.get(method.name, 0) + 1
    return counts


def on_torch(layer: nn.Module) -> bool:
    """The layer multiplies through torch's GEMM (DenseMethod), not the kernels: blockings
    that follow the row count, so its outputs may depend on the batch."""
    return not isinstance(layer.method, PackedMethod)


def _drop_float_copy(layer: nn.Module) -> None:
    """A layer whose kernel holds its own copy of a dense weight (bf16, int8) frees the
    one it was loaded into (a Llama-3.2-1B would hold 4.9 GB of float32 beside 2.5 of
    bf16): the linears and an untied head, not the embedding, whose table a tied head's
    lookup reads. A float32 kernel weight or a GGUF's own blocks keep the loaded float32
    copy: freeing it (2026-12-07, 4e1d6dd and ac94872) made the default model's decode
    step 1.4-1.7x slower on a Zen 4 VM, measured and not understood (docs/architecture.md)."""
    if isinstance(layer, LinearBase | ParallelLMHead):
        layer.weight = _param(0, dtype=layer.weight.dtype)


def narrow_weights(layers: list[nn.Module], dtype: torch.dtype) -> None:
    """Before loading a dense checkpoint whose matmuls the kernels will hold as bf16 or int8:
    each weight (and the embedding table) allocated in ``dtype`` (the checkpoint's own
    16-bit type, or bf16 for bf16 weights: rounded on the copy to nearest even, as
    from_dense_bf16 rounds), so that the model never exists in float32 — the load's peak was the float32 model (twice a bf16
    checkpoint: a Llama-3.1-8B's 16 GB needed 32). Biases stay float32, and so do weights
    of a width the kernels do not take (K % 32: torch's GEMM, float32 as before)."""
    for layer in layers:
        if layer.weight.shape[1] % 32 == 0:
            layer.weight = _param(*layer.weight.shape, dtype=dtype)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by the loader (missing ones are an error).
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


# ------------------------------------------------------------------ layers


class LinearBase(nn.Module):
    """``weight`` [out, in] (this rank's part), optional ``bias`` [out]."""

    shards: dict[str, int] = {}  # fused shard -> index (subclasses with fused outputs)

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, tp: TPGroup
    ) -> None:
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None
        self.method: LinearMethod = DenseMethod()

    def forward(self, x: torch.Tensor, num_decode: int = 0) -> torch.Tensor:
        """[num_tokens, in] -> [num_tokens, out]; the first ``num_decode`` rows decode."""
        return self.method.apply(self, x, num_decode)

    # Shard math. ``shard_rows`` says where a fused shard sits in this rank's rows.
    def shard_rows(self, shard: str | None) -> tuple[int, int]:
        return 0, self.out_features

    def tp_slice(self, name: str, shard: str | None, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor (replicated by default)."""
        return loaded

    def weight_loader(self, name: str, loaded: torch.Tensor, shard: str | None = None) -> None:
        """Copy a full checkpoint tensor into ``weight`` or ``bias`` (``name``), slicing it
        for this rank and placing it at its fused shard. Raises ShardShapeError."""
        dest = getattr(self, name).data
        if shard is not None:
            dest = dest.narrow(0, *self.shard_rows(shard))
        part = self.tp_slice(name, shard, loaded)
        copy_weight(dest, part, sliced=part is not loaded)

    def set_method(self, method: LinearMethod) -> None:
        self.method = method


class ColumnParallelLinear(LinearBase):
    """Output rows split over the ranks; for fused layers each shard is split separately,
    so a rank holds whole heads of q, k and v (or its part of gate and of up)."""

    def tp_slice(self, name, shard, loaded):
        size = self.tp.size
        if size == 1:
            return loaded
        rows = loaded.shape[0] // size
        return loaded.narrow(0, self.tp.rank * rows, rows)


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(self, hidden, head_dim, num_heads, num_kv_heads, bias, dtype, tp) -> None:
        # This rank's heads.
        self.q_size = num_heads // tp.size * head_dim
        self.kv_size = num_kv_heads // tp.size * head_dim
        super().__init__(hidden, self.q_size + 2 * self.kv_size, bias, dtype, tp)

    shards = {"q": 0, "k": 1, "v": 2}

    def shard_rows(self, shard):
        q, kv = self.q_size, self.kv_size
        return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard]


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs of equal width fused (gate/up)."""

    shards = {"gate": 0, "up": 1}

    def __init__(self, in_features, out_each, bias, dtype, tp) -> None:
        self.out_each = out_each // tp.size
        super().__init__(in_features, 2 * self.out_each, bias, dtype, tp)

    def shard_rows(self, shard):
        return self.shards[shard] * self.out_each, self.out_each


class RowParallelLinear(LinearBase):
    """Input columns split over the ranks; ``forward`` all-reduces the partial sums."""

    def __init__(self, in_features, out_features, bias, dtype, tp) -> None:
        super().__init__(in_features // tp.size, out_features, bias, dtype, tp)

    def tp_slice(self, name, shard, loaded):
        if self.tp.size == 1:
            return loaded
        if name == "bias":  # once in the all-reduced sum: rank 0's
            return loaded if self.tp.rank == 0 else torch.zeros_like(loaded)
        cols = loaded.shape[1] // self.tp.size
        return loaded.narrow(1, self.tp.rank * cols, cols)

    def forward(self, x, num_decode=0):
        return self.tp.all_reduce(self.method.apply(self, x, num_decode))


class VocabParallelEmbedding(nn.Module):
    """The token embedding, replicated on every rank (no vocab split; see architecture.md).
    With tied embeddings it is also the LM head, so it carries a method for ``logits``."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(vocab_size, hidden, dtype=dtype)
        self.bias = None
        self.method: LinearMethod = DenseMethod()
        self.rows_dtype = dtype  # what a lookup gives (hold_bf16 keeps the table narrower)
        self.rows_from = None  # a tied head's kernel weight whose rows are the table

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.rows_from is not None:
            return kernel_rows(self.rows_from, input_ids)
        return F.embedding(input_ids, self.weight).to(self.rows_dtype)  # [num_tokens, hidden]

    def rows_from_head(self) -> None:
        """A tied head on the kernels whose weight is the table exactly (a GGUF's own blocks,
        bf16 weights, float32; not int8 of --quantization int8): lookups read the kernel's
        copy (kernels/rows.py) and the table is freed."""
        if isinstance(self.method, PackedMethod) and self.method.kernel.kind in ROW_KINDS:
            self.rows_from = self.method.kernel
            self.weight = _param(0, dtype=torch.float32)

    def hold_bf16(self) -> None:
        """Keep the table in bf16, rows widened on lookup (``--quantization bf16``: a bf16
        checkpoint's rows exactly; a Llama-3.2-1B's tied table 1.05 -> 0.53 GB)."""
        if self.weight.dtype == torch.float32 and self.weight.numel():
            self.weight = nn.Parameter(self.weight.data.to(torch.bfloat16), requires_grad=False)

    def logits(self, hidden: torch.Tensor, num_decode: int = 0) -> torch.Tensor:
        """[n, hidden] -> [n, vocab]; the first ``num_decode`` rows are decode rows."""
        return self.method.apply(self, hidden, num_decode)

    weight_loader = LinearBase.weight_loader
    set_method = LinearBase.set_method

    def tp_slice(self, name, shard, loaded):
        return loaded


class ParallelLMHead(VocabParallelEmbedding):
    """A separate (untied) LM head [vocab, hidden], replicated."""
