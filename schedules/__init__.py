"""Schedules: every PrimFunc leaves compilation scheduled for its target."""

from __future__ import annotations

import tvm
from tvm.s_tir import dlight

from ember.targets import TargetSpec


def schedule_passes(target: TargetSpec) -> list[tvm.transform.Pass]:
    """The scheduling phase of the pipeline for `target`."""
    return [dlight.ApplyDefaultSchedule(dlight.cpu.GEMV(), dlight.cpu.Reduction())]
