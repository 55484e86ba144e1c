"""The integer dot product a CPU target's quantized projections are built on, chosen in one place.

x86 from AVX2 up and aarch64 with the dot-product extension have one (see `_INT8_DOTS`);
other CPUs take the float path. x86 with AMX (level "amx") multiplies prefill's rows on AMX tiles
(`Int8Dot.tiles`: bfloat16 tiles with AMX-BF16, `schedules/amx_bf16_matmul.py`, else int8 ones,
`schedules/amx_matmul.py`) and keeps AVX512-VNNI for decode.

`schedules/int8_matmul.py` emits whichever instruction sequence `int8_dot_of` picks from the
target's LLVM features; every other module asks `TargetSpec.int8_dot`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tvm.target import Target, codegen


@dataclass(frozen=True)
class Int8Dot:
    """A CPU's dot product of bytes, 4 products into each int32 lane, as the int8 matmul emits it.

    VNNI levels have one instruction that adds four u8 x s8 products into each int32 lane
    (`vpdpbusd`). Without VNNI, `vpmaddubsw` adds two products into a saturating int16
    and `vpmaddwd` with ones sums those pairs into int32, as llama.cpp's AVX2 kernels do;
    `sign` (`vpsignb`) moves a sign from one operand onto the other so that the unsigned
    operand can be a magnitude (see `schedules/int8_matmul.py` for why no sum saturates).
    aarch64's `sdot` (dotprod) multiplies s8 x s8, `usdot` (i8mm) u8 x s8 as `vpdpbusd`
    does, on 128-bit registers: half of an interleaved 8-row block each.
    """

    level: str  # the ISA level, as reports name it: "amx", "avx512vnni", "avxvnni", "avx512", "avx2", "i8mm", "dotprod"
    multiply: str  # LLVM intrinsic: byte products -> int32 sums of 4 (vpdpbusd, sdot), or int16 sums of 2 (vpmaddubsw)
    widen: str = ""  # LLVM intrinsic: int16 pairs -> int32 (vpmaddwd); empty when `multiply` gives int32
    sign: str = ""  # LLVM intrinsic: a byte negated where another is negative, zeroed where it is zero
    lanes: int = 8  # int32 lanes of one `multiply` (weight rows): 16 on 512-bit, 8 on 256-bit, 4 on NEON registers
    signed_weights: bool = False  # `multiply` takes the weight bytes signed (sdot: s8 x s8)
    narrow: Int8Dot | None = None  # the same products on half the lanes, for weights of fewer rows
    tiles: str = ""  # prefill's projections on AMX tiles, "bf16" (`amx_bf16_matmul.py`) or "int8" (`amx_matmul.py`)

    def for_rows(self, rows: int) -> Int8Dot:
        """This dot product, or its narrower form where `rows` weight rows are not whole multiplies."""
        return self.narrow.for_rows(rows) if rows % self.lanes and self.narrow is not None else self

    @property
    def accumulates(self) -> bool:
        """Whether `multiply` adds into an int32 accumulator itself (VNNI, sdot, usdot)."""
        return not self.widen


_VNNI = {"multiply": "llvm.x86.avx512.vpdpbusd.256"}  # LLVM picks EVEX or, for AVX-VNNI, VEX by the features
_PAIRS = {"multiply": "llvm.x86.avx2.pmadd.ub.sw", "widen": "llvm.x86.avx2.pmadd.wd", "sign": "llvm.x86.avx2.psign.b"}
# The first level whose CPU features a target has is its int8 dot product. AVX512-VNNI
# multiplies 16 weight rows, two interleaved 8-row blocks, per 512-bit instruction: the
# two blocks' words are two 256-bit loads joined (vinserti64x4), and everything after the
# load (int4's nibble masks, the dot products, the group's convert and FMA, the store of 16
# outputs) takes half the instructions of the 256-bit form. The int8 matmul uses it for
# prefill, which is compute-bound (1.6x to 1.85x on Zen 5), and for int4 decode's whole tiles of
# sequences; one sequence keeps the 256-bit form (`int8_matmul.kernel_dot`, `wide_decode_tiles`).
# CPUs that split 512-bit operations in two (Zen 4) are not measured.
# AVX-512 without VNNI runs AVX2's sequence on 256-bit registers (its 32 registers allow a
# larger tile).
_AVX512_VNNI = Int8Dot("avx512vnni", multiply="llvm.x86.avx512.vpdpbusd.512", lanes=16,
                       narrow=Int8Dot("avx512vnni", **_VNNI))
# AMX (Sapphire Rapids on) computes prefill's 16-row tiles, with `tdpbf16ps` on weights dequantized to bfloat16 where
# it has AMX-BF16 (as every AMX CPU so far: 2.4x-3.2x the VNNI kernel's speed at 2,048 rows), else with `tdpbssd`
# (1.3x-1.7x); decode's rows stay on AVX512-VNNI.
_AMX = Int8Dot("amx", multiply=_AVX512_VNNI.multiply, lanes=16, narrow=_AVX512_VNNI.narrow, tiles="int8")
_INT8_DOTS = (
    (("amx-bf16", "avx512bf16", "amx-int8", "amx-tile", "avx512vnni", "avx512vl"), replace(_AMX, tiles="bf16")),
    (("amx-int8", "amx-tile", "avx512vnni", "avx512vl"), _AMX),
    (("avx512vnni", "avx512vl"), _AVX512_VNNI),
    (("avxvnni",), Int8Dot("avxvnni", **_VNNI)),
    (("avx512bw", "avx512vl"), Int8Dot("avx512", **_PAIRS)),
    (("avx2",), Int8Dot("avx2", **_PAIRS)),
    (("i8mm",), Int8Dot("i8mm", multiply="llvm.aarch64.neon.usdot", lanes=4)),
    (("dotprod",), Int8Dot("dotprod", multiply="llvm.aarch64.neon.sdot", lanes=4, signed_weights=True)),
)


def int8_dot_of(target: Target) -> Int8Dot | None:
    """The first level in `_INT8_DOTS` whose features `target` has (None: the float path)."""
    for features, dot in _INT8_DOTS:
        if codegen.target_has_features(list(features), target):
            return dot
    return None
