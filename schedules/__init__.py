"""Schedules: every PrimFunc leaves compilation scheduled for its target.

The rules are tried in order on each PrimFunc; the first that matches schedules it,
and on CPUs the last (`fallback.py`) keeps any other kernel's loops as written, so
every kernel a graph can leave compiles. After them, `check_all_scheduled` fails
compilation if any kernel fell through all the same, except TVM's hand-written
paged-KV-cache kernels, which arrive already written as loops and are tagged by the
frontend (`ember.kernel_source`).

On CPUs, a tuning database (`ember tune`) may schedule matmul kernels first
(`tuning.py`); the rules schedule the rest.

CPUs get ember's own rules; GPUs get TVM's dlight GPU rules, which bind every
kernel to thread blocks (a GPU kernel cannot run unscheduled at all).
"""

from __future__ import annotations

import tvm
from tvm.s_tir import dlight

from ember.schedules.check import check_all_scheduled
from ember.schedules.elementwise import Elementwise
from ember.schedules.fallback import SerialFallback
from ember.schedules.matmul import NTMatmul
from ember.schedules.reduction import RowReduction
from ember.schedules.tuning import apply_tuning_database
from ember.schedules.tuning_db import TuningDatabase
from ember.targets.registry import TargetSpec


def schedule_passes(target: TargetSpec, tuning: TuningDatabase | None = None) -> list[tvm.transform.Pass]:
    """The scheduling phase of the pipeline for `target`, tuned records first if a database is given."""
    tuned = [apply_tuning_database(tuning, target)] if tuning is not None and not target.is_gpu else []
    rules = dlight.ApplyDefaultSchedule(*(gpu_rules() if target.is_gpu else cpu_rules(target)))
    return tuned + [rules, check_all_scheduled]


def cpu_rules(target: TargetSpec) -> list[dlight.ScheduleRule]:
    """ember's rules for llvm targets, sized by the SIMD width; the serial fallback last."""
    bits = target.vector_bits
    return [NTMatmul(bits), RowReduction(bits), Elementwise(bits), SerialFallback()]


def gpu_rules() -> list[dlight.ScheduleRule]:
    """TVM's dlight GPU rules, most specific first (as in TVM's CUDA pipeline and MLC-LLM)."""
    gpu = dlight.gpu
    return [_Declining(rule) for rule in (
        gpu.Matmul(),  # prefill GEMMs: shared-memory tiles, tensor cores for float16
        gpu.GEMV(),  # batch-1 decode projections: one row per warp, vectorized loads
        gpu.LowBatchGEMV(),  # decode with a few sequences: the batch rows share each weight load
        gpu.RMSNorm(),
        gpu.Reduction(),  # softmax-like row reductions
        gpu.GeneralReduction(),
    )] + [gpu.Fallback()]  # elementwise and everything else: flattened onto thread blocks


class _Declining(dlight.ScheduleRule):
    """A dlight rule that declines (None) a kernel it raises on, instead of ending the compile: TVM's RMSNorm rule
    unpacks a fixed number of blocks, and Gemma's `(1 + w)` norm has one more. The next rule takes the kernel."""

    def __init__(self, rule: dlight.ScheduleRule) -> None:
        self.rule = rule

    def apply(self, func, target, tunable):
        try:
            return self.rule.apply(func, target, tunable)
        except Exception:  # any error of a rule that did not expect this kernel: not this rule's kernel
            return None
