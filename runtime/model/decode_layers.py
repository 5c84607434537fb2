"""A decode-only step's layers in one C call (csrc/decode_layers.c) instead of ~9 Python calls a layer.

The C loop makes the same kernel calls, in the same order and with the same
arguments, as LlamaModel._forward_native does for such a step, so the hidden
states are the same bit for bit (tested). What it saves is the Python wrapping
around each call (tensor allocation, data_ptr, ctypes), a sizeable share of a
decode step and more of a one-sequence step (`python -m tests.bench engine`,
decode rows). It takes a model whose every projection the C matmul serves at this row
count (the default GGUF on a CPU with the kernels); other steps keep the Python
loop.
"""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from runtime.kernels.library import load
from runtime.kernels.stacked_matmul import StackedMatmul
from runtime.quant.linear import ALL_ROWS, Int4Linear

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p

_split = 1
_pool: ThreadPoolExecutor | None = None
_pool_ids: list[int] = []


def set_split(parts: int) -> list[int]:
    """Run the decode steps that follow in `parts` groups of rows, each group's layers (and LM head rows, in_parts)
    on a thread of its own, the calling thread and parts - 1 helpers, each kernel on one thread and no barrier
    between the groups but the step's end (csrc/decode_layers.c, decode_layers_rows); 1: all the rows together,
    each kernel over the compute threads. The engine's CpuShare sets it where other processes share the cores.
    Returns the helper threads' Linux thread ids (their scheduler statistics are the engine's to read)."""
    global _split, _pool, _pool_ids
    parts = max(1, int(parts))
    if parts > 1 and (_pool is None or len(_pool_ids) != parts - 1):
        if _pool is not None:
            _pool.shutdown()
        _pool = ThreadPoolExecutor(max_workers=parts - 1, thread_name_prefix="prescient-part")
        meet = threading.Barrier(parts - 1)

        def thread_id() -> int:
            meet.wait()  # every helper holds one task at once: each reports a different thread
            return threading.get_native_id()

        _pool_ids = [f.result() for f in [_pool.submit(thread_id) for _ in range(parts - 1)]]
    _split = parts
    return list(_pool_ids) if parts > 1 else []


def sequence_cuts(positions: torch.Tensor, tables: torch.Tensor, parts: int) -> list[int]:
    """Where to cut a decode step's rows into at most `parts` parts of about equal size, each cut between two
    sequences: a sequence verifying proposals has a row per proposal on one block table at consecutive
    positions, each row attending to the keys the earlier ones write in the same layer, so its rows stay in
    one part. Returns the cuts (rows where a part starts, ascending; none: run them together)."""
    m = positions.shape[0]
    follows = (positions[1:] == positions[:-1] + 1) & (tables[1:] == tables[:-1]).all(dim=1)
    free = [r for r, cont in enumerate(follows.tolist(), start=1) if not cont]  # a sequence starts at row r
    cuts: list[int] = []
    for i in range(1, parts):
        if not free:
            break
        best = min(free, key=lambda r: abs(r - m * i / parts))
        if (not cuts or best > cuts[-1]) and best < m:
            cuts.append(best)
    return cuts


_inside = threading.local()


def split_parts() -> int:
    """The parts set_split asks for, on this thread: 1 inside a part run_parts already runs (no nesting)."""
    return 1 if getattr(_inside, "part", False) else _split


def run_parts(fns: list) -> list:
    """fns() each on its own thread (the first on the calling one), none splitting again inside; their
    results in order."""

    def inside(fn):
        _inside.part = True
        try:
            return fn()
        finally:
            _inside.part = False

    others = [_pool.submit(inside, fn) for fn in fns[1:]]
    return [inside(fns[0]), *(f.result() for f in others)]


def in_parts(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for a row-wise fn (x's rows in, the same rows out), where the steps are split (set_split) the rows
    in as many parts, each on its thread."""
    parts, rows = split_parts(), x.shape[0]
    if parts < 2 or rows < parts:
        return fn(x)
    bounds = [rows * i // parts for i in range(parts + 1)]
    return torch.cat(run_parts([lambda a=a, b=b: fn(x[a:b]) for a, b in zip(bounds, bounds[1:])]))


class _Projection(ctypes.Structure):
    _fields_ = [
        ("codes", _ptr),
        ("scale", _ptr),
        ("offset", _ptr),
        ("tiles", _ptr),
        ("tscale", _ptr),
        ("toffset", _ptr),
        ("n", _i64),
        ("k", _i64),
        ("bits", _i64),
        ("native_rows", _i64),
        ("gemm_rows", _i64),
        ("next", ctypes.c_void_p),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Projection),
        ("o", _Projection),
        ("gate_up", _Projection),
        ("down", _Projection),
        ("post_norm", _ptr),
        ("next_norm", _ptr),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("qkv_bias", _ptr),
        ("q_norm", _ptr),
        ("k_norm", _ptr),
        ("attn_out_norm", _ptr),
        ("mlp_out_norm", _ptr),
        ("cos", _ptr),
        ("sin_signed", _ptr),
        ("window", _i64),
        ("softcap", ctypes.c_float),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("hidden", _i64),
        ("heads", _i64),
        ("kv_heads", _i64),
        ("head_dim", _i64),
        ("intermediate", _i64),
        ("block_size", _i64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("bf16", ctypes.c_int),
        ("gelu", ctypes.c_int),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("M", _i64),
        ("max_blocks", _i64),
        ("positions", _ptr),
        ("slots", _ptr),
        ("block_tables", _ptr),
        ("context_lens", _ptr),
        ("first_norm", _ptr),
        ("h", _ptr),
        ("x", _ptr),
        ("qkv", _ptr),
        ("o", _ptr),
        ("gate_up", _ptr),
        ("act", _ptr),
        ("down", _ptr),
        ("q", _ptr),
        ("attn", _ptr),
    ]


def _projection(w: Int4Linear, keep: list) -> _Projection:
    """w's struct; a StackedMatmul's parts as a chain of structs (each kept alive in `keep`)."""
    native = w.native
    if isinstance(native, StackedMatmul):
        following = None
        for part in reversed(native.parts):
            tiles = tuple(t.data_ptr() for t in part.tiles)
            link = _Projection(
                None, None, None, *tiles, part.out_features, part.in_features, part.bits, -1, 1, following
            )
            keep.append(link)
            following = ctypes.addressof(link)
        return link
    codes = (native.codes.data_ptr(), native.scale.data_ptr(), native.offset.data_ptr())
    tiles = tuple(t.data_ptr() for t in native.tiles) if native.tiles is not None else (None, None, None)
    native_rows = -1 if w.native_rows is None else w.native_rows
    gemm_rows = -1 if w.gemm_rows is None or native.tiles is None else w.gemm_rows
    if w.packed is None:  # the C kernels' one layout takes every row count (Int4Linear.native_path)
        native_rows, gemm_rows = (-1, 1) if native.tiles is not None else (ALL_ROWS, -1)
    return _Projection(
        *codes, *tiles, w.out_features, w.in_features, native.bits, native_rows, gemm_rows, None
    )


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _takes(w, rows: int) -> bool:
    """The C matmul serves this projection at this many rows (Int4Linear.native_path)."""
    if not isinstance(w, Int4Linear) or w.native is None:
        return False
    path = w.native_path(rows)
    return path == "one-row" or (path == "many-row" and w.native.tiles is not None)


class NativeDecode:
    """The C layer loop for one model and its KV cache; `usable(rows)` says where it serves."""

    def __init__(self, model, kv):
        c = model.config
        self.model, self.kv = model, kv
        self.projections = [
            w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ]
        self._usable: dict[int, bool] = {}
        self.spec = _Model(
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.intermediate_size,
            kv.block_size,
            c.rms_norm_eps,
            model.scale,
            int(model.dtype == torch.bfloat16),
            int(c.hidden_act == "gelu_tanh"),
        )
        layers = []
        self._parts: list[_Projection] = []  # the chains' links, which the layer structs point to
        for i, layer in enumerate(model.layers):
            k_cache, v_cache = kv.layer(i)
            following = model.layers[i + 1].input_norm if i + 1 < len(model.layers) else model.norm
            rope = model.layer_rope(i)
            layers.append(
                _Layer(
                    *(_projection(w, self._parts) for w in (layer.qkv, layer.o, layer.gate_up, layer.down)),
                    layer.post_norm.data_ptr(),
                    following.data_ptr(),
                    k_cache.data_ptr(),
                    v_cache.data_ptr(),
                    *(
                        _address(t)
                        for t in (
                            layer.qkv_bias,
                            layer.q_norm,
                            layer.k_norm,
                            layer.attn_out_norm,
                            layer.mlp_out_norm,
                            rope.cos,
                            rope.sin_signed,
                        )
                    ),
                    model.windows[i] or 0,
                    c.attn_logit_softcap or 0.0,
                )
            )
        self.layers = (_Layer * len(layers))(*layers)

    @staticmethod
    def possible(model, kv) -> bool:
        """The C loop can run this model at all: CPU, float32 or bfloat16, every projection in GGUF-style
        blocks the C matmul has a layout for, K/V in the model dtype."""
        return (
            model.device.type == "cpu"
            and model.dtype in (torch.float32, torch.bfloat16)
            and kv.pool.dtype == model.dtype
            and load() is not None
            and all(
                isinstance(w, Int4Linear) and w.native is not None
                for layer in model.layers
                for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
            )
        )

    def usable(self, rows: int) -> bool:
        """The C loop serves a decode step of this many rows. The routes it checks are the load-time choices
        its structs copied, fixed from then on, so the answer is kept per row count (asking every projection each
        step costs more than the lookup)."""
        known = self._usable.get(rows)
        if known is None:
            known = self._usable[rows] = all(_takes(w, rows) for w in self.projections)
        return known

    def forward(self, h: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """h [M, hidden]: the rows' embeddings (overwritten: the residual stream); returns the final
        normalised hidden states [M, hidden], as LlamaModel.forward."""
        model, c = self.model, self.model.config
        m, dtype = h.shape[0], model.dtype
        x = torch.empty_like(h)
        qkv = torch.empty(m, c.q_size + 2 * c.kv_size, dtype=dtype)
        o, down = torch.empty_like(h), torch.empty_like(h)
        gate_up = torch.empty(m, 2 * c.intermediate_size, dtype=dtype)
        act = torch.empty(m, c.intermediate_size, dtype=dtype)
        q = torch.empty(m, c.num_heads, c.head_dim, dtype=torch.float32)
        attn = torch.empty_like(q)
        tables, lens = meta.decode_block_tables.contiguous(), meta.decode_context_lens.contiguous()
        slots = meta.slot_mapping.contiguous()
        step = _Step(
            m,
            tables.shape[1],
            positions.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            lens.data_ptr(),
            model.layers[0].input_norm.data_ptr(),
            h.data_ptr(),
            x.data_ptr(),
            qkv.data_ptr(),
            o.data_ptr(),
            gate_up.data_ptr(),
            act.data_ptr(),
            down.data_ptr(),
            q.data_ptr(),
            attn.data_ptr(),
        )
        args = (ctypes.byref(self.spec), self.layers, len(self.layers), ctypes.byref(step))
        parts = split_parts()
        cuts = sequence_cuts(positions, tables, parts) if parts > 1 and m > 1 else []
        bounds = [0, *cuts, m]
        if cuts and all(self.usable(b - a) for a, b in zip(bounds, bounds[1:])):
            rows = load().decode_layers_rows
            run_parts([lambda a=a, b=b: rows(*args, a, b) for a, b in zip(bounds, bounds[1:])])
        else:
            load().decode_layers(*args, torch.get_num_threads())
        return x
