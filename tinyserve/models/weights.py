"""Checkpoint tensors into our fused parameters: safetensors iteration, the HF-name ->
(parameter, shard) table, and ``load_weights``. The model never sees a checkpoint name."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tinyserve.models.llama import LlamaForCausalLM

# One logger for the whole loading path, so its messages keep the name they have always had.
logger = logging.getLogger("tinyserve.models.loader")

# HF checkpoint projection -> (our fused parameter, shard). Everything else keeps its name.
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def safetensors_files(folder: Path) -> list[Path]:
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


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor, str]]:
    from safetensors import safe_open

    for f in safetensors_files(folder):
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
    gguf: bool = False,
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
    for name, tensor, file in model.checkpoint_tensors(tensors, gguf):
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
    # attention_bias with q/k/v biases only ("llamafied" Qwen): o_proj's zeros, as transformers
    absent = {(p, s) for p, s in needed - loaded if p.endswith("self_attn.o_proj.bias")}
    for p, _ in absent:
        params[p].data.zero_()
    if absent:
        logger.warning("%s: no o_proj biases in the checkpoint: zeros", where)
    missing = sorted(checkpoint_name(p, s) for p, s in needed - loaded - absent)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ValueError(f"{where}: checkpoint is missing weights: {shown}")
