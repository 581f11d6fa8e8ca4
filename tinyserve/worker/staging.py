"""A step's host-built tensors to the device in one copy.

The model runner builds every per-step input on the host from plain lists (token ids,
positions, the attention metadata's slot mapping, masks and gather indices, the logits rows,
the sampler's per-row parameters). Copied one by one from pageable memory, each would be a
blocking transfer that waits for the device (~17 per step). ``HostToDevice`` packs their bytes
into one pinned host buffer and issues a single ``non_blocking`` copy into a persistent device
buffer; the step's tensors are views of it. On a CPU it returns the tensors as they are
(``pack=True`` forces the packing there, which is how the tests check the views).

Reuse: the host buffer is rewritten only once the previous step's copy has finished (a CUDA
event recorded after it); the device buffer is rewritten by a copy queued behind the kernels
that read the previous views, so stream order protects it.
"""

from __future__ import annotations

import dataclasses

import torch

_ALIGN = 16  # bytes: every view starts aligned for any dtype


class HostToDevice:
    def __init__(self, device: torch.device | str, pack: bool | None = None) -> None:
        self.device = torch.device(device)
        self.pack = self.device.type != "cpu" if pack is None else pack
        self._pinned = self.device.type == "cuda"
        self._host: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None
        self._copied = None  # CUDA event after the last copy
        self.num_copies = 0  # transfers issued (tests)

    def __call__(self, objs: list) -> list:
        """``objs`` (tensors, or dataclasses / tuples holding them) with every tensor on the
        device, moved in one copy; on a CPU ``objs`` itself, untouched."""
        if not self.pack:
            return objs
        return with_tensors(objs, iter(self._copy(tensors_of(objs))))

    def _copy(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        host, dev = self._buffers(max(total, _ALIGN))
        for t, off in zip(tensors, offsets, strict=True):
            n = t.numel() * t.element_size()
            if n:
                host[off : off + n].copy_(t.contiguous().view(-1).view(torch.uint8))
        dev[:total].copy_(host[:total], non_blocking=True)
        self.num_copies += 1
        if self._pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return [
            dev[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, off in zip(tensors, offsets, strict=True)
        ]

    def _buffers(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has read the host buffer
        if self._host is None or self._host.numel() < nbytes:
            size = max(nbytes, 2 * (0 if self._host is None else self._host.numel()), 1 << 16)
            self._host = torch.empty(size, dtype=torch.uint8, pin_memory=self._pinned)
            self._dev = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self._host, self._dev


def tensors_of(obj) -> list[torch.Tensor]:
    """Every tensor in ``obj`` (a tensor, a dataclass, a tuple or list of them, or None), in
    a fixed order: what :func:`with_tensors` puts back."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in tensors_of(getattr(obj, f.name))]
    if isinstance(obj, tuple | list):
        return [t for item in obj for t in tensors_of(item)]
    return []


def with_tensors(obj, tensors):
    """``obj`` with its tensors (in :func:`tensors_of` order) replaced from the iterator
    ``tensors``; dataclasses are copied, never changed in place."""
    if isinstance(obj, torch.Tensor):
        return next(tensors)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if tensors_of(value):
                changes[f.name] = with_tensors(value, tensors)
        return dataclasses.replace(obj, **changes) if changes else obj
    if isinstance(obj, tuple | list):
        return type(obj)(with_tensors(item, tensors) for item in obj)
    return obj
