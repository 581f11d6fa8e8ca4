"""All decoder layers of a step in one C call (step.c), for the CPU kernel path.

models/llama.py's kernel path calls ~8 kernels per layer from Python; at one decode stream
those ~240 ctypes round trips and their tensor allocations cost milliseconds a step. step.c
makes the same calls with the same arguments in the same order, so its results are bitwise
those of the Python path (tests/kernels/test_cpu_kernels.py), and the Python path stays the
readable reference. Built once per model by :func:`build_plan` (None where any layer is off
the kernels: torch methods, tensor parallel, shapes the kernels do not serve).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tinyserve.kernels import attention, gemm, ops
from tinyserve.kernels.build import kernel_threads, load

P, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Linear(ctypes.Structure):
    _fields_ = [("kind", I64), ("int8_decode", I64), ("qs", P), ("d", P), ("m", P),
                ("bias", P), ("N", I64), ("K", I64), ("q8_qs", P), ("q8_d", P),
                ("q8_m", P)]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", P), ("post_norm", P), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("q_norm", P), ("k_norm", P),
                ("attn_out_norm", P), ("mlp_out_norm", P), ("rope", I64),
                ("window", I64), ("group", I64)]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [("gemm", P), ("qgemm", P), ("rms_norm", P), ("act_and_mul", P),
                ("rope_and_cache", P), ("paged_attention", P), ("head_norm", P),
                ("branch_scale", F32), ("num_layers", I64),
                ("hidden", I64), ("intermediate", I64), ("num_heads", I64),
                ("num_kv_heads", I64), ("head_dim", I64), ("block_size", I64), ("eps", F32),
                ("scale", F32), ("layers", ctypes.POINTER(_Layer))]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [("cos", P), ("sin", P), ("cos_id", P), ("sin_id", P), ("cos2", P),
                ("sin2", P), ("slot_mapping", P),
                ("query_start_loc", P),
                ("seq_lens", P), ("seq_of_token", P), ("block_tables", P),
                ("max_blocks", I64), ("k_caches", P), ("v_caches", P),
                ("group_slots", P), ("group_tables", P), ("group_max_blocks", P)]  # fmt: skip


@functools.cache
def library() -> ctypes.CDLL | None:
    lib = load("step")
    if lib is not None:
        lib.forward_layers.argtypes = [P, P, P, P, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.forward_layers.restype = ctypes.c_int
        lib.gelu_tanh_and_mul.argtypes = [P, P, I64, I64, ctypes.c_int]
        lib.gelu_tanh_and_mul.restype = None
    return lib


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2I] float32 -> gelu_tanh(gate) * up [rows, I] (Gemma 3's GeGLU), the
    kernel step.c calls, for the Python loop."""
    rows, two_i = gate_up.shape
    out = torch.empty(rows, two_i // 2, dtype=torch.float32)
    library().gelu_tanh_and_mul(gate_up.data_ptr(), out.data_ptr(), rows, two_i // 2,
                                kernel_threads())  # fmt: skip
    return out


def _fn(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _linear(layer) -> _Linear | None:
    """gemm.c's pointers (the kernel layout) and, for int8 decode rows, qgemm.c's (the
    checkpoint layout)."""
    method = layer.method
    kw = getattr(method, "kernel", None)
    if kw is None:
        return None
    n, k = kw.shape
    q8 = method.packed if method.int8_decode else None
    q8_ptrs = (None, None, None) if q8 is None else (_ptr(q8.qs), _ptr(q8.d), _ptr(q8.m))
    kind = gemm._KIND_IDS[kw.kind] | (gemm.BF16_ACT if method.bf16 else 0)
    return _Linear(kind, int(method.int8_decode), _ptr(kw.qs), _ptr(kw.d),
                   _ptr(kw.m), _ptr(layer.bias), n, k, *q8_ptrs)  # fmt: skip


class StepPlan:
    """The model's layers as step.c reads them: pointers into the model's tensors, fixed
    when built (after the loader fixes the methods), which the plan keeps alive."""

    def __init__(self, model, layers: ctypes.Array, keep: list) -> None:
        # keep: the tensors the pointers point into (alive even if a method is replaced).
        self._layers, self._keep = layers, keep
        cfg, attn = model.config, model.model.layers[0].self_attn
        libs = (gemm.library(), gemm.q8_library(), ops.library(), attention.library())
        self._lib = library()
        tiles = "_tiles" if model.attention_method.tiles else ""  # as the Python loop
        gelu = model.model.layers[0].mlp.activation == "gelu_tanh"  # Gemma 3's, else SiLU
        act = _fn(self._lib, "gelu_tanh_and_mul") if gelu else _fn(libs[2], "silu_and_mul")
        self._struct = _Model(
            _fn(libs[0], "gemm"), _fn(libs[1], "qgemm"), _fn(libs[2], "rms_norm"),
            act, _fn(libs[2], "rope_and_cache"),
            _fn(libs[3], "paged_attention" + tiles), _fn(libs[2], "head_norm"),
            model.model.layers[0].residual_multiplier, cfg.num_hidden_layers, cfg.hidden_size,
            cfg.intermediate_size, attn.num_heads, attn.num_kv_heads, attn.head_dim, 0,
            cfg.rms_norm_eps, attn.scale, layers,
        )  # fmt: skip
        self._nope = any(not layer.rope for layer in layers)  # identity tables needed
        self._caches: tuple[tuple, ctypes.Array, ctypes.Array] | None = None  # (key, K, V)
        # The cache writer and attention for each cache dtype (--kv-cache-dtype).
        self._cache_fns = {
            torch.float32: (self._struct.rope_and_cache, self._struct.paged_attention),
            torch.bfloat16: (_fn(libs[2], "rope_and_cache_bf16"),
                             _fn(libs[3], "paged_attention_bf16" + tiles)),
        }  # fmt: skip

    def _cache_ptrs(self, kv_caches) -> tuple[ctypes.Array, ctypes.Array]:
        """The layers' K and V cache pointers as C arrays, rebuilt when any pointer changes.
        Keyed by every K *and* V pointer: engines sharing one model (the tests) each bring
        their own caches, and a new engine's K tensors can land where a freed engine's did
        while its V tensors do not (a key of K alone handed the kernel freed V memory)."""
        dtype = kv_caches[0][0].dtype
        key = (dtype, *(t.data_ptr() for kv in kv_caches for t in kv))
        if self._caches is None or self._caches[0] != key:
            if dtype not in self._cache_fns:
                raise ValueError(f"the fused step reads float32 or bfloat16 caches, not {dtype}")
            self._struct.rope_and_cache, self._struct.paged_attention = self._cache_fns[dtype]
            n = len(kv_caches)
            ks = (ctypes.c_void_p * n)(*(k.data_ptr() for k, _ in kv_caches))
            vs = (ctypes.c_void_p * n)(*(v.data_ptr() for _, v in kv_caches))
            self._caches = (key, ks, vs)
        return self._caches[1], self._caches[2]

    def forward(
        self, x: torch.Tensor, cos_sin, kv_caches, meta
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, H] embeddings (overwritten in place) -> (last layer's output, residual)."""
        x = x.contiguous()
        residual = torch.empty_like(x)
        kin = meta.kernel
        ks, vs = self._cache_ptrs(kv_caches)
        tables = (*cos_sin[0], *cos_sin[1]) if isinstance(cos_sin[0], tuple) else cos_sin
        cos, sin, cos2, sin2 = (*(t.contiguous() for t in tables), None, None)[:4]  # Gemma 3: 4
        ident = (torch.ones_like(cos), torch.zeros_like(sin)) if self._nope else (None, None)
        self._struct.block_size = meta.block_size
        step = _Step(cos.data_ptr(), sin.data_ptr(), _ptr(ident[0]), _ptr(ident[1]),
                     _ptr(cos2), _ptr(sin2),
                     meta.slot_mapping.data_ptr(),
                     kin.query_start_loc.data_ptr(), kin.seq_lens.data_ptr(),
                     kin.seq_of_token.data_ptr(), kin.block_tables.data_ptr(),
                     kin.block_tables.shape[1], ctypes.addressof(ks), ctypes.addressof(vs))  # fmt: skip
        if meta.group_metas:  # a hybrid model's layer groups 1, 2, ...: their own tables
            n = len(meta.group_metas)
            groups = (
                (ctypes.c_void_p * n)(*(m.slot_mapping.data_ptr() for m in meta.group_metas)),
                (ctypes.c_void_p * n)(*(m.kernel.block_tables.data_ptr()
                                        for m in meta.group_metas)),
                (ctypes.c_int64 * n)(*(m.kernel.block_tables.shape[1] for m in meta.group_metas)),
            )  # fmt: skip
            step.group_slots, step.group_tables, step.group_max_blocks = map(
                ctypes.addressof, groups
            )
        rc = self._lib.forward_layers(
            ctypes.addressof(self._struct), ctypes.addressof(step), x.data_ptr(),
            residual.data_ptr(), x.shape[0], meta.num_decode_tokens, kernel_threads(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("forward_layers: could not allocate its scratch memory")
        return x, residual


def build_plan(model) -> StepPlan | None:
    """A StepPlan when every layer runs on the kernels (packed linears, fused norms, RoPE,
    the MLP's activation and the block-table attention, one rank); else None (the Python
    path serves)."""
    if library() is None or model.tp.size != 1 or not model.fused_step_ok:
        return None
    if not model.attention_method.block_table_inputs:  # the CPU kernels' attention only
        return None
    if gemm.q8_library() is None:
        return None
    layers, keep = [], []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms = [n for n in layer.step_norms() if n is not None]
        if not (mlp.use_kernel and all(n.use_kernel for n in norms)):
            return None
        lins = [_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(lin is None for lin in lins):
            return None
        q_norm, k_norm = (getattr(attn, n, None) for n in ("q_norm", "k_norm"))
        heads = [None if m is None else m.weight for m in (q_norm, k_norm)]
        weights = [None if n is None else n.weight for n in layer.step_norms()]
        layers.append(_Layer(*map(_ptr, weights[:2]), *lins, *map(_ptr, heads),
                             *map(_ptr, weights[2:]), attn.step_table,
                             attn.window or 0, attn.kv_group))  # fmt: skip
        keep += [n.weight for n in norms] + heads
        keep += [(m.method.kernel, m.method.packed, m.bias) for m in (attn.qkv_proj, attn.o_proj,
                                                    mlp.gate_up_proj, mlp.down_proj)]  # fmt: skip
    return StepPlan(model, (_Layer * len(layers))(*layers), keep)
