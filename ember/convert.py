"""Weight conversion: evaluate each parameter's recipe and stream it into tensor-cache shards.

The recipes come from the passes that ran (see `ir_passes/weight_recipes.py`), so
the tensors written are exactly those the compiled graph takes, in its order.
One parameter is materialised at a time: peak memory is a few tensors, not the model.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ember.frontend.weights import CheckpointWeights


def evaluate_recipe(recipe: dict[str, Any], weights: CheckpointWeights) -> np.ndarray:
    """Compute one parameter from checkpoint tensors."""
    op = recipe["op"]
    if op == "load":
        return weights.load(recipe["name"])
    if op == "concat":
        return np.concatenate([evaluate_recipe(r, weights) for r in recipe["inputs"]], axis=recipe["axis"])
    raise ValueError(f"unknown weight recipe op {op!r}")


def write_params(
    params: list[tuple[str, str]],
    recipes: dict[str, dict[str, Any]],
    weights: CheckpointWeights,
    out_dir: Path,
    show_progress: bool = True,
) -> None:
    """Write `params` ([(name, dtype)], graph order) as TVM tensor-cache shards in `out_dir`."""
    from tvm.contrib import tvmjs  # the compiler side only; the runtime reads shards natively

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        for name, dtype in tqdm(params, desc="Converting weights", unit="tensor", disable=not show_progress):
            yield name, np.ascontiguousarray(evaluate_recipe(recipes[name], weights).astype(dtype))

    with contextlib.redirect_stdout(io.StringIO()):  # tvmjs prints its staging path
        tvmjs.dump_tensor_cache(tensors(), str(out_dir), encode_format="raw", show_progress=False)
