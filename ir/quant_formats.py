"""Weight formats chosen with `--quant`: how a weight is packed, and how a kernel unpacks it.

Both halves of each format live here side by side so they cannot drift apart:
`quantize` (numpy, run once during weight conversion) and `dequantize_expr` (TIR,
inlined into the kernels that read the weight). `dequantize` is the numpy
reference of the unpacking, which the tests hold the kernels to.

A quantized [N, K] weight is cut into groups of 32 consecutive values along its
reduction axis K (one row at a time), each group with its own scale, as in
llama.cpp's Q8_0/Q4_0/Q4_1 and MLC-LLM's q4f16_1. K is zero-padded up to a
multiple of 32 when needed; kernels never read the padding.

    name        weight values                  per group of 32       bits/weight  like
    q0f32       float32                        -                     32           llama.cpp F32, MLC q0f32
    q0f16       float16                        -                     16           llama.cpp F16, MLC q0f16
    q8f32       int8, symmetric                float16 scale         8.5          llama.cpp Q8_0
    q8f16       int8, symmetric                float16 scale         8.5          llama.cpp Q8_0
    q4f32       int4, symmetric, 8 per uint32  float16 scale         4.5          llama.cpp Q4_0, MLC q4f32_1
    q4f16       int4, symmetric, 8 per uint32  float16 scale         4.5          llama.cpp Q4_0, MLC q4f16_1
    q4f32_zp    uint4 with a per-group minimum float16 scale + min   5.0          llama.cpp Q4_1
    q4f16_zp    uint4 with a per-group minimum float16 scale + min   5.0          llama.cpp Q4_1

The suffix names the compute dtype: a `f16` format runs its activations and its
unquantized parameters (norms, biases) in float16, a `f32` one in float32. Scales and
minimums are stored in float16 by every format, as llama.cpp's blocks store them
(`SCALE_DTYPE`): decode streams the weights, and float32 scales would add a bit per
weight, 11% of a 4-bit weight's bytes; a float16 scale is within 2^-11 of the float32
one, far below the weights' rounding to 16 levels. A kernel widens them to its compute
dtype as it reads them, and a GGUF file's Q8_0/Q4_0/Q4_1 scales are kept bit for bit. Symmetric int4 uses all 16 levels
the way Q4_0 does: the scale maps the group's largest-magnitude value to -8, so
values land in [-8, 7]. `_zp` formats store a minimum per group (a zero point),
so a group whose values are not centred on zero still gets all 16 levels: better
quality for one more scalar per group.

Each quantized weight is stored in one of two layouts:

    rows          packed [N, K / per_word], scale [N, K / 32]: row-major, the layout above
    interleaved   packed [N / 8, K * bits / 32, 8] uint32, scale (and min) [N / 8, K / 32, 8]:
                  blocks of 8 rows, word w of the 8 rows side by side

`interleaved` is what the int8 dot-product kernels read (`schedules/int8_matmul.py`):
one 256-bit load holds 4 bytes of each of 8 rows, so one `vpdpbusd` with a broadcast
activation word computes 8 rows at once, each int32 lane one row, and a group's 8
scales are one vector load (and with a zero point, its 8 minimums another). Values are
stored unsigned, as the instruction multiplies them: int8 as `v + 128`, int4 as `v + 8`,
zero-point int4 as its level 0..15. An int8 word holds 4 consecutive values;
the 4 int4 words of a group hold its values 0-15 in their low nibbles and 16-31 in
the high ones (byte t of word j: values 4j + t and 16 + 4j + t), so masking and
shifting a word gives two byte vectors that pair with consecutive activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # TVM is needed to build kernels, not to read the table (`ember --help`)
    from tvm import te, tirx

GROUP_SIZE = 32
WORD_BITS = 32
ROWS, INTERLEAVED = "rows", "interleaved"  # weight layouts
INTERLEAVED_ROWS = 8
_QUANTIZE_BLOCK_VALUES = 1 << 20
# Parameter-name suffixes of a quantized weight's stored tensors (`W.packed`, ...).
QUANTIZED_PARTS = ("packed", "scale", "min")
SCALE_DTYPE = "float16"  # of every format's scales and minimums (see the module docstring)


@dataclass(frozen=True)
class QuantFormat:
    """One `--quant` format."""

    name: str
    bits: int  # 0: weights stay in `dtype`
    dtype: str  # compute dtype, and the dtype of unquantized parameters (scales are SCALE_DTYPE)
    zero_point: bool = False
    group_size: int = GROUP_SIZE

    @property
    def quantizes(self) -> bool:
        """Whether weights are stored as integers."""
        return self.bits > 0

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight value, scales (and minimums) included."""
        if not self.quantizes:
            return float(np.dtype(self.dtype).itemsize * 8)
        scale_bits = np.dtype(SCALE_DTYPE).itemsize * 8
        return self.bits + scale_bits * (2 if self.zero_point else 1) / self.group_size

    @property
    def parts(self) -> tuple[str, ...]:
        """Names of the tensors a quantized weight is stored as."""
        return QUANTIZED_PARTS if self.zero_point else QUANTIZED_PARTS[:2]

    @property
    def storage_dtype(self) -> str:
        """Dtype of the `packed` part: int8 values, or eight 4-bit values per uint32."""
        return "int8" if self.bits == 8 else "uint32"

    @property
    def per_word(self) -> int:
        """Values stored in one element of `packed`."""
        return 1 if self.bits == 8 else WORD_BITS // self.bits

    @property
    def vector_run(self) -> int:
        """Consecutive values along K read from one packed element and one scale."""
        return self.group_size if self.bits == 8 else self.per_word

    def padded(self, k: int) -> int:
        """K rounded up to whole groups."""
        return -(-k // self.group_size) * self.group_size

    def interleaves(self, n: int, k: int) -> bool:
        """Whether an [n, k] weight can be stored `interleaved`: int8/int4, whole row blocks and groups."""
        return self.bits in (4, 8) and n % INTERLEAVED_ROWS == 0 and k % self.group_size == 0

    def part_shapes(self, n: int, k: int, layout: str = ROWS) -> dict[str, tuple[tuple[int, ...], str]]:
        """Shape and dtype of each stored part of an [n, k] weight."""
        groups = self.padded(k) // self.group_size
        if layout == INTERLEAVED:
            self._check_interleaves(n, k)
            blocks = n // INTERLEAVED_ROWS
            shapes = {"packed": ((blocks, k * self.bits // WORD_BITS, INTERLEAVED_ROWS), "uint32"),
                      "scale": ((blocks, groups, INTERLEAVED_ROWS), SCALE_DTYPE)}
            if self.zero_point:
                shapes["min"] = ((blocks, groups, INTERLEAVED_ROWS), SCALE_DTYPE)
            return shapes
        shapes = {"packed": ((n, self.padded(k) // self.per_word), self.storage_dtype),
                  "scale": ((n, groups), SCALE_DTYPE)}
        if self.zero_point:
            shapes["min"] = ((n, groups), SCALE_DTYPE)
        return shapes

    def quantize(self, weight: np.ndarray, layout: str = ROWS) -> dict[str, np.ndarray]:
        """Pack an [N, K] float weight into this format's parts, in `layout`."""
        if weight.ndim != 2:
            raise ValueError(f"{self.name} quantizes 2-D weights; got shape {weight.shape}")
        return self._pack_blocks(weight.shape, layout,
                                 lambda rows: self._pack_rows(*self._levels(weight[rows]), layout))

    def pack(self, levels: np.ndarray, scale: np.ndarray, low: np.ndarray | None = None,
             layout: str = ROWS) -> dict[str, np.ndarray]:
        """The parts of a weight quantized elsewhere (a GGUF file's Q8_0/Q4_0/Q4_1 blocks), its values unchanged:
        integer `levels` [N, K] (signed; 0..15 with a zero point), `scale` and `low` (the minimums) [N, K / 32]."""
        n, k = levels.shape
        if k % self.group_size or scale.shape != (n, k // self.group_size) or (low is None) == self.zero_point:
            raise ValueError(f"{self.name} cannot pack levels {levels.shape} with scales {scale.shape}")

        def rows_of(rows: slice):
            return (levels[rows], scale[rows].astype(SCALE_DTYPE),
                    None if low is None else low[rows].astype(SCALE_DTYPE))

        return self._pack_blocks(levels.shape, layout, lambda rows: self._pack_rows(*rows_of(rows), layout))

    def _pack_blocks(self, shape: tuple[int, int], layout: str, pack_rows) -> dict[str, np.ndarray]:
        """The parts of an [N, K] weight, `pack_rows(slice)` giving those of a block of its rows."""
        n, k = shape
        # A block of rows at a time: the float temporaries stay a few MB even for a
        # 128k-token embedding table, so conversion memory is the packed weight's.
        parts = {name: np.empty(shape, dtype) for name, (shape, dtype) in self.part_shapes(n, k, layout).items()}
        block = max(1, _QUANTIZE_BLOCK_VALUES // max(k, 1))
        if layout == INTERLEAVED:
            block = -(-block // INTERLEAVED_ROWS) * INTERLEAVED_ROWS
        stored_rows = INTERLEAVED_ROWS if layout == INTERLEAVED else 1  # weight rows per first-axis index
        for start in range(0, n, block):
            for name, values in pack_rows(slice(start, start + block)).items():
                parts[name][start // stored_rows: start // stored_rows + len(values)] = values
        return parts

    def _levels(self, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Integer levels [n, padded K], scales (and minimums) [n, groups] of a block of float rows."""
        n, k = weight.shape
        groups = np.zeros((n, self.padded(k)), np.float32)
        groups[:, :k] = weight
        groups = groups.reshape(n, -1, self.group_size)
        low = None
        if self.zero_point:
            scale, low = _fit_scale_and_min(groups, 2**self.bits - 1)
            scale, low = scale.astype(SCALE_DTYPE), low.astype(SCALE_DTYPE)
            offset = low.astype(np.float32)[..., None]
            levels = (0, 2**self.bits - 1)
        else:
            top = 2 ** (self.bits - 1)
            if self.bits == 8:  # Q8_0: the largest magnitude maps to +-127
                scale = (np.abs(groups).max(axis=-1) / (top - 1)).astype(SCALE_DTYPE)
                levels = (-(top - 1), top - 1)
            else:  # Q4_0: the largest-magnitude value maps to -8, all 16 levels in use
                extreme = np.take_along_axis(groups, np.abs(groups).argmax(axis=-1)[..., None], -1)[..., 0]
                scale = (extreme / -top).astype(SCALE_DTYPE)
                levels = (-top, top - 1)
            offset = 0.0
        stored_scale = scale.astype(np.float32)[..., None]
        with np.errstate(divide="ignore", invalid="ignore"):
            values = np.where(stored_scale != 0, (groups - offset) / stored_scale, 0.0)
        return np.clip(np.rint(values), *levels).reshape(n, -1), scale, low

    def _pack_rows(self, values: np.ndarray, scale: np.ndarray, low: np.ndarray | None,
                   layout: str) -> dict[str, np.ndarray]:
        if layout == INTERLEAVED:
            return self._pack_interleaved(values, scale, low)
        parts = {"packed": self._pack(values), "scale": scale}
        if self.zero_point:
            parts["min"] = low
        return parts

    def dequantize(self, parts: dict[str, np.ndarray], k: int, layout: str = ROWS) -> np.ndarray:
        """Numpy reference: the [N, k] weight the kernels compute from `parts`, stored in `layout`."""
        if layout == INTERLEAVED:
            parts = self._deinterleave(parts)
        # In the compute dtype, one rounding per operation, as the kernels do.
        values = self._unpack(parts["packed"]).astype(self.dtype)
        weight = values * np.repeat(parts["scale"].astype(self.dtype), self.group_size, axis=1)
        if self.zero_point:
            weight = weight + np.repeat(parts["min"].astype(self.dtype), self.group_size, axis=1)
        return weight[:, :k]

    def dequantize_expr(self, parts: dict[str, te.Tensor], row: tirx.PrimExpr, col: tirx.PrimExpr,
                        layout: str = ROWS) -> tirx.PrimExpr:
        """TIR: element [row, col] of the weight, computed from `parts` stored in `layout` (in `self.dtype`)."""
        from tvm import tirx

        packed = parts["packed"]
        if layout == INTERLEAVED:
            block, lane = row // INTERLEAVED_ROWS, row % INTERLEAVED_ROWS
            if self.bits == 8:
                word, shift = packed[block, col // 4, lane], col % 4 * 8
            else:  # group g, word j = (col % 16) // 4, byte col % 4, high nibble for the group's second half
                word = packed[block, col // self.group_size * 4 + col % 16 // 4, lane]
                shift = col % 4 * 8 + col % self.group_size // 16 * 4
            value = (word >> shift.astype("uint32")) & tirx.const(2**self.bits - 1, "uint32")
            value = value.astype("int32") - self.stored_offset
            weight = value.astype(self.dtype) * parts["scale"][block, col // self.group_size, lane].astype(self.dtype)
            if self.zero_point:
                weight = weight + parts["min"][block, col // self.group_size, lane].astype(self.dtype)
            return weight
        value = self.level_expr(packed, row, col)
        weight = value.astype(self.dtype) * parts["scale"][row, col // self.group_size].astype(self.dtype)
        if self.zero_point:
            weight = weight + parts["min"][row, col // self.group_size].astype(self.dtype)
        return weight

    def level_expr(self, packed: te.Tensor, row: tirx.PrimExpr, col: tirx.PrimExpr) -> tirx.PrimExpr:
        """TIR: the integer level of element [row, col] stored in `rows` layout, its offset taken out: the weight is
        the level times its group's scale (plus the group's minimum, for a zero-point format)."""
        from tvm import tirx

        if self.bits == 8:
            return packed[row, col]
        word = packed[row, col // self.per_word]
        shift = (col % self.per_word * self.bits).astype("uint32")
        value = (word >> shift) & tirx.const(2**self.bits - 1, "uint32")
        return value.astype("int32") - self.stored_offset if self.stored_offset else value

    def _pack(self, values: np.ndarray) -> np.ndarray:
        if self.bits == 8:
            return values.astype(np.int8)
        unsigned = (values + self.stored_offset).astype(np.uint32)
        lanes = unsigned.reshape(unsigned.shape[0], -1, self.per_word)
        shifts = np.arange(self.per_word, dtype=np.uint32) * self.bits
        return np.bitwise_or.reduce(lanes << shifts, axis=-1).astype(np.uint32)

    @property
    def stored_offset(self) -> int:
        """What is added to a level to store it unsigned: 2 ** (bits - 1) for signed levels, 0 with a zero point."""
        return 0 if self.zero_point else 2 ** (self.bits - 1)

    def _pack_interleaved(self, values: np.ndarray, scale: np.ndarray,
                          low: np.ndarray | None) -> dict[str, np.ndarray]:
        """The `interleaved` parts of a block of rows (a multiple of 8): `values` [n, K] (signed, or 0..15 with
        a zero point), `scale` and `low` (the minimums, with a zero point) [n, groups]."""
        unsigned = (values + self.stored_offset).astype(np.uint8)
        n = unsigned.shape[0]
        if self.bits == 4:  # byte t of a group's word j: values 4j + t (low nibble) and 16 + 4j + t (high)
            halves = unsigned.reshape(n, -1, 2, 16)
            unsigned = halves[:, :, 0] | halves[:, :, 1] << 4
        words = np.ascontiguousarray(unsigned).view("<u4").reshape(n, -1)

        def side_by_side(rows: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(rows.reshape(n // INTERLEAVED_ROWS, INTERLEAVED_ROWS, -1).transpose(0, 2, 1))

        parts = {"packed": side_by_side(words).astype(np.uint32), "scale": side_by_side(scale)}
        if self.zero_point:
            parts["min"] = side_by_side(low)
        return parts

    def _deinterleave(self, parts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The `rows` parts of `interleaved` parts (the inverse of `_pack_interleaved`)."""

        def row_major(blocks: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(blocks.transpose(0, 2, 1)).reshape(-1, blocks.shape[1])

        unsigned = row_major(parts["packed"]).astype("<u4").view(np.uint8).astype(np.int32)
        if self.bits == 4:
            groups = unsigned.reshape(unsigned.shape[0], -1, 16)
            unsigned = np.stack([groups & 0x0F, groups >> 4], axis=2).reshape(unsigned.shape[0], -1)
        rows = {"packed": self._pack(unsigned - self.stored_offset), "scale": row_major(parts["scale"])}
        if self.zero_point:
            rows["min"] = row_major(parts["min"])
        return rows

    def _check_interleaves(self, n: int, k: int) -> None:
        if not self.interleaves(n, k):
            raise ValueError(f"{self.name} cannot store a [{n}, {k}] weight interleaved "
                             f"(int8/int4, rows a multiple of {INTERLEAVED_ROWS}, K of {self.group_size})")

    def _unpack(self, packed: np.ndarray) -> np.ndarray:
        if self.bits == 8:
            return packed.astype(np.int32)
        shifts = np.arange(self.per_word, dtype=np.uint32) * self.bits
        values = (packed[..., None] >> shifts) & np.uint32(2**self.bits - 1)
        values = values.reshape(packed.shape[0], -1).astype(np.int32)
        return values - self.stored_offset


def _fit_scale_and_min(groups: np.ndarray, top: int, rounds: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Per-group scale and minimum of `groups` [..., G] for levels 0..top, least squares error.

    Starts from the group's range (min, (max - min) / top), then alternates: round
    each value to its level, refit scale and minimum by linear regression of the
    values on their levels (llama.cpp's k-quants search the same way). Each group
    keeps its best fit: the error never grows past the plain range's. On the demo
    model's weights this cuts the squared error of 4-bit groups by 14%.
    """
    low = groups.min(axis=-1)
    scale = (groups.max(axis=-1) - low) / top
    size = groups.shape[-1]

    def levels_and_error(scale, low):
        with np.errstate(divide="ignore", invalid="ignore"):
            levels = np.where(scale[..., None] != 0, (groups - low[..., None]) / scale[..., None], 0.0)
        levels = np.clip(np.rint(levels), 0, top)
        return levels, ((levels * scale[..., None] + low[..., None] - groups) ** 2).sum(axis=-1)

    levels, best_error = levels_and_error(scale, low)
    best_scale, best_low = scale, low
    for _ in range(rounds):
        sum_l, sum_ll = levels.sum(-1), (levels * levels).sum(-1)
        sum_w, sum_lw = groups.sum(-1), (levels * groups).sum(-1)
        det = size * sum_ll - sum_l * sum_l
        solvable = det > 0
        scale = np.where(solvable, (size * sum_lw - sum_l * sum_w) / np.where(solvable, det, 1), best_scale)
        low = np.where(solvable, (sum_w - scale * sum_l) / size, best_low)
        levels, error = levels_and_error(scale, low)
        better = error < best_error
        best_scale, best_low = np.where(better, scale, best_scale), np.where(better, low, best_low)
        best_error = np.minimum(error, best_error)
        levels, _ = levels_and_error(best_scale, best_low)
    return best_scale, best_low


FORMATS: dict[str, QuantFormat] = {
    fmt.name: fmt
    for fmt in (
        QuantFormat("q0f32", 0, "float32"),
        QuantFormat("q0f16", 0, "float16"),
        QuantFormat("q8f32", 8, "float32"),
        QuantFormat("q8f16", 8, "float16"),
        QuantFormat("q4f32", 4, "float32"),
        QuantFormat("q4f16", 4, "float16"),
        QuantFormat("q4f32_zp", 4, "float32", zero_point=True),
        QuantFormat("q4f16_zp", 4, "float16", zero_point=True),
    )
}
