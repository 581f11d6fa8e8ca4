"""Frozen configuration objects, one per concern, validated on construction. ``ModelConfig``
is built here from either checkpoint format: a Hugging Face ``config.json`` dict
(``from_hf_config``) or GGUF metadata (``from_gguf_metadata``). No torch or numpy here: the
scheduler and the KV-cache manager import this module."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tinyserve.utils import model_families as families

# HF ``architectures`` name -> the module of tinyserve/models/ that defines its model class
# (models/registry.py). A new family is that one file plus a line here.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",  # q/k/v bias: a config flag
    "MistralForCausalLM": "llama",  # Llama's layer; a sliding window where the config sets one
    "Qwen3ForCausalLM": "qwen3",
    "GraniteForCausalLM": "granite",
    "SmolLM3ForCausalLM": "smollm3",
    "Phi3ForCausalLM": "phi3",  # Phi-3 and Phi-4-mini
    "Gemma3ForCausalLM": "gemma3",  # Gemma 3 text (1B; the text tower of the larger ones)
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# HF ``model_type`` / GGUF ``general.architecture`` -> architecture.
MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "granite": "GraniteForCausalLM",
               "smollm3": "SmolLM3ForCausalLM", "phi3": "Phi3ForCausalLM",
               "gemma3": "Gemma3ForCausalLM"}  # fmt: skip
HF_MODEL_TYPES = {**MODEL_TYPES, "mistral": "MistralForCausalLM",  # GGUF: Mistral is "llama"
                  "gemma3_text": "Gemma3ForCausalLM"}  # fmt: skip
# GGUF architectures whose q/k rows llama.cpp's converter permutes (its LlamaModel family).
GGUF_PERMUTED_QK = frozenset({"llama", "granite", "smollm3"})
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "longrope")  # longrope: Phi-3 only


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder. Llama and Qwen2 differ only by flags; the fields after
    ``eos_token_ids`` are other families' (their model files read them; the defaults are
    Llama's)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None or {"rope_type": "llama3", "factor": .., "low_freq_factor": .., ...}
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2; model_families.hf_attention_bias)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    o_proj_bias: bool = False  # attention_bias in Llama, Qwen3, Granite, Gemma 3, SmolLM3
    # Attention sees the last ``sliding_window`` positions (Mistral); None: all of them.
    sliding_window: int | None = None
    # Per layer 1 = windowed, 0 = full (``layer_types``; Gemma 3: local_layers); None: all 1.
    window_layers: tuple[int, ...] | None = None
    # SmolLM3: per layer, 1 = RoPE, 0 = no position encoding (NoPE). None: RoPE everywhere.
    no_rope_layers: tuple[int, ...] | None = None
    # Granite: input rows x embedding_multiplier; attention / MLP outputs x residual_multiplier
    # before the add; softmax scale attention_multiplier (None: head_dim ** -0.5; Gemma 3:
    # query_pre_attn_scalar ** -0.5); logits / logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    partial_rotary_factor: float = 1.0  # Phi-3: RoPE rotates head_dim * this dims of a head
    # Gemma 3: per layer 1 = a local (sliding-window) layer, whose RoPE base is
    # rope_local_theta, unscaled; the global layers take rope_theta and rope_scaling.
    local_layers: tuple[int, ...] | None = None
    rope_local_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}: tinyserve "
                             f"serves {', '.join(SUPPORTED_ARCHITECTURES)}")  # fmt: skip
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):  # fmt: skip
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"model config: {name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(f"model config: num_attention_heads ({self.num_attention_heads}) "
                             f"must be a multiple of num_key_value_heads "
                             f"({self.num_key_value_heads})")  # fmt: skip
        for name in ("no_rope_layers", "window_layers", "local_layers"):
            marks = getattr(self, name)
            if marks is not None and len(marks) != self.num_hidden_layers:
                raise ValueError(f"model config: {name} has {len(marks)} entries for "
                                 f"{self.num_hidden_layers} layers")  # fmt: skip
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"model config: sliding_window must be > 0, got {self.sliding_window}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"model config: rope scaling type {rope_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        phi3 = self.architecture == "Phi3ForCausalLM"  # what models/phi3.py serves
        if (rope_type == "longrope" or self.rotary_dim != self.head_dim) and not phi3:
            raise ValueError("model config: longrope and partial_rotary_factor: Phi-3 only")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"model config: rotary dims {self.rotary_dim} of {self.head_dim}")

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates (transformers' int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (None: it attends to its whole context)."""
        marks = self.window_layers or self.local_layers
        return None if marks is not None and not marks[layer] else self.sliding_window

    @property
    def uniform_window(self) -> int | None:
        """The window if every layer has the same one (Mistral, Phi-3-mini), else None."""
        windows = {self.layer_window(i) for i in range(self.num_hidden_layers)}
        return next(iter(windows)) if len(windows) == 1 else None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout)."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else HF_MODEL_TYPES.get(cfg.get("model_type") or "")
        if arch is None:
            raise ValueError(
                "config.json names no architecture (no 'architectures' and an unknown "
                f"'model_type' {cfg.get('model_type')!r})"
            )
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope_theta, rope_scaling = families.hf_rope(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5 if "Phi3" in arch else 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(
                cfg.get("tie_word_embeddings", arch in families.TIED_BY_DEFAULT)
            ),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            **(families.hf_family_fields(cfg, arch) if arch in SUPPORTED_ARCHITECTURES else {}),
        )

    @classmethod
    def from_gguf_metadata(
        cls, fields: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]], where: str
    ) -> ModelConfig:
        """Build from a GGUF file's metadata ``fields`` and its tensor table (name -> shape);
        ``where`` (the file) prefixes the error when a model dimension is missing."""
        a = fields.get("general.architecture")
        try:
            hidden = int(fields.get(f"{a}.embedding_length"))
            num_heads = int(fields.get(f"{a}.attention.head_count"))
            num_layers = int(fields.get(f"{a}.block_count"))
            intermediate = int(fields.get(f"{a}.feed_forward_length"))
        except TypeError as e:
            raise ValueError(f"{where}: GGUF metadata lacks a model dimension ({e})") from e
        tokens = fields.get("tokenizer.ggml.tokens")
        # The token list's length (gguf_file.py reads it as an ArrayLen, an int, not the list).
        num_tokens = (int(tokens) if isinstance(tokens, int) else len(tokens)) if tokens else None
        vocab = fields.get(f"{a}.vocab_size") or num_tokens
        if vocab is None:
            vocab = tensor_shapes["token_embd.weight"][0]
        head_dim = int(fields.get(f"{a}.attention.key_length") or hidden // num_heads)
        rope_scaling, scaling = None, fields.get(f"{a}.rope.scaling.type", "none")
        if scaling == "linear":
            rope_scaling = {"rope_type": "linear",
                            "factor": float(fields.get(f"{a}.rope.scaling.factor"))}  # fmt: skip
        elif scaling != "none":  # YaRN was served unscaled, as if the key were absent
            rope_scaling = {"rope_type": str(scaling)}  # refused by __post_init__, named
        return cls(
            architecture=MODEL_TYPES[a],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(fields.get(f"{a}.attention.head_count_kv") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(fields.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(fields.get(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(fields.get(f"{a}.context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_shapes,
            attention_bias="blk.0.attn_q.bias" in tensor_shapes,
            o_proj_bias="blk.0.attn_output.bias" in tensor_shapes,
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=families.gguf_eos_ids(fields),
            **families.gguf_family_fields(fields, a, num_layers),
        )


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?)[bB]?\s*$")


def parse_size(text: str | int) -> int:
    """'2GiB' / '512MB' / '1.5G' / 1234 -> bytes. Binary and decimal units both accepted."""
    if isinstance(text, int):
        if text <= 0:
            raise ValueError(f"size must be > 0, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"cannot parse size {text!r}: use e.g. '2GiB', '512MB' or a byte count")
    num, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if (binary or unit) else 1
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit]
    value = int(num * (base**power))
    if value <= 0:
        raise ValueError(f"size must be > 0, got {text!r}")
    return value


# --kv-cache-dtype: "auto" is the model's dtype (worker/kv_cache.py: resolve_kv_cache_dtype).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class LoadConfig:
    """How every rank loads and runs its shard of the model. Tensor-parallel worker ranks
    receive this very object (worker/tp_worker.py), and the driver and the workers load
    through one function (models/loader.py ``load_shard``): a setting added here reaches
    every rank by construction."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # the driver resolves it once; workers get the resolved name
    device: str = "auto"
    max_model_len: int | None = None  # as asked; the engine resolves it from the KV cache
    cpu_kernels: bool = True
    quantization: str | None = None
    decode_activations: str = "float32"
    kernel_activations: str = "auto"
    fused_step: bool = True
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size and how many blocks (from a count or a memory budget)."""

    block_size: int = 16
    num_blocks: int | None = None  # wins over kv_cache_memory when given
    # Bytes, used when num_blocks is None. None: the executor's default (1 GiB on a CPU or
    # MPS; on CUDA what gpu_memory_utilization leaves after a profiling forward).
    kv_cache_memory: int | None = 1 << 30
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0, got {self.kv_cache_memory}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Step budget. ``policy='continuous'`` is iteration-level batching; ``'static'`` gangs."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = 2048  # None: not resolved yet (EngineArgs.create_configs)
    policy: str = "continuous"
    enable_chunked_prefill: bool = True
    # While requests decode, a step's prompt tokens are capped so that the step's estimated
    # time (the engine's measured step costs) stays within this many ms: the running
    # streams' TPOT bound. None: prompts take the whole token budget.
    max_decode_step_ms: float | None = None

    def __post_init__(self) -> None:
        if self.max_decode_step_ms is not None and not self.max_decode_step_ms > 0:
            raise ValueError(f"max_decode_step_ms must be > 0, got {self.max_decode_step_ms}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, "
                             f"got {self.max_num_batched_tokens}")  # fmt: skip
        if self.policy not in ("continuous", "static"):
            raise ValueError(f"policy must be 'continuous' or 'static', got {self.policy!r}")
        if self.max_model_len is None:  # the engine sets it from the KV cache, then checks
            return
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8321
    served_model_name: str | None = None
    api_key: str | None = None
    max_queued_requests: int = 256
    log_requests: bool = False
    # Request bodies above this are refused with 413 before they are read in full.
    max_request_bytes: int = 4 << 20
    # With api_key: the paths that answer without it (exact, or "/folder/*"): the liveness
    # probe and the playground's static files (no data; the page asks for the key). Every
    # other route needs the key; metrics_no_key adds /metrics for a scraper.
    open_routes: tuple[str, ...] = ("/health", "/", "/playground/*")
    metrics_no_key: bool = False
    # SIGTERM: stop accepting, let in-flight requests finish for up to this long, then exit.
    shutdown_timeout: float = 30.0
    # Tool-call arguments may hold undeclared properties (default: OpenAI's strict semantics).
    open_tool_arguments: bool = False
    # JSON answers may be pretty-printed within bounds (entrypoints/structured_options.py),
    # not only on one line (structured/backend.py's default); a request's options win.
    json_pretty: bool = False
    # <think> blocks to reasoning_content: "auto" (where the chat template has them), "think",
    # "none" (entrypoints/reasoning.py).
    reasoning_parser: str = "auto"

    def __post_init__(self) -> None:
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.reasoning_parser not in ("auto", "think", "none"):
            raise ValueError(f"reasoning_parser must be auto, think or none, "
                             f"got {self.reasoning_parser!r}")  # fmt: skip
        for route in self.open_routes:
            if not route.startswith("/") or "*" in route[:-1] or route == "/*":
                raise ValueError(f"open_routes: {route!r} is not a path ('/health') or a "
                                 "folder ('/playground/*'; '/*' would open every route)")  # fmt: skip

    @property
    def routes_without_key(self) -> tuple[str, ...]:
        return self.open_routes + (("/metrics",) if self.metrics_no_key else ())


def window_live_blocks(window: int, max_chunk: int, block_size: int) -> int:
    """The most blocks one request holds at once where every layer has ``window``: a step's
    up to ``max_chunk`` queries from s read keys from s - window + 1 on, and the blocks
    wholly left of those are released first (engine/kv_cache_manager.py)."""
    return -(-(window - 1 + max_chunk) // block_size) + 1
