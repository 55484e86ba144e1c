"""Split a model by layers into pipeline stages: one module per stage, each a complete set of entries.

Runs on the module with its entries over the paged KV cache (`pipeline.with_entries`), before any graph pass, so
it is the same for ember's own definitions and for imported graphs (torch.export, ONNX): every attention is then
a call into the KV cache that names its layer, whatever the frontend wrote around it.

In each entry (prefill, decode, verify) the bindings are walked in order. A value depends on the tokens if it is
computed from the input ids; the *boundary* before layer L is the last point before layer L's attention where
exactly one token-dependent value is live, and it is the residual stream [b, n, hidden] (the last: in a Llama
block the stream after the attention's residual add is such a point too, but halfway through layer L-1).
Values that do not depend on the tokens (transposed weights, positions read from the KV cache, rotary tables) may
be live across a boundary: a later stage computes them again from its own weights and cache. A graph with no such
boundary (a value of an earlier layer read again later) is refused, naming the entry and the layer.

Stage i keeps the bindings between its boundaries: the first takes the token ids and holds the embedding; the
others take the residual stream as float32 `hidden` [b, n, hidden_size]; the last holds the final norm and the
output projection and returns logits, the others return the residual stream as float32. Each stage's KV cache
holds its own layers only (the attention calls' layer ids renumbered from 0, the cache created for that many),
and a stage's entries take only the weights some entry of the stage reads, so its artifact holds no other.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import relax

from ember.core.errors import EmberError
from ember.ir.attributes import KV_CACHE_ATTR
from ember.ir.weight_recipes import get_recipes, set_recipes, weight_params

ENTRIES = ("prefill", "decode", "verify")
HIDDEN_DTYPE = "float32"  # what stages pass between them, whatever the model computes in
_KV_CALL_PREFIX = "vm.builtin.attention_kv_cache"
_CREATE_CACHE = "vm.builtin.paged_attention_kv_cache_create"


def stage_layers(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """The layer range [begin, end) of each of `stages` stages, as even as can be; the first stages get the extra."""
    base, extra = divmod(num_layers, stages)
    ranges, begin = [], 0
    for index in range(stages):
        end = begin + base + (1 if index < extra else 0)
        ranges.append((begin, end))
        begin = end
    return ranges


def split_pipeline_stage(mod: tvm.IRModule, layers: tuple[int, int], hidden_size: int) -> tvm.IRModule:
    """The module of the stage that computes `layers` [begin, end) of `mod` (every entry, its KV cache, its weights)."""
    num_layers = int(mod.attrs[KV_CACHE_ATTR]["num_layers"])
    begin, end = layers
    out = mod
    for name in ENTRIES:
        if any(gv.name_hint == name for gv in mod.get_global_vars()):
            out = _replace(out, name, _EntrySplit(mod[name], name, num_layers, hidden_size).stage(begin, end))
    out = _keep_used_weights(out)
    out = _replace(out, "create_paged_kv_cache", _cache_for_layers(mod["create_paged_kv_cache"], begin, end,
                                                                    num_layers))
    cache = dict(mod.attrs[KV_CACHE_ATTR].items())
    windows = [int(w) for w in cache.get("layer_windows", [])]
    return out.with_attr(KV_CACHE_ATTR, {**cache, "num_layers": end - begin, "layer_windows": windows[begin:end]})


def _replace(mod: tvm.IRModule, name: str, func: relax.Function) -> tvm.IRModule:
    """`mod` with the function `name` replaced by `func`."""
    functions = {gv: (func if gv.name_hint == name else old) for gv, old in mod.functions_items()}
    return tvm.IRModule(functions, attrs=mod.attrs)


@dataclass
class _Boundary:
    position: int  # bindings before it belong to the earlier stage
    residual: relax.Var  # the one token-dependent value live there


class _EntrySplit:
    """One entry's bindings, what depends on the tokens, and where its layer boundaries are."""

    def __init__(self, func: relax.Function, name: str, num_layers: int, hidden_size: int) -> None:
        self.func, self.name, self.num_layers, self.hidden_size = func, name, num_layers, hidden_size
        blocks = func.body.blocks
        if len(blocks) != 1 or not isinstance(blocks[0], relax.DataflowBlock):
            raise EmberError(f"--pipeline-stages: the {name} entry is not one dataflow block; cannot split it")
        self.bindings = list(blocks[0].bindings)
        self.num_input = int(func.attrs["num_input"])
        self.input_ids, self.kv_cache = func.params[0], func.params[self.num_input - 1]
        self.uses = [set(relax.analysis.free_vars(b.value)) for b in self.bindings]
        self.depends = self._token_dependent()
        self.layer_of = [_kv_layer(b.value, self.kv_cache) for b in self.bindings]

    def _token_dependent(self) -> list[bool]:
        dependent = {self.input_ids}
        flags = []
        for binding, used in zip(self.bindings, self.uses):
            flag = bool(used & dependent)
            if flag:
                dependent.add(binding.var)
            flags.append(flag)
        return flags

    def boundary(self, layer: int) -> _Boundary:
        """Where layer `layer` begins: the last point before its first KV-cache call (and after the previous
        layer's last) where the only live token-dependent value is the residual stream."""
        previous = max(i for i, found in enumerate(self.layer_of) if found == layer - 1)
        first = min(i for i, found in enumerate(self.layer_of) if found == layer)
        last_use = {}
        for index, used in enumerate(self.uses):
            for var in used:
                last_use[var] = index
        for var in relax.analysis.free_vars(self.func.body.body):
            last_use[var] = len(self.bindings)
        for position in range(first, previous, -1):
            live = [b.var for i, b in enumerate(self.bindings[:position])
                    if self.depends[i] and last_use.get(b.var, -1) >= position]
            if last_use.get(self.input_ids, -1) >= position:
                live.append(self.input_ids)
            if len(live) == 1 and self._is_residual(live[0]):
                return _Boundary(position, live[0])
        raise EmberError(f"--pipeline-stages: the {self.name} entry has no point between layers {layer - 1} and "
                         f"{layer} where only the residual stream [.., .., {self.hidden_size}] is live; "
                         "this model cannot be split there")

    def _is_residual(self, var: relax.Var) -> bool:
        info = var.ty
        return (isinstance(info, relax.TensorType) and info.ndim == 3 and str(info.dtype).startswith(("float",
                "bfloat")) and isinstance(info.shape, relax.ShapeExpr)
                and int(info.shape.values[2]) == self.hidden_size)

    def rows_shape(self) -> relax.ShapeExpr:
        """The shape hidden states cross stages in: the token ids' shape and hidden_size ([b, 1, H] in decode
        whatever the graph's own layout: a traced graph's decode runs its batch as one sequence [1, b, H])."""
        return relax.ShapeExpr([*self.input_ids.ty.shape.values, self.hidden_size])

    def stage(self, begin: int, end: int) -> relax.Function:
        """This entry for layers [begin, end): its input, its bindings, its output."""
        start = self.boundary(begin) if begin > 0 else None
        stop = self.boundary(end) if end < self.num_layers else None
        kept: list[relax.Binding] = []
        params = list(self.func.params)
        if start is not None:
            hidden = relax.Var("hidden", relax.TensorType(self.rows_shape(), HIDDEN_DTYPE))
            params[0] = hidden
            kept.append(relax.VarBinding(start.residual, _reshaped(_cast(hidden, str(start.residual.ty.dtype)),
                                                                   start.residual.ty.shape)))
        for index, binding in enumerate(self.bindings):
            if stop is not None and index >= stop.position:
                break
            if self.depends[index] and start is not None and index < start.position:
                continue
            kept.append(_renumbered(binding, self.kv_cache, begin))
        if stop is None:
            output = self.func.body.body
        else:
            hidden_out = relax.DataflowVar("hidden_out", relax.TensorType(self.rows_shape(), HIDDEN_DTYPE))
            kept.append(relax.VarBinding(hidden_out, _reshaped(_cast(stop.residual, HIDDEN_DTYPE),
                                                               hidden_out.ty.shape)))
            result = relax.Tuple([hidden_out, self.kv_cache])
            output = relax.Var("gv", relax.TupleType([hidden_out.ty, self.kv_cache.ty]))
            kept.append(relax.VarBinding(output, result))
        body = relax.SeqExpr([relax.DataflowBlock(_live_bindings(kept, output))], output)
        return relax.Function(params, body, output.ty, self.func.is_pure, self.func.attrs)


def _reshaped(value: relax.Expr, shape: relax.Expr) -> relax.Expr:
    """`value` in `shape` (itself when it has that shape already)."""
    return value if tvm_ffi.structural_equal(value.ty.shape, shape) else relax.op.reshape(value, shape)


def _cast(value: relax.Expr, dtype: str) -> relax.Expr:
    """`value` as `dtype` (itself when it is already)."""
    return value if str(value.ty.dtype) == dtype else relax.op.astype(value, dtype)


def _live_bindings(bindings: list[relax.Binding], output: relax.Var) -> list[relax.Binding]:
    """The bindings `output` needs, in order (a dataflow block's bindings are pure)."""
    needed = set(relax.analysis.free_vars(output))
    kept = []
    for binding in reversed(bindings):
        if binding.var in needed:
            kept.append(binding)
            needed |= set(relax.analysis.free_vars(binding.value))
    return kept[::-1]


def _kv_layer(value: relax.Expr, kv_cache: relax.Var) -> int | None:
    """The layer id a KV-cache call names (its argument after the cache), or None for any other binding."""
    fields = _kv_call_fields(value)
    if fields is None or len(fields) < 2 or not fields[0].same_as(kv_cache):
        return None
    layer = fields[1]
    value = getattr(layer, "value", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _kv_call_fields(value: relax.Expr) -> list[relax.Expr] | None:
    """The arguments of a packed call into the KV cache (`vm.builtin.attention_kv_cache_*`), else None."""
    if not (isinstance(value, relax.Call) and value.args and isinstance(value.args[0], relax.ExternFunc)
            and str(value.args[0].global_symbol).startswith(_KV_CALL_PREFIX)):
        return None
    if value.op.same_as(tvm.ir.Op.get("relax.call_dps_packed")):
        return list(value.args[1].fields)
    return list(value.args[1:])


def _renumbered(binding: relax.Binding, kv_cache: relax.Var, first_layer: int) -> relax.Binding:
    """`binding` with the layer id of its KV-cache call counted from `first_layer` (the stage's cache starts there)."""
    layer = _kv_layer(binding.value, kv_cache)
    if layer is None or first_layer == 0:
        return binding
    call = binding.value
    local = relax.prim_value(layer - first_layer)
    if call.op.same_as(tvm.ir.Op.get("relax.call_dps_packed")):
        fields = list(call.args[1].fields)
        fields[1] = local
        args = [call.args[0], relax.Tuple(fields)]
    else:
        args = [call.args[0], call.args[1], local, *call.args[3:]]
    return relax.VarBinding(binding.var, relax.Call(call.op, args, call.attrs, call.ty_args))


def _cache_for_layers(func: relax.Function, begin: int, end: int, num_layers: int) -> relax.Function:
    """`create_paged_kv_cache` for layers [begin, end) only: its layer partition [0, end - begin] and the
    attention kind of each of those layers."""
    block = func.body.blocks[0]
    bindings = []
    for binding in block.bindings:
        value = binding.value
        if (isinstance(value, relax.Call) and value.args and isinstance(value.args[0], relax.ExternFunc)
                and str(value.args[0].global_symbol) == _CREATE_CACHE):
            args = list(value.args)
            partition, kinds = [int(v) for v in args[2].values], [int(v) for v in args[7].values]
            if partition != [0, num_layers] or len(kinds) != num_layers:
                raise EmberError(f"--pipeline-stages: the KV cache is created for layers {partition} with "
                                 f"{len(kinds)} attention kinds, not the model's {num_layers} layers")
            args[2] = relax.ShapeExpr([0, end - begin])
            args[7] = relax.ShapeExpr(kinds[begin:end])
            value = relax.Call(value.op, args, value.attrs, value.ty_args)
        bindings.append(relax.VarBinding(binding.var, value))
    body = relax.SeqExpr([relax.DataflowBlock(bindings)], func.body.body)
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)


def _keep_used_weights(mod: tvm.IRModule) -> tvm.IRModule:
    """Every entry takes the same weights, those some entry of the stage reads, in the original order; the weight
    recipes keep only theirs."""
    entries = [name for name in ENTRIES if any(gv.name_hint == name for gv in mod.get_global_vars())]
    used = set()
    for name in entries:
        used |= {var.name for var in relax.analysis.free_vars(mod[name].body)}
    for name in entries:
        func = mod[name]
        num_input = int(func.attrs["num_input"])
        params = list(func.params[:num_input]) + [p for p in weight_params(func) if p.name in used]
        mod = _replace(mod, name, relax.Function(params, func.body, func.ret_ty, func.is_pure, func.attrs))
    kept = {p.name for p in weight_params(mod[entries[0]])}
    return set_recipes(mod, {name: recipe for name, recipe in get_recipes(mod).items() if name in kept})
