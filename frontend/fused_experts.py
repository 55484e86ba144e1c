"""Expert weights transformers fuses at load time, traced back to the checkpoint tensors they are made of.

transformers 5 stacks a mixture-of-experts block's per-expert linear weights into
one parameter as it loads a checkpoint: Mixtral's and Qwen-MoE's `experts.N.w1/w3`
(`gate_proj`/`up_proj`) become `experts.gate_up_proj` [experts, 2 * ffn, hidden],
their `w2` (`down_proj`) `experts.down_proj` [experts, hidden, ffn]. The traced
graph reads the fused parameter, which no checkpoint stores.

transformers also knows the way back (`revert_weight_conversion`, what its
`save_pretrained` writes). Rather than restate its tables, the way back is run on
a probe: the fused parameter filled with its own element indices. Each checkpoint
tensor that comes back then says exactly which elements it holds. ember accepts
the answer only if the checkpoint tensors are whole rows of the parameter seen as
[experts * rows, columns] that tile it without gap or overlap; the recipe is then
their concatenation in row order (a GGUF or quantized loader keeps each tensor's
stored blocks: no element moves within a row), reshaped to the parameter.
Anything else (a transpose, an interleave) is refused naming the parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ember.core.errors import ModelError
from ember.ir.weight_recipes import Recipe

_EXACT_INDICES = 2**53  # float64 holds every integer index below this


def fused_weight_recipe(model, name: str, shape: tuple[int, ...],
                        stored: Callable[[str], bool]) -> tuple[Recipe, dict[str, tuple[int, ...]]]:
    """The recipe of the fused parameter `name` (of `shape`) from the checkpoint tensors transformers makes it of,
    and those tensors' shapes; a `ModelError` naming `name` where they are not whole rows of it."""
    import torch
    from transformers.core_model_loading import revert_weight_conversion

    columns = shape[-1]
    size = math.prod(shape)
    if size >= _EXACT_INDICES:
        raise ModelError(f"{name}: {size} elements are too many to trace back to the checkpoint")
    probe = torch.arange(size, dtype=torch.float64).reshape(shape)
    with torch.no_grad():
        reverted = revert_weight_conversion(model, {name: probe})
    if set(reverted) == {name}:
        raise ModelError(f"{name}: the checkpoint does not store this tensor, and transformers names no checkpoint "
                         f"tensors it is made of")
    pieces: list[tuple[int, str, tuple[int, ...]]] = []
    for source, tensor in reverted.items():
        values = tensor.detach().numpy()
        if not stored(source):
            raise ModelError(f"{name}: made of checkpoint tensor {source!r}, which the checkpoint does not store")
        if values.ndim != 2 or values.shape[1] != columns or not _whole_rows(values):
            raise ModelError(f"{name}: transformers makes it of {source!r} {list(values.shape)} in a way ember "
                             f"cannot map back (not whole rows of the stacked experts)")
        pieces.append((int(values[0, 0]), source, tuple(values.shape)))
    pieces.sort()
    expected = 0
    for start, source, piece_shape in pieces:
        if start != expected:
            raise ModelError(f"{name}: the checkpoint tensors transformers makes it of leave a gap or overlap "
                             f"at {source!r}")
        expected += math.prod(piece_shape)
    if expected != size:
        raise ModelError(f"{name}: the checkpoint tensors transformers makes it of cover {expected} of its "
                         f"{size} elements")
    recipe = {"op": "reshape", "shape": list(shape),
              "input": {"op": "concat", "axis": 0,
                        "inputs": [{"op": "load", "name": source} for _, source, _ in pieces]}}
    return recipe, {source: piece_shape for _, source, piece_shape in pieces}


def _whole_rows(values: np.ndarray) -> bool:
    """Whether `values` (indices into the parameter) are consecutive whole rows of it."""
    start = values[0, 0]
    return start % values.shape[1] == 0 and np.array_equal(values.ravel(), start + np.arange(values.size))
