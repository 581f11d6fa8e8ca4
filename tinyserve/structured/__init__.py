"""Structured outputs: the grammar seam (see backend.py for the contract).

The engine imports this package; it imports only the leaf modules and utils. ``spec`` is
torch-free; ``backend`` and ``manager`` load the grammar library (llguidance) and torch, so
they are imported by name, not from here.
"""

from tinyserve.structured.spec import StructuredOutputSpec

__all__ = ["StructuredOutputSpec"]
