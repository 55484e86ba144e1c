"""`ember eval`: an artifact's perplexity on a text, and its distance from a reference artifact."""

from __future__ import annotations

import argparse
import json
import stat
from pathlib import Path
from typing import TextIO

from ember.cli.options import add_threads_argument, positive_int, whole_number
from ember.core.errors import EmberError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `ember eval` and its options."""
    parser = subparsers.add_parser(
        "eval", help="measure an artifact's quality on a text",
        description="Perplexity of an artifact on a text file, and optionally how far its next-token "
                    "distributions are from a reference artifact of the same model (mean KL, top-1 agreement).",
        epilog="example:\n  ember compile demo --quant q4f32 -o demo-q4 && ember compile demo -o demo-f32\n"
               "  ember eval demo-q4 --perplexity src/ember/demo_model/validation.txt --reference demo-f32",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--perplexity", required=True, type=Path, metavar="TEXTFILE", help="UTF-8 text to score")
    parser.add_argument("--reference", type=Path, metavar="ARTIFACT",
                        help="an artifact of the same model (e.g. q0f32) to compare logits with")
    parser.add_argument("--window", type=whole_number(2),
                        help="tokens per scoring window, <s> included (default: the artifact's context, at most 1024)")
    parser.add_argument("--max-tokens", type=positive_int, help="score only the first N tokens of the text")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_threads_argument(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Score the text (and compare with --reference); print the results."""
    results = _evaluate(args)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{args.artifact} ({results['quantization']}): perplexity {results['perplexity']:.3f} over "
          f"{results['tokens']} tokens ({results['windows']} windows of {results['window']})")
    if args.reference:
        ref = results["reference"]
        print(f"{args.reference} ({ref['quantization']}): perplexity {ref['perplexity']:.3f}")
        print(f"divergence from the reference: mean KL {ref['mean_kl']:.5f} nats/token (max {ref['max_kl']:.4f}), "
              f"top-1 agreement {ref['top1_agreement']:.2%}")
    return 0


def _evaluate(args: argparse.Namespace) -> dict:
    """The results `run` prints, as JSON values."""
    import itertools
    from dataclasses import asdict

    from tqdm import tqdm

    from ember.runtime import Engine, load_artifact
    from ember.runtime.evaluate import compare, iter_scoring_windows, perplexity, stream_token_ids

    text = _open_text(args.perplexity)
    artifact = load_artifact(args.artifact, threads=args.threads)
    if artifact.tokenizer is None:
        raise EmberError(f"{args.artifact}: the artifact has no tokenizer, so it cannot score text")
    engine = Engine(artifact)
    max_context = artifact.manifest.kv_cache["max_context"]
    window = args.window or min(max_context, 1024)
    if window > max_context:
        raise EmberError(f"--window {window}: {args.artifact} holds at most {max_context} tokens per sequence")
    # Read, tokenized and cut into windows as scoring goes: a long text never sits in memory whole.
    windows = iter_scoring_windows(stream_token_ids(artifact.tokenizer, text, args.max_tokens),
                                   artifact.tokenizer.bos_token_id, window)
    first = next(windows, None)
    if first is None:
        raise EmberError(f"--perplexity {args.perplexity}: the text has too few tokens to score (at least 2)")
    windows = itertools.chain([first], windows)

    def progress(desc: str):
        return tqdm(windows, desc=desc, unit="window", disable=args.no_progress)

    results = {"artifact": str(args.artifact), "quantization": artifact.manifest.quantization, "window": window}
    if args.reference:
        reference = load_artifact(args.reference, threads=args.threads)
        if reference.manifest.model != artifact.manifest.model:
            raise EmberError(f"--reference {args.reference} was compiled from a different model than {args.artifact}")
        comparison = compare(engine, Engine(reference), progress("Comparing"))
        results.update(asdict(comparison.candidate))
        results["reference"] = {"artifact": str(args.reference), "quantization": reference.manifest.quantization,
                                "perplexity": comparison.reference.perplexity, **asdict(comparison.divergence)}
    else:
        results.update(asdict(perplexity(engine, progress("Perplexity"))))
    return results


def _open_text(path: Path) -> TextIO:
    """`path` opened as UTF-8 text for --perplexity, refusing what is not a regular file
    (/dev/zero, a FIFO: endless or unbounded input)."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise EmberError(f"--perplexity {path}: not a regular file")
        return path.open(encoding="utf-8")
    except OSError as err:
        raise EmberError(f"--perplexity {path}: cannot read it ({err.strerror or err})") from None
