"""EngineArgs: every knob of the engine in one place, shared by LLM(), `generate` and `serve`;
``create_configs()`` turns them, once, at the edge, into the frozen configs the engine's
parts take (``EngineConfig``)."""

from __future__ import annotations

import argparse
import numbers
from dataclasses import dataclass, fields

from tinyserve.config import (
    KV_CACHE_DTYPES,
    CacheConfig,
    LoadConfig,
    ParallelConfig,
    SchedulerConfig,
    parse_size,
)
from tinyserve.spec_decode.config import SpeculativeConfig


@dataclass(frozen=True)
class EngineConfig:
    """Every setting of one engine, one frozen config per concern. The executor (and every
    tensor-parallel rank) reads ``load``, ``cache``, ``parallel`` and ``scheduler``; the core
    ``scheduler`` (its ``max_model_len`` set once the KV cache is sized) and ``speculative``."""

    load: LoadConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    speculative: SpeculativeConfig | None = None
    grammar_fast_forward: bool = True  # a grammar's forced tokens as drafts (structured/)


@dataclass
class EngineArgs:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    # None: 1 GiB on a CPU / MPS; on CUDA what gpu_memory_utilization leaves (worker/memory.py)
    kv_cache_memory: int | float | str | None = None
    # "auto": the model's dtype; "bfloat16": a bf16 cache for a float32 model on the CPU
    # kernels (half the bytes a decode row's attention reads, twice the tokens per GiB)
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9  # CUDA: the share of the card the engine may take
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # While requests decode, cap a step's prompt tokens so that the step's measured cost
    # stays within this bound (ms): the running streams' TPOT. None / 0: no cap.
    max_decode_step_ms: float | None = None
    scheduling_policy: str = "continuous"  # or "static" (gang), for the benchmarks
    load_tokenizer: bool = True
    tensor_parallel_size: int = 1  # ranks the model is split over (docs/scaling.md)
    cpu_kernels: bool = True  # tinyserve/kernels matmuls + attention (CPU, fp32; batch-invariant)
    quantization: str | None = None  # "int8" / "bf16": weight-only, for float checkpoints
    decode_activations: str = "float32"  # GGUF blocks: "int8" rounds decode activations
    kernel_activations: str = "auto"  # GGUF blocks: bf16 activations where AVX512-BF16 is
    fused_step: bool = True  # all layers in one C call (kernels/step.c) on the kernel path
    # Speculative decoding (spec_decode/): "auto" (suffix decoding, drafts only where the
    # measured step costs say they pay), "off" / None, or vLLM's JSON, e.g. '{"method":
    # "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    # or '{"method": "suffix"}', or the parsed config (what --speculative-config gives).
    speculative_config: str | dict | SpeculativeConfig | None = "auto"
    # The tokens a request's grammar forces (JSON keys, punctuation) drafted, whatever
    # speculative_config says: never rejected under greedy, so on by default. False: plain
    # decoding for constrained requests too (with speculation off, one token a step).
    grammar_fast_forward: bool = True
    enforce_eager: bool = False  # CUDA: no graphs for decode steps (worker/decode_graphs.py)

    @property
    def kv_cache_bytes(self) -> int | None:
        return None if self.kv_cache_memory is None else parse_size(self.kv_cache_memory)

    def create_configs(self) -> EngineConfig:
        """The frozen configs, validated (a ValueError names the setting)."""
        _check_types(self)
        # Checked before the model is built (a negative one reached the rotary table).
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        spec = self.speculative_config
        load_names = {f.name for f in fields(LoadConfig)}
        return EngineConfig(
            load=LoadConfig(**{k: v for k, v in vars(self).items() if k in load_names}),
            cache=CacheConfig(
                block_size=self.block_size, num_blocks=self.num_blocks,
                kv_cache_memory=self.kv_cache_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
                gpu_memory_utilization=self.gpu_memory_utilization,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=None, policy=self.scheduling_policy,
                enable_chunked_prefill=self.enable_chunked_prefill,
                max_decode_step_ms=self.max_decode_step_ms or None,
            ),
            parallel=ParallelConfig(self.tensor_parallel_size),
            speculative=spec if isinstance(spec, SpeculativeConfig) else SpeculativeConfig.parse(spec),
            grammar_fast_forward=self.grammar_fast_forward,
        )  # fmt: skip

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names and v is not None})


_PLAIN = {
    "int": (numbers.Integral,),
    "float": (numbers.Real,),
    "bool": (bool,),
    "str": (str,),
    "None": (type(None),),
}


def _check_types(args: EngineArgs) -> None:
    """A setting of a plain type given another (``LLM(num_blocks="5")``) is a ValueError
    naming it, not a TypeError from deep inside the engine."""
    for f in fields(args):
        kinds = [k.strip() for k in str(f.type).split("|")]
        if not all(k in _PLAIN for k in kinds):
            continue  # a config object or a dict: checked where it is parsed
        value = getattr(args, f.name)
        ok = any(isinstance(value, t) for k in kinds for t in _PLAIN[k])
        # A str setting also takes what stands for one (torch.bfloat16, a device, a Path).
        ok = ok or ("str" in kinds and not isinstance(value, (int, float, list, dict)))
        ok = ok or ("bool" in kinds and value in (0, 1) and isinstance(value, numbers.Integral))
        if not ok or (isinstance(value, bool) and "bool" not in kinds):
            raise ValueError(f"{f.name} must be {' or '.join(kinds)}, got {value!r:.60}")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineArgs()
    parser.add_argument(
        "--model",
        default=None,
        help="HF folder, .gguf file or hub id (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument("--device", default=d.device, help="auto, cpu, cuda, cuda:1 or mps")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context window (default: the model's, capped by the KV cache)",
    )
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks (overrides --kv-cache-memory)"
    )
    parser.add_argument(
        "--kv-cache-memory",
        default=None,
        help="KV cache budget, e.g. 2GiB (default: 1GiB on a CPU; on CUDA what "
        "--gpu-memory-utilization leaves after a profiling forward of the largest step)",
    )
    _add_scheduler_args(parser, d)
    _add_kernel_args(parser, d)
    _add_gpu_args(parser, d)
    parser.add_argument(
        "--speculative-config",
        default=d.speculative_config,
        type=_speculative_config,
        help="speculative decoding (lossless): 'auto' (the default: suffix decoding), 'off', "
        'or vLLM\'s JSON: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
        '(n-gram prompt lookup), or \'{"method": "suffix"}\' (suffix decoding: drafts '
        "from the request's tokens and earlier outputs of its cache_salt); drafts "
        "priced by this machine's measured step costs, none above max_batch_size running "
        "requests, default 8",
    )
    parser.add_argument(
        "--grammar-fast-forward",
        action=argparse.BooleanOptionalAction,
        default=d.grammar_fast_forward,
        help="draft the tokens a structured output's grammar forces (keys, punctuation), "
        "whatever --speculative-config says (default on; --no-grammar-fast-forward with "
        "--speculative-config off: one token a step for every request)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=d.tensor_parallel_size,
        help="split the model over N processes / devices (torch.distributed; see docs/scaling.md)",
    )


def _add_scheduler_args(parser: argparse.ArgumentParser, d: EngineArgs) -> None:
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument(
        "--max-decode-step-ms",
        type=float,
        default=d.max_decode_step_ms,
        help="while requests decode, cap each step's prompt tokens so that the step, by this "
        "machine's measured step costs, stays within this many ms: the running streams' "
        "TPOT bound (prompts still take >= 32 tokens a step; 0: no cap)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
    )
    parser.add_argument(
        "--scheduling-policy", default=d.scheduling_policy, choices=["continuous", "static"]
    )


def _speculative_config(text: str) -> SpeculativeConfig | str:
    """Parsed (once) when the flags are, so a bad value is a usage error, not a traceback.
    Off stays the string "off": ``EngineArgs.from_namespace`` skips None values (flags not
    given), which would put the default back."""
    try:
        parsed = SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return "off" if parsed is None else parsed


def _add_gpu_args(parser: argparse.ArgumentParser, d: EngineArgs) -> None:
    """The CUDA path's flags."""
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        help="CUDA: the share of the GPU's memory for weights, activations and KV cache",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        default=d.enforce_eager,
        help="CUDA: run decode steps eagerly instead of replaying captured CUDA graphs",
    )


def _add_kernel_args(parser: argparse.ArgumentParser, d: EngineArgs) -> None:
    """The CPU kernel path's flags."""
    parser.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="auto (default): the model's dtype, or bfloat16 where attention computes bf16 "
        "products (AMX tiles or AVX-512 BF16 dot products, which round K and V to bf16 "
        "anyway); float32: a float32 model's own; bfloat16: K and V stored rounded to bf16 "
        "(float32 models on the CPU kernels): half the bytes each decode step's attention "
        "reads and twice the tokens per GiB, at bf16's rounding of K and V",
    )
    parser.add_argument(
        "--cpu-kernels",
        "--gguf-kernels",
        dest="cpu_kernels",
        action=argparse.BooleanOptionalAction,
        default=d.cpu_kernels,
        help="CPU fp32: matmuls (a GGUF's Q4_1/Q8_0 blocks read directly) and paged attention "
        "through tinyserve's AVX2 kernels, batch-invariant; off: torch's GEMM and SDPA",
    )
    parser.add_argument(
        "--quantization",
        default=None,
        choices=["none", "int8", "bf16"],
        help="weight-only, for float checkpoints, on the CPU kernels: int8 (per-channel "
        "scales); bf16 (AVX512-BF16 or AMX: the weights in bf16, the matmuls' activations "
        "rounded to bf16, batch-invariant)",
    )
    parser.add_argument(
        "--decode-activations",
        default=d.decode_activations,
        choices=["int8", "float32"],
        help="CPU kernels on a GGUF's Q4_1/Q8_0 blocks: int8 rounds a generated token's "
        "activations to 8 bits per block of 32 for integer dot products, as llama.cpp does "
        "(1.6x faster decode matmuls on AVX2; logits move, greedy text can differ from the "
        "float reference); default float32 keeps them exact",
    )
    parser.add_argument(
        "--kernel-activations",
        default=d.kernel_activations,
        choices=["auto", "bfloat16", "float32"],
        help="CPU kernels on a GGUF's Q4_1/Q8_0 blocks: bfloat16 rounds activations to bf16 "
        "and multiplies on AVX512-BF16's dot-product instruction (2x faster prefill matmuls; "
        "still batch-invariant); float32 keeps the logits those of the float reference (and "
        "keeps --dtype auto from holding a bf16 checkpoint's weights in bf16); auto "
        "(default) picks bfloat16 where the CPU has AVX512-BF16",
    )
    parser.add_argument(
        "--fused-step",
        action=argparse.BooleanOptionalAction,
        default=d.fused_step,
        help="on the CPU kernel path, run every decoder layer in one C call (kernels/step.c; "
        "bitwise the same as the per-layer Python loop, which --no-fused-step keeps)",
    )
