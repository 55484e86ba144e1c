"""Roofline analysis of a decoder LLM on a device, from its config alone (`ember analyze`).

operators.py  what each operator computes and moves (the formulas), and model loading
roofline.py   placing operators on a device's roofline; stage, generation and memory totals
report.py     text tables, JSON and plots
measure.py    `--measure`: a compiled artifact's kernels timed on this machine (loads TVM;
              imported only for it)
cli.py        the `ember analyze` command
Device descriptions live in `ember.targets.hardware`.
"""

from ember.driver.analyze.operators import Architecture, Precision, load_architecture
from ember.driver.analyze.roofline import Analysis, Workload, analyze

__all__ = ["Analysis", "Architecture", "Precision", "Workload", "analyze", "load_architecture"]
