"""Causal self-attention in an imported graph becomes attention over the paged KV cache.

Input: an IRModule whose `forward(input_ids[1, seq], *weights) -> logits[1, seq, vocab]`
is a decoder-only LM's full-sequence forward as an importer wrote it
(`frontend/torch_export.py`, `frontend/onnx.py`). Output: the same weights behind
ember's entries (`frontend/llama.py` has their contracts), the KV cache's constructor
and kernels:

    prefill(input_ids[1, seq_len], logit_positions[num_logits], [prompt_end[1]], kv_cache)
    decode(input_ids[batch_size, 1], kv_cache)
    verify(input_ids[1, verify_len], [prompt_end[1]], kv_cache)

Every entry is `forward` with its token count bound (`seq` becomes `seq_len`,
`batch_size` or `verify_len`): a decoder's tokens only meet in attention, so a
decode batch of one token per sequence runs as one row of `batch_size` tokens,
and the cache, which knows which sequence each token belongs to, attends per
sequence. Three rewrites make that true:

1. **Attention.** `softmax(q @ k^T * scale + mask) @ v`, as torch.export decomposes
   `scaled_dot_product_attention` and as eager attention and ONNX exports write it
   (the scale on q, k or both; k transposed in 4-D or in a 3-D view of merged heads;
   a guard that zeroes fully masked rows), with an additive mask that is proven, not
   sampled: evaluated at two lengths past every window the config names (and past 16
   tokens), it must be causal, or causal through a sliding window of W tokens (a query
   at position p sees p - W + 1 .. p) at every length alike, and each layer's must be
   what the importer read of the config (`CONFIG_WINDOWS_ATTR`: `layer_types`,
   `sliding_window` and their kin). The windows go to the cache, which hands windowed
   layers to kernels that mask by position. q [1, heads, n, d] and k, v [1, kv_heads, n, d] after undoing
   a grouped-query repeat (`expand_dims` -> `broadcast_to` -> `reshape`, as
   transformers' `repeat_kv` traces) or broadcast over the heads (multi-query): q, k
   and v as [1, n, heads, d] (the tensors the graph permuted them from, where it did)
   are concatenated and handed to the cache (`attention_with_fused_qkv`: append k/v to
   the sequence's pages, attend over them). Attention layers are numbered in graph order.
   Soft-capped scores (Gemma 2), ALiBi's distance bias and gpt-oss's attention sinks (a
   weight of one logit per head, as a column concatenated to the scores before the
   softmax and dropped after it) go to the cache's kernels, the sinks as one extra query
   head per KV head that carries them (`CacheShape.sinks`).
2. **Positions.** `arange(0, n)` (the positions of a sequence's tokens when the graph
   sees one whole sequence) becomes the cache's query positions, each token's place
   in its own sequence, and `cumsum(ones[1, n], axis=1)` (OPT counts an all-ones
   attention mask) those positions plus one: rotary embeddings (either form, computed
   in the graph) and learned position tables then read the right rows. Keys are
   stored rotated, so the cache applies no rotary embedding itself (`RopeMode.NONE`).
   Longrope's choice of factors by the longest position (`longrope_choice`) is made per
   token from its own sequence's last position: the cache's position in decode, the
   prompt's end in prefill and verify, which then take `prompt_end` (the sequence's
   length once the whole prompt is appended, the same for each of its chunks).
3. **Logits.** In `prefill`, the LM head (the projection whose result is returned)
   reads only the rows at `logit_positions`.

Anything else is refused with the path of operators where recognition stopped, never
compiled into something wrong: attention with a learned bias or without a causal mask
(a bidirectional encoder), a mask that is neither causal nor a sliding window, or that
disagrees with the config (naming the layer and both), a bias not linear in the
distance, a column beside the scores other than one sink per head, keys or values
that are not per-token projections of the sequence, a graph without attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax.utils import copy_with_new_vars

from ember.core.errors import ModelError
from ember.core.manifest import PROMPT_END_INPUT
from ember.ir.attributes import BATCH_SIZE, CONFIG_WINDOWS_ATTR, FORWARD, ROPE_ATTR, SEQ_LEN, VERIFY_LEN
from ember.ir.kv_cache import CacheShape, cache_functions, with_cache_shape
from ember.ir.module_utils import bindings, is_op, permute_axes, scalar_constant
from ember.ir_passes.longrope_choice import longrope_lengths

KV_ATTENTION = "vm.builtin.attention_kv_cache_attention_with_fused_qkv"
QUERY_POSITIONS = "vm.builtin.attention_kv_cache_get_query_positions"
_HEADS_FIRST = [0, 2, 1, 3]  # [1, n, heads, d] <-> [1, heads, n, d]
# entry -> (its symbolic token count, how input_ids arrive)
ENTRIES = {"prefill": SEQ_LEN, "decode": BATCH_SIZE, "verify": VERIFY_LEN}


def _cache_shape(found: list[_Attention], context_window: int) -> CacheShape:
    """What the KV cache must hold for the attentions `found`: layers, query and key/value heads, head dim,
    each layer's window."""
    shapes = {(a.num_heads, a.num_kv_heads, a.head_dim) for a in found}
    if len(shapes) > 1:
        raise ModelError(f"{FORWARD}: attention layers differ in heads or head dim ({sorted(shapes)}); "
                         "one paged KV cache holds one shape")
    (heads, kv_heads, head_dim), = shapes
    windows = tuple(a.window for a in found)
    softcaps, slopes = {a.softcap for a in found}, {a.slopes for a in found}
    if len(softcaps) > 1 or len(slopes) > 1:
        what = "soft-cap their scores" if len(softcaps) > 1 else "bias their scores by distance"
        raise ModelError(f"{FORWARD}: attention layers {what} differently; ember's kernels take one way for all")
    sinks = {a.sinks is not None for a in found}
    if len(sinks) > 1:
        with_sinks = [layer for layer, a in enumerate(found) if a.sinks is not None]
        raise ModelError(f"{FORWARD}: attention layers {with_sinks} have attention sinks and the others none; "
                         "ember's kernels take one way for all")
    return CacheShape(len(found), heads, kv_heads, head_dim, context_window, layer_windows=windows if any(windows)
                      else (), softcap=softcaps.pop(), alibi_slopes=slopes.pop(), sinks=sinks.pop())


def _config_windows(mod: tvm.IRModule, layers: int, context_window: int) -> list[int]:
    """Per attention layer, the window the importer read of the config (0: none, and for a window the context
    never fills), all 0 if it recorded none."""
    recorded = [int(w) for w in (mod.attrs or {}).get(CONFIG_WINDOWS_ATTR, [])]
    if recorded and len(recorded) != layers:
        raise ModelError(f"{FORWARD}: the graph has {layers} attention layers and the config names windows for "
                         f"{len(recorded)}")
    return [w if w < context_window else 0 for w in recorded] or [0] * layers


def _probe_lengths(windows: list[int], context_window: int) -> list[int]:
    """Sequence lengths to evaluate masks at: two past the longest window the config names (and past 16
    tokens), within the context. Two, so that a mask that changes with the length shows it."""
    longest = max(windows + [16])
    return sorted({min(n, context_window) for n in (longest + 17, longest + 41)} - {0, 1})


# Reductions whose result mixes the values of the tokens they reduce over.
_REDUCTIONS = ("relax.max", "relax.min", "relax.sum", "relax.mean", "relax.prod", "relax.variance", "relax.std",
               "relax.argmax", "relax.argmin", "relax.cumsum", "relax.cumprod", "relax.sort", "relax.argsort",
               "relax.topk")


def _check_no_token_reductions(name: str, func: relax.Function, count: tirx.Var) -> None:
    """Refuse a reduction over the entry `func`'s tokens (`count` of them) that is left once attention is the
    cache's (a choice by the longest position other than longrope's, say): decode runs a batch's sequences as one
    row of tokens, which it would mix."""
    for binding in bindings(func):
        value = binding.value
        if not any(is_op(value, op) for op in _REDUCTIONS):
            continue
        shape = getattr(value.args[0].ty, "shape", None)
        if shape is None:
            raise ModelError(f"{name}: {binding.var.name} = {value.op.name.removeprefix('relax.')} over a tensor of "
                             "unknown shape; ember cannot tell whether it mixes the tokens of several sequences")
        dims = list(shape)
        axis = getattr(value.attrs, "axis", None)
        axes = range(len(dims)) if axis is None else [int(a) for a in (axis if isinstance(axis, tvm.ir.Array)
                                                                       else [axis])]
        if any(v.same_as(count) for a in axes for v in tirx.analysis.undefined_vars(dims[a])):
            raise ModelError(f"{name}: {binding.var.name} = {value.op.name.removeprefix('relax.')} over the "
                             "sequence's tokens, outside attention (a rotary scaling chosen by the longest position, "
                             "not in longrope's form?); ember's entries run a batch of sequences as one row of "
                             "tokens, which it would mix, so ember does not compile it")


def _describe(window: int) -> str:
    return f"a sliding window of {window} tokens" if window else "causal over the whole context"


def _check_windows(found: list[_Attention], expected: list[int]) -> None:
    """Each layer's mask as the graph computes it equals what the config says, or the compile stops."""
    for layer, (attention, window) in enumerate(zip(found, expected)):
        if attention.window != window:
            raise ModelError(f"attention layer {layer} ({attention.where}): the graph's mask is "
                             f"{_describe(attention.window)}, and the config says {_describe(window)}; ember "
                             "compiles a mask only where both agree")


def specialize_attention(target: tvm.target.Target) -> tvm.transform.Pass:
    """The pass: an imported `forward` becomes the entries over a paged KV cache built for `target`."""

    @tvm.transform.module_pass(opt_level=0, name="SpecializeAttention")
    def rewrite(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if FORWARD not in [gv.name_hint for gv in mod.get_global_vars()]:
            return mod
        return specialized_entries(mod, target)

    return rewrite


def specialized_entries(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """`mod` with `forward` replaced by the entries `prefill`, `decode` and `verify` (see the module docstring),
    the KV cache's constructor and kernels beside them, and the cache's shape recorded."""
    func = mod[FORWARD]
    input_ids = func.params[0]
    batch, seq = input_ids.ty.shape
    if not (isinstance(batch, tirx.IntImm) and int(batch) == 1 and isinstance(seq, tirx.Var)):
        raise ModelError(f"{FORWARD}: expected input_ids of shape [1, seq], got {list(input_ids.ty.shape)}")
    context_window = int((func.attrs or {}).get("tir_var_upper_bound", {}).get(seq.name, 0))
    if context_window < 1:
        raise ModelError(f"{FORWARD}: the importer gave no context window (tir_var_upper_bound of {seq.name!r})")
    graph = _Graph(func)
    layers = len(graph.softmaxes())
    expected = _config_windows(mod, layers, context_window)
    graph.probe_lengths = _probe_lengths(expected, context_window)
    found = graph.attentions()
    _check_windows(found, expected)
    functions: dict = {gv: f for gv, f in mod.functions_items() if gv.name_hint != FORWARD}  # kernels keep their gvs
    long_above: set[int] = set()  # longrope: the lengths past which its choices take the long factors
    for entry, size in ENTRIES.items():
        count = tirx.Var(size, "int64")
        rewriter = _Entry(mod, entry, count, [a.window for a in found])
        # Each entry its own variables: a Relax variable belongs to one function.
        functions[entry] = copy_with_new_vars(rewriter.rewrite(func.bind_symbolic_vars({seq: count})))
        long_above.update(rewriter.longest.values())
    if len(long_above) > 1:
        raise ModelError(f"{FORWARD}: longrope's factors switch at several sequence lengths ({sorted(long_above)}); "
                         "ember's KV cache keeps one switch")
    shape = _cache_shape(found, context_window)
    cache = cache_functions(shape, str(found[0].q.ty.dtype), target)
    functions.update({gv.name_hint: f for gv, f in cache.functions_items()})
    cleaned = tvm.transform.Sequential(
        [relax.transform.Normalize(), relax.transform.DeadCodeElimination(list(ENTRIES))])
    # The graph rotates q and k itself (in either form); the cache stores keys as they come, and with longrope
    # the runtime computes a sequence's keys again when its length passes `long_factors_above`.
    rope = {"mode": "in-graph", **({"long_factors_above": long_above.pop()} if long_above else {})}
    specialized = cleaned(tvm.IRModule(functions, attrs=mod.attrs)).with_attr(ROPE_ATTR, rope)
    for entry in ENTRIES:
        _check_no_token_reductions(entry, specialized[entry], specialized[entry].params[0].ty.shape[
            0 if entry == "decode" else 1])
    return with_cache_shape(specialized, shape)


# Operators that only re-view a tensor for a batched matmul (torch's bmm over [heads, n, d] views).
_VIEWS = ("relax.reshape", "relax.broadcast_to")


@dataclass
class _Attention:
    """One recognised attention: q [1, heads, n, d] and k, v [1, kv_heads, n, d] (torch's layout), its
    scale, the variable its output ([1, heads, n, d]) is bound to, where in the graph it is, and the window
    its mask reads through (0: causal over the whole context), the soft-cap of its scores and the slopes of its
    distance bias."""

    q: relax.Var
    k: relax.Var
    v: relax.Var
    scale: float
    output: relax.Var
    where: str = ""
    window: int = 0
    softcap: float = 0.0  # scores become softcap * tanh(scores / softcap) before the mask (0: not capped)
    slopes: tuple[float, ...] = ()  # ALiBi: each head's scores gain slope * (key position - query position)
    sinks: relax.Var | None = None  # gpt-oss: a weight [heads] of per-head logits joining each softmax's denominator

    @property
    def num_heads(self) -> int:
        return int(self.q.ty.shape[1])

    @property
    def num_kv_heads(self) -> int:
        return int(self.k.ty.shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.q.ty.shape[3])


class _Graph:
    """The bindings of one imported forward, with who uses each variable. `check_masks`: evaluate each
    attention's mask at `probe_lengths` to find its window (once, on `forward`; its bound copies have the same
    masks)."""

    def __init__(self, func: relax.Function, check_masks: bool = True) -> None:
        self.func = func
        self.check_masks = check_masks
        self.probe_lengths = [33, 57]
        self.values = _values(func)
        self.users: dict[relax.Var, list[relax.VarBinding]] = {}
        for binding in bindings(func):
            for var in relax.analysis.free_vars(binding.value) if isinstance(binding.value, relax.Expr) else []:
                self.users.setdefault(var, []).append(binding)
        self._kinds: dict[tuple[relax.Expr, ...], tuple[int, tuple[float, ...]]] = {}

    def softmaxes(self) -> list[relax.VarBinding]:
        return [binding for binding in bindings(self.func) if is_op(binding.value, "relax.nn.softmax")]

    def attentions(self) -> list[_Attention]:
        """Every attention of the graph, in order; refuses what it cannot recognise."""
        found = [self._written_out(binding) for binding in self.softmaxes()]
        if not found:
            raise ModelError("forward: found no attention (scaled_dot_product_attention or softmax(QK^T)V) in the "
                             "imported graph; is it a decoder?")
        return found

    def _written_out(self, softmax: relax.VarBinding) -> _Attention:
        """softmax(softcap(q k^T * scale) + biases) v, as torch.export decomposes scaled_dot_product_attention and
        eager attention writes it (the scale on q, k or the product; soft-capping, cap * tanh(scores / cap), as
        Gemma 2 writes it; biases added in the scores' views, a mask and BLOOM's ALiBi, say)."""
        where = [f"{softmax.var.name} = softmax"]
        logits, sinks = self._sinks_of(softmax.value.args[0], where)
        scores, biases = self._biased(logits)
        product, post_scale, softcap = self._scores_of(scores, where)
        if product is None:
            raise ModelError(f"{' <- '.join(where)}: a softmax over something other than q @ k^T (attention "
                             "is the only softmax a decoder's graph may have before its logits)")
        q, q_scale = self._strip(product.args[0], where)
        keys_t, k_scale = self._strip(product.args[1], where)
        transposed = self.values.get(keys_t)
        if not (is_op(transposed, "relax.permute_dims") and _swaps_last_two(transposed)):
            raise ModelError(f"{' <- '.join(where)}: the keys of q @ k^T are not transposed [1, heads, n, d]")
        keys, more_scale = self._strip(transposed.args[0], where)
        k = self._unrepeat(keys, " <- ".join(where))
        if not biases:
            raise ModelError(f"{' <- '.join(where)}: attention without a causal mask (a bidirectional encoder?) "
                             "cannot use a KV cache; ember compiles causal decoders")
        window, slopes = self._mask_kind(biases, " <- ".join(where))
        probabilities = self._consumer(softmax.var, sinks is not None)
        if probabilities is None or not is_op(probabilities.value, "relax.matmul"):
            raise ModelError(f"{' <- '.join(where)}: the attention weights are not multiplied by the values"
                             + (" once the sinks' column is dropped" if sinks is not None else ""))
        values_view, _ = self._strip(probabilities.value.args[1], where)
        v = self._unrepeat(values_view, " <- ".join(where))
        output = probabilities.var
        users = self.users.get(output, [])
        if len(users) == 1 and is_op(users[0].value, "relax.reshape") and len(users[0].var.ty.shape) == 4:
            output = users[0].var
        scale = q_scale * k_scale * more_scale * post_scale
        attention = _Attention(q, k, v, scale, output, where[0], window, softcap, slopes, sinks)
        if len(slopes) not in (0, 1, attention.num_heads):
            raise ModelError(f"{' <- '.join(where)}: a position bias of {len(slopes)} slopes for "
                             f"{attention.num_heads} heads")
        if sinks is not None and int(np.prod([int(d) for d in sinks.ty.shape])) != attention.num_heads:
            raise ModelError(f"{' <- '.join(where)}: attention sinks {sinks.name} of shape {list(sinks.ty.shape)} "
                             f"for {attention.num_heads} heads; ember takes one sink per head")
        return self._checked(attention, " <- ".join(where))

    def _sinks_of(self, x: relax.Expr, where: list[str]) -> tuple[relax.Expr, relax.Var | None]:
        """(the logits, the sinks) where `x` is concat([logits, sinks viewed as [1, heads, n, 1]], last axis), as
        gpt-oss writes its attention sinks: a learned logit per head that joins the softmax's denominator and whose
        column is dropped after it; (x, None) for any other `x`. The sinks must be a weight, one per head, the same
        at every query (a view of [heads]); anything else in that place is refused."""
        value = self.values.get(x)
        if not (is_op(value, "relax.concat") and isinstance(value.args[0], relax.Tuple)
                and len(value.args[0].fields) == 2 and int(value.attrs.axis) % 4 == 3 and x.ty.ndim == 4):
            return x, None
        logits, column = value.args[0].fields
        if not self._leads_to_scores(logits):
            return x, None
        where.append("concat (attention sinks)")
        sinks, factor = self._strip(column, where)
        if sinks not in self.func.params[1:] or factor != 1.0 or int(column.ty.shape[3]) != 1:
            raise ModelError(f"{' <- '.join(where)}: a column joined to the attention scores that is not a weight "
                             "of one logit per head (gpt-oss's sinks); ember knows no other")
        return logits, sinks

    def _checked(self, attention: _Attention, where: str) -> _Attention:
        for x, name in ((attention.q, "queries"), (attention.k, "keys"), (attention.v, "values")):
            if len(x.ty.shape) != 4 or int(x.ty.shape[0]) != 1:
                raise ModelError(f"{where}: {name} are not [1, heads, seq, head_dim] ({x.ty})")
        if not (int(attention.q.ty.shape[3]) == int(attention.k.ty.shape[3]) == int(attention.v.ty.shape[3])):
            raise ModelError(f"{where}: queries, keys and values of different head dims are not supported")
        if attention.num_heads % attention.num_kv_heads:
            raise ModelError(f"{where}: {attention.num_heads} query heads do not share {attention.num_kv_heads} "
                             "key/value heads evenly")
        return attention

    def _biased(self, x: relax.Expr) -> tuple[relax.Expr, list[tuple[relax.Expr, relax.Call]]]:
        """(the scores within `x`, the terms added to them with the addition of each), through the views between
        the additions."""
        biases = []
        while True:
            value = self.values.get(x)
            if any(is_op(value, op) for op in _VIEWS) and self._leads_to_scores(value.args[0]):
                x = value.args[0]
            elif is_op(value, "relax.add") and self._leads_to_scores(value.args[0]):
                biases.append((value.args[1], value))
                x = value.args[0]
            elif is_op(value, "relax.add") and self._leads_to_scores(value.args[1]):
                biases.append((value.args[0], value))
                x = value.args[1]
            else:
                return x, biases

    def _leads_to_scores(self, x: relax.Expr) -> bool:
        """`x` is q @ k^T's scores, with biases added in their views (`_biased`)."""
        scores, _ = self._biased(x)
        return self._scores_of(scores, [])[0] is not None

    def _scores_of(self, x: relax.Expr, where: list[str]) -> tuple[relax.Call | None, float, float]:
        """(the q @ k^T matmul whose scores `x` is, the scale multiplied after it, the soft-cap applied to them (0:
        none)), through views; (None, ..) if `x` is not such scores."""
        value, softcap = self.values.get(x), 0.0
        tanh = self.values.get(value.args[0]) if is_op(value, "relax.multiply") else None
        if is_op(tanh, "relax.tanh") and scalar_constant(value.args[1]) is not None:
            softcap, value = scalar_constant(value.args[1]), self.values.get(tanh.args[0])
            where.append(f"soft-cap {softcap:g}")
            inner, divisor = _scaled(value)
            if inner is None or not np.isclose(divisor, softcap, rtol=1e-6):
                raise ModelError(f"{' <- '.join(where)}: scores soft-capped as c * tanh(x / d) with c != d; ember "
                                 "computes c * tanh(x / c)")
            value = self.values.get(inner)
        post_scale = 1.0
        while (scaled := _scaled(value))[0] is not None:
            post_scale, value = post_scale / scaled[1], self.values.get(scaled[0])
        product = self._producer_through(value, _VIEWS, where)
        return (product, post_scale, softcap) if is_op(product, "relax.matmul") else (None, 1.0, 0.0)

    def _producer_through(self, value: relax.Expr | None, ops: tuple[str, ...], where: list[str]) -> relax.Expr | None:
        """`value`, or what it views through `ops` (reshape, broadcast_to)."""
        while value is not None and any(is_op(value, op) for op in ops):
            where.append(value.op.name.removeprefix("relax."))
            value = self.values.get(value.args[0])
        return value

    def _strip(self, x: relax.Expr, where: list[str]) -> tuple[relax.Expr, float]:
        """`x` without views and multiplications by scalar constants, and the product of those constants."""
        scale = 1.0
        while isinstance(x, relax.Var) and x in self.values:
            value = self.values[x]
            if any(is_op(value, op) for op in _VIEWS):
                x = value.args[0]
            elif is_op(value, "relax.multiply") and scalar_constant(value.args[1]) is not None:
                scale *= scalar_constant(value.args[1])
                x = value.args[0]
            else:
                break
            where.append(value.op.name.removeprefix("relax."))
        return x, scale

    def _consumer(self, var: relax.Var, sinks: bool = False) -> relax.VarBinding | None:
        """The matmul reading `var` through views and a guard for rows masked out entirely
        (where(all masked, 0, softmax), which transformers' sdpa decomposition adds; where(isnan(softmax), 0,
        softmax), as ONNX exporters write it); with `sinks`, first the slice dropping the sinks' last column."""
        if sinks:
            users = self.users.get(var, [])
            if len(users) != 1 or not _drops_last_column(users[0].value):
                return None
            var = users[0].var
        while True:
            users = [b for b in self.users.get(var, [])
                     if not (is_op(b.value, "relax.full_like") or is_op(b.value, "relax.isnan"))]
            if len(users) != 1:
                return None
            value = users[0].value
            if is_op(value, "relax.matmul"):
                return users[0]
            is_view = any(is_op(value, op) for op in _VIEWS)
            if not (is_view or is_op(value, "relax.where") and value.args[2].same_as(var)):
                return None
            var = users[0].var

    def _unrepeat(self, x: relax.Expr, where: str) -> relax.Expr:
        """Keys or values before a grouped-query repeat, [1, kv_heads, n, d] (x itself if none). `x` is what
        is left after stripping views: for repeat_kv's reshape(broadcast_to(expand_dims(t, 2))), expand_dims."""
        expanded = self.values.get(x)
        if not is_op(expanded, "relax.expand_dims"):
            return x
        if [int(a) for a in expanded.attrs.axis] != [2]:
            raise ModelError(f"{where}: expand_dims on axis {list(expanded.attrs.axis)} is not a grouped-query repeat")
        return expanded.args[0]

    def _mask_kind(self, biases: list[tuple[relax.Expr, relax.Call]], where: str) -> tuple[int, tuple[float, ...]]:
        """The window of the mask the added `biases` make (0: causal over the whole context) and the slopes of their
        linear bias of the distance between a query and a key (ALiBi: one per head, or one for all; () for none),
        evaluated at every probe length. A bias reading weights (a learned bias), anything else, or one that
        changes with the sequence's length, is refused."""
        if not self.check_masks:
            return 0, ()
        key = tuple(bias for bias, _ in biases)
        if key in self._kinds:
            return self._kinds[key]
        totals = [0.0] * len(self.probe_lengths)
        for bias, addition in biases:
            evaluated = _evaluate(self.func, bias, self.probe_lengths)
            if evaluated is None:
                raise ModelError(f"{where}: the attention bias depends on the model's weights (a learned bias?); ember "
                                 "compiles a causal mask, one through a sliding window, and ALiBi's distance bias")
            for index, (tokens, values) in enumerate(zip(self.probe_lengths, evaluated)):
                shape = [int(d) if isinstance(d, tirx.IntImm) else tokens for d in addition.ty.shape]
                totals[index] = totals[index] + np.broadcast_to(values, shape).reshape(-1, tokens, tokens)
        kinds = {}
        for tokens, total in zip(self.probe_lengths, totals):
            visible = np.isfinite(total) & (total > -1e4)
            window, slopes = mask_window(np.where(visible, 0.0, -np.inf)), distance_slopes(total, visible)
            if window is None or slopes is None:
                shown = total[0][:6, :6]
                raise ModelError(f"{where}: the attention mask is neither causal nor a sliding window, or biases the "
                                 f"scores otherwise than by distance (at {tokens} tokens, its first rows "
                                 f"{np.array2string(shown, precision=2)}); ember compiles causal decoders")
            kinds[tokens] = (window, slopes)
        window, slopes = kinds[max(kinds)]
        if not all(found == (window if window < tokens else 0) and len(found_slopes) == len(slopes)
                   and np.allclose(found_slopes, slopes, rtol=1e-5, atol=1e-7)
                   for tokens, (found, found_slopes) in kinds.items()):
            raise ModelError(f"{where}: the attention mask changes with the sequence's length "
                             f"({', '.join(f'{_describe(w)} at {n} tokens' for n, (w, _) in kinds.items())})")
        self._kinds[key] = window, slopes
        return window, slopes


def distance_slopes(total: np.ndarray, visible: np.ndarray) -> tuple[float, ...] | None:
    """Slopes s_h such that, where a query i sees a key j, `total`[h, i, j] = s_h * (j - i) plus a constant of the
    row (which the softmax ignores): () if the bias is constant along every row, one slope per head (or one for all
    if `total` has one head), None if it is no such bias."""
    tokens = total.shape[-1]
    rows = np.where(visible, total, 0.0).astype(np.float64)
    relative = rows - rows[:, np.arange(tokens), np.arange(tokens)][:, :, None]
    distance = np.where(visible[0], np.arange(tokens)[None, :] - np.arange(tokens)[:, None], 0).astype(np.float64)
    relative = np.where(visible, relative, 0.0)
    if not np.any(relative):
        return ()
    slopes = (relative * distance).sum(axis=(1, 2)) / max((distance * distance).sum(), 1.0)
    fitted = slopes[:, None, None] * distance
    if np.abs(relative - fitted).max() > 1e-5 * max(1.0, float(np.abs(relative).max())):
        return None
    return tuple(float(s) for s in slopes)


def mask_window(values: np.ndarray) -> int | None:
    """The window of an additive mask [..., n, n] that is 0 where a query sees a key and -inf (or a large
    negative) elsewhere, the same for every leading index: 0 if causal, W if each query sees its own and
    the W - 1 positions before it (W < n), None for any other mask."""
    tokens = values.shape[-1]
    rows = values.reshape(-1, tokens, tokens)
    if not np.all(rows == rows[:1]):
        return None
    visible = rows[0] == 0
    if not np.all(visible | (rows[0] <= -1e4)):
        return None
    window = int(visible.sum(axis=1).max())
    query, key = np.indices((tokens, tokens))
    if not np.array_equal(visible, (key <= query) & (query - key < window)):
        return None
    return window if window < tokens else 0


def _evaluate(func: relax.Function, target: relax.Expr, lengths: list[int]) -> list[np.ndarray] | None:
    """The values of `target` in `func` for input_ids of each of `lengths` zeros, if it reads no weight."""
    values = _values(func)
    needed, stack = [], [target]
    seen: set[relax.Var] = set()
    input_ids, *weights = func.params
    while stack:
        var = stack.pop()
        if not isinstance(var, relax.Var) or var in seen:
            continue
        seen.add(var)
        if var in weights:
            return None
        if var in values:
            needed.append(var)
            stack.extend(relax.analysis.free_vars(values[var]))
    order = [b for b in bindings(func) if b.var in needed]
    builder = relax.BlockBuilder()
    ids = relax.Var("input_ids", input_ids.ty)
    with builder.function("main", [ids]):
        with builder.dataflow():
            remap = {input_ids: ids}
            for binding in order:
                value = _Rename(remap).visit_expr(binding.value)
                if is_op(value, "relax.cumsum") and value.args[0].ty.dtype == "bool":  # nor add booleans
                    counted = builder.emit(relax.op.astype(value.args[0], "int32"))
                    value = relax.op.cumsum(counted, value.attrs.axis, "int32", value.attrs.exclusive)
                remap[binding.var] = builder.emit(value)
            out = builder.emit_output(remap[target])
        builder.emit_func_output(out)
    main, seq = builder.get()["main"], input_ids.ty.shape[1]
    results = []
    for tokens in lengths:  # one build each: TVM's scans (a cumsum) take no symbolic length
        mod = tvm.IRModule({"main": main.bind_symbolic_vars({seq: tokens})})
        vm = relax.VirtualMachine(tvm.compile(mod, tvm.target.Target("llvm")), tvm.cpu())
        results.append(vm["main"](tvm.runtime.tensor(np.zeros((1, tokens), "int32"))).numpy().astype(np.float32))
    return results


@relax.expr_functor.mutator
class _Rename(relax.PyExprMutator):
    def __init__(self, remap: dict[relax.Var, relax.Expr]) -> None:
        super().__init__()
        self.remap = remap

    def visit_var_(self, var: relax.Var) -> relax.Expr:
        return self.remap.get(var, var)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if is_op(call, "relax.strided_slice"):  # TVM 0.27 cannot legalize a negative axis: count it from 0
            x, axes, *rest = call.args
            ndim = len(x.ty.shape)
            axes = [int(a.value) % ndim for a in axes.fields]
            return relax.op.strided_slice(x, axes, *[list(r.fields) for r in rest],
                                          assume_inbound=call.attrs.assume_inbound)
        return call

    def visit_dataflow_var_(self, var: relax.DataflowVar) -> relax.Expr:
        return self.remap.get(var, var)


def _values(func: relax.Function) -> dict[relax.Var, relax.Expr]:
    return {binding.var: binding.value for binding in bindings(func)}


@relax.expr_functor.mutator
class _Entry(relax.PyExprMutator):
    """Rewrites one bound copy of `forward` into an entry over the KV cache."""

    def __init__(self, mod: tvm.IRModule, entry: str, count: tirx.Var, windows: list[int]) -> None:
        super().__init__(mod)
        self.entry, self.count = entry, count
        self.windows = windows  # each attention layer's, as proven on `forward` (a bound copy's are not evaluated)
        self.cache = relax.Var("kv_cache", relax.ObjectType())
        self.layer = 0
        self.attentions: dict[relax.Var, _Attention] = {}
        self.narrowed: set[relax.Var] = set()  # prefill: variables holding rows at logit_positions only
        self.values: dict[relax.Var, relax.Expr] = {}
        self.tokens_first_outputs: dict[relax.Var, relax.Expr] = {}  # attention output -> the cache's [1, n, h, d]
        self.lm_head: relax.Var | None = None
        self.returned: relax.Var | None = None
        self.input_ids: relax.Var | None = None
        self.ids: relax.Var | None = None
        self.logit_positions = relax.Var("logit_positions",
                                         relax.TensorType([tirx.Var("num_logits", "int64")], "int32"))
        # max(positions) choosing longrope's factors (`longrope_choice`) -> the length past which they are long
        self.longest: dict[relax.Var, int] = {}
        self.prompt_end: relax.Var | None = None

    def rewrite(self, func: relax.Function) -> relax.Function:
        self.attentions = {a.output: a for a in _Graph(func, check_masks=False).attentions()}
        self.values = _values(func)
        self.lm_head = _returned_projection(func, self.values)
        self.returned = func.body.body
        self.input_ids, *weights = func.params
        shape = [self.count, 1] if self.entry == "decode" else [1, self.count]
        self.ids = relax.Var("input_ids", relax.TensorType(shape, "int32"))
        self.longest = longrope_lengths(func, self.count)
        if self.longest and self.entry != "decode":
            self.prompt_end = relax.Var(PROMPT_END_INPUT, relax.TensorType([1], "int32"))
        inputs = [self.ids, *([self.logit_positions] if self.entry == "prefill" else []),
                  *([self.prompt_end] if self.prompt_end is not None else [])]
        if self.entry != "decode":
            self.set_var_remap(self.input_ids, self.ids)
        body = self.visit_expr(func.body)
        attrs = tvm.ir.make_node("ir.DictAttrs", num_input=len(inputs) + 1, global_symbol=self.entry)
        return relax.Function([*inputs, self.cache, *weights], body, None, True, attrs)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if self.entry == "decode" and self.input_ids is not None:
            # One token of each sequence: the graph sees them as one row.
            row = self.builder_.emit(relax.op.reshape(self.ids, [1, self.count]))
            self.set_var_remap(self.input_ids, row)
            self.input_ids = None
        value = binding.value
        if binding.var in self.attentions:
            self.set_var_remap(binding.var, self._cached_attention(self.attentions[binding.var]))
        elif (is_op(value, "relax.permute_dims") and value.args[0] in self.tokens_first_outputs
              and permute_axes(value) == _HEADS_FIRST):
            # The graph turns the attention's output back to [1, n, heads, d]: the cache's output is that already.
            self.set_var_remap(binding.var, self.tokens_first_outputs[value.args[0]])
        elif is_op(value, "relax.arange") and _counts_tokens(value, self.count):
            positions = self.builder_.emit(relax.call_pure_packed(QUERY_POSITIONS, self.cache,
                                                                  ty_args=relax.TensorType([self.count], "int32")))
            self.set_var_remap(binding.var, self.builder_.emit(relax.op.astype(positions, value.ty.dtype)))
        elif binding.var in self.longest:
            self.set_var_remap(binding.var, self._last_positions(value.ty.dtype))
        elif is_op(value, "relax.cumsum") and _counts_ones(value, self.values):
            positions = self.builder_.emit(relax.call_pure_packed(QUERY_POSITIONS, self.cache,
                                                                  ty_args=relax.TensorType([self.count], "int32")))
            counts = relax.op.astype(relax.op.add(positions, relax.const(1, "int32")), value.ty.dtype)
            self.set_var_remap(binding.var, self.builder_.emit(relax.op.reshape(counts, [1, self.count])))
        elif binding.var.same_as(self.lm_head):
            # The LM head reads [1, rows, hidden], as the hand-written frontend's does (a 2-D view of the
            # hidden states defeats FuseTransposeMatmul for a tied head); prefill's rows are logit_positions.
            x, weight = (self.visit_expr(arg) for arg in value.args)
            hidden = x.ty.shape[-1]
            rows = self.builder_.emit(relax.op.reshape(x, [1, self.count, hidden]))
            if self.entry == "prefill":
                rows = self.builder_.emit(relax.op.take(rows, self.logit_positions, axis=1))
                self.narrowed.add(binding.var)
            logits = self.builder_.emit(relax.op.matmul(rows, weight, value.attrs.out_dtype))
            self.set_var_remap(binding.var, self.builder_.emit(relax.op.reshape(logits, [-1, logits.ty.shape[-1]])))
        elif (is_op(value, "relax.reshape") and value.args[0] in self.narrowed
              and not binding.var.same_as(self.returned)):
            # Views of the logits keep the rows picked at logit_positions, not every token's.
            num_logits = self.logit_positions.ty.shape[0]
            shape = [num_logits if isinstance(d, tirx.Var) and d.same_as(self.count) else d
                     for d in value.args[1].values]
            self.set_var_remap(binding.var, self.builder_.emit(relax.op.reshape(self.visit_expr(value.args[0]), shape)))
            self.narrowed.add(binding.var)
        elif binding.var.same_as(self.returned):
            logits = self.visit_expr(value)
            vocab = logits.ty.shape[-1]
            rows = 1 if self.entry == "decode" else logits.ty.shape[-2]
            logits = self.builder_.emit(relax.op.reshape(logits, [self.count if self.entry == "decode" else 1,
                                                                  rows, vocab]))
            self.set_var_remap(binding.var, self.builder_.emit_output(relax.Tuple([logits, self.cache])))
        else:
            super().visit_var_binding_(binding)
            if _maps_each_logit(value) and value.args[0] in self.narrowed:
                self.narrowed.add(binding.var)  # each logit mapped alone: still the rows at logit_positions

    def _last_positions(self, dtype: str) -> relax.Expr:
        """[n, 1]: per token, the last position of its sequence once this call's tokens are appended: its own in
        decode (one token per sequence), the prompt's last (`prompt_end` - 1) in prefill and verify."""
        emit = self.builder_.emit
        if self.prompt_end is None:
            positions = emit(relax.call_pure_packed(QUERY_POSITIONS, self.cache,
                                                    ty_args=relax.TensorType([self.count], "int32")))
            return emit(relax.op.reshape(relax.op.astype(positions, dtype), [self.count, 1]))
        last = emit(relax.op.astype(relax.op.subtract(self.prompt_end, relax.const(1, "int32")), dtype))
        return emit(relax.op.broadcast_to(relax.op.reshape(last, [1, 1]), [self.count, 1]))

    def _cached_attention(self, attention: _Attention) -> relax.Expr:
        emit = self.builder_.emit
        # [1, heads, n, d] -> [1, n, heads, d]: the cache takes each token's heads together.
        q, k, v = (self._tokens_first(x) for x in (attention.q, attention.k, attention.v))
        d, heads, kv_heads = attention.head_dim, attention.num_heads, attention.num_kv_heads
        cache_heads = heads
        if attention.sinks is not None:
            # The sinks ride in query heads of their own after the model's (`CacheShape.sinks`): one per KV head,
            # its first `group` values the sinks of the query heads sharing that KV head, the next the layer's window.
            group = heads // kv_heads
            window = np.zeros([kv_heads, d - group], str(q.ty.dtype))
            window[:, 0] = self.windows[self.layer]
            carriers = emit(relax.op.concat([relax.op.reshape(self.visit_expr(attention.sinks), [kv_heads, group]),
                                             relax.const(window)], axis=1))
            carriers = emit(relax.op.broadcast_to(relax.op.reshape(carriers, [1, 1, kv_heads, d]),
                                                  [1, self.count, kv_heads, d]))
            q = emit(relax.op.concat([q, carriers], axis=2))
            cache_heads = heads + kv_heads
        qkv = emit(relax.op.concat([q, k, v], axis=2))
        qkv = emit(relax.op.reshape(qkv, [self.count, cache_heads + 2 * kv_heads, d]))
        scale = relax.prim_value(tirx.FloatImm("float64", attention.scale))
        out = emit(relax.call_dps_packed(KV_ATTENTION, [self.cache, relax.prim_value(self.layer), scale, qkv],
                                         out_ty=relax.TensorType([self.count, cache_heads, d], q.ty.dtype)))
        self.layer += 1
        if cache_heads != heads:
            out = emit(relax.op.strided_slice(out, axes=[1], begin=[0], end=[heads]))
        self.tokens_first_outputs[attention.output] = out = emit(relax.op.reshape(out, [1, self.count, heads, d]))
        return emit(relax.op.permute_dims(out, _HEADS_FIRST))

    def _tokens_first(self, x: relax.Var) -> relax.Expr:
        """`x` ([1, heads, n, d]) as [1, n, heads, d]: the tensor the graph permuted it from, where it did (no copy)."""
        value = self.values.get(x)
        if is_op(value, "relax.permute_dims") and permute_axes(value) == _HEADS_FIRST:
            return self.visit_expr(value.args[0])
        return self.builder_.emit(relax.op.permute_dims(self.visit_expr(x), _HEADS_FIRST))


def _scaled(value: relax.Expr | None) -> tuple[relax.Expr | None, float]:
    """(x, d) for `value` = x / d or x * (1 / d) with a scalar constant d; (None, 1) otherwise."""
    if (is_op(value, "relax.divide") or is_op(value, "relax.multiply")) and scalar_constant(value.args[1]) not in (
            None, 0.0):
        constant = scalar_constant(value.args[1])
        return value.args[0], constant if is_op(value, "relax.divide") else 1 / constant
    return None, 1.0


def _drops_last_column(value: relax.Expr) -> bool:
    """strided_slice(x, [last axis], [0], [-1 or its extent - 1], [1]): x without its last column."""
    if not is_op(value, "relax.strided_slice"):
        return False
    x, axes, begin, end, *strides = value.args
    rank = x.ty.ndim
    fields = [[int(f.value) for f in arg.fields] for arg in (axes, begin, end, *strides)]
    if [a % rank for a in fields[0]] != [rank - 1] or fields[1] != [0] or (strides and fields[3] != [1]):
        return False
    extent = x.ty.shape[rank - 1]
    kept = value.ty.shape[rank - 1]
    return fields[2] == [-1] or tvm_ffi.structural_equal(tvm.arith.Analyzer().simplify(extent - 1), kept)


def _swaps_last_two(permute: relax.Call) -> bool:
    """permute_dims exchanging its last two axes ([0, 1, 3, 2], or [0, 2, 1] on a view of merged heads)."""
    rank = len(permute.args[0].ty.shape)
    return rank >= 2 and permute_axes(permute) == [*range(rank - 2), rank - 1, rank - 2]


def _counts_tokens(arange: relax.Call, count: tirx.Var) -> bool:
    """arange(0, count, 1): the positions of the graph's tokens."""
    start, end, step = arange.args[:3]
    constant = (tirx.IntImm,)
    return (isinstance(start, constant) and int(start) == 0 and isinstance(step, constant) and int(step) == 1
            and isinstance(end, tirx.Var) and end.same_as(count))


def _counts_ones(cumsum: relax.Call, values: dict[relax.Var, relax.Expr]) -> bool:
    """cumsum(full([1, n], 1), axis=1), inclusive: each token's position counted from 1."""
    ones = values.get(cumsum.args[0])
    shape = cumsum.ty.shape
    return (is_op(ones, "relax.full") and scalar_constant(ones.args[1]) == 1.0 and len(shape) == 2
            and isinstance(shape[0], tirx.IntImm) and int(shape[0]) == 1 and cumsum.attrs.axis is not None
            and int(cumsum.attrs.axis) % 2 == 1 and not cumsum.attrs.exclusive)


# Operators between the LM head and the returned logits that map each logit alone (besides scaling by a constant):
# a cast, a view, Gemma 2's final soft-cap (cap * tanh(logits / cap)).
_LOGIT_MAPS = ("relax.astype", "relax.reshape", "relax.tanh")


def _maps_each_logit(value: relax.Expr) -> bool:
    return any(is_op(value, op) for op in _LOGIT_MAPS) or _scaled(value)[0] is not None


def _returned_projection(func: relax.Function, values: dict[relax.Var, relax.Expr]) -> relax.Var | None:
    """The matmul (the LM head) whose result `func` returns, through casts, reshapes, tuples and the maps of
    each logit alone (`_LOGIT_MAPS`, scaling)."""
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
        if isinstance(value, relax.Var) or _maps_each_logit(value):
            stack.append(value if isinstance(value, relax.Var) else value.args[0])
    return None

