"""Where a model comes from (``resolve_model_source``):

* a Hugging Face folder: ``config.json`` + ``*.safetensors`` (one file, or sharded with
  ``model.safetensors.index.json``);
* a ``.gguf`` file (or a folder holding one);
* a hub id (``org/name``) through ``huggingface_hub`` (honours ``HF_HUB_OFFLINE``);
* nothing: the embedded default model (SmolLM2-135M-Instruct, see default_model.py).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

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
