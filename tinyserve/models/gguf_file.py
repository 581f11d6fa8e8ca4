"""A small, fast GGUF reader: metadata and tensor views over a memory map.

``gguf.GGUFReader`` builds a numpy view for every part of every field (the ~100k
vocabulary strings included), which takes ~9 s for SmolLM2 here. We only need the scalar
metadata, the length of the token list and the tensor table, so we walk the header with
``struct`` and skip string arrays. Dequantisation and the type tables still come from the
``gguf`` package.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF stores dims fastest-first)
    qtype: int
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """Parsed header of a .gguf file. ``fields`` maps keys to values; string arrays are
    replaced by their length (``ArrayLen``) unless listed in ``keep_arrays``."""

    def __init__(self, path: str | Path, keep_arrays: tuple[str, ...] = ()) -> None:
        from gguf.constants import GGML_QUANT_SIZES

        self.path = Path(path)
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = memoryview(self._mm)
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise ValueError("bad magic: this is not a GGUF file")
        self._buf, self._pos = buf, 4
        version = self._read("<I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._read_str()
            vtype = self._read("<I")
            self.fields[key] = self._read_value(vtype, keep=key in keep_arrays)
        raw: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = self._read_str()
            n_dims = self._read("<I")
            dims = tuple(self._read("<Q") for _ in range(n_dims))
            qtype, offset = self._read("<I"), self._read("<Q")
            raw.append((name, dims, qtype, offset))
        align = int(self.fields.get("general.alignment", 32))
        data_start = (self._pos + align - 1) // align * align
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, qtype, offset in raw:
            if qtype not in GGML_QUANT_SIZES:
                raise ValueError(f"tensor {name} has unknown GGML type {qtype}")
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims)) if dims else 1
            nbytes = n // block * type_size
            start = data_start + offset
            if start + nbytes > len(self._mm):
                raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
            self.tensors[name] = GGUFTensorInfo(name, tuple(reversed(dims)), qtype, start, nbytes)

    # -- header walking ---------------------------------------------------------------
    def _read(self, fmt: str):
        try:
            (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        except struct.error as e:
            raise ValueError("header ends early (truncated file?)") from e
        self._pos += struct.calcsize(fmt)
        return value

    def _read_str(self) -> str:
        n = self._read("<Q")
        if self._pos + n > len(self._buf):
            raise ValueError("header ends early (truncated file?)")
        s = bytes(self._buf[self._pos : self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _read_value(self, vtype: int, keep: bool = True):
        if vtype in _SCALARS:
            return self._read(_SCALARS[vtype])
        if vtype == _STRING:
            return self._read_str()
        if vtype == _ARRAY:
            itype, count = self._read("<I"), self._read("<Q")
            if itype in _SCALARS and not keep:
                self._pos += struct.calcsize(_SCALARS[itype]) * count
                return ArrayLen(count)
            if itype == _STRING and not keep:
                for _ in range(count):  # skip: length-prefixed strings
                    (n,) = struct.unpack_from("<Q", self._buf, self._pos)
                    self._pos += 8 + n
                return ArrayLen(count)
            return [self._read_value(itype) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")

    # -- tensors ----------------------------------------------------------------------
    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """Bytes of a tensor shaped [..., bytes_per_row] (what gguf.quants.dequantize takes)."""
        data = self._mm[info.offset : info.offset + info.nbytes]
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return data.reshape(*info.shape[:-1], info.nbytes // max(rows, 1))

    def dequantize(self, info: GGUFTensorInfo) -> np.ndarray:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        qtype = GGMLQuantizationType(info.qtype)
        out = dequantize(self.raw(info), qtype)
        out = np.ascontiguousarray(out.reshape(info.shape), dtype=np.float32)
        return out if out.flags.writeable else out.copy()  # F32 comes back as a view of the map


class ArrayLen(int):
    """Stands in for a skipped array: only its length is known."""
