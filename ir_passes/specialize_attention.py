"""Causal self-attention in an imported graph becomes attention over the paged KV cache.

Input: an IRModule whose `forward(input_ids[1, seq], *weights) -> logits[1, seq, vocab]`
is a decoder-only LM's full-sequence forward as an importer wrote it
(`frontend/torch_export.py`). Output: the same weights behind ember's entries
(`frontend/llama.py` has their contracts), the KV cache's constructor and kernels:

    prefill(input_ids[1, seq_len], logit_positions[num_logits], kv_cache)
    decode(input_ids[batch_size, 1], kv_cache)
    verify(input_ids[1, verify_len], kv_cache)

Every entry is `forward` with its token count bound (`seq` becomes `seq_len`,
`batch_size` or `verify_len`): a decoder's tokens only meet in attention, so a
decode batch of one token per sequence runs as one row of `batch_size` tokens,
and the cache, which knows which sequence each token belongs to, attends per
sequence. Three rewrites make that true:

1. **Attention.** `nn.attention(q, k, v)` with a causal mask (`causal_mask`, which is
   how TVM's importer writes `scaled_dot_product_attention(is_causal=True)`), q as
   [1, n, heads, d] and k, v as [1, n, kv_heads, d] after undoing a grouped-query
   repeat (`expand_dims` -> `broadcast_to` -> `reshape`, as transformers' `repeat_kv`
   traces): q, k and v are concatenated and handed to the cache
   (`attention_with_fused_qkv`: append k/v to the sequence's pages, attend over them).
   Attention layers are numbered in graph order.
2. **Positions.** `arange(0, n)` (the positions of a sequence's tokens when the graph
   sees one whole sequence) becomes the cache's query positions, each token's place
   in its own sequence: rotary embeddings (either form, computed in the graph) and
   learned position tables then read the right rows. Keys are stored rotated, so the
   cache applies no rotary embedding itself (`RopeMode.NONE`).
3. **Logits.** In `prefill`, the LM head (the projection whose result is returned)
   reads only the rows at `logit_positions`.

Anything else is refused with the path of operators where recognition stopped, never
compiled into something wrong: attention with an additive bias or without a causal
mask (a bidirectional encoder, ALiBi), keys or values that are not per-token
projections of the sequence, a graph without attention.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, tirx

from ember.errors import ModelError
from ember.ir_passes.module_utils import VERIFY_LEN, bindings, is_op

KV_ATTENTION = "vm.builtin.attention_kv_cache_attention_with_fused_qkv"
QUERY_POSITIONS = "vm.builtin.attention_kv_cache_get_query_positions"
# entry -> (its symbolic token count, how input_ids arrive)
ENTRIES = {"prefill": "seq_len", "decode": "batch_size", "verify": VERIFY_LEN}


def attention_heads(mod: tvm.IRModule, forward: str = "forward") -> dict[str, int]:
    """What the KV cache must hold for `forward`'s attention: layers, query and key/value heads, head dim."""
    found = [_Attention.recognise(binding, _values(mod[forward])) for binding in _attention_bindings(mod[forward])]
    if not found:
        raise ModelError(f"{forward}: found no attention (nn.attention) in the imported graph; is it a decoder?")
    shapes = {(a.num_heads, a.num_kv_heads, a.head_dim) for a in found}
    if len(shapes) > 1:
        raise ModelError(f"{forward}: attention layers differ in heads or head dim ({sorted(shapes)}); "
                         "one paged KV cache holds one shape")
    (heads, kv_heads, head_dim), = shapes
    return {"num_layers": len(found), "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim}


def specialize_attention(mod: tvm.IRModule, forward: str = "forward") -> tvm.IRModule:
    """`mod` with `forward` replaced by the entries `prefill`, `decode` and `verify` (see the module docstring)."""
    func = mod[forward]
    input_ids = func.params[0]
    batch, seq = input_ids.ty.shape
    if not (isinstance(batch, tirx.IntImm) and int(batch) == 1 and isinstance(seq, tirx.Var)):
        raise ModelError(f"{forward}: expected input_ids of shape [1, seq], got {list(input_ids.ty.shape)}")
    functions = {gv.name_hint: f for gv, f in mod.functions_items() if gv.name_hint != forward}
    for entry, size in ENTRIES.items():
        count = tirx.Var(size, "int64")
        functions[entry] = _Entry(mod, entry, count).rewrite(func.bind_symbolic_vars({seq: count}))
    return relax.transform.Normalize()(tvm.IRModule(functions, attrs=mod.attrs))


class _Attention:
    """One recognised attention: its q and k/v per token, and its scale."""

    def __init__(self, q: relax.Expr, k: relax.Expr, v: relax.Expr, scale: float) -> None:
        self.q, self.k, self.v, self.scale = q, k, v, scale
        self.num_heads, self.head_dim = int(q.ty.shape[2]), int(q.ty.shape[3])
        self.num_kv_heads = int(k.ty.shape[2])

    @classmethod
    def recognise(cls, binding: relax.VarBinding, values: dict[relax.Var, relax.Expr]) -> _Attention:
        call = binding.value
        where = f"{binding.var.name_hint} = nn.attention"
        attrs = call.attrs
        if len(call.args) > 3:
            raise ModelError(f"{where}: attention with an additive bias (a mask or ALiBi) is not supported; "
                             "ember recognises causal attention (scaled_dot_product_attention with is_causal=True)")
        if attrs.causal_mask is None:
            raise ModelError(f"{where}: attention without a causal mask (a bidirectional encoder?) cannot use "
                             "a KV cache; ember compiles causal decoders")
        q, k, v = call.args[:3]
        k, v = (_unrepeat(x, values, f"{where}: {name}") for x, name in ((k, "keys"), (v, "values")))
        for x, name in ((q, "queries"), (k, "keys"), (v, "values")):
            if len(x.ty.shape) != 4:
                raise ModelError(f"{where}: {name} are not [batch, seq, heads, head_dim] ({x.ty})")
        if int(q.ty.shape[3]) != int(v.ty.shape[3]) or int(k.ty.shape[3]) != int(q.ty.shape[3]):
            raise ModelError(f"{where}: queries, keys and values of different head dims are not supported")
        scale = float(attrs.scale) if attrs.scale is not None else 1 / math.sqrt(int(q.ty.shape[3]))
        return cls(q, k, v, scale)


def _unrepeat(x: relax.Expr, values: dict[relax.Var, relax.Expr], where: str) -> relax.Expr:
    """Keys or values before a grouped-query repeat, [1, n, kv_heads, d] (x itself if none).

    The importer's x is permute_dims(t, [0, 2, 1, 3]) of torch's [1, heads, n, d]; repeat_kv made t as
    reshape(broadcast_to(expand_dims(t0, 2), [1, kv, rep, n, d]), [1, kv * rep, n, d])."""
    path = []
    t = _producer(x, values, "relax.permute_dims", path)
    if t is None or [int(a) for a in values[x].attrs.axes] != [0, 2, 1, 3]:
        return x
    reshaped = _producer(t, values, "relax.reshape", path)
    broadcast = reshaped is not None and _producer(reshaped, values, "relax.broadcast_to", path)
    expanded = broadcast is not None and broadcast is not False and _producer(broadcast, values,
                                                                             "relax.expand_dims", path)
    if not expanded:
        return x
    if [int(a) for a in values[broadcast].attrs.axis] != [2] if hasattr(values[broadcast].attrs, "axis") else False:
        raise ModelError(f"{where}: {' <- '.join(path)} is not a grouped-query repeat")
    return relax.op.permute_dims(expanded, [0, 2, 1, 3])


def _producer(x: relax.Expr, values: dict[relax.Var, relax.Expr], op: str, path: list[str]) -> relax.Expr | None:
    """The first argument of the `op` call bound to `x`, or None."""
    value = values.get(x) if isinstance(x, relax.Var) else None
    if value is None or not is_op(value, op):
        return None
    path.append(op.removeprefix("relax."))
    return value.args[0]


def _values(func: relax.Function) -> dict[relax.Var, relax.Expr]:
    return {binding.var: binding.value for binding in bindings(func)}


def _attention_bindings(func: relax.Function) -> list[relax.VarBinding]:
    return [b for b in bindings(func) if is_op(b.value, "relax.nn.attention")]


@relax.expr_functor.mutator
class _Entry(relax.PyExprMutator):
    """Rewrites one bound copy of `forward` into an entry over the KV cache."""

    def __init__(self, mod: tvm.IRModule, entry: str, count: tirx.Var) -> None:
        super().__init__(mod)
        self.entry, self.count = entry, count
        self.cache = relax.Var("kv_cache", relax.ObjectType())
        self.layer = 0
        self.values: dict[relax.Var, relax.Expr] = {}
        self.lm_head: relax.Var | None = None
        self.returned: relax.Var | None = None
        self.input_ids: relax.Var | None = None
        self.ids: relax.Var | None = None
        self.logit_positions = relax.Var("logit_positions",
                                         relax.TensorType([tirx.Var("num_logits", "int64")], "int32"))

    def rewrite(self, func: relax.Function) -> relax.Function:
        self.values = _values(func)
        self.lm_head = _returned_projection(func, self.values)
        self.returned = func.body.body
        self.input_ids, *weights = func.params
        shape = [self.count, 1] if self.entry == "decode" else [1, self.count]
        self.ids = relax.Var("input_ids", relax.TensorType(shape, "int32"))
        inputs = [self.ids, self.logit_positions] if self.entry == "prefill" else [self.ids]
        if self.entry != "decode":
            self.set_var_remap(self.input_ids.vid, self.ids)
        body = self.visit_expr(func.body)
        if self.layer == 0:
            raise ModelError("forward: found no attention (nn.attention) in the imported graph; is it a decoder?")
        attrs = tvm.ir.make_node("ir.DictAttrs", num_input=len(inputs) + 1)
        return relax.Function([*inputs, self.cache, *weights], body, None, True, attrs)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if self.entry == "decode" and self.input_ids is not None:
            # One token of each sequence: the graph sees them as one row.
            row = self.builder_.emit(relax.op.reshape(self.ids, [1, self.count]))
            self.set_var_remap(self.input_ids.vid, row)
            self.input_ids = None
        value = binding.value
        if is_op(value, "relax.nn.attention"):
            attention = _Attention.recognise(binding, self.values)
            self.set_var_remap(binding.var.vid, self._cached_attention(attention))
        elif is_op(value, "relax.arange") and _counts_tokens(value, self.count):
            positions = self.builder_.emit(relax.call_pure_packed(QUERY_POSITIONS, self.cache,
                                                                  sinfo_args=relax.TensorType([self.count], "int32")))
            self.set_var_remap(binding.var.vid, self.builder_.emit(relax.op.astype(positions, value.ty.dtype)))
        elif self.entry == "prefill" and binding.var.same_as(self.lm_head):
            x, weight = (self.visit_expr(arg) for arg in value.args)
            rows = self.builder_.emit(relax.op.take(x, self.logit_positions, axis=1))
            self.set_var_remap(binding.var.vid,
                               self.builder_.emit(relax.op.matmul(rows, weight, value.attrs.out_dtype)))
        elif binding.var.same_as(self.returned):
            logits = self.visit_expr(value)
            if self.entry == "decode":
                logits = self.builder_.emit(relax.op.reshape(logits, [self.count, 1, logits.ty.shape[-1]]))
            self.set_var_remap(binding.var.vid, self.builder_.emit_output(relax.Tuple([logits, self.cache])))
        else:
            super().visit_var_binding_(binding)

    def _cached_attention(self, attention: _Attention) -> relax.Expr:
        emit = self.builder_.emit
        q, k, v = (self.visit_expr(x) for x in (attention.q, attention.k, attention.v))
        d, heads = attention.head_dim, attention.num_heads
        qkv = emit(relax.op.concat([q, k, v], axis=2))
        qkv = emit(relax.op.reshape(qkv, [self.count, heads + 2 * attention.num_kv_heads, d]))
        scale = relax.PrimValue(tirx.FloatImm("float64", attention.scale))
        out = emit(relax.call_dps_packed(KV_ATTENTION, [self.cache, relax.PrimValue(self.layer), scale, qkv],
                                         out_sinfo=relax.TensorType([self.count, heads, d], q.ty.dtype)))
        self.layer += 1
        return emit(relax.op.reshape(out, [1, self.count, heads, d]))


def _counts_tokens(arange: relax.Call, count: tirx.Var) -> bool:
    """arange(0, count, 1): the positions of the graph's tokens."""
    start, end, step = (arg.value for arg in arange.args[:3])
    analyzer = tvm.arith.Analyzer()
    return (analyzer.can_prove_equal(start, 0) and analyzer.can_prove_equal(end, count)
            and analyzer.can_prove_equal(step, 1))


def _returned_projection(func: relax.Function, values: dict[relax.Var, relax.Expr]) -> relax.Var | None:
    """The matmul (the LM head) whose result `func` returns, through casts, reshapes and tuples."""
    stack, seen = [func.body.body], set()
    while stack:
        expr = stack.pop()
        if isinstance(expr, relax.Tuple):
            stack.extend(expr.fields)
            continue
        if not isinstance(expr, relax.Var) or expr in seen:
            continue
        seen.add(expr)
        value = values.get(expr)
        if value is None:
            continue
        if is_op(value, "relax.matmul"):
            return expr
        if isinstance(value, relax.Var) or any(is_op(value, op) for op in ("relax.astype", "relax.reshape")):
            stack.append(value if isinstance(value, relax.Var) else value.args[0])
    return None

