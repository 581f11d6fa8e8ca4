"""Where a model comes from, and how checkpoint tensors land in our fused parameters.

Sources (``resolve_model_source``):
  * a Hugging Face folder: ``config.json`` + ``*.safetensors`` (one file, or sharded with
    ``model.safetensors.index.json``);
  * a ``.gguf`` file (or a folder holding one), dequantised with the ``gguf`` package;
  * a hub id (``org/name``) through ``huggingface_hub`` (honours ``HF_HUB_OFFLINE``);
  * nothing: the embedded default model (SmolLM2-135M-Instruct, see default_model.py).

All checkpoint-name mapping lives in the two tables below; the model never sees a
checkpoint name.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from tinyserve.config import ModelConfig
from tinyserve.distributed.parallel_state import TPGroup
from tinyserve.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# HF checkpoint projection -> (our fused parameter, shard). Everything else keeps its name.
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}

# GGUF tensor name -> HF checkpoint name ("{i}" is the layer index).
GGUF_TO_HF = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blk.{i}.ffn_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.ffn_gate": "model.layers.{i}.mlp.gate_proj",
    "blk.{i}.ffn_up": "model.layers.{i}.mlp.up_proj",
    "blk.{i}.ffn_down": "model.layers.{i}.mlp.down_proj",
}
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "safetensors" | "gguf"
    path: Path  # the folder (safetensors) or the .gguf file
    name: str  # what /v1/models reports by default

    @property
    def tokenizer_path(self) -> Path:
        """A folder with tokenizer files; for a GGUF, its converted ``<name>.tokenizer/``."""
        if self.kind == "gguf":
            from tinyserve.models.default_model import tokenizer_dir_for

            return tokenizer_dir_for(self.path)
        return self.path


def resolve_model_source(model: str | os.PathLike | None) -> ModelSource:
    if model is None or str(model) == "":
        from tinyserve.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model

        return ModelSource("gguf", ensure_default_model(), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: a model file must be a .gguf; otherwise pass a folder")
        return ModelSource("gguf", path, path.stem)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("safetensors", path, path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0], ggufs[0].stem)
        if len(ggufs) > 1:
            raise ValueError(f"{path}: holds several .gguf files; pass the one to load")
        raise FileNotFoundError(f"{path}: no config.json and no .gguf file in this folder")
    if _HUB_ID_RE.match(str(model)) and not str(model).startswith((".", "/", "~")):
        return ModelSource("safetensors", _snapshot_from_hub(str(model)), str(model))
    raise FileNotFoundError(f"model {str(model)!r}: no such file or folder, and not a hub id")


def _snapshot_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        folder = snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model"],
            local_files_only=offline,
        )
    except Exception as e:  # noqa: BLE001 - any hub failure becomes one clear message
        how = "HF_HUB_OFFLINE is set and it is not in the local cache" if offline else str(e)
        raise ValueError(
            f"could not fetch model {repo_id!r} from the Hugging Face hub: {how}. "
            "Pass a local folder or .gguf path instead."
        ) from e
    return Path(folder)


# ---------------------------------------------------------------- configs


def load_model_config(
    source: ModelSource, gguf_checkpoint: _GGUFCheckpoint | None = None
) -> tuple[ModelConfig, torch.Tensor | None]:
    """The config, plus RoPE inverse frequencies when the checkpoint carries its own
    (GGUF ``rope_freqs``); None means "derive from the config"."""
    if source.kind == "gguf":
        return (gguf_checkpoint or _GGUFCheckpoint(source.path)).config_and_rope()
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


# ---------------------------------------------------------------- safetensors


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a valid safetensors index: {e}") from e
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{index} names shard {f.name}, which is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights found")
    return files


def _iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor, str]]:
    from safetensors import safe_open

    for f in _safetensors_files(folder):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name), f.name
        except (OSError, ValueError, RuntimeError) as e:
            raise ValueError(f"{f}: cannot read safetensors weights: {e}") from e
        except Exception as e:  # SafetensorError is not a subclass of the above
            if type(e).__name__ == "SafetensorError":
                raise ValueError(f"{f}: cannot read safetensors weights: {e}") from e
            raise


# ---------------------------------------------------------------- GGUF


class _GGUFCheckpoint:
    """Reads config and tensors from a .gguf file (memory-mapped)."""

    def __init__(self, path: Path) -> None:
        from tinyserve.models.gguf_file import GGUFFile

        self.path = path
        try:
            self.file = GGUFFile(path)
        except (ValueError, OSError) as e:
            raise ValueError(f"{path}: not a valid GGUF file ({e})") from e
        self.arch = self._field("general.architecture")
        if self.arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"{path}: GGUF architecture {self.arch!r} is not supported "
                f"(tinyserve serves {', '.join(GGUF_ARCHITECTURES)})"
            )
        self.tensors = self.file.tensors

    def _field(self, key: str, default=None):
        return self.file.fields.get(key, default)

    def config_and_rope(self) -> tuple[ModelConfig, torch.Tensor | None]:
        a = self.arch
        try:
            hidden = int(self._field(f"{a}.embedding_length"))
            num_heads = int(self._field(f"{a}.attention.head_count"))
            num_layers = int(self._field(f"{a}.block_count"))
            intermediate = int(self._field(f"{a}.feed_forward_length"))
        except TypeError as e:
            raise ValueError(f"{self.path}: GGUF metadata lacks a model dimension ({e})") from e
        tokens = self._field("tokenizer.ggml.tokens")
        vocab = self._field(f"{a}.vocab_size") or (len(tokens) if tokens else None)
        if vocab is None:
            vocab = self.tensors["token_embd.weight"].shape[0]
        head_dim = int(self._field(f"{a}.attention.key_length") or hidden // num_heads)
        rope_scaling = None
        if self._field(f"{a}.rope.scaling.type") == "linear":
            rope_scaling = {
                "rope_type": "linear",
                "factor": float(self._field(f"{a}.rope.scaling.factor")),
            }
        eos = self._field("tokenizer.ggml.eos_token_id")
        config = ModelConfig(
            architecture=GGUF_ARCHITECTURES[a],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(self._field(f"{a}.attention.head_count_kv") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self._field(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(self._field(f"{a}.context_length", 2048)),
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
        )
        inv_freq = None
        if "rope_freqs.weight" in self.tensors:  # llama3-style scaling baked in as factors
            from tinyserve.layers.rotary import rope_inv_freq

            factors = self._dequantize(self.tensors["rope_freqs.weight"])
            inv_freq = rope_inv_freq(head_dim, config.rope_theta, None) / factors.float()
        return config, inv_freq

    def _dequantize(self, t) -> torch.Tensor:
        try:
            return torch.from_numpy(self.file.dequantize(t))
        except NotImplementedError as e:
            raise ValueError(
                f"{self.path}: tensor {t.name} has a GGUF type ({t.qtype}) "
                "that cannot be dequantised"
            ) from e

    def iter_tensors(self, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor, str]]:
        for name, t in self.tensors.items():
            if name == "rope_freqs.weight":
                continue
            hf_name = gguf_to_hf_name(name)
            if hf_name is None:
                logger.warning("%s: ignoring unknown GGUF tensor %s", self.path.name, name)
                continue
            w = self._dequantize(t)
            if self.arch == "llama" and (".attn_q." in name or ".attn_k." in name):
                # llama.cpp's converter interleaves q/k rows for its rope layout; undo it.
                heads = (
                    config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
                )
                w = _unpermute_qk(w, heads)
            yield hf_name, w, self.path.name

    def packed_blocks(self, net: LlamaForCausalLM) -> dict[str, object]:
        """The checkpoint's Q4_1 / Q8_0 blocks for each linear whose parts share one kind, by
        our module prefix (q/k/v and gate/up stacked like the fused float parameters, q/k rows
        in the dequantised order: llama.cpp's permutation undone)."""
        from tinyserve.kernels import gemm

        config = net.config

        def blocks(name: str, heads: int | None = None):
            t = self.tensors.get(name)
            if t is None or len(t.shape) != 2:
                return None
            qw = gemm.from_gguf(self.file.raw(t), t.qtype, t.shape)
            if qw is not None and heads is not None and self.arch == "llama":
                order = _unpermute_qk(torch.arange(t.shape[0])[:, None], heads)[:, 0]
                qw = qw.take_rows(order)
            return qw

        def fused(parts):
            if any(p is None for p in parts) or len({p.kind for p in parts}) != 1:
                return None
            return gemm.cat_rows(parts)

        found = {}
        for i in range(config.num_hidden_layers):
            b, prefix = f"blk.{i}.", f"model.layers.{i}."
            found[prefix + "self_attn.qkv_proj"] = fused(
                [
                    blocks(b + "attn_q.weight", config.num_attention_heads),
                    blocks(b + "attn_k.weight", config.num_key_value_heads),
                    blocks(b + "attn_v.weight"),
                ]
            )
            found[prefix + "self_attn.o_proj"] = blocks(b + "attn_output.weight")
            found[prefix + "mlp.gate_up_proj"] = fused(
                [blocks(b + "ffn_gate.weight"), blocks(b + "ffn_up.weight")]
            )
            found[prefix + "mlp.down_proj"] = blocks(b + "ffn_down.weight")
        if config.tie_word_embeddings:
            found["model.embed_tokens"] = blocks("token_embd.weight")
        else:
            found["lm_head"] = blocks("output.weight")
        return {k: v for k, v in found.items() if v is not None}


def gguf_to_hf_name(name: str) -> str | None:
    base, _, suffix = name.rpartition(".")
    m = re.match(r"^blk\.(\d+)\.(.+)$", base)
    if m:
        key, i = f"blk.{{i}}.{m.group(2)}", m.group(1)
    else:
        key, i = base, None
    hf = GGUF_TO_HF.get(key)
    if hf is None:
        return None
    return f"{hf.format(i=i)}.{suffix}"


def _unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


# ---------------------------------------------------------------- weights -> model


def map_checkpoint_name(name: str) -> tuple[str, str | None]:
    """HF checkpoint name -> (our parameter name, shard or None)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in STACKED_PARAMS:
            fused, shard = STACKED_PARAMS[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), shard
    return name, None


_SHARD_TO_CHECKPOINT = {shard: proj for proj, (_, shard) in STACKED_PARAMS.items()}


def checkpoint_name(param: str, shard: str | None) -> str:
    """Our (parameter, shard) -> the HF checkpoint tensor that fills it (for error messages)."""
    if shard is None:
        return param
    prefix, fused, leaf = param.rsplit(".", 2)
    return f"{prefix}.{_SHARD_TO_CHECKPOINT[shard]}.{leaf}"


def load_weights(
    model: LlamaForCausalLM,
    tensors: Iterator[tuple[str, torch.Tensor, str]],
    where: str,
) -> None:
    """Copy (name, tensor, file) triples into the model through each layer's weight loader
    (which slices for this rank and places fused shards); every parameter, and every shard of
    a fused one, must be filled exactly once. Raises ValueError naming the file and tensor."""
    from tinyserve.layers.linear import ShardShapeError, copy_weight

    config = model.config
    rank, size = model.tp.rank, model.tp.size
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    needed: set[tuple[str, str | None]] = set()
    for pname in params:
        owner = modules[pname.rsplit(".", 1)[0]]
        shards = getattr(owner, "shards", {})
        needed |= {(pname, s) for s in shards} if shards else {(pname, None)}
    loaded: set[tuple[str, str | None]] = set()
    for name, tensor, file in tensors:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name.startswith("lm_head.") and config.tie_word_embeddings:
            continue  # some tied checkpoints still store a copy of the embedding
        target, shard = map_checkpoint_name(name)
        if target not in params:
            logger.warning("%s: ignoring unexpected tensor %s", file, name)
            continue
        prefix, leaf = target.rsplit(".", 1)
        owner = modules[prefix]
        try:
            if hasattr(owner, "weight_loader"):
                owner.weight_loader(leaf, tensor, shard)
            else:
                copy_weight(getattr(owner, leaf).data, tensor)
        except ShardShapeError as e:
            sliced = f"; its rank-{rank} slice of {size} is {e.got}" if e.sliced else ""
            raise ValueError(
                f"{file}: tensor {name} has shape {list(tensor.shape)}{sliced} but the config "
                f"({where}) expects {e.expected}"
            ) from None
        loaded.add((target, shard))
    missing = sorted(checkpoint_name(p, s) for p, s in needed - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ValueError(f"{where}: checkpoint is missing weights: {shown}")


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
) -> tuple[LlamaForCausalLM, ModelSource]:
    """Resolve, build and fill the model (this rank's shard of it under tensor parallel), then
    fix each linear layer's method (layers/linear.py: choose_linear_methods): on a CPU with
    the kernels and fp32, a GGUF's own Q4_1/Q8_0 blocks, int8 if ``quantization="int8"``, or
    the float32 weight through the same batch-invariant kernel; ``decode_activations="int8"``
    rounds decode rows' activations on a GGUF's blocks (as llama.cpp). ``fused_step``: all
    layers in one C call where every layer is on the kernels. The tokenizer is separate."""
    from tinyserve.kernels import attention as attention_kernel
    from tinyserve.layers.linear import check_quantization, choose_linear_methods

    check_quantization(quantization, cpu_kernels, dtype, device)
    source = model if isinstance(model, ModelSource) else resolve_model_source(model)
    ckpt = _GGUFCheckpoint(source.path) if source.kind == "gguf" else None
    config, inv_freq = load_model_config(source, ckpt)
    net = LlamaForCausalLM(
        config, dtype=dtype, max_position=max_position, rope_inv_freq=inv_freq, tp=tp
    )
    if ckpt is not None:
        tensors = ckpt.iter_tensors(config)
    else:
        tensors = _iter_safetensors(source.path)
    load_weights(net, _with_progress(tensors, config), str(source.path))
    net = net.to(device).eval()
    use_kernels = cpu_kernels and dtype == torch.float32 and torch.device(device).type == "cpu"
    packed = (
        ckpt.packed_blocks(net) if use_kernels and ckpt is not None and net.tp.size == 1 else {}
    )
    counts = choose_linear_methods(
        net.linear_layers(), packed, use_kernels, quantization, decode_activations
    )
    layers = net.linear_layers().values()
    if decode_activations == "int8" and not any(
        getattr(m.method, "int8_decode", False) for m in layers
    ):
        logger.warning(
            "--decode-activations int8 has no effect here: it needs a GGUF's Q4_1/Q8_0 blocks "
            "on the CPU kernels (float32, tensor parallel size 1)"
        )
    heads = (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    if use_kernels and attention_kernel.fits(*heads):
        net.attention_backend = "kernel"
    _use_fused_ops(net, use_kernels)
    if use_kernels and fused_step:
        from tinyserve.kernels import step as step_kernel

        net.model.step_plan = step_kernel.build_plan(net)
    logger.info(
        "linear methods: %s; attention: %s; layers in one C call: %s",
        ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())),
        net.attention_backend,
        net.model.step_plan is not None,
    )
    return net, source


def largest_matmul(model, quantization: str | None = None) -> tuple[str, int, int]:
    """(weight kind, N, K) of the model's gate/up matmul, read from the config and (for a
    GGUF) the tensor table only: what worker/autotune.py times before the model loads."""
    source = model if isinstance(model, ModelSource) else resolve_model_source(model)
    ckpt = _GGUFCheckpoint(source.path) if source.kind == "gguf" else None
    config, _ = load_model_config(source, ckpt)
    kind = "q8_0" if quantization == "int8" else "f32"
    if ckpt is not None:
        t = ckpt.tensors.get("blk.0.ffn_gate.weight")
        kind = {3: "q4_1", 8: "q8_0"}.get(getattr(t, "qtype", None), kind)
    return kind, 2 * config.intermediate_size, config.hidden_size


def _use_fused_ops(net: LlamaForCausalLM, use_kernels: bool) -> None:
    """The fused residual+RMSNorm and SiLU-and-mul kernels (kernels/ops.c) where they fit."""
    from tinyserve.kernels import ops
    from tinyserve.layers.norm import RMSNorm
    from tinyserve.models.llama import LlamaAttention, LlamaMLP

    cfg = net.config
    on = use_kernels and ops.library() is not None
    for m in net.modules():
        if isinstance(m, RMSNorm):
            m.use_kernel = on and cfg.hidden_size % 8 == 0
        elif isinstance(m, LlamaMLP):
            m.use_kernel = on and (cfg.intermediate_size // net.tp.size) % 8 == 0
        elif isinstance(m, LlamaAttention):
            m.use_kernel = on and net.attention_backend == "kernel" and cfg.head_dim % 16 == 0


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
