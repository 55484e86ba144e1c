"""Place operators on a device's roofline and add them up into stage, generation and memory totals.

For an operator doing `ops` operations while moving `bytes` to and from memory, on a
device with peak compute P (for the operator's data type) and memory bandwidth BW:
    arithmetic intensity  I = ops / bytes                   (op/byte)
    attainable            A = min(P, I x BW)                (op/s)
    time                  t = max(ops / P, bytes / BW) = ops / A
    bound                 compute if ops / P >= bytes / BW, else memory
A stage's time is the sum of its operators' times: kernels run one after another, each
at its own roofline (an upper bound on speed; real kernels reach 50-90% of it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ember.driver.analyze.operators import (
    Architecture,
    Operator,
    Precision,
    Stage,
    decode,
    flash_tile_rows,
    prefill,
)
from ember.targets.hardware import Hardware


@dataclasses.dataclass(frozen=True)
class Point:
    """An operator placed on a device's roofline."""

    op: Operator
    dtype: str  # the data type it computes in on this device, after fallback
    intensity: float
    attainable: float
    time: float
    bound: str


def place(op: Operator, hw: Hardware) -> Point:
    """Intensity, attainable performance, time and bound of `op` on `hw`."""
    dtype = hw.compute_dtype(op.dtype)
    peak = hw.peak_flops[dtype]
    compute_s, memory_s = op.ops / peak, op.bytes / hw.memory_bandwidth
    intensity = op.ops / op.bytes
    return Point(op, dtype, intensity, min(peak, intensity * hw.memory_bandwidth),
                 max(compute_s, memory_s), "compute" if compute_s >= memory_s else "memory")


@dataclasses.dataclass(frozen=True)
class StageResult:
    """A stage's operators on the roofline, and their totals over all layers."""

    stage: Stage
    layer: tuple[Point, ...]
    once: tuple[Point, ...]

    def _sum(self, value: Callable[[Point], float]) -> float:
        return self.stage.num_layers * sum(map(value, self.layer)) + sum(map(value, self.once))

    @property
    def ops(self) -> float:
        """Operations of the whole step."""
        return self._sum(lambda p: p.op.ops)

    @property
    def bytes(self) -> float:
        """Bytes moved by the whole step."""
        return self._sum(lambda p: p.op.bytes)

    @property
    def time(self) -> float:
        """Seconds for the whole step."""
        return self._sum(lambda p: p.time)

    def peak_activations(self) -> float:
        """Estimated peak activation memory: the residual stream plus the largest operator's
        activation inputs and outputs, all of which must be live at once."""
        residual = self.layer[0].op.act_read  # attn_norm reads the residual stream
        return residual + max(p.op.act_read + p.op.act_write for p in self.layer + self.once)


def evaluate(stage: Stage, hw: Hardware) -> StageResult:
    """Place every operator of `stage` on `hw`'s roofline."""
    return StageResult(stage, tuple(place(op, hw) for op in stage.layer),
                       tuple(place(op, hw) for op in stage.once))


@dataclasses.dataclass(frozen=True)
class Workload:
    """What is run: batch, prompt and generation lengths, the decode step shown, attention kind."""

    batch: int = 1
    prompt_len: int = 1024
    gen_len: int = 256
    context: int | None = None  # the decode step reported in detail; default prompt_len
    flash_attention: bool = False

    @property
    def decode_context(self) -> int:
        """Tokens the reported decode step attends to, itself included."""
        return self.context or self.prompt_len


@dataclasses.dataclass(frozen=True)
class Memory:
    """Memory a generation needs, in bytes."""

    weights: float
    kv_cache: float
    activations: float
    expert_weights: float = 0.0  # of `weights`, the routed experts' (a token reads experts_per_token of them)

    @property
    def total(self) -> float:
        """Weights, full KV cache and peak activations together."""
        return self.weights + self.kv_cache + self.activations


@dataclasses.dataclass(frozen=True)
class Analysis:
    """The roofline analysis of one model, device, precision and workload."""

    arch: Architecture
    hardware: Hardware
    precision: Precision
    workload: Workload
    prefill: StageResult
    decode: StageResult
    decode_steps_time: float  # all gen_len - 1 decode steps of the generation
    memory: Memory

    @property
    def generation_time(self) -> float:
        """Seconds to read the prompt and generate gen_len tokens per sequence."""
        return self.prefill.time + self.decode_steps_time

    @property
    def mean_decode_time(self) -> float:
        """Mean seconds per decode step over the generation."""
        steps = self.workload.gen_len - 1
        return self.decode_steps_time / steps if steps else self.decode.time


def analyze(arch: Architecture, hw: Hardware, prec: Precision, work: Workload) -> Analysis:
    """Prefill, one decode step, the whole generation and memory of `work` on `hw`.

    The prefill yields the first token's logits, so gen_len tokens take gen_len - 1 decode
    steps, at contexts prompt_len + 1 ... prompt_len + gen_len - 1.
    """
    prefill_result, decode_result = step_results(arch, hw, prec, work)
    tile = _flash_tile(arch, hw, prec, work)  # the same tiles for every step
    steps = range(work.prompt_len + 1, work.prompt_len + work.gen_len)
    steps_time = sum(evaluate(decode(arch, prec, work.batch, c, tile), hw).time for c in steps)
    memory = Memory(
        weights=weight_bytes(arch, prec),
        expert_weights=expert_weight_bytes(arch, prec),
        kv_cache=kv_cache_bytes(arch, prec, work.batch, work.prompt_len + work.gen_len),
        activations=max(prefill_result.peak_activations(), decode_result.peak_activations()),
    )
    return Analysis(arch, hw, prec, work, prefill_result, decode_result, steps_time, memory)


def step_results(arch: Architecture, hw: Hardware, prec: Precision,
                 work: Workload) -> tuple[StageResult, StageResult]:
    """The prefill and the reported decode step of `work` on `hw` (no generation loop: cheap to sweep)."""
    tile = _flash_tile(arch, hw, prec, work)
    return (evaluate(prefill(arch, prec, work.batch, work.prompt_len, tile), hw),
            evaluate(decode(arch, prec, work.batch, work.decode_context, tile), hw))


def _flash_tile(arch: Architecture, hw: Hardware, prec: Precision, work: Workload) -> int | None:
    return flash_tile_rows(hw.onchip_memory, arch.config.head_dim, prec) if work.flash_attention else None


def weight_bytes(arch: Architecture, prec: Precision) -> float:
    """Bytes of all weights: linear layers and embeddings at wbits, norms and biases at abits."""
    c = arch.config
    h = c.hidden_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    mlp = (3 * h * (arch.expert_width * arch.num_experts + arch.shared_expert_intermediate_size)
           + (h * arch.num_experts if arch.is_moe else 0))
    linear = c.num_hidden_layers * (2 * h * q + 2 * h * kv + mlp)
    embeddings = c.vocab_size * h * (1 if c.tie_word_embeddings else 2)
    small = c.num_hidden_layers * (2 * h + (q + 2 * kv if c.attention_bias else 0)) + h
    return (linear + embeddings) * prec.wbytes + small * prec.abytes


def expert_weight_bytes(arch: Architecture, prec: Precision) -> float:
    """Bytes of the routed experts' projections (0 for a dense model)."""
    c = arch.config
    return 3 * c.hidden_size * arch.expert_width * arch.num_experts * c.num_hidden_layers * prec.wbytes \
        if arch.is_moe else 0.0


def kv_cache_bytes(arch: Architecture, prec: Precision, batch: int, tokens: int) -> float:
    """Bytes of K and V for `tokens` positions of `batch` sequences: every position, windowed layers' too (ember's
    cache keeps them; its kernels read only the window's)."""
    c = arch.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * prec.kvbytes * batch * tokens
