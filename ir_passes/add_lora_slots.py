"""Room for LoRA adapters: each targeted projection gains a term from its token's adapter.

Rewrites, in every entry function that takes weights, each projection whose weight is (or holds the rows of) a
targeted module's, e.g. `model.layers.3.self_attn.q_proj`,

    y = matmul(x, permute_dims(W))

into

    y' = lora_apply(x, y, A, B_t, adapter_slots, adapter_scales)      (`schedules/lora.py`, in place of y)

where A [slots, members * rank, K] and B_t [slots, rank, N] are new weight parameters (after the others, in the
same order in every function) and `adapter_slots` [tokens] int32, `adapter_scales` [tokens] float32 two new
inputs before the KV cache, one of each per token of the call (decode's sequences, a prompt chunk's positions).
The adapters are no checkpoint's tensors: their recipe (`ADAPTER_OP`) has the runtime allocate them as zeros,
and `runtime/lora.py` fills a slot from a PEFT adapter at serve time. A token with scale 0 is the base model.

After `fuse_parallel_projections`: a fused projection (q/k/v, gate/up) takes one term, its targeted members'
A stacked along the rank and their B in their own columns of B_t (the recipe's `rows` say whose), so the
fused projection's split and reshapes stay as they were and a layer runs one adapter kernel per projection.
Before `quantize_weights`, which quantizes the projection and leaves the adapters float32. A module is targeted
when its name ends in one of `targets`' components (PEFT's rule for a list of names).

A projection of [tokens, K] rows (a traced graph's flattened tokens) is seen as [1, tokens, K]. Refused in one
line: a target that names no projection of the model; a targeted projection that is not float32, or whose
rows are not the call's tokens, naming the module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import tvm
from tvm import relax
from tvm.sym.analyzer import Analyzer

from ember.core.errors import ModelError
from ember.ir.attributes import KERNEL_SOURCE_ATTR
from ember.ir.module_utils import bindings, is_op, is_weight_transpose, replace_functions
from ember.ir.weight_recipes import Recipe, entry_functions_with_weights, get_recipes, set_recipes, weight_params
from ember.schedules import lora

# The recipe of an adapter stack: {"op", "part": "A" | "B", "shape", "members": [{"module", "a_row", "b_column",
# "output"}]}, where each targeted module's adapter lies in it.
ADAPTER_OP = "adapter"
SLOTS_INPUT, SCALES_INPUT = "adapter_slots", "adapter_scales"
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSlots:
    """Room for `slots` adapters at once, each of rank up to `rank`, on the projections of the modules `targets`
    name (`ember compile --lora-rank/--lora-slots/--lora-targets`)."""

    rank: int
    slots: int
    targets: tuple[str, ...] = DEFAULT_TARGETS


def add_lora_slots(lora_slots: LoraSlots, vector_bits: int) -> tvm.transform.Pass:
    """The pass giving every projection of a module `lora_slots.targets` names room for its adapters."""
    rank, slots, targets = lora_slots.rank, lora_slots.slots, lora_slots.targets

    @tvm.transform.module_pass(opt_level=0, name="AddLoraSlots")
    def transform(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        names = entry_functions_with_weights(mod)
        recipes = get_recipes(mod)
        projections = _targeted(_projections(mod[names[0]], recipes), targets)
        stacks = {weight.name: _stacks(weight, members, rank, slots) for weight, members in projections.items()}
        kernels: dict[tuple, relax.GlobalVar] = {}
        rewritten = {}
        for name in names:
            rewriter = _Rewriter(mod, mod[name], projections, stacks, kernels, vector_bits)
            rewritten[name] = rewriter.rewrite()
            mod = rewriter.builder_.get()
        new_recipes = dict(recipes)
        for weight, members in projections.items():
            a, b = stacks[weight.name]
            layout = _layout(members, rank)
            new_recipes[a.name] = _recipe("A", a, layout)
            new_recipes[b.name] = _recipe("B", b, layout)
        return set_recipes(replace_functions(mod, rewritten), new_recipes)

    return transform


# A projection's members: (module, its rows of the weight, targeted), in row order.
Members = list[tuple[str, int, bool]]


def _projections(func: relax.Function, recipes: dict[str, Recipe]) -> dict[relax.Var, Members]:
    """Each [N, K] weight parameter `func` projects with whose rows are checkpoint tensors `<module>.weight` (one, or
    several fused), with its members (none targeted yet)."""
    # A tied head projects with the embedding table, whose PEFT adapter is an embedding's (lora_embedding_A/B),
    # not a projection's: it gets no slot.
    tables = {b.value.args[0] for b in bindings(func) if is_op(b.value, "relax.take")}
    weights = set(weight_params(func)) - tables
    transposed = {b.var: b.value.args[0] for b in bindings(func) if is_weight_transpose(b.value, weights)}
    projections = {}
    for binding in bindings(func):
        value = binding.value
        if is_op(value, "relax.matmul") and value.args[1] in transposed:
            weight = transposed[value.args[1]]
            members = _members(recipes.get(weight.name, {}), int(weight.ty.shape[0]))
            if members:
                projections[weight] = members
    return projections


def _members(recipe: Recipe, rows: int) -> Members:
    """The modules whose weights `recipe` stacks as rows (fused projections record each one's rows), or []."""
    if recipe.get("op") == "concat" and recipe.get("axis") == 0 and "rows" in recipe:
        parts = [_members(member, count) for member, count in zip(recipe["inputs"], recipe["rows"])]
        return [member for part in parts for member in part] if all(parts) else []
    if recipe.get("op") == "transpose":  # transformers' Conv1D, stored [in, out]
        recipe = recipe["input"]
    name = recipe.get("name", "") if recipe.get("op") == "load" else ""
    return [(name.removesuffix(".weight"), rows, False)] if name.endswith(".weight") else []


def _targeted(projections: dict[relax.Var, Members], targets: Sequence[str]) -> dict[relax.Var, Members]:
    """The projections with a member `targets` names, their members marked; each target must name one."""
    def named(module: str, target: str) -> bool:
        return module == target or module.endswith("." + target)

    modules = [module for members in projections.values() for module, _, _ in members]
    for target in targets:
        if not any(named(module, target) for module in modules):
            known = sorted({module.rsplit(".", 1)[-1] for module in modules})
            raise ModelError(f"--lora-targets {target}: no projection of this model is named so; its projections "
                             f"are {', '.join(known) or 'none'}")
    marked = {weight: [(module, rows, any(named(module, t) for t in targets)) for module, rows, _ in members]
              for weight, members in projections.items()}
    return {weight: members for weight, members in marked.items() if any(on for _, _, on in members)}


def _stacks(weight: relax.Var, members: Members, rank: int, slots: int) -> tuple[relax.Var, relax.Var]:
    n, k = (int(d) for d in weight.ty.shape)
    if str(weight.ty.dtype) != "float32":
        raise ModelError(f"{members[0][0]}: its projection computes in {weight.ty.dtype}; LoRA slots need a float32 "
                         "compute dtype (--quant q0f32, q8f32 or q4f32)")
    base = weight.name.removesuffix(".weight")
    targeted = sum(on for _, _, on in members)
    return (relax.Var(f"{base}.lora_A", relax.TensorType([slots, targeted * rank, k], "float32")),
            relax.Var(f"{base}.lora_B_t", relax.TensorType([slots, rank, n], "float32")))


def _layout(members: Members, rank: int) -> list[dict]:
    """Where each targeted member's adapter lies: its A's first row in the stacked A, its columns of B_t."""
    layout, column, packed = [], 0, 0
    for module, rows, on in members:
        if on:
            layout.append({"module": module, "a_row": packed * rank, "b_column": column, "output": rows})
            packed += 1
        column += rows
    return layout


def _segments(members: Members) -> tuple[tuple[int, int, int], ...]:
    """The kernel's view of the members: (first column, columns, index among the targeted or -1)."""
    segments, column, packed = [], 0, 0
    for _, rows, on in members:
        segments.append((column, rows, packed if on else -1))
        packed += on
        column += rows
    return tuple(segments)


def _recipe(part: str, stack: relax.Var, layout: list[dict]) -> Recipe:
    return {"op": ADAPTER_OP, "part": part, "shape": [int(d) for d in stack.ty.shape], "members": layout}


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    """One entry function with the adapter inputs and parameters, each targeted projection followed by its term."""

    def __init__(self, mod: tvm.IRModule, func: relax.Function, projections: dict[relax.Var, Members],
                 stacks: dict[str, tuple[relax.Var, relax.Var]], kernels: dict, vector_bits: int) -> None:
        super().__init__(mod)
        self.func = func
        self.vector_bits = vector_bits
        self.kernels = kernels
        by_name = {p.name: p for p in weight_params(func)}
        # This function's own parameter of each targeted weight, and its own variables of the adapter stacks
        # (a Var is bound in one function only).
        self.members = {by_name[weight.name]: members for weight, members in projections.items()}
        self.stacks = {by_name[name]: tuple(relax.Var(stack.name, stack.ty) for stack in pair)
                       for name, pair in stacks.items()}
        self.transposed: dict[relax.Var, relax.Var] = {}
        num_input = int(func.attrs["num_input"])
        batch, seq = func.params[0].ty.shape  # input_ids: the call's tokens
        self.tokens = Analyzer().simplify(batch * seq)
        self.slots = relax.Var(SLOTS_INPUT, relax.TensorType([self.tokens], "int32"))
        self.scales = relax.Var(SCALES_INPUT, relax.TensorType([self.tokens], "float32"))
        self.inputs = [*func.params[:num_input - 1], self.slots, self.scales, func.params[num_input - 1]]
        self.weights = list(func.params[num_input:])

    def rewrite(self) -> relax.Function:
        body = self.visit_expr(self.func.body)
        params = self.inputs + self.weights + [stack for pair in self.stacks.values() for stack in pair]
        rewritten = relax.Function(params, body, self.func.ret_ty, self.func.is_pure, self.func.attrs, self.func.span)
        return rewritten.with_attr("num_input", len(self.inputs))

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if is_op(value, "relax.permute_dims") and value.args[0] in self.members:
            self.transposed[binding.var] = value.args[0]
        super().visit_var_binding_(binding)
        if is_op(value, "relax.matmul") and value.args[1] in self.transposed:
            self._add_term(binding, self.transposed[value.args[1]])

    def _add_term(self, binding: relax.VarBinding, weight: relax.Var) -> None:
        members = self.members[weight]
        x, y = self.visit_expr(binding.value.args[0]), self.visit_expr(binding.var)
        x_type, y_type = x.ty, binding.var.ty
        analyzer = Analyzer()
        rows = [analyzer.simplify(d) for d in list(x_type.shape)[:-1]]
        tokens = analyzer.simplify(rows[0] * rows[1]) if len(rows) == 2 else rows[0] if len(rows) == 1 else None
        if (tokens is None or not analyzer.can_prove_equal(tokens, self.tokens) or str(x_type.dtype) != "float32"
                or str(y_type.dtype) != "float32"):
            raise ModelError(f"{members[0][0]}: its projection maps {x_type} to {y_type}; LoRA slots need a float32 "
                             "projection of the call's tokens ([batch, seq, K] or [tokens, K])")
        flat = len(rows) == 1
        if flat:  # [tokens, K]: one batch of the call's tokens
            x = self.builder_.emit(relax.op.reshape(x, [1, *x_type.shape]))
            y = self.builder_.emit(relax.op.reshape(y, [1, *y_type.shape]))
        a, b = self.stacks[weight]
        slots, _, k = (int(d) for d in a.ty.shape)
        rank, n = (int(d) for d in list(b.ty.shape)[1:])
        key = (k, n, rank, slots, _segments(members))
        if key not in self.kernels:
            kernel = lora.lora_apply(k, n, rank, slots, _segments(members), self.vector_bits)
            self.kernels[key] = self.builder_.add_func(kernel.with_attr(KERNEL_SOURCE_ATTR, lora.__name__),
                                                       "lora_apply")
        # In place: the projection's output is read by the term alone (its readers read the term's output).
        call = relax.call_tir_inplace(self.kernels[key], [x, y, a, b, self.slots, self.scales], 1, y.ty)
        if flat:
            call = relax.op.reshape(self.builder_.emit(call), y_type.shape)
        var = binding.var
        self.set_var_remap(var, self.builder_.emit(call) if isinstance(var, relax.DataflowVar)
                           else self.builder_.emit_output(call))
