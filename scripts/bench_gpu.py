"""ember on an NVIDIA GPU next to PyTorch eager, same weights, one run.

Builds (or reuses) a random 1B-class Llama checkpoint (hidden 2048, 16 layers,
32 query / 8 KV heads, ffn 8192, vocab 128256: Llama 3.2 1B's shape with an
untied head), compiles it with ember for each `--quant` format (a format this
ember does not have yet is skipped with a note), then measures each runtime in its
own fresh process, one after another:

- batch 1: prefill tok/s over the prompt (one prefill call), decode tok/s over the
  new tokens, and decode as a share of the memory-bandwidth roofline (bytes read
  per token: every weight but the embedding table, plus the KV cache), against
  the datasheet bandwidth of the hardware preset and against a device-to-device
  copy measured on this GPU;
- batch 8: decode throughput (8 sequences, one decode call per step).

PyTorch eager runs the same checkpoint in float16 (transformers, SDPA attention).
Greedy tokens of ember are compared with PyTorch's (float16 kernels differ, so
the report says how many leading tokens agree).

The compile step needs no GPU (`--compile-only --target cuda:sm_90a`); the rest does:

    python scripts/bench_gpu.py --model /tmp/llama1b --prompt-len 512 --new-tokens 256 --batch 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402
from gpu_check_device import timed_decode  # noqa: E402

SHAPE = dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256)
TORCH_ROW = "pytorch-eager fp16"


def compile_artifacts(model: Path, target: str, quants: list[str], prompt_len: int, batch: int) -> dict[str, dict]:
    """Compile `model` once per format; {quant: {"artifact", "seconds", "library_mb"}} for those that exist."""
    from ember.core.errors import EmberError
    from ember.driver.compiler import CompileOptions, compile_model

    built = {}
    for quant in quants:
        artifact = model.with_name(f"{model.name}-ember-{quant}-{target.replace(':', '-')}")
        options = CompileOptions(target=target, quantization=quant, prefill_chunk=prompt_len, max_batch=batch,
                                 show_progress=False)
        start = time.perf_counter()
        try:
            compile_model(model, artifact, options)
        except EmberError as err:
            if "--quant" not in str(err):
                raise
            print(f"skipping {quant}: {err}")
            continue
        seconds = time.perf_counter() - start
        built[quant] = {"artifact": str(artifact), "seconds": seconds,
                        "library_mb": (artifact / "model.so").stat().st_size / 2**20}
        print(f"compiled {quant} for {target} in {seconds:.1f} s (model.so {built[quant]['library_mb']:.1f} MiB)")
    return built


def bytes_per_decode_token(artifact: Path, context: float) -> float:
    """Bytes one batch-1 decode step reads: every weight but the embedding table (one row of it is
    gathered), plus the KV cache at `context` tokens."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    index = json.loads((artifact / "params" / "tensor-cache.json").read_text())
    weights = sum(r["nbytes"] for shard in index["records"] for r in shard["records"]
                  if "embed_tokens" not in r["name"])
    return weights + manifest["memory"]["kv_bytes_per_token"] * context


def run_worker(kind: str, request: dict) -> dict:
    """Run `kind`'s measurement in a fresh interpreter (its own CUDA context and memory)."""
    with tempfile.TemporaryDirectory(prefix="ember-bench-gpu-") as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run([sys.executable, __file__, "--worker", kind, json.dumps(request), str(out)], check=True)
        return json.loads(out.read_text())


def _ember_worker(request: dict) -> dict:
    from ember.runtime import Engine, load_artifact

    engine = Engine(load_artifact(Path(request["artifact"])))
    prompts, new_tokens, repeats = request["prompts"], request["new_tokens"], request["repeats"]

    def single(prompt: list[int], steps: int) -> tuple[list[int], float, float]:
        seq = engine.add_sequence()
        start = time.perf_counter()
        token = int(np.argmax(engine.prefill(seq, prompt)))
        prefill_s = time.perf_counter() - start
        tokens, start = [token], time.perf_counter()
        for _ in range(steps):
            token = int(np.argmax(engine.decode([seq], [token])[0]))
            tokens.append(token)
        decode_s = time.perf_counter() - start
        engine.remove_sequence(seq)
        return tokens, prefill_s, decode_s

    def batched(steps: int) -> float:
        return timed_decode(engine, prompts, steps)

    single(prompts[0], 4)  # warm-up; captures decode's CUDA graphs for batch 1
    batched(2)  # and for the full batch
    runs = [single(prompts[0], new_tokens) for _ in range(repeats)]
    batch_s = statistics.median(batched(new_tokens) for _ in range(repeats))
    return {"token_ids": runs[0][0], "prefill_tokens_per_s": len(prompts[0]) / statistics.median(r[1] for r in runs),
            "decode_tokens_per_s": new_tokens / statistics.median(r[2] for r in runs),
            "batch_decode_tokens_per_s": len(prompts) * new_tokens / batch_s}


def _torch_worker(request: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda")
    model = AutoModelForCausalLM.from_pretrained(request["model"], dtype=torch.float16).to(device).eval()
    prompts, new_tokens, repeats = request["prompts"], request["new_tokens"], request["repeats"]

    @torch.inference_mode()
    def generate(batch: list[list[int]], steps: int) -> tuple[list[list[int]], float, float]:
        ids = torch.tensor(batch, device=device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens = [token[:, 0].tolist()]  # the copy to the host waits for the GPU
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token[:, 0].tolist())
        decode_s = time.perf_counter() - start
        return [list(row) for row in zip(*tokens)], prefill_s, decode_s

    generate(prompts[:1], 4)
    generate(prompts, 2)
    runs = [generate(prompts[:1], new_tokens) for _ in range(repeats)]
    batch_s = statistics.median(generate(prompts, new_tokens)[2] for _ in range(repeats))
    return {"token_ids": runs[0][0][0], "prefill_tokens_per_s": len(prompts[0]) / statistics.median(r[1] for r in runs),
            "decode_tokens_per_s": new_tokens / statistics.median(r[2] for r in runs),
            "batch_decode_tokens_per_s": len(prompts) * new_tokens / batch_s,
            "copy_bandwidth": _copy_bandwidth(torch), "device_name": torch.cuda.get_device_name()}


def _copy_bandwidth(torch, nbytes: int = 2**31, repeats: int = 10) -> float:
    """Device-to-device copy rate in bytes/s, counting the read and the write."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * nbytes * repeats / (time.perf_counter() - start)


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker = {"ember": _ember_worker, "torch": _torch_worker}[sys.argv[2]]
        Path(sys.argv[4]).write_text(json.dumps(worker(json.loads(sys.argv[3]))))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("/tmp/llama1b"),
                        help="checkpoint dir; created with random weights of the 1B shape if missing")
    parser.add_argument("--target", default="cuda", help="ember --target (default: this machine's GPU)")
    parser.add_argument("--quant", nargs="+", default=["q0f16", "q4f16"])
    parser.add_argument("--hardware", help="hardware preset for the datasheet roofline (default: the target's)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile-only", action="store_true", help="compile the artifacts and stop (no GPU needed)")
    parser.add_argument("--json", type=Path, help="also write every measurement to this file")
    args = parser.parse_args()

    if not (args.model / "config.json").exists():
        print(f"writing a random {SHAPE} Llama to {args.model} ...")
        peers.make_random_llama(args.model, **SHAPE)
    built = compile_artifacts(args.model, args.target, args.quant, args.prompt_len, args.batch)
    if args.compile_only or not built:
        return

    from ember.targets.hardware import hardware_presets, load_hardware

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, SHAPE["vocab"], args.prompt_len).tolist() for _ in range(args.batch)]
    request = {"prompts": prompts, "new_tokens": args.new_tokens, "repeats": args.repeats}
    rows = {f"ember {quant}": run_worker("ember", {**request, "artifact": info["artifact"]})
            for quant, info in built.items()}
    rows[TORCH_ROW] = torch = run_worker("torch", {**request, "model": str(args.model)})

    first = next(iter(built.values()))["artifact"]
    # A detected GPU is recorded by its device name, not a preset: then --hardware names the datasheet.
    preset = args.hardware or json.loads((Path(first) / "manifest.json").read_text())["target"]["hardware"]
    known = args.hardware or preset in hardware_presets()
    bandwidth = load_hardware(preset).memory_bandwidth if known else float("nan")
    print(f"\n{torch['device_name']}; datasheet bandwidth {bandwidth / 1e9:.0f} GB/s ({preset}; --hardware to choose), "
          f"measured copy {torch['copy_bandwidth'] / 1e9:.0f} GB/s; prompt {args.prompt_len} + {args.new_tokens} new "
          f"tokens, median of {args.repeats}")
    for quant, info in built.items():
        print(f"ember {quant}: compiled in {info['seconds']:.1f} s, model.so {info['library_mb']:.1f} MiB")
    print(f"\n{'runtime':<20} {'prefill tok/s':>14} {'decode tok/s':>13} {'% roofline':>11} {'% copy bw':>10} "
          f"{f'batch-{args.batch} tok/s':>14} {'decode vs torch':>16} {'tokens = torch':>15}")
    context = args.prompt_len + args.new_tokens / 2
    read = {f"ember {quant}": bytes_per_decode_token(Path(info["artifact"]), context) for quant, info in built.items()}
    read[TORCH_ROW] = read.get("ember q0f16")  # the same float16 weights and KV cache
    for name, row in rows.items():
        achieved = row["decode_tokens_per_s"] * read[name] if read[name] else float("nan")
        agree = next((i for i, (a, b) in enumerate(zip(row["token_ids"], torch["token_ids"])) if a != b),
                     len(torch["token_ids"]))
        print(f"{name:<20} {row['prefill_tokens_per_s']:>14.0f} {row['decode_tokens_per_s']:>13.1f} "
              f"{100 * achieved / bandwidth:>10.0f}% {100 * achieved / torch['copy_bandwidth']:>9.0f}% "
              f"{row['batch_decode_tokens_per_s']:>14.0f} "
              f"{row['decode_tokens_per_s'] / torch['decode_tokens_per_s']:>15.2f}x {agree:>15}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "compiled": built,
                                         "datasheet_bandwidth": bandwidth, "bytes_per_decode_token": read,
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
