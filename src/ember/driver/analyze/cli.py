"""`ember analyze`: the roofline of a model on a device, per layer, for prefill and decode;
with --measure, a compiled artifact's kernels timed on this machine against its roofline."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from ember.core.errors import EmberError
from ember.driver.analyze.operators import FormatPrecision, Precision, load_architecture, model_presets
from ember.driver.analyze.report import (
    format_measurement,
    format_text,
    measurement_json,
    to_json,
    write_measured_plot,
    write_plots,
)
from ember.driver.analyze.roofline import Workload, analyze
from ember.ir.quant_formats import FORMATS
from ember.targets.hardware import hardware_presets, load_hardware

DESCRIPTION = """\
Estimate, without compiling anything, how fast MODEL can run on a device and why.

Every operator of a decoder layer (q/k/v/o projections, RoPE, the qk and sv matmuls,
softmax, norms, residual adds, MLP projections) and the lm_head is placed on the
device's roofline: arithmetic intensity = operations / bytes moved, attainable
performance = min(peak compute, intensity x memory bandwidth), one multiply-accumulate
= 2 operations. An operator below the ridge point (peak / bandwidth) is memory-bound:
making it faster means moving fewer bytes (smaller bit widths, bigger batches), not
more FLOP/s. Prefill is mostly compute-bound, decode mostly memory-bound.

The tables show, for the prefill and for one decode step: operations, bytes moved,
intensity, attainable op/s, the bound, time and share of the step. Then totals (time
to first token, per-token decode, the whole generation) and memory (weights, KV cache,
peak activations). Times are ideal: each kernel at its roofline, one after another.

With --measure, MODEL is an artifact directory from `ember compile`: its prefill and
one decode step run on this machine, every kernel is timed, and the table shows each
kernel's operations, bytes, measured time and the share of its roofline it reaches on
the measured `host` roofline, next to analyze's prediction for the same model. The int8
matmuls of a quantized artifact (int8 activations) are placed on an int8 roof, measured
with ember's own int8 matmul; every other kernel on the fp32 roof."""

DEFAULT_PROMPT_LEN = 1024
DEFAULT_GEN_LEN = 256
# Options that describe a hypothetical deployment: an artifact fixes them itself.
_NOT_MEASURED = ("quant", "wbits", "abits", "kvbits", "gen_len", "context", "flash_attention")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `ember analyze`'s options on `parser`."""
    parser.description = DESCRIPTION
    # --hardware is required without --measure and refused with it: say so in the usage line.
    parser.usage = ("%(prog)s MODEL --hardware NAME [--batch B] [--prompt-len S] [--gen-len G] [--context C]\n"
                    "       [--quant FORMAT | --wbits BITS --abits BITS --kvbits BITS] [--flash-attention] [--json]\n"
                    "       [--plot DIR]\n"
                    "       %(prog)s ARTIFACT --measure [--batch B] [--prompt-len S] [--json] [--wide] [--plot DIR]")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _epilog()
    parser.add_argument("model", metavar="MODEL",
                        help="an HF checkpoint directory, a config.json, a GGUF file, or a preset name (see below); "
                             "with --measure, an artifact directory")
    parser.add_argument("--hardware", metavar="NAME",
                        help="a device preset (a unique part of its name is enough, e.g. a6000), "
                             "'host' to measure this machine (cached), or a JSON file shaped like a preset; "
                             "required unless --measure, which always uses 'host'")
    parser.add_argument("--batch", type=_positive_int, default=1, metavar="B",
                        help="sequences processed together (default: 1); with --measure, the decode batch")
    parser.add_argument("--prompt-len", type=_positive_int, metavar="S",
                        help="prompt tokens per sequence (default: 1024, or less to fit the model's context window; "
                             "128 with --measure)")
    parser.add_argument("--gen-len", type=_positive_int, metavar="G",
                        help="tokens generated per sequence (default: 256, or less to fit the model's context window)")
    parser.add_argument("--context", type=_positive_int, metavar="C",
                        help="the decode step shown in detail attends to C tokens (default: the prompt length)")
    parser.add_argument("--quant", choices=tuple(FORMATS), metavar="FORMAT",
                        help="an ember --quant format instead of --wbits/--abits/--kvbits: weights at its stored "
                             "bits per weight (scales included), float activations and KV cache, int8 projections "
                             "for q8f32/q4f32 (" + ", ".join(FORMATS) + ")")
    parser.add_argument("--wbits", type=float, choices=(2, 3, 4, 8, 16, 32),
                        help="weight bits of the linear layers and embeddings (default: 16)")
    parser.add_argument("--abits", type=float, choices=(4, 8, 16, 32),
                        help="activation bits; with --wbits <= 8 and --abits 8, matmuls run in int8 (default: 16)")
    parser.add_argument("--kvbits", type=float, choices=(2, 3, 4, 8, 16, 32),
                        help="KV-cache bits (default: --abits)")
    parser.add_argument("--flash-attention", action="store_true",
                        help="fuse qk, softmax and sv into one kernel (FlashAttention / flash-decoding)")
    parser.add_argument("--measure", action="store_true",
                        help="MODEL is a compiled artifact: time each of its kernels on this machine and place "
                             "them on the host roofline next to the predicted operators")
    parser.add_argument("--json", action="store_true", help="print the full analysis as JSON instead of tables")
    parser.add_argument("--wide", action="store_true",
                        help="with --measure: every column (ops, bytes, op/B, op/s, roof op/s) and full kernel names; "
                             "by default the table fits 100 columns")
    parser.add_argument("--plot", type=Path, metavar="DIR",
                        help="also write roofline.png, batch_sweep.png and seqlen_sweep.png to DIR, or with "
                             "--measure measured_roofline.png (needs matplotlib: pip install 'ember[plot]')")


def run(args: argparse.Namespace) -> int:
    """Analyze (or measure), print the report (or JSON), write plots if asked."""
    if args.measure:
        return _run_measure(args)
    if args.hardware is None:
        raise EmberError("--hardware is required: a device preset, 'host', or a JSON file (see --help)")
    arch = load_architecture(args.model)
    hardware = load_hardware(args.hardware)
    float16 = "bf16" if arch.config.weight_dtype == "bfloat16" else "fp16"
    abits = 16 if args.abits is None else args.abits
    precision = Precision(16 if args.wbits is None else args.wbits, abits, args.kvbits or abits, float16)
    if args.quant:
        if (args.wbits, args.abits, args.kvbits) != (None, None, None):
            raise EmberError("--quant sets the weight, activation and KV-cache bits: give it without "
                             "--wbits/--abits/--kvbits")
        precision = FormatPrecision.of(args.quant)
    window = arch.config.context_window
    prompt_len, gen_len = _lengths(args, window)
    workload = Workload(args.batch, prompt_len, gen_len, args.context, args.flash_attention)
    if workload.prompt_len + workload.gen_len > window or (args.context or 0) > window:
        raise EmberError(f"--prompt-len {workload.prompt_len} + --gen-len {workload.gen_len}"
                         f"{f' (or --context {args.context})' if args.context else ''} exceeds {args.model}'s "
                         f"context window of {window} tokens")
    analysis = analyze(arch, hardware, precision, workload)
    print(json.dumps(to_json(analysis), indent=2) if args.json else format_text(analysis))
    if args.plot:
        paths = write_plots(analysis, args.plot)
        print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return 0


def _lengths(args: argparse.Namespace, window: int) -> tuple[int, int]:
    """--prompt-len and --gen-len, a default left out shortened to fit the model's context `window` (and a
    note on stderr saying so); lengths the user gave are kept, for `run` to refuse if too long."""
    prompt_len, gen_len = args.prompt_len, args.gen_len
    if prompt_len is None and gen_len is None:
        gen_len = min(DEFAULT_GEN_LEN, max(window // 4, 1))
        prompt_len = min(DEFAULT_PROMPT_LEN, max(window - gen_len, 1))
    elif prompt_len is None:
        prompt_len = min(DEFAULT_PROMPT_LEN, window - gen_len) if gen_len < window else DEFAULT_PROMPT_LEN
    elif gen_len is None:
        gen_len = min(DEFAULT_GEN_LEN, window - prompt_len) if prompt_len < window else DEFAULT_GEN_LEN
    shortened = [f"--{name} {value} (default {default})" for name, value, default, given in
                 (("prompt-len", prompt_len, DEFAULT_PROMPT_LEN, args.prompt_len),
                  ("gen-len", gen_len, DEFAULT_GEN_LEN, args.gen_len)) if given is None and value != default]
    if shortened:
        print(f"ember: {' and '.join(shortened)} to fit {args.model}'s context window of {window} tokens",
              file=sys.stderr)
    return prompt_len, gen_len


def _run_measure(args: argparse.Namespace) -> int:
    from ember.driver.analyze.measure import measure  # loads TVM and the compiler: only for --measure

    given = [f"--{name.replace('_', '-')}" for name in _NOT_MEASURED if getattr(args, name) not in (None, False)]
    if given:
        raise EmberError(f"{', '.join(given)} do not apply to --measure: the artifact fixes its precision "
                         "and attention, and one prefill and one decode step are measured")
    if args.hardware not in (None, "host"):
        raise EmberError(f"--hardware {args.hardware}: --measure runs on this machine, whose roofline is 'host'")
    prompt_len = args.prompt_len or 128
    def announce() -> None:
        print(f"timing every kernel of {args.model}: a prefill of {prompt_len} tokens and a decode step of "
              f"batch {args.batch} ...", file=sys.stderr)

    measurement = measure(Path(args.model), prompt_len, args.batch, on_start=announce)
    print(json.dumps(measurement_json(measurement), indent=2) if args.json
          else format_measurement(measurement, wide=args.wide))
    if args.plot:
        print(f"wrote {write_measured_plot(measurement, args.plot)}", file=sys.stderr)
    return 0


def _epilog() -> str:
    def wrap(names: list[str]) -> str:
        return textwrap.fill(", ".join(names), 88, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False)

    return f"""\
examples:
  ember analyze Llama-2-7b --hardware nvidia-rtx-a6000 --prompt-len 2048
      per-layer prefill and decode tables of Llama-2-7b in fp16 on an RTX A6000
  ember analyze Llama-3.1-8B --hardware rtx-4090 --wbits 4 --kvbits 8 --flash-attention
      4-bit weights, 8-bit KV cache, fused attention: what decode speed to expect
  ember analyze ./my-checkpoint --hardware host --batch 8 --json > analysis.json
      an HF checkpoint directory on this machine (measured once, cached in ~/.cache/ember/)
  ember analyze Qwen2.5-7B --hardware apple-m2-max --plot plots/
      roofline plot, and time vs batch size and vs sequence length for several bit widths
  ember compile demo -o demo-cpu && ember analyze demo-cpu --measure --plot plots/
      every kernel of a compiled artifact timed here, against this machine's roofline

model presets:
{wrap(model_presets())}
hardware presets:
{wrap(hardware_presets())}
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value
