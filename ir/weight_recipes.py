"""How each model parameter is computed from checkpoint tensors, carried by the IRModule.

Passes that change parameters (fusing projections, quantizing weights) rewrite the
graph *and* the recipe of the parameters they touch, so weight conversion is derived
from the passes that ran instead of from a second, hand-kept table. The recipes live
in the module attribute `ember.weight_recipes` as JSON (plain data that survives
every TVM pass), keyed by the Relax parameter name:

    {"op": "load", "name": "model.layers.0.self_attn.q_proj.weight"}
    {"op": "concat", "axis": 0, "inputs": [<recipe>, <recipe>, ...], "rows": [N_1, N_2, ...]}  (rows: each's)
    {"op": "adapter", "part": "A" | "B", "shape": [...], "members": [...]}  LoRA slots (`ir_passes/add_lora_slots.py`)
    {"op": "quantize", "format": "q4f32", "part": "packed", "layout": "rows", "input": <recipe>}
    {"op": "transpose", "input": <recipe>}          a weight stored [..., in, out] (transformers' Conv1D, gpt-oss's
                                                    experts): its last two axes swapped
    {"op": "reshape", "shape": [..], "input": <recipe>}  stacked experts (`frontend/fused_experts.py`)
    {"op": "panels", "rows": 16, "input": <recipe>} `ir_passes/pack_float_panels.py`

Every entry function that takes weights takes the same weights in the same order,
after its `num_input` runtime inputs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import tvm
from tvm import relax

ATTR = "ember.weight_recipes"
Recipe = dict[str, Any]


def get_recipes(mod: tvm.IRModule) -> dict[str, Recipe]:
    """The recipes of `mod`'s parameters, in parameter order."""
    if mod.attrs is None or ATTR not in mod.attrs:
        raise ValueError(f"IRModule has no {ATTR!r} attribute; was it built by an ember frontend?")
    return json.loads(str(mod.attrs[ATTR]))


def set_recipes(mod: tvm.IRModule, recipes: dict[str, Recipe]) -> tvm.IRModule:
    """A copy of `mod` carrying `recipes`."""
    return mod.with_attr(ATTR, json.dumps(recipes))


def recipe_sources(recipe: Recipe) -> Iterator[str]:
    """Names of the checkpoint tensors `recipe` reads, in order."""
    if recipe["op"] == "load":
        yield recipe["name"]
    for child in recipe.get("inputs", [recipe["input"]] if "input" in recipe else []):
        yield from recipe_sources(child)


def weight_params(func: relax.Function) -> list[relax.Var]:
    """The parameters of an entry function that are model weights."""
    num_input = int(func.attrs["num_input"]) if func.attrs and "num_input" in func.attrs else len(func.params)
    return list(func.params[num_input:])


def entry_functions_with_weights(mod: tvm.IRModule) -> list[str]:
    """Names of the Relax functions that take model weights."""
    return [
        gv.name_hint
        for gv, func in mod.functions_items()
        if isinstance(func, relax.Function) and weight_params(func)
    ]
