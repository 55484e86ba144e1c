"""Quality and size of every `--quant` format on one model, in one table.

Compiles the model in each format, then scores a text with each artifact:
perplexity (as `ember eval --perplexity`), mean KL divergence and top-1 agreement
against the float32 artifact, weight bytes, stored bits per weight and the
artifact size without tokenizer files.

    python scripts/quant_quality.py                      # the bundled demo model, validation.txt
    python scripts/quant_quality.py --model DIR --text FILE --window 256
    python scripts/quant_quality.py --float-activations   # the weights' error alone

On CPUs with an int8 dot product, q8f32/q4f32 projections round their activations to
int8 (`schedules/int8_matmul.py`); `--float-activations` compiles without that, so the
two tables side by side show what the activation rounding costs.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from ember import DEMO_MODEL_DIR
from ember.core.manifest import LIBRARY_NAME, MANIFEST_NAME, PARAMS_DIR
from ember.driver.compiler import CompileOptions, compile_model
from ember.ir.quant_formats import FORMATS
from ember.runtime import Engine, load_artifact
from ember.runtime.evaluate import compare, scoring_windows


def artifact_bytes(artifact: Path) -> tuple[int, int]:
    """(weight bytes, library + weights + manifest bytes) of an artifact."""
    weights = sum(p.stat().st_size for p in (artifact / PARAMS_DIR).iterdir())
    return weights, weights + (artifact / LIBRARY_NAME).stat().st_size + (artifact / MANIFEST_NAME).stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--text", type=Path, default=DEMO_MODEL_DIR / "validation.txt")
    parser.add_argument("--window", type=int, default=256, help="tokens per scoring window (the demo trained on 256)")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--float-activations", action="store_true",
                        help="compile as `ember compile --float-activations`: activations stay float")
    args = parser.parse_args()

    formats = args.formats.split(",")
    with tempfile.TemporaryDirectory(prefix="ember-quant-") as tmp:
        engines, sizes = {}, {}
        for name in ["q0f32"] + [f for f in formats if f != "q0f32"]:
            artifact = Path(tmp) / name
            compile_model(args.model, artifact, CompileOptions(quantization=name, max_batch=1, show_progress=False,
                                                                float_activations=args.float_activations))
            engines[name], sizes[name] = Engine(load_artifact(artifact)), artifact_bytes(artifact)
        tokenizer = engines["q0f32"].artifact.tokenizer
        ids = tokenizer.encode(args.text.read_text(encoding="utf-8"), add_special_tokens=False)
        windows = scoring_windows(ids, tokenizer.bos_token_id, args.window)
        print(f"\n{args.model.name}: {len(ids)} tokens of {args.text.name}, windows of {args.window}\n")
        print(f"{'format':<10} {'activations':>11} {'bits/weight':>11} {'perplexity':>11} {'vs q0f32':>9} "
              f"{'mean KL':>9} {'top-1 agree':>11} {'weights MiB':>11} {'artifact MiB':>12} {'vs q0f32':>9}")
        for name in formats:
            comparison = compare(engines[name], engines["q0f32"], windows)
            ppl, baseline, div = comparison.candidate.perplexity, comparison.reference.perplexity, comparison.divergence
            weights, total = sizes[name]
            activations = engines[name].artifact.manifest.activations
            print(f"{name:<10} {activations:>11} {FORMATS[name].bits_per_weight:>11g} {ppl:>11.3f} "
                  f"{ppl / baseline - 1:>+8.2%} {div.mean_kl:>9.5f} {div.top1_agreement:>10.2%} "
                  f"{weights / 2**20:>11.2f} {total / 2**20:>12.2f} {total / sizes['q0f32'][1]:>8.3f}x")


if __name__ == "__main__":
    main()
