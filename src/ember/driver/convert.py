"""Weight conversion: evaluate each parameter's recipe and stream it into tensor-cache shards.

The recipes come from the passes that ran (see `ir/weight_recipes.py`), so
the tensors written are exactly those the compiled graph takes, in its order.
One parameter is materialised at a time: peak memory is a few tensors, not the model.
Importing this module needs no TVM compiler (numpy, ml_dtypes and TVM's runtime library only): a device
with the runtime alone converts a checkpoint into an artifact's shards (`scripts/gpu_check.py` does).
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np
from tqdm import tqdm

from ember.core.errors import ModelError
from ember.ir.quant_formats import FORMATS, QuantFormat

if TYPE_CHECKING:
    from ember.frontend.weights import CheckpointWeights


class RecipeEvaluator:
    """Computes parameters from checkpoint tensors, one recipe at a time.

    A quantized weight is stored as several parameters (its parts) with the same
    input; they are adjacent in parameter order, so the last packing is kept and
    each weight is read and packed once.
    """

    def __init__(self, weights: CheckpointWeights) -> None:
        self.weights = weights
        self._last_packed: tuple[str, dict[str, np.ndarray]] | None = None

    def __call__(self, recipe: dict[str, Any]) -> np.ndarray:
        """The parameter `recipe` describes."""
        op = recipe["op"]
        if op == "load":
            tensor = self.weights.load(recipe["name"])
            _refuse_non_finite(tensor, f"checkpoint tensor {recipe['name']!r}",
                               "the checkpoint is damaged, or was saved from a diverged run")
            return tensor
        if op == "concat":
            return np.concatenate([self(r) for r in recipe["inputs"]], axis=recipe["axis"])
        if op == "transpose":
            return np.swapaxes(self(recipe["input"]), -1, -2)
        if op == "reshape":
            return self(recipe["input"]).reshape(recipe["shape"])
        if op == "quantize":
            layout = recipe["layout"]
            key = json.dumps([recipe["format"], layout, recipe["input"]], sort_keys=True)
            if self._last_packed is None or self._last_packed[0] != key:
                self._last_packed = None  # free the previous weight's parts first
                self._last_packed = (key, self._quantized(FORMATS[recipe["format"]], recipe["input"], layout))
            return self._last_packed[1][recipe["part"]]
        # Panels are a CPU layout; their module needs relax, which a runtime-only device has not.
        from ember.ir_passes.pack_float_panels import PANEL_OP, to_panels

        if op == PANEL_OP:
            return to_panels(self(recipe["input"]), recipe["rows"])
        raise ValueError(f"unknown weight recipe op {op!r}")

    def _quantized(self, fmt: QuantFormat, source: dict[str, Any], layout: str) -> dict[str, np.ndarray]:
        """`source` in `fmt`: the file's own levels and scales where it stores them in this format (a GGUF
        Q8_0/Q4_0/Q4_1 tensor, kept bit for bit), else quantized from its float values."""
        stored = self._stored_levels(fmt, source)
        if stored is not None:
            return fmt.pack(stored["levels"], stored["scale"], stored.get("min"), layout)
        return fmt.quantize(self(source), layout)

    def _stored_levels(self, fmt: QuantFormat, source: dict[str, Any]) -> dict[str, np.ndarray] | None:
        """The stored levels, scales (and minimums) of `source` (a tensor, or rows of tensors concatenated)."""
        stored = getattr(self.weights, "stored_quantization", None)
        if stored is None:
            return None
        if source["op"] == "load":
            return stored(source["name"], fmt.bits, fmt.zero_point)
        if source["op"] == "reshape":  # rows of experts stacked and flattened back: the same rows
            levels = self._stored_levels(fmt, source["input"])
            shape = tuple(source["shape"])
            return levels if levels is not None and levels["levels"].shape == shape else None
        if source["op"] == "concat" and source["axis"] == 0:
            members = [self._stored_levels(fmt, member) for member in source["inputs"]]
            if all(member is not None for member in members):
                return {key: np.concatenate([m[key] for m in members]) for key in members[0]}
        return None


def quantized_sources(recipes: dict[str, dict[str, Any]]) -> dict[str, QuantFormat]:
    """The checkpoint tensors that `recipes` quantize, each with its format (for a GGUF file's conversion report)."""
    from ember.ir.weight_recipes import recipe_sources  # needs relax: the compiler side only
    return {name: FORMATS[recipe["format"]] for recipe in recipes.values() if recipe["op"] == "quantize"
            for name in recipe_sources(recipe["input"])}


def write_params(
    params: list[tuple[str, str]],
    recipes: dict[str, dict[str, Any]],
    weights: CheckpointWeights,
    out_dir: Path,
    show_progress: bool = True,
) -> None:
    """Write `params` ([(name, dtype)], graph order) as TVM tensor-cache shards in `out_dir`."""
    from tvm.contrib import tvmjs  # the compiler side only; the runtime reads shards natively

    evaluate = RecipeEvaluator(weights)

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        for name, dtype in tqdm(params, desc="Converting weights", unit="tensor", disable=not show_progress):
            with np.errstate(over="ignore"):  # refused below, in one line
                param = np.ascontiguousarray(evaluate(recipes[name]).astype(dtype))
            # Finite sources can still overflow here: float32 beyond 65504 becomes float16's inf.
            _refuse_non_finite(param, f"weight {name!r} as {dtype}",
                               f"beyond {dtype}'s range; choose a float32 --quant")
            yield name, param

    with contextlib.redirect_stdout(io.StringIO()):  # tvmjs prints its staging path
        tvmjs.dump_tensor_cache(tensors(), str(out_dir), encode_format="raw", show_progress=False)


def _refuse_non_finite(array: np.ndarray, what: str, why: str) -> None:
    """Refuse a float tensor holding NaN or infinite values: the compiled model would only ever sample from NaN."""
    if array.dtype.kind != "f" and array.dtype != ml_dtypes.bfloat16:
        return
    finite = np.isfinite(array)
    if not finite.all():
        bad = array.size - int(np.count_nonzero(finite))
        raise ModelError(f"{what}: {bad} of {array.size} values are NaN or infinite ({why}); ember compiles finite "
                         f"weights only")
