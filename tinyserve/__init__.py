"""tinyserve: an OpenAI-compatible server with its own continuous-batching engine."""

__version__ = "0.1.0"
