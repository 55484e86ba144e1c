"""The paged KV cache stores keys and values packed: int8 (`--kv-quant q8`) or float16 (`f16`).

Decode reads every cached key and value of every sequence once per token: at long
contexts more than the weights (a 110M model at 8,192 tokens: 192 MiB of float32 keys
and values, 60 MiB of q4 weights), and at 8 sequences of ~130 tokens already a quarter
of a step. This pass makes a float32 model's cache hold rows of `ir.kv_cache.KV_ROWS`:
int8 with a float32 scale per token and head (`Int8Rows`, 0.27x the bytes at a head dim
of 64) or float16 (`Float16Rows`, 0.5x), while TVM's cache runtime keeps managing pages,
sequences, forks and rollbacks. That runtime allocates pages in the dtype of the q/k/v
it is handed and checks head counts and head dim, and moves data only through kernels
it is given; so:

- `create_paged_kv_cache` declares the cache in float32 words (head dim 1, `stored_*`
  heads) and hands it ember's kernels: `schedules/quantized_kv_cache.py` to quantize,
  store, copy and merge rows, and the int8 variants of ember's attention kernels (their
  sliding-window variants too, where the cache has windowed layers). Kernels for what
  ember never asks of it (token trees, MLA) are left out, so the runtime refuses such a
  request instead of computing on the wrong layout.
- Every `attention_with_fused_qkv` call hands the same fused q/k/v bytes as words (a
  reshape, no copy) and takes the real output from the front of the output rows.
- Where the cache rotates q and k itself (`RopeMode.NORMAL`), ember's split kernel
  rotates them as it splits (`schedules/rope.py`'s `Rotary`, from the rotation the
  frontend recorded). Until then the graph rotated them before the call, with the
  module's rotary kernel, and concatenated its outputs again: two more kernels a layer,
  7.5 us of each layer's ~200 us in the ~110M model's 8-sequence decode step.

Runs before legalization, so the reshapes and slices are fused like any others.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import tvm
from tvm import relax, tirx

from ember.ir.attributes import KERNEL_SOURCE_ATTR
from ember.ir.kv_cache import (
    CREATE_FUNCTION,
    KV_ROWS,
    NEVER_CALLED_ATTENTION,
    CreateArg,
    KVRows,
    cache_window,
    recorded_scores,
    recorded_sinks,
)
from ember.ir.module_utils import calls_packed
from ember.schedules import quantized_kv_cache as kernels
from ember.schedules.decode_attention import paged_decode_attention
from ember.schedules.kv_storage import PackedPageRows
from ember.schedules.prefill_attention import paged_prefill_attention, ragged_prefill_attention
from ember.schedules.rope import recorded_rotary
from ember.targets.registry import TargetSpec

ATTENTION = "vm.builtin.attention_kv_cache_attention_with_fused_qkv"
_ROPE_NORMAL = 1


def quantize_kv_cache(target: TargetSpec, kv_quant: str) -> tvm.transform.Pass:
    """The pass for `target` (a CPU: the kernels are ember's CPU kernels) and a `KV_ROWS` format."""
    lanes = max(target.vector_bits // 32, 1)

    @tvm.transform.module_pass(opt_level=0, name="QuantizeKVCache")
    def _quantize(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rewriter = _Rewriter(mod, lanes, kv_quant)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        if rewriter.rows is None:
            raise ValueError("quantize_kv_cache: the module creates no paged KV cache")
        # The kernels the cache is no longer handed (TVM's split, attention and page kernels) stay in the module
        # until `drop_unreachable_functions`.
        return rewriter.builder_.get()

    return _quantize


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, lanes: int, kv_quant: str) -> None:
        super().__init__(mod)
        self.mod, self.lanes, self.kv_quant = mod, lanes, kv_quant
        self.rows: KVRows | None = None

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if calls_packed(value, CREATE_FUNCTION):
            rewritten = self._create(value)
        elif isinstance(value, relax.Call) and calls_packed(value, ATTENTION, op="relax.call_dps_packed"):
            rewritten = self._attention(value)
        else:
            super().visit_var_binding_(binding)
            return
        emit = self.builder_.emit if isinstance(binding.var, relax.DataflowVar) else self.builder_.emit_output
        self.set_var_remap(binding.var, emit(rewritten))

    def _create(self, call: relax.Call) -> relax.Call:
        args = list(call.args[1:])
        dtype = str(args[CreateArg.DTYPE_EXAMPLE].ty.dtype)
        if dtype != "float32":
            raise ValueError(f"quantize_kv_cache: the {self.kv_quant} cache stores float32 models' keys and values, "
                             f"not {dtype}")
        qo_heads, kv_heads, head_dim = (int(args[i].value)
                                        for i in (CreateArg.QO_HEADS, CreateArg.KV_HEADS, CreateArg.QK_DIM))
        self.rows = rows = KV_ROWS[self.kv_quant](qo_heads, kv_heads, head_dim)
        # By name: an importer's cache was built apart.
        decode = self.mod[args[CreateArg.DECODE].fields[1].name_hint]
        page_size = int(decode.params[1].shape[3])  # TVM's kernels are built for the page size the runtime uses
        num_layers = int(self.mod[args[CreateArg.DEBUG_READ].name_hint].params[2].shape[0])
        # Where the cache rotates q and k (`RopeMode.NORMAL`: the builtin frontend's models, which record their
        # rotation), ember's split rotates them as it splits; the cache's own split kernel goes.
        split_rotary = None
        if int(args[CreateArg.ROPE_MODE].value) == _ROPE_NORMAL:
            split_rotary = recorded_rotary(self.mod, head_dim, dtype)
            if split_rotary is None:
                raise ValueError("quantize_kv_cache: the cache rotates q and k, and the module records no rotation "
                                 "ember's split computes")
        storage = PackedPageRows(rows, page_size)

        def kernel(name: str, build: Callable[..., tirx.PrimFunc]) -> relax.GlobalVar:
            """`build(symbol=...)`, added to the module under its exported symbol."""
            symbol = f"ember_{self.kv_quant}_kv_{name}"
            return self.builder_.add_func(build(symbol=symbol).with_attr(KERNEL_SOURCE_ATTR, __name__), symbol)

        def attention(name: str, build: Callable[..., tirx.PrimFunc]) -> relax.Tuple:
            return relax.Tuple([tvm.ir.StringImm("tirx"), kernel(name, build)])

        args[CreateArg.QO_HEADS] = relax.prim_value(rows.stored_qo_heads)
        args[CreateArg.KV_HEADS] = relax.prim_value(rows.stored_kv_heads)
        args[CreateArg.QK_DIM] = args[CreateArg.V_DIM] = relax.prim_value(1)
        args[CreateArg.APPEND] = kernel("append", partial(kernels.append_rows, storage, dtype))
        args[CreateArg.APPEND_MLA] = relax.op.null_value()
        # Where every layer has the window, the plain kernels see through it (`CacheShape.window_pages`).
        window, sliding_slots = cache_window(self.mod)
        plain_window = 0 if sliding_slots else window
        softcap, slopes = recorded_scores(self.mod)
        sinks = recorded_sinks(self.mod)
        args[CreateArg.RAGGED] = attention("ragged", partial(ragged_prefill_attention, kv_heads, qo_heads, head_dim,
                                                             dtype, self.lanes, rows=rows, softcap=softcap,
                                                             slopes=slopes, sinks=sinks))
        args[CreateArg.PREFILL] = attention("prefill", partial(paged_prefill_attention, kv_heads, qo_heads, head_dim,
                                                               dtype, page_size, self.lanes, storage=storage,
                                                               window=plain_window, softcap=softcap, slopes=slopes,
                                                               sinks=sinks))
        args[CreateArg.DECODE] = attention("decode", partial(paged_decode_attention, kv_heads, qo_heads, head_dim,
                                                             dtype, page_size, self.lanes, storage=storage,
                                                             window=plain_window, softcap=softcap, slopes=slopes,
                                                             sinks=sinks))
        if sliding_slots:
            args[CreateArg.PREFILL_SLIDING_WINDOW] = attention("prefill_window", partial(
                paged_prefill_attention, kv_heads, qo_heads, head_dim, dtype, page_size, self.lanes, storage=storage,
                window=window, window_pages=True, softcap=softcap, slopes=slopes, sinks=sinks))
            args[CreateArg.DECODE_SLIDING_WINDOW] = attention("decode_window", partial(
                paged_decode_attention, kv_heads, qo_heads, head_dim, dtype, page_size, self.lanes, storage=storage,
                window=window, window_pages=True, softcap=softcap, slopes=slopes, sinks=sinks))
        else:
            args[CreateArg.PREFILL_SLIDING_WINDOW] = args[CreateArg.DECODE_SLIDING_WINDOW] = relax.Tuple([])
        for index in NEVER_CALLED_ATTENTION:
            args[index] = relax.Tuple([])
        args[CreateArg.MERGE] = relax.Tuple([kernel("merge", partial(kernels.merge_states, rows, dtype))])
        args[CreateArg.SPLIT] = kernel("split", partial(kernels.split_and_quantize, rows, dtype,
                                                        rotary=split_rotary))
        args[CreateArg.COPY_PAGE] = kernel("copy_page", partial(kernels.copy_page_rows, storage, dtype))
        args[CreateArg.DEBUG_READ] = kernel("read", partial(kernels.read_rows, storage, num_layers, dtype))
        args[CreateArg.COMPACT] = kernel("compact", partial(kernels.compact_rows, storage, dtype))
        return relax.call_pure_packed(CREATE_FUNCTION, *args, ty_args=list(call.ty_args))

    def _attention(self, call: relax.Call) -> relax.Expr:
        """The call with q/k/v as word rows; the real output from the front of its word rows."""
        if self.rows is None:
            raise ValueError("quantize_kv_cache: attention before the module's create_paged_kv_cache")
        rows = self.rows
        cache, layer, scale, qkv = (self.visit_expr(arg) for arg in call.args[1].fields)
        tokens = qkv.ty.shape[0]
        dtype = str(qkv.ty.dtype)
        words = self.builder_.emit(relax.op.reshape(qkv, (tokens, rows.stored_qo_heads + 2 * rows.stored_kv_heads, 1)))
        output = self.builder_.emit(relax.call_dps_packed(
            ATTENTION, relax.Tuple([cache, layer, scale, words]),
            relax.TensorType((tokens, rows.stored_qo_heads, 1), dtype)))
        flat = self.builder_.emit(relax.op.reshape(output, (tokens, rows.stored_qo_heads)))
        real = self.builder_.emit(relax.op.strided_slice(flat, axes=[1], begin=[0],
                                                         end=[rows.num_qo_heads * rows.head_dim]))
        return relax.op.reshape(real, (tokens, rows.num_qo_heads, rows.head_dim))
