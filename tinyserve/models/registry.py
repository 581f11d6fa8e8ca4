"""Architecture name -> model class. ``config.ARCHITECTURES`` (torch-free, so the config can
reject an unknown architecture before anything loads) names the module of tinyserve/models/
that defines each; the class is that module's attribute of the same name."""

from __future__ import annotations

import importlib

from tinyserve.config import ARCHITECTURES, ModelConfig
from tinyserve.models.llama import LlamaForCausalLM


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class that serves ``config.architecture`` (ModelConfig checked it is known)."""
    module = importlib.import_module(f"tinyserve.models.{ARCHITECTURES[config.architecture]}")
    return getattr(module, config.architecture)
