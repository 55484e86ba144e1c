"""LoRA serving throughput: batched decode with every stream on the base model, spread over adapters, or on one.

A random Llama checkpoint of `--shape` (bench_cpu's shapes; 1b: Llama-3.2-1B's) is compiled with `--quant` and
adapter slots (`--lora-rank`, 4 slots), and, unless `--no-baseline`, without them. Four random rank-`--rank` PEFT
adapters on every projection (q, k, v, o, gate, up, down) are written and loaded. Then `--streams` sequences,
each prefilled with a `--prompt`-token prompt, decode `--steps` steps per round (`Engine.decode`, as the serving
scheduler calls it), the sequences cut back to their prompts after each round, in these settings, round-robin
over `--repeats` rounds:

- base: every stream on the base model (each token's adapter scale 0: the adapter kernel copies its input);
- mixed: the streams spread evenly over the 4 adapters;
- one adapter: every stream on the same adapter;
- no slots: the artifact compiled without adapter slots (the cost of having them).

Per setting: the median over rounds of each round's median step time, the rounds' range, tokens/s, and each over
base's. The issue's bar: mixed >= 0.8x base.

    python scripts/bench_lora.py --model /tmp/llama1b --shape 1b --quant q4f32 --rank 16 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cpu  # noqa: E402
import peers  # noqa: E402
from bench_decode_batch import step_times  # noqa: E402

from ember.runtime import Engine, load_artifact  # noqa: E402

ADAPTERS = 4
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, config: dict, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter on every projection of a Llama checkpoint's `config` (its config.json)."""
    from safetensors.numpy import save_file

    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    sizes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
             "gate_proj": (hidden, ffn), "up_proj": (hidden, ffn), "down_proj": (ffn, hidden)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in sizes.items():
            part = "self_attn" if module in TARGETS[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) / np.sqrt(fan_in)).astype(
                np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((fan_out, rank)) * 0.01).astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}))
    return path


def compile_artifact(model: Path, out: Path, quant: str, rank: int | None) -> Path:
    """`model` compiled with `quant` (and adapter slots of `rank`, 4 of them), unless `out` holds it already."""
    if (out / "manifest.json").exists():
        return out
    from ember.driver.compiler import CompileOptions, compile_model
    from ember.ir_passes.add_lora_slots import LoraSlots

    lora = LoraSlots(rank, ADAPTERS) if rank else None
    compile_model(model, out, CompileOptions(quantization=quant, max_batch=8, lora=lora))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory (made if absent)")
    parser.add_argument("--shape", choices=bench_cpu.SHAPES, default="1b")
    parser.add_argument("--quant", default="q4f32")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ember-bench-lora"))
    parser.add_argument("--no-baseline", action="store_true", help="skip the artifact without adapter slots")
    args = parser.parse_args()
    if not (args.model / "config.json").exists():
        peers.make_random_llama(args.model, **bench_cpu.SHAPES[args.shape])
    config = json.loads((args.model / "config.json").read_text())
    tag = f"{args.model.name}-{args.quant}"
    with_slots = compile_artifact(args.model, args.work / f"{tag}-lora{args.rank}", args.quant, args.rank)
    engine = Engine(load_artifact(with_slots, threads=args.threads))
    names = [f"adapter{i}" for i in range(ADAPTERS)]
    for index, name in enumerate(names):
        engine.load_adapter(name, write_adapter(args.work / f"adapters-r{args.rank}" / name, config, args.rank,
                                                index))
    prompt = np.random.default_rng(0).integers(3, engine.vocab_size, args.prompt).tolist()
    settings = {"base": [None] * args.streams,
                "mixed": [names[i % ADAPTERS] for i in range(args.streams)],
                "one adapter": [names[0]] * args.streams}
    seqs = [engine.add_sequence() for _ in range(args.streams)]
    for seq in seqs:
        engine.prefill(seq, prompt)
    # One set of sequences for the settings on the slots' artifact, each setting naming their adapters before its
    # steps (a step's time does not depend on what the cached keys hold).
    runs = {setting: (engine, seqs) for setting in settings}
    if not args.no_baseline:
        plain = Engine(load_artifact(compile_artifact(args.model, args.work / tag, args.quant, None),
                                     threads=args.threads))
        plain_seqs = [plain.add_sequence() for _ in range(args.streams)]
        for seq in plain_seqs:
            plain.prefill(seq, prompt)
        runs["no slots"] = (plain, plain_seqs)
    for run_engine, run_seqs in runs.values():
        step_times(run_engine, run_seqs, args.prompt, 2)  # warm-up
    rounds: dict[str, list[float]] = {setting: [] for setting in runs}  # each round's median step
    for _ in range(args.repeats):
        for setting, (run_engine, seqs) in runs.items():
            for seq, adapter in zip(seqs, settings.get(setting, ())):
                run_engine.set_adapter(seq, adapter)
            rounds[setting].append(statistics.median(step_times(run_engine, seqs, args.prompt, args.steps)))
    median = {setting: statistics.median(times) for setting, times in rounds.items()}
    print(bench_cpu.host_line())
    print(f"read bandwidth after the runs: {bench_cpu.read_bandwidth() / 1e9:.1f} GB/s")
    print(f"{args.shape} shape, {args.quant}, adapters of rank {args.rank} on q/k/v/o/gate/up/down, {args.streams} "
          f"streams, {args.prompt}-token prompts; median of {args.repeats} x {args.steps} decode steps, round-robin")
    print(f"{'setting':<12} {'step ms':>8} {'rounds ms':>13} {'tok/s':>8} {'x base':>7}")
    for setting, seconds in median.items():
        spread = f"{min(rounds[setting]) * 1e3:.1f}-{max(rounds[setting]) * 1e3:.1f}"
        print(f"{setting:<12} {seconds * 1e3:>8.1f} {spread:>13} {args.streams / seconds:>8.1f} "
              f"{median['base'] / seconds:>7.2f}")


if __name__ == "__main__":
    main()
