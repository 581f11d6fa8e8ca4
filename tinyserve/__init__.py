"""tinyserve: an OpenAI-compatible server with its own continuous-batching engine.

``from tinyserve import LLM, SamplingParams``. LLM is imported lazily so that the torch-free
parts (scheduler, KV-cache manager) can be imported without torch.
"""

from tinyserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from tinyserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'tinyserve' has no attribute {name!r}")
