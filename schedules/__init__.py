"""Schedules: every PrimFunc leaves compilation scheduled for its target.

The rules are tried in order on each PrimFunc; the first that matches schedules it.
After them, `check_all_scheduled` fails compilation if any kernel fell through,
except TVM's hand-written paged-KV-cache kernels, which arrive already written as
loops and are tagged by the frontend (`ember.kernel_source`).
"""

from __future__ import annotations

import tvm
from tvm.s_tir import dlight

from ember.schedules.check import check_all_scheduled
from ember.schedules.elementwise import Elementwise
from ember.schedules.matmul import NTMatmul
from ember.schedules.reduction import RowReduction
from ember.targets.registry import TargetSpec


def schedule_passes(target: TargetSpec) -> list[tvm.transform.Pass]:
    """The scheduling phase of the pipeline for `target`."""
    bits = target.vector_bits
    rules = [NTMatmul(bits), RowReduction(bits), Elementwise(bits)]
    return [dlight.ApplyDefaultSchedule(*rules), check_all_scheduled]
