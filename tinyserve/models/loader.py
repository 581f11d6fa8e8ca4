"""Loading a model: resolve the source, read its config, build the model, fill it, and fix
each linear layer's method. The pieces live beside this module:

  * source.py          where a model comes from (folder / .gguf / hub id / default model);
  * config.py          ``ModelConfig`` from an HF ``config.json`` dict or from GGUF metadata;
  * gguf_file.py       the GGUF header reader;
  * gguf_checkpoint.py GGUF tensors: dequantised, renamed to HF names, q/k un-permuted, and
                       the Q4_1/Q8_0 blocks packed for the CPU kernels;
  * weights.py         safetensors iteration and HF names -> our fused parameters.
"""

from __future__ import annotations

import json
import logging
import os

import torch

from tinyserve.config import LoadConfig, ModelConfig
from tinyserve.distributed.parallel_state import TPGroup
from tinyserve.models.gguf_checkpoint import GGUFCheckpoint
from tinyserve.models.llama import LlamaForCausalLM
from tinyserve.models.registry import model_class
from tinyserve.models.source import ModelSource, resolve_model_source
from tinyserve.models.weights import iter_safetensors, load_weights

__all__ = [
    "ModelSource",
    "layer_matmuls",
    "load_model",
    "load_model_config",
    "load_shard",
    "numerics_path",
    "load_tokenizer",
    "resolve_model_source",
]

logger = logging.getLogger(__name__)


def load_model_config(
    source: ModelSource, gguf_checkpoint: GGUFCheckpoint | None = None
) -> tuple[ModelConfig, torch.Tensor | None]:
    """The config, plus RoPE inverse frequencies when the checkpoint carries its own
    (GGUF ``rope_freqs``); None means "derive from the config"."""
    if source.kind == "gguf":
        return (gguf_checkpoint or GGUFCheckpoint(source.path)).config_and_rope()
    config_path = source.path / "config.json"
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_path}: cannot read the model config: {e}") from e
    gen_path = source.path / "generation_config.json"
    if gen_path.is_file():
        try:
            gen = json.loads(gen_path.read_text())
        except json.JSONDecodeError:
            gen = {}
        if gen.get("eos_token_id") is not None:
            eos = cfg.get("eos_token_id")
            merged = [*(eos if isinstance(eos, list) else [eos] if eos is not None else [])]
            extra = gen["eos_token_id"]
            merged += [
                e for e in (extra if isinstance(extra, list) else [extra]) if e not in merged
            ]
            cfg = {**cfg, "eos_token_id": merged}
    try:
        return ModelConfig.from_hf_config(cfg), None
    except KeyError as e:
        raise ValueError(f"{config_path}: missing field {e}") from e
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from e


def load_shard(load: LoadConfig, dtype: torch.dtype, device, tp: TPGroup | None = None):
    """This rank's shard as ``load`` says: the one call of :func:`load_model` the engine's
    ranks make (driver and workers alike), so every load setting reaches every rank."""
    return load_model(
        load.model, dtype, device, max_position=load.max_model_len, tp=tp,
        cpu_kernels=load.cpu_kernels, quantization=load.quantization,
        decode_activations=load.decode_activations, fused_step=load.fused_step,
        kernel_activations=load.kernel_activations,
    )  # fmt: skip


def numerics_path(net: LlamaForCausalLM) -> str:
    """What arithmetic a loaded model runs: each linear method and how many layers take it,
    the attention backend (and tiles), the fused step. Tensor-parallel ranks compare theirs
    with the driver's at start-up (worker/executor.py)."""
    methods: dict[str, int] = {}
    for layer in net.linear_layers().values():
        methods[layer.method.name] = methods.get(layer.method.name, 0) + 1
    return (
        f"linears {dict(sorted(methods.items()))}; attention {net.attention_method.name}"
        f"{' on tiles' if net.attention_method.tiles else ''}; "
        f"fused step {net.model.step_plan is not None}"
    )


def load_model(
    model: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_position: int | None = None,
    tp: TPGroup | None = None,
    cpu_kernels: bool = True,
    quantization: str | None = None,
    decode_activations: str = "float32",
    fused_step: bool = True,
    kernel_activations: str = "auto",
) -> tuple[LlamaForCausalLM, ModelSource]:
    """Resolve, build and fill the model (this rank's shard of it under tensor parallel), then
    fix each linear layer's method (layers/linear.py: choose_linear_methods): on a CPU with
    the kernels and fp32, a GGUF's own Q4_1/Q8_0 blocks, int8 if ``quantization="int8"``, or
    the float32 weight through the same batch-invariant kernel; ``decode_activations="int8"``
    rounds decode rows' activations on a GGUF's blocks (as llama.cpp);
    ``kernel_activations``: "bfloat16" rounds the other rows' activations to bf16 on those
    blocks (AVX512-BF16; "auto" picks it where the CPU has it). ``fused_step``: all layers in
    one C call where every layer is on the kernels. The tokenizer is separate."""
    from tinyserve.layers import linear

    linear.check_quantization(quantization, cpu_kernels, dtype, device)
    source = model if isinstance(model, ModelSource) else resolve_model_source(model)
    ckpt = GGUFCheckpoint(source.path) if source.kind == "gguf" else None
    config, inv_freq = load_model_config(source, ckpt)
    net = model_class(config)(
        config, dtype=dtype, max_position=max_position, rope_inv_freq=inv_freq, tp=tp
    )
    use_kernels = cpu_kernels and dtype == torch.float32 and torch.device(device).type == "cpu"
    narrow = _load_dtype(source, quantization if use_kernels else None)
    if narrow is not None:  # the matmuls' weights never in float32 (their kernels' own copy)
        layers = {id(m): m for m in (*net.linear_layers().values(), net.model.embed_tokens)}
        linear.narrow_weights(list(layers.values()), narrow)
    # A GGUF's every tensor is dequantised and loaded, and a layer the kernels then serve
    # from its own blocks keeps that float32 copy: not loading it (2026-12-07, 4e1d6dd) or
    # freeing it (ac94872) left the default model's decode step 1.4-1.7x slower on a Zen 4
    # VM, for no reason found (docs/architecture.md).
    if ckpt is not None:
        tensors = ckpt.iter_tensors(config)
    else:
        tensors = iter_safetensors(source.path)
    load_weights(net, _with_progress(tensors, config), str(source.path), ckpt is not None)
    net = net.to(device).eval()
    packed = (
        ckpt.packed_blocks(net) if use_kernels and ckpt is not None and net.tp.size == 1 else {}
    )
    counts = linear.choose_linear_methods(
        net.linear_layers(), packed, use_kernels, quantization, decode_activations,
        kernel_activations,
    )  # fmt: skip
    if use_kernels:
        _settle_tables(net, quantization)
    _use_kernel_attention_and_step(net, use_kernels, fused_step)
    _report_methods(net, counts, decode_activations, kernel_activations, quantization)
    return net, source


def _report_methods(
    net, counts: dict[str, int], decode_activations: str, kernel_act: str, quantization=None
):
    """Log each layer's method, the kernels' activations as the methods took them (and warn
    about an activation flag that applies nowhere, or a quantization that misses layers)."""
    from tinyserve.layers.linear import QUANTIZATIONS, on_torch

    layers = net.linear_layers().values()
    if decode_activations == "int8" and not any(
        getattr(m.method, "int8_decode", False) for m in layers
    ):
        logger.warning(
            "--decode-activations int8 has no effect here: it needs a GGUF's Q4_1/Q8_0 blocks "
            "on the CPU kernels (float32, tensor parallel size 1)"
        )
    dense = sum(map(on_torch, layers))
    if quantization in QUANTIZATIONS and dense:
        logger.warning(
            "--quantization %s does not apply to %d of %d linear layers: the kernels need an "
            "input width that is a multiple of 32; they run on torch's GEMM in float32",
            quantization, dense, len(layers),
        )  # fmt: skip
    taken = "bfloat16" if any(getattr(m.method, "bf16", False) for m in layers) else "float32"
    if taken == "bfloat16":
        from tinyserve.kernels.gemm import bf16_engine

        taken += f" on {bf16_engine()}"
    if kernel_act == "bfloat16" and taken == "float32":
        taken += " (bfloat16 needs a GGUF's Q4_1/Q8_0 blocks on kernels built for AVX512-BF16)"
    logger.info(
        "linear methods: %s (kernel activations %s); attention: %s; layers in one C call: %s",
        ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())),
        taken,
        net.attention_method.name + _products_unit(net),
        net.model.step_plan is not None,
    )


def _settle_tables(net: LlamaForCausalLM, quantization: str | None) -> None:
    """After the methods (a float32 model on the kernels): a tied table read from the head's
    kernel copy where that is the table exactly (not int8's rounding), else held in bf16
    beside bf16 weights (not a tied head of K % 32: float32 on torch's GEMM, as any layer the
    kernels do not take)."""
    from tinyserve.layers import linear

    embed, tied = net.model.embed_tokens, net.config.tie_word_embeddings
    if tied and quantization != "int8":
        embed.rows_from_head()
    if quantization == "bf16" and not (tied and linear.on_torch(embed)):
        embed.hold_bf16()


def _load_dtype(source: ModelSource, quantization: str | None) -> torch.dtype | None:
    """What a dense checkpoint's matmul weights are loaded in when the kernels will hold them
    as bf16 (bf16) or int8 (the checkpoint's own 16-bit type, exact), or None: float32."""
    if source.kind != "safetensors" or quantization not in ("bf16", "int8"):
        return None
    if quantization == "bf16":
        return torch.bfloat16
    stored = checkpoint_dtype(source)
    return stored if stored in (torch.bfloat16, torch.float16) else None


def checkpoint_dtype(model) -> torch.dtype | None:
    """The one dtype a safetensors checkpoint stores its 2-D weights in (read from every
    file's header, not config.json's say-so), or None (a GGUF, mixed, unreadable)."""
    from safetensors import safe_open

    source = model if isinstance(model, ModelSource) else resolve_model_source(model)
    files = sorted(source.path.glob("*.safetensors")) if source.kind == "safetensors" else []
    names = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    kinds = set()
    try:
        for file in files:
            with safe_open(str(file), "pt") as f:
                tensors = [f.get_slice(k) for k in f.keys()]
                kinds |= {t.get_dtype() for t in tensors if len(t.get_shape()) == 2}
    except (OSError, ValueError):
        return None
    return names.get(kinds.pop()) if len(kinds) == 1 else None


def layer_matmuls(model, quantization: str | None = None) -> tuple[tuple[str, int, int], ...]:
    """(weight kind, N, K) of each matmul of a decoder layer (fused q/k/v, o, fused gate/up,
    down), read from the config and (for a GGUF) the tensor table only: what
    worker/autotune.py times before the model loads."""
    source = model if isinstance(model, ModelSource) else resolve_model_source(model)
    ckpt = GGUFCheckpoint(source.path) if source.kind == "gguf" else None
    config, _ = load_model_config(source, ckpt)
    from tinyserve.kernels.gemm import block_kind

    dense = {"int8": "q8_0", "bf16": "bf16"}.get(quantization, "f32")

    def kind(*names: str) -> str:
        """The blocks the kernels keep (GGUFCheckpoint.packed_blocks: stacked parts must share
        one kind), else the dense weight as choose_linear_methods holds it. Of ``names``,
        the tensors the file has (Phi-3: attn_qkv for attn_q/k/v, ffn_up for gate and up)."""
        if ckpt is None:
            return dense
        kinds = {block_kind(ckpt.tensors[f"blk.0.{n}.weight"].qtype) for n in names
                 if f"blk.0.{n}.weight" in ckpt.tensors}  # fmt: skip
        return (kinds.pop() or dense) if len(kinds) == 1 else dense

    h, hd = config.hidden_size, config.head_dim
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * hd
    inter = config.intermediate_size
    return (
        (kind("attn_q", "attn_k", "attn_v", "attn_qkv"), qkv, h),
        (kind("attn_output"), h, config.num_attention_heads * hd),
        (kind("ffn_gate", "ffn_up"), 2 * inter, h),
        (kind("ffn_down"), h, inter),
    )


def _use_kernel_attention_and_step(
    net: LlamaForCausalLM, use_kernels: bool, fused_step: bool
) -> None:
    """The attention kernel where it fits, the fused ops, then (``fused_step``) the plan that
    runs all layers in one C call."""
    from tinyserve.kernels import attention as attention_kernel
    from tinyserve.kernels import ops
    from tinyserve.layers.attention_method import KernelAttention, TritonDecodeAttention

    config = net.config
    heads = (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    fused_ops = use_kernels and ops.library() is not None
    if fused_ops and attention_kernel.fits(*heads) and config.head_dim % 16 == 0:
        net.set_attention_method(KernelAttention(tiles=_tiles_fit(net)))
    elif _triton_decode_fits(net, heads):
        net.set_attention_method(TritonDecodeAttention())  # decode rows by the block table
    _use_fused_ops(net, fused_ops)
    if use_kernels and fused_step:
        from tinyserve.kernels import step as step_kernel

        net.set_step_plan(step_kernel.build_plan(net))


def _triton_decode_fits(net: LlamaForCausalLM, heads: tuple[int, int, int]) -> bool:
    """On CUDA, decode attention through the Triton block-table kernel where Triton is
    installed (it comes with CUDA PyTorch) and the heads fit; TINYSERVE_TRITON_ATTENTION=0
    keeps the masked SDPA rectangle (for A/B runs)."""
    from tinyserve.kernels import triton_attention

    device = next(net.parameters()).device
    if device.type != "cuda" or os.environ.get("TINYSERVE_TRITON_ATTENTION", "1") == "0":
        return False
    num_heads, num_kv_heads, head_dim = heads
    tp = net.tp.size
    return triton_attention.available(device) and triton_attention.fits(
        num_heads // tp, num_kv_heads // tp, head_dim
    )


def _use_fused_ops(net: LlamaForCausalLM, on: bool) -> None:
    """The fused residual+RMSNorm and SiLU-and-mul kernels (kernels/ops.c) where they fit."""
    from tinyserve.layers.norm import RMSNorm
    from tinyserve.models.llama import LlamaMLP

    cfg = net.config
    for m in net.modules():
        if isinstance(m, RMSNorm):
            m.use_kernel = on and m.weight.numel() == cfg.hidden_size and cfg.hidden_size % 8 == 0
        elif isinstance(m, LlamaMLP):
            m.use_kernel = on and (cfg.intermediate_size // net.tp.size) % 8 == 0


def _products_unit(net: LlamaForCausalLM) -> str:
    """The start-up log's name for where attention's bf16 products run (none: float32)."""
    from tinyserve.kernels import attention as attention_kernel

    if not net.attention_method.tiles:
        return ""
    amx = attention_kernel.uses_tiles(net.config.head_dim)
    return " in bf16 products on " + ("AMX tiles" if amx else "VDPBF16PS dot products")


def _tiles_fit(net: LlamaForCausalLM) -> bool:
    """Whether the block-table attention should compute bf16 products (bf16 q, k, v and p;
    on AMX tiles, kernels/attention_amx.h, or AVX-512 BF16 dot products, attention_dp.h):
    where this CPU's attention build has them for the head size and the matmuls round their
    activations to bf16 (--kernel-activations, default where the CPU has native bf16), so that
    the model runs at one precision; --kernel-activations float32 keeps float32 attention
    too (not with bf16 weights, whose matmuls take bf16 activations only)."""
    from tinyserve.kernels import attention as attention_kernel

    bf16 = any(getattr(m.method, "bf16", False) for m in net.linear_layers().values())
    return bf16 and attention_kernel.uses_bf16_products(net.config.head_dim)


def _with_progress(tensors, config: ModelConfig):
    if not logger.isEnabledFor(logging.INFO) or os.environ.get("TINYSERVE_NO_PROGRESS"):
        yield from tensors
        return
    from tqdm import tqdm

    total = 2 + 9 * config.num_hidden_layers + (0 if config.tie_word_embeddings else 1)
    yield from tqdm(tensors, total=total, desc="loading weights", unit="tensor", leave=False)


def load_tokenizer(source: ModelSource):
    """A transformers tokenizer (with the chat template) for the source."""
    from transformers import AutoTokenizer

    tok_dir = source.tokenizer_path
    if tok_dir.is_dir() and any(tok_dir.glob("tokenizer*")):
        return AutoTokenizer.from_pretrained(str(tok_dir))
    if source.kind == "gguf":
        from tinyserve.models.default_model import convert_gguf_tokenizer

        try:  # convert once and keep it beside the file: the GGUF vocab takes seconds to read
            return convert_gguf_tokenizer(source.path, tok_dir)
        except OSError:
            return AutoTokenizer.from_pretrained(
                str(source.path.parent), gguf_file=source.path.name
            )
    raise FileNotFoundError(f"{source.path}: no tokenizer files (tokenizer.json) found")
