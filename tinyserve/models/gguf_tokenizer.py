"""A GGUF's tokenizer for a family transformers' GGUF reader does not know (granite,
smollm3, ...): transformers reads a GGUF's tokenizer only through its architecture's config
mapping, and refuses the file before looking at the tokenizer. The tokenizer does not depend
on the architecture, so its ``tokenizer.*`` fields are copied into a tensor-less GGUF that
says ``llama``, which transformers then converts (once: the loader keeps the result beside
the file). The same copy gives the family benchmark GGUFs a tokenizer
(benchmarks/family_ggufs.py)."""

from __future__ import annotations

from pathlib import Path


def tokenizer_fields(gguf_path: Path):
    """A GGUFWriter callback that adds ``gguf_path``'s ``tokenizer.*`` fields."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    fields = {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    kinds = gguf.GGUFValueType

    def add(w) -> None:
        for key, f in fields.items():
            kind = f.types[0]
            if kind == kinds.ARRAY:
                values = [f.parts[i] for i in f.data]
                if f.types[1] == kinds.STRING:
                    w.add_array(key, [bytes(v).decode("utf-8") for v in values])
                else:
                    w.add_array(key, [int(v[0]) for v in values])
            elif kind == kinds.STRING:
                w.add_string(key, bytes(f.parts[f.data[0]]).decode("utf-8"))
            elif kind == kinds.BOOL:
                w.add_bool(key, bool(f.parts[f.data[0]][0]))
            else:
                w.add_uint32(key, int(f.parts[f.data[0]][0]))

    return add


def tokenizer_only_gguf(gguf_path: Path, dest: Path) -> Path:
    """``dest``: a GGUF holding ``gguf_path``'s tokenizer under the ``llama`` architecture."""
    import gguf

    w = gguf.GGUFWriter(str(dest), "llama")
    tokenizer_fields(gguf_path)(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest
