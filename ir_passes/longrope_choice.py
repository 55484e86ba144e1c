"""Longrope's choice of factors, found in a traced graph so that each token makes it for its own sequence.

transformers' longrope (Phi-3, Phi-3.5, Phi-4-mini) rotates with the long factors once the sequence is longer
than `original_max_position_embeddings`, with the short ones before, and traces the choice as

    seq_len  = max(position_ids) + 1
    inv_freq = where(seq_len > original, long_inv_freq, short_inv_freq)        # [rotary_dim / 2]
    freqs    = positions[1, n, 1] * inv_freq                                     # [1, n, rotary_dim / 2]

The `max` reads every token of the call. ember's decode runs a batch of sequences as one row of tokens and a long
prompt is prefilled chunk by chunk, so neither may compute it from the tokens it sees. `specialize_attention`
replaces each `max` found here with a [n, 1] tensor holding, per token, the last position of its own sequence
once the call's tokens are appended (the token's own position in decode; in a prompt, its end, which the
runtime passes in). The `where` then picks factors per token ([n, rotary_dim / 2]) and `freqs[t] = pos[t] *
inv_freq[t]` keeps its shape. Only this exact chain is accepted: a `max` over the positions read any other way
stays, and `specialize_attention` refuses it as a reduction that would mix sequences.
"""

from __future__ import annotations

from collections import defaultdict

from tvm import relax, tirx

from ember.ir.module_utils import bindings, is_op, scalar_constant

# Operators that carry the token positions from `arange(0, n)` without mixing them.
_POSITION_VIEWS = ("relax.add", "relax.expand_dims", "relax.reshape", "relax.astype")


def longrope_lengths(func: relax.Function, count: tirx.Var) -> dict[relax.Var, int]:
    """The variables of `func` bound to `max(positions)` where that maximum only chooses longrope's factors
    (the module docstring's chain), each with the sequence length past which it chooses the long ones; `count` is
    the function's token count."""
    values = {binding.var: binding.value for binding in bindings(func)}
    readers: dict[relax.Var, list[relax.Var]] = defaultdict(list)
    for var, value in values.items():
        if isinstance(value, relax.Call):
            for arg in value.args:
                if isinstance(arg, relax.Var):
                    readers[arg].append(var)
    found = {}
    for var, value in values.items():
        if is_op(value, "relax.max") and _are_positions(value.args[0], values, count):
            long_above = _long_factors_above(var, values, readers, count)
            if long_above is not None:
                found[var] = long_above
    return found


def _are_positions(expr: relax.Expr, values: dict[relax.Var, relax.Expr], count: tirx.Var) -> bool:
    """`expr` is `arange(0, count)` through views, casts and an added zero."""
    value = values.get(expr)
    while any(is_op(value, op) for op in _POSITION_VIEWS):
        if is_op(value, "relax.add") and scalar_constant(value.args[1]) != 0.0:
            return False
        value = values.get(value.args[0])
    if not is_op(value, "relax.arange"):
        return False
    start, end, step = value.args[:3]
    return (isinstance(start, tirx.IntImm) and int(start) == 0 and isinstance(step, tirx.IntImm) and int(step) == 1
            and isinstance(end, tirx.Var) and end.same_as(count))


def _only_reader(var: relax.Var, values: dict[relax.Var, relax.Expr],
                 readers: dict[relax.Var, list[relax.Var]], op: str) -> relax.Var | None:
    """The one binding reading `var`, if there is one and it calls `op`."""
    found = readers.get(var, [])
    return found[0] if len(found) == 1 and is_op(values[found[0]], op) else None


def _long_factors_above(longest: relax.Var, values: dict[relax.Var, relax.Expr],
                        readers: dict[relax.Var, list[relax.Var]], count: tirx.Var) -> int | None:
    """L where `longest` + c > C (that is: the sequence's length `longest` + 1 > L) picks between two token-free
    vectors, and each reader multiplies that choice by the positions [.., n, 1]; None for anything else."""
    length = _only_reader(longest, values, readers, "relax.add")
    if length is None or not values[length].args[0].same_as(longest):
        return None
    longer = _only_reader(length, values, readers, "relax.greater")
    if longer is None or not values[longer].args[0].same_as(length):
        return None
    added, bound = scalar_constant(values[length].args[1]), scalar_constant(values[longer].args[1])
    if added is None or bound is None or not float(added).is_integer() or not float(bound).is_integer():
        return None
    choice = _only_reader(longer, values, readers, "relax.where")
    if choice is None or not values[choice].args[0].same_as(longer):
        return None
    if any(len(getattr(branch.ty, "shape", ())) != 1 or _reads_tokens(branch.ty, count)
           for branch in values[choice].args[1:]):
        return None
    uses = readers.get(choice, [])
    if not uses or not all(_scales_positions(values[use], choice, count) for use in uses):
        return None
    return int(bound) - int(added) + 1


def _reads_tokens(ty: relax.Type, count: tirx.Var) -> bool:
    return any(v.same_as(count) for d in getattr(ty, "shape", ()) for v in tirx.analysis.undefined_vars(d))


def _scales_positions(value: relax.Expr, choice: relax.Var, count: tirx.Var) -> bool:
    """`value` multiplies `choice` by a tensor of one value per token, [.., n, 1]."""
    if not is_op(value, "relax.multiply") or not any(arg.same_as(choice) for arg in value.args):
        return False
    other = value.args[1] if value.args[0].same_as(choice) else value.args[0]
    shape = list(getattr(other.ty, "shape", ()))
    return (len(shape) >= 2 and isinstance(shape[-1], tirx.IntImm) and int(shape[-1]) == 1
            and isinstance(shape[-2], tirx.Var) and shape[-2].same_as(count))
