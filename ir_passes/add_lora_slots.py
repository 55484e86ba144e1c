"""Room for LoRA adapters: each targeted projection gains a term from its row's adapter.

Rewrites, in every entry function that takes weights, each projection of a targeted module

    y = matmul(x, permute_dims(W))          W the weight of e.g. `model.layers.3.self_attn.q_proj`

into

    y' = lora_apply(x, y, A, B_t, adapter_slots, adapter_scales)      (`schedules/lora.py`)

where A [slots, rank, K] and B_t [slots, rank, N] are new weight parameters (after the others, in the same
order in every function) and `adapter_slots` [rows] int32, `adapter_scales` [rows] float32 two new inputs
before the KV cache, `rows` being the function's batch (decode's sequences; 1 for a prompt chunk). The
adapters are no checkpoint's tensors: their recipe (`ADAPTER_OP`) has the runtime allocate them as zeros,
and `runtime/lora.py` fills a slot from a PEFT adapter at serve time. A row with scale 0 is the base model.

Before `fuse_parallel_projections`, so each term belongs to one module as PEFT names it (q, k and v still
fuse: their terms read the fused projection's parts), and before `quantize_weights`, which quantizes the
projection and leaves the adapters float32. A module is targeted when its name ends in one of `targets`'
components (PEFT's rule for a list of names).

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

ADAPTER_OP = "adapter"  # the recipe of an adapter stack: {"op", "module", "part": "A" | "B", "shape"}
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
        modules = _projection_modules(mod[names[0]], recipes)
        targeted = _targeted(modules, targets)
        stacks = {module: _stacks(module, weight, rank, slots) for module, weight in targeted.items()}
        kernels = {}
        rewritten = {}
        for name in names:
            func = mod[name]
            rewriter = _Rewriter(mod, func, targeted, stacks, kernels, vector_bits)
            rewritten[name] = rewriter.rewrite()
            mod = rewriter.builder_.get()
        new_recipes = dict(recipes)
        for module, (a, b) in stacks.items():
            new_recipes[a.name] = _recipe(module, "A", a)
            new_recipes[b.name] = _recipe(module, "B", b)
        return set_recipes(replace_functions(mod, rewritten), new_recipes)

    return transform


def _projection_modules(func: relax.Function, recipes: dict[str, Recipe]) -> dict[str, relax.Var]:
    """Module name -> the [N, K] weight parameter of its projection, for every projection `func` reads a weight
    of a checkpoint tensor `<module>.weight` in."""
    weights = set(weight_params(func))
    transposed = {b.var: b.value.args[0] for b in bindings(func) if is_weight_transpose(b.value, weights)}
    modules = {}
    for binding in bindings(func):
        value = binding.value
        if is_op(value, "relax.matmul") and value.args[1] in transposed:
            weight = transposed[value.args[1]]
            source = _source(recipes.get(weight.name, {}))
            if source is not None and source.endswith(".weight"):
                modules[source.removesuffix(".weight")] = weight
    return modules


def _source(recipe: Recipe) -> str | None:
    """The checkpoint tensor a projection weight's recipe reads as it is, or transposed (transformers' Conv1D)."""
    if recipe.get("op") == "transpose":
        recipe = recipe["input"]
    return recipe["name"] if recipe.get("op") == "load" else None


def _targeted(modules: dict[str, relax.Var], targets: Sequence[str]) -> dict[str, relax.Var]:
    """The modules named by `targets`, each target matching at least one."""
    targeted = {}
    for target in targets:
        found = {name: weight for name, weight in modules.items() if name == target or name.endswith("." + target)}
        if not found:
            known = sorted({name.rsplit(".", 1)[-1] for name in modules})
            raise ModelError(f"--lora-targets {target}: no projection of this model is named so; its projections "
                             f"are {', '.join(known) or 'none'}")
        targeted.update(found)
    return dict(sorted(targeted.items(), key=lambda item: list(modules).index(item[0])))


def _stacks(module: str, weight: relax.Var, rank: int, slots: int) -> tuple[relax.Var, relax.Var]:
    n, k = (int(d) for d in weight.ty.shape)
    if str(weight.ty.dtype) != "float32":
        raise ModelError(f"{module}: its projection computes in {weight.ty.dtype}; LoRA slots need a float32 "
                         "compute dtype (--quant f32, q8f32 or q4f32)")
    return (relax.Var(f"{module}.lora_A", relax.TensorType([slots, rank, k], "float32")),
            relax.Var(f"{module}.lora_B_t", relax.TensorType([slots, rank, n], "float32")))


def _recipe(module: str, part: str, stack: relax.Var) -> Recipe:
    return {"op": ADAPTER_OP, "module": module, "part": part, "shape": [int(d) for d in stack.ty.shape]}


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    """One entry function with the adapter inputs and parameters, each targeted projection followed by its term."""

    def __init__(self, mod: tvm.IRModule, func: relax.Function, targeted: dict[str, relax.Var],
                 stacks: dict[str, tuple[relax.Var, relax.Var]], kernels: dict, vector_bits: int) -> None:
        super().__init__(mod)
        self.func = func
        self.vector_bits = vector_bits
        self.kernels = kernels
        by_name = {p.name: p for p in weight_params(func)}
        # This function's own parameter of each targeted weight (each function has its own Var).
        self.module_of = {by_name[weight.name]: module for module, weight in targeted.items()}
        # Each function its own variables of the same parameters (a Var is bound in one function only).
        self.stacks = {module: tuple(relax.Var(stack.name, stack.ty) for stack in pair)
                       for module, pair in stacks.items()}
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
        if is_op(value, "relax.permute_dims") and value.args[0] in self.module_of:
            self.transposed[binding.var] = value.args[0]
        super().visit_var_binding_(binding)
        if is_op(value, "relax.matmul") and value.args[1] in self.transposed:
            self._add_term(binding, self.module_of[self.transposed[value.args[1]]])

    def _add_term(self, binding: relax.VarBinding, module: str) -> None:
        x, y = self.visit_expr(binding.value.args[0]), self.visit_expr(binding.var)
        x_type, y_type = x.ty, binding.var.ty
        analyzer = Analyzer()
        rows = [analyzer.simplify(d) for d in list(x_type.shape)[:-1]]
        tokens = analyzer.simplify(rows[0] * rows[1]) if len(rows) == 2 else rows[0] if len(rows) == 1 else None
        if (tokens is None or not analyzer.can_prove_equal(tokens, self.tokens) or str(x_type.dtype) != "float32"
                or str(y_type.dtype) != "float32"):
            raise ModelError(f"{module}: its projection maps {x_type} to {y_type}; LoRA slots need a float32 "
                             "projection of the call's tokens ([batch, seq, K] or [tokens, K])")
        flat = len(rows) == 1
        if flat:  # [tokens, K]: one batch of the call's tokens
            x = self.builder_.emit(relax.op.reshape(x, [1, *x_type.shape]))
            y = self.builder_.emit(relax.op.reshape(y, [1, *y_type.shape]))
        a, b = self.stacks[module]
        slots, rank, k = (int(d) for d in a.ty.shape)
        n = int(b.ty.shape[2])
        kernel = lora.lora_apply(k, n, rank, slots, self.vector_bits)
        key = (k, n, rank, slots)
        if key not in self.kernels:
            self.kernels[key] = self.builder_.add_func(kernel.with_attr(KERNEL_SOURCE_ATTR, lora.__name__),
                                                       "lora_apply")
        call = relax.call_tir(self.kernels[key], [x, y, a, b, self.slots, self.scales], y.ty)
        if flat:
            call = relax.op.reshape(self.builder_.emit(call), y_type.shape)
        var = binding.var
        self.set_var_remap(var, self.builder_.emit(call) if isinstance(var, relax.DataflowVar)
                           else self.builder_.emit_output(call))
