"""Present an `Analysis`: a text table, JSON, and PNG plots (roofline and sweeps); and a
`Measurement` (`--measure`): its table of kernels, JSON, and the measured roofline plot.

Plots need matplotlib, an optional dependency (`pip install 'ember[plot]'`); the table
and JSON need nothing beyond the standard library.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.core.errors import EmberError
from ember.driver.analyze.operators import Precision
from ember.driver.analyze.roofline import Analysis, Point, StageResult, Workload, step_results

if TYPE_CHECKING:  # measure.py loads TVM and the compiler; the analysis alone needs neither
    from ember.driver.analyze.measure import KernelTiming, MeasuredStage, Measurement

_COLUMNS = ("operator", "dtype", "ops", "bytes", "op/B", "op/s", "bound", "time", "share")
_WIDTHS = (16, 6, 9, 9, 8, 9, 8, 10, 7)
# Bit widths compared in the sweep plots: 16-bit, weight+activation int8, and 4-bit
# weights with 16-bit and with 4-bit KV cache.
SWEEP_PRECISIONS = ((16, 16, 16), (8, 8, 8), (4, 16, 16), (4, 16, 4))


def format_text(analysis: Analysis) -> str:
    """The per-layer tables for prefill and one decode step, then totals and memory."""
    a, work, hw = analysis, analysis.workload, analysis.hardware
    c = a.arch.config
    matmul_dtype = hw.compute_dtype(a.precision.matmul_dtype(a.precision.wbits, a.precision.abits))
    attention = "FlashAttention" if work.flash_attention else "unfused attention"
    roofs = {matmul_dtype: "matmuls", "fp32": "matmuls and elementwise" if matmul_dtype == "fp32" else "elementwise"}
    lines = [
        f"{a.arch.name} on {hw.name}: {hw.description}",
        f"  batch {work.batch}, prompt {work.prompt_len} tokens, generate {work.gen_len}; "
        f"{a.precision.label()}; {attention}",
        "  roofline: " + ", ".join(
            f"{dtype} {what} {_si(hw.peak_flops[dtype], 'op/s', 4)} (ridge {hw.ridge_point(dtype):.1f} op/B)"
            for dtype, what in roofs.items()
        ) + f"; memory {_si(hw.memory_bandwidth, 'B/s', 4)}",
    ]
    if work.prompt_len + work.gen_len > c.context_window:
        lines.append(f"  note: {work.prompt_len + work.gen_len} tokens exceed the model's context window "
                     f"({c.context_window})")
    lines += ["", f"Prefill: batch {work.batch} x {work.prompt_len} tokens", *_stage_table(a.prefill)]
    lines += ["", f"Decode: one step, batch {work.batch}, attending to {work.decode_context} tokens",
              *_stage_table(a.decode)]
    steps = work.gen_len - 1
    tokens = work.batch * work.gen_len
    m = a.memory
    lines += [
        "",
        "Totals",
        f"  {'prefill (time to first token)':<36}{_time(a.prefill.time):>9}   "
        f"{_si(a.prefill.ops, 'op')}, {_si(a.prefill.bytes, 'B')}",
        f"  {f'one decode step, context {work.decode_context}':<36}{_time(a.decode.time):>9}   "
        f"{_si(a.decode.ops, 'op')}, {_si(a.decode.bytes, 'B')}; {_si(work.batch / a.decode.time)} tokens/s",
        f"  {f'generation (prefill + {steps} steps)':<36}{_time(a.generation_time):>9}   "
        f"mean step {_time(a.mean_decode_time)}; {_si(tokens / a.generation_time)} tokens/s overall",
        "",
        "Memory",
        f"  weights           {_si(m.weights, 'B')}" + (
            f"   (experts {_si(m.expert_weights, 'B')}, of which a token reads {a.arch.experts_per_token} of "
            f"{a.arch.num_experts}: {_si(m.expert_weights * a.arch.experts_per_token / a.arch.num_experts, 'B')})"
            if m.expert_weights else ""),
        f"  KV cache          {_si(m.kv_cache, 'B')}   "
        f"({work.prompt_len + work.gen_len} tokens x batch {work.batch})",
        f"  peak activations  {_si(m.activations, 'B')}",
        f"  total             {_si(m.total, 'B')} of {_si(hw.memory_capacity, 'B')} "
        f"({hw.memory_capacity / 2**30:.0f} GiB): {'fits' if m.total <= hw.memory_capacity else 'DOES NOT FIT'}",
    ]
    return "\n".join(lines)


def _stage_table(result: StageResult) -> list[str]:
    layers = result.stage.num_layers
    total = result.time
    rows = [_row(_COLUMNS), _row(tuple("-" * w for w in _WIDTHS))]
    rows += [_point_row(p, layers * p.time / total) for p in result.layer]
    layer_ops = sum(p.op.ops for p in result.layer)
    layer_bytes = sum(p.op.bytes for p in result.layer)
    layer_time = sum(p.time for p in result.layer)
    rows.append(_row((f"layer x{layers}", "", _si(layers * layer_ops), _si(layers * layer_bytes),
                      f"{layer_ops / layer_bytes:.1f}", "", "", _time(layers * layer_time),
                      _pct(layers * layer_time / total))))
    rows += [_point_row(p, p.time / total) for p in result.once]
    rows.append(_row(("total", "", _si(result.ops), _si(result.bytes), f"{result.ops / result.bytes:.1f}",
                      _si(result.ops / result.time), "", _time(total), "100%")))
    return rows


def _point_row(p: Point, share: float) -> str:
    return _row((p.op.name, p.dtype, _si(p.op.ops), _si(p.op.bytes), f"{p.intensity:.1f}",
                 _si(p.attainable), p.bound, _time(p.time), _pct(share)))


def _row(cells: tuple[str, ...]) -> str:
    first, *rest = cells
    return "  " + first.ljust(_WIDTHS[0]) + "".join(c.rjust(w) for c, w in zip(rest, _WIDTHS[1:]))


def _si(value: float, unit: str = "", digits: int = 3) -> str:
    """`value` with an SI prefix, e.g. 6.87e10 -> "68.7G"; with a unit, "68.7 Gop"."""
    sep = " " if unit else ""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.{digits}g}{sep}{prefix}{unit}"
    return f"{value:.{digits}g}{sep}{unit}"


def _time(seconds: float) -> str:
    for factor, unit in ((1, "s"), (1e-3, "ms"), (1e-6, "us")):
        if seconds >= factor:
            return f"{seconds / factor:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _pct(share: float) -> str:
    return f"{100 * share:.1f}%"


def to_json(analysis: Analysis) -> dict[str, Any]:
    """Everything in the text report, unrounded, in SI units (op, byte, second)."""
    a = analysis
    return {
        "model": {"name": a.arch.name, "config": a.arch.config.to_json(),
                  "num_experts": a.arch.num_experts, "experts_per_token": a.arch.experts_per_token,
                  "expert_intermediate_size": a.arch.expert_width if a.arch.is_moe else 0,
                  "shared_expert_intermediate_size": a.arch.shared_expert_intermediate_size},
        "hardware": a.hardware.to_json(),
        "precision": dataclasses.asdict(a.precision),
        "workload": {**dataclasses.asdict(a.workload), "context": a.workload.decode_context},
        "prefill": _stage_json(a.prefill),
        "decode": _stage_json(a.decode),
        "generation": {
            "prefill_s": a.prefill.time,
            "decode_steps": a.workload.gen_len - 1,
            "decode_steps_s": a.decode_steps_time,
            "mean_decode_step_s": a.mean_decode_time,
            "total_s": a.generation_time,
            "tokens_per_s": a.workload.batch * a.workload.gen_len / a.generation_time,
        },
        "memory": {
            "weights_bytes": a.memory.weights,
            "expert_weights_bytes": a.memory.expert_weights,
            "kv_cache_bytes": a.memory.kv_cache,
            "peak_activations_bytes": a.memory.activations,
            "total_bytes": a.memory.total,
            "capacity_bytes": a.hardware.memory_capacity,
            "fits": a.memory.total <= a.hardware.memory_capacity,
        },
    }


def _stage_json(result: StageResult) -> dict[str, Any]:
    s = result.stage
    return {
        "batch": s.batch, "new_tokens": s.new_tokens, "past_tokens": s.past_tokens, "num_layers": s.num_layers,
        "per_layer": [_point_json(p) for p in result.layer],
        "once": [_point_json(p) for p in result.once],
        "total": {"ops": result.ops, "bytes": result.bytes, "time_s": result.time},
    }


def _point_json(p: Point) -> dict[str, Any]:
    return {**dataclasses.asdict(p.op), "bytes": p.op.bytes, "compute_dtype": p.dtype,
            "intensity": p.intensity, "attainable_ops_per_s": p.attainable, "bound": p.bound, "time_s": p.time}


def write_plots(analysis: Analysis, directory: Path) -> list[Path]:
    """roofline.png (every operator, prefill and decode), batch_sweep.png, seqlen_sweep.png."""
    fig = _new_figure((14, 6.5))
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / "roofline.png", directory / "batch_sweep.png", directory / "seqlen_sweep.png"]

    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.09, top=0.9, wspace=0.18)
    for ax, result in zip(fig.subplots(1, 2), (analysis.prefill, analysis.decode)):
        _roofline_axes(ax, result, analysis)
    fig.savefig(paths[0], dpi=120)

    a, work = analysis, analysis.workload
    batches = [2**i for i in range(8)]
    lengths = [2**i for i in range(4, 16) if 2**i <= max(a.arch.config.context_window, work.prompt_len)]
    _sweep_figure(a, "batch size", batches,
                  lambda b: dataclasses.replace(work, batch=b)).savefig(paths[1], dpi=120)
    _sweep_figure(a, "prompt length = decode context (tokens)", lengths,
                  lambda s: dataclasses.replace(work, prompt_len=s, context=None)).savefig(paths[2], dpi=120)
    return paths


def _new_figure(figsize: tuple[float, float]) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise EmberError("--plot needs matplotlib: pip install 'ember[plot]' "
                         "(or pip install 'matplotlib>=3.8')") from None
    return Figure(figsize=figsize)


def _roofline_axes(ax: Any, result: StageResult, analysis: Analysis) -> None:
    hw = analysis.hardware
    points = [p for p in result.layer + result.once if p.op.ops > 0]
    lo = min(p.intensity for p in points) / 2
    hi = max(max(p.intensity for p in points), max(hw.ridge_point(p.dtype) for p in points)) * 4
    roofs: dict[float, list[str]] = {}  # data types sharing a peak share a line
    for dtype in sorted({p.dtype for p in points}):
        roofs.setdefault(hw.peak_flops[dtype], []).append(dtype)
    for peak, dtypes in roofs.items():
        ridge = peak / hw.memory_bandwidth
        ax.plot([lo, ridge, hi], [lo * hw.memory_bandwidth, peak, peak], label=f"{', '.join(dtypes)} roof")
    spots: dict[tuple[float, float], list[Point]] = {}  # operators at one spot share a marker
    for p in points:
        spots.setdefault((round(math.log10(p.intensity), 2), round(math.log10(p.attainable), 2)), []).append(p)
    colors = iter(_colors(len(spots)))
    for group in spots.values():
        ax.scatter(group[0].intensity, group[0].attainable, s=30, color=next(colors), zorder=3,
                   edgecolors="black", linewidths=0.5, label=", ".join(p.op.name for p in group))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (op/byte)")
    ax.set_ylabel("attainable performance (op/s)")
    s = result.stage
    what = (f"prefill of {s.new_tokens} tokens" if s.name == "prefill"
            else f"decode step at context {s.past_tokens + s.new_tokens}")
    ax.set_title(f"{analysis.arch.name} on {hw.name}: {what}\nbatch {s.batch}, {analysis.precision.label()}",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")  # points lie on the roof: the lower right is empty


def _colors(count: int) -> list[Any]:
    """`count` distinct colours (tab20, cycled)."""
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    return [cmap(i % 20) for i in range(count)]


def _sweep_figure(analysis: Analysis, xlabel: str, xs: list[int], workload: Callable[[int], Workload]) -> Any:
    from matplotlib.figure import Figure
    from matplotlib.ticker import ScalarFormatter

    fig = Figure(figsize=(12, 5))
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.11, top=0.91, wspace=0.22)
    prefill_ax, decode_ax = fig.subplots(1, 2)
    precisions = [Precision(*bits, analysis.precision.float16) for bits in SWEEP_PRECISIONS]
    for prec in precisions + ([analysis.precision] if analysis.precision not in precisions else []):
        times = [step_results(analysis.arch, analysis.hardware, prec, workload(x)) for x in xs]
        prefill_ax.plot(xs, [p.time for p, _ in times], marker="o", label=prec.label())
        decode_ax.plot(xs, [d.time for _, d in times], marker="o", label=prec.label())
    for ax, what in ((prefill_ax, "prefill time (s)"), (decode_ax, "decode step time (s)")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{analysis.arch.name} on {analysis.hardware.name}", fontsize=11)
    return fig


# --- measurements (--measure) --------------------------------------------------------


NARROW = 100  # columns the default measured report fits (`wide` shows every column)
_NARROW_COLUMNS = ("kernel", "implements", "calls", "time", "of roof", "bound", "predicted", "share")
_NARROW_NAMES = 24, 18  # characters of the kernel and implements columns


def format_measurement(m: Measurement, wide: bool = False) -> str:
    """The measured kernels of the prefill and the decode step, against the host roofline and the prediction;
    within `NARROW` columns unless `wide`."""
    hw, c = m.hardware, m.arch.config
    peaks = ", ".join(f"{dtype} {_si(peak, 'op/s', 4)}" for dtype, peak in hw.peak_flops.items())
    paragraphs = [
        f"{m.artifact} measured on {hw.name}: {hw.description}",
        f"  model: {c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} heads / "
        f"{c.num_key_value_heads} KV heads, ffn {c.intermediate_size}, vocab {c.vocab_size}; {m.precision.label()}",
        f"  roofline: {peaks}, memory {_si(hw.memory_bandwidth, 'B/s', 4)} "
        f"(ridge {hw.ridge_point('fp32'):.3g} op/B for fp32); {hw.source}",
        f"  each kernel timed on its own with cold caches ({m.cache_flush_bytes / 2**20:.0f} MiB copied before each "
        f"run), best of {m.repeats}; 'of roof' = roofline time / measured time; 'predicted' = analyze's "
        "operators on this roofline",
    ]
    lines = paragraphs if wide else [wrapped for text in paragraphs for wrapped in textwrap.wrap(
        text, NARROW, subsequent_indent="    ", break_on_hyphens=False)]
    for stage in (m.prefill, m.decode):
        what = (f"Prefill: 1 sequence x {stage.new_tokens} tokens" if stage.name == "prefill"
                else f"Decode: one step, batch {stage.batch}, attending to {stage.context} tokens")
        lines += ["", what, *_measured_table(stage, wide)]
    return "\n".join(lines)


def _measured_table(stage: MeasuredStage, wide: bool) -> list[str]:
    header = ("kernel", "implements", "calls", "ops", "bytes", "op/B", "time", "op/s", "roof op/s", "of roof",
              "bound", "predicted", "share")
    total = stage.kernel_seconds
    rows = []
    for k in stage.kernels:
        p = k.point
        arithmetic = p.op.ops > 0
        rows.append((_kernel_name(k), "+".join(k.implements) or "-", str(k.calls), _si(p.op.ops), _si(p.op.bytes),
                     f"{p.intensity:.2f}", _time(k.seconds), _si(k.achieved) if arithmetic else "-",
                     _si(p.attainable) if arithmetic else "-", _pct(k.fraction), p.bound,
                     _time(k.predicted) if k.predicted is not None else "-", _pct(k.calls * k.seconds / total)))
    if not wide:
        keep = [header.index(name) for name in _NARROW_COLUMNS]
        header = tuple(header[i] for i in keep)
        rows = [(_clip(r[0], _NARROW_NAMES[0]), _clip(r[1], _NARROW_NAMES[1]), *(r[i] for i in keep[2:])) for r in rows]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return "  " + "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    explained = total / stage.step_seconds
    return [line(header), "  " + "-" * (sum(widths) + 2 * (len(widths) - 1)), *map(line, rows), "",
            f"  kernels, every call summed  {_time(total):>9}   ({100 * explained:.0f}% of the step: warm caches "
            "there, plus VM overhead)",
            f"  step, timed end to end      {_time(stage.step_seconds):>9}",
            f"  predicted by analyze        {_time(stage.predicted.time):>9}   "
            f"(the measured step takes {stage.step_seconds / stage.predicted.time:.2g}x that)"]


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _kernel_name(k: KernelTiming) -> str:
    return k.name.removeprefix("vm.builtin.")


def measurement_json(m: Measurement) -> dict[str, Any]:
    """Everything in the measured report, unrounded, in SI units (op, byte, second)."""
    return {
        "artifact": str(m.artifact),
        "model": {"name": m.arch.name, "config": m.arch.config.to_json()},
        "hardware": m.hardware.to_json(),
        "precision": dataclasses.asdict(m.precision),
        "timing": {"repeats": m.repeats, "cache_flush_bytes": m.cache_flush_bytes, "statistic": "min"},
        "prefill": _measured_stage_json(m.prefill),
        "decode": _measured_stage_json(m.decode),
    }


def _measured_stage_json(stage: MeasuredStage) -> dict[str, Any]:
    return {
        "batch": stage.batch, "new_tokens": stage.new_tokens, "context": stage.context,
        "step_s": stage.step_seconds, "kernels_s": stage.kernel_seconds, "predicted_s": stage.predicted.time,
        "kernels": [{
            "name": k.name, "implements": list(k.implements), "calls": k.calls, "ops": k.point.op.ops,
            "bytes": k.point.op.bytes, "intensity": k.point.intensity, "time_s": k.seconds,
            "achieved_ops_per_s": k.achieved, "attainable_ops_per_s": k.point.attainable,
            "roofline_time_s": k.point.time, "fraction_of_roofline": k.fraction, "bound": k.point.bound,
            "predicted_time_s": k.predicted,
        } for k in stage.kernels],
        "predicted": _stage_json(stage.predicted),
    }


def write_measured_plot(m: Measurement, directory: Path) -> Path:
    """measured_roofline.png: predicted operators and measured kernels on the host roofline, prefill and decode."""
    fig = _new_figure((15, 10))
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "measured_roofline.png"
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.3, top=0.93, wspace=0.15)
    for ax, stage in zip(fig.subplots(1, 2), (m.prefill, m.decode)):
        _measured_axes(ax, stage, m)
    fig.savefig(path, dpi=100)
    return path


def _measured_axes(ax: Any, stage: MeasuredStage, m: Measurement) -> None:
    from matplotlib.lines import Line2D

    hw = m.hardware
    kernels = [k for k in stage.kernels if k.point.op.ops > 0]  # data movement has no place on an op/s axis
    predicted = [p for p in stage.predicted.layer + stage.predicted.once if p.op.ops > 0]
    intensities = [k.point.intensity for k in kernels] + [p.intensity for p in predicted]
    peak = hw.peak_flops["fp32"]
    lo, hi = min(intensities) / 2, max(max(intensities), peak / hw.memory_bandwidth) * 4
    ax.plot([lo, peak / hw.memory_bandwidth, hi], [lo * hw.memory_bandwidth, peak, peak], color="black",
            linewidth=1.2)
    colors = dict(zip(((k.name, k.implements) for k in kernels), _colors(len(kernels))))
    owner = {name: k for k in kernels for name in k.implements}
    for p in predicted:
        k = owner.get(p.op.name)
        color = colors[(k.name, k.implements)] if k else "grey"
        ax.scatter(p.intensity, p.attainable, s=60, facecolors="none", edgecolors=[color], linewidths=1.5, zorder=3)
        if k:
            ax.plot([p.intensity, k.point.intensity], [p.attainable, k.achieved], color=color, linestyle=":",
                    linewidth=1)
        else:
            ax.annotate(p.op.name, (p.intensity, p.attainable), fontsize=6, color="grey",
                        xytext=(4, -8), textcoords="offset points")
    handles = []
    for k in kernels:
        color = colors[(k.name, k.implements)]
        ax.scatter(k.point.intensity, k.achieved, s=40, marker="s", color=color, edgecolors="black",
                   linewidths=0.5, zorder=4)
        label = f"{_kernel_name(k)}" + (f" ({'+'.join(k.implements)})" if k.implements else "")
        handles.append(Line2D([], [], marker="s", linestyle="", color=color, markeredgecolor="black",
                              label=f"{label}: {_pct(k.fraction)}"))
    handles += [Line2D([], [], marker="o", linestyle="", markerfacecolor="none", markeredgecolor="grey",
                       label="predicted operator (analyze), dotted to its kernel"),
                Line2D([], [], color="black", label=f"host roofline ({_si(peak, 'op/s')}, "
                                                    f"{_si(hw.memory_bandwidth, 'B/s')})")]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (op/byte)")
    ax.set_ylabel("performance (op/s): attainable (predicted), achieved (measured)")
    what = (f"prefill of {stage.new_tokens} tokens" if stage.name == "prefill"
            else f"decode step, batch {stage.batch}, context {stage.context}")
    ax.set_title(f"{m.arch.name} on {hw.description}: {what}\nsquares: kernels as measured "
                 f"(legend: share of the roofline reached)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08))
