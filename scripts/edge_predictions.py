"""What to expect on an aarch64 board before buying one: `ember analyze`'s predictions next to
published llama.cpp figures for the same boards.

For each board preset that `--target` compiles for (the presets in targets/hardware/ with an
`llvm_target`: raspberry-pi-5, rockchip-rk3588, nvidia-jetson-orin-cpu, aws-graviton3), each
model (the bundled demo model, TinyLlama-1.1B's shape, Llama-3-8B's shape) and each format
(q8f32, q4f32), prints one markdown table row: the decode and prefill speed bounds and the
memory that `ember analyze`'s roofline model predicts, and the llama.cpp decode speed
published for that board and model size, with its source.

How the predictions are made: the same code as `ember analyze MODEL --hardware BOARD`
(src/ember/driver/analyze: every operator on the board's roofline, kernels one after another, each at
min(peak, intensity x bandwidth)), with the precision of ember's own formats rather than
the CLI's whole-bit `--wbits`:
- weights at the format's stored bits per weight, scales included (q8f32 9 bits, q4f32 5
  bits: int8/int4 values plus one float32 scale per group of 32), embedding and lm_head too;
- activations between kernels and the KV cache in float32 (the formats' compute dtype);
- the projections multiply in int8 (the board's dot-product peak), as ember's q8f32/q4f32
  kernels do on a CPU with dotprod, rounding each activation row to int8 per group of 32.
Decode is the mean over `--gen-len` steps after a `--prompt-len` prompt; prefill is that
prompt. Memory is all weights plus a float32 KV cache of `--context` tokens (capped at the
model's context window). The speeds are upper bounds: real kernels reach part of the
roofline (see `ember analyze ARTIFACT --measure` on a machine you have).

The published figures are **published, not measured here**: each is copied from the page
cited next to it, with the model, weight type and thread count its author used, which are not
always the model in the row (a Llama-2-7B figure stands next to the 8B row). A board with
none found says so. `--target aarch64` (any ARMv8.2-A CPU with dotprod) has no bandwidth
figure, so nothing can be predicted for it; pass a preset-style JSON file with `--board` for
a board of your own.

    python scripts/edge_predictions.py
    python scripts/edge_predictions.py --board raspberry-pi-5 --prompt-len 512 --context 4096
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

from ember import DEMO_MODEL_DIR
from ember.driver.analyze.operators import Architecture, FormatPrecision, architecture_from_config, load_architecture
from ember.driver.analyze.roofline import Workload, analyze, kv_cache_bytes, weight_bytes
from ember.targets.hardware import Hardware, board_presets, load_hardware

FORMAT_NAMES = ("q8f32", "q4f32")
_GIB = 2**30

# HF config.json fields of the two reference shapes (TinyLlama/TinyLlama-1.1B-Chat-v1.0 and
# meta-llama/Meta-Llama-3-8B); only the shape matters to the roofline.
_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "attention_bias": False, "mlp_bias": False, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
          "torch_dtype": "bfloat16"}
SHAPES = {
    "TinyLlama-1.1B": {**_LLAMA, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                       "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
                       "max_position_embeddings": 2048, "rope_theta": 10000.0},
    "Llama-3-8B": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                   "max_position_embeddings": 8192, "rope_theta": 500000.0},
}


class Published(NamedTuple):
    """A llama.cpp decode speed someone published for a board (not measured here)."""

    board: str
    size: str  # "1B" or "8B": the row of ours it stands next to
    format: str  # "q8f32" or "q4f32": ours nearest to the published weight type
    tok_s: float
    what: str  # the model, weight type, software and threads as published
    url: str


PUBLISHED = (
    # "LLaMA Now Goes Faster on CPUs" (2024-03-31), the row "35 | 9 | TinyLlama 1.1B | q8_0 | RPI5 |
    # llama.cpp 2024-03-26" (prompt, eval tok/s); a copy: https://github.com/guevara/read-it-later/issues/11711
    Published("raspberry-pi-5", "1B", "q8f32", 9, "TinyLlama-1.1B Q8_0, llama.cpp 2024-03-26 (prompt: 35 tok/s)",
              "https://justine.lol/matmul/"),
    Published("raspberry-pi-5", "8B", "q4f32", 2.05, "Llama-3-8B Q4_0_4_4/Q4_0_4_8, llama.cpp b3891 (IQ4_XS: ~2.5)",
              "https://github.com/ggml-org/llama.cpp/issues/9774"),
    Published("raspberry-pi-5", "8B", "q4f32", 2.17,
              "Llama-3.1-8B via Ollama (llama.cpp inside; weight type not stated), Pi 5 16 GB",
              "https://github.com/geerlingguy/ai-benchmarks/issues/7"),
    Published("aws-graviton3", "8B", "q4f32", 31.55, "Llama-2-7B Q4_0, llama.cpp 2024-03, 64 threads, r7g.16xlarge",
              "https://github.com/ggml-org/llama.cpp/pull/5780"),
    Published("aws-graviton3", "8B", "q4f32", 17.6, "Llama-3.1-8B Q4_K_M, llama-bench pp1 (one-token steps), "
              "8 threads only", "https://github.com/ggml-org/llama.cpp/pull/15277"),
)


def models() -> dict[str, Architecture]:
    """The demo model and the two reference Llama shapes, by the name shown in the table."""
    archs = {"demo": load_architecture(str(DEMO_MODEL_DIR))}
    archs.update({name: architecture_from_config(raw, f"<{name} config>", name) for name, raw in SHAPES.items()})
    return archs


def size_class(arch: Architecture) -> str | None:
    """The published-figure bucket ("1B", "8B") of a model, or None for the demo."""
    return {"TinyLlama-1.1B": "1B", "Llama-3-8B": "8B"}.get(arch.name)


def predict(arch: Architecture, hw: Hardware, fmt: str, args: argparse.Namespace) -> tuple[float, float, float, int]:
    """Decode tok/s, prefill tok/s, memory (bytes) and the KV context it assumes."""
    prec = FormatPrecision.of(fmt)
    window = arch.config.context_window
    gen = min(args.gen_len, window // 2)
    work = Workload(1, min(args.prompt_len, window - gen), gen)
    result = analyze(arch, hw, prec, work)
    context = min(args.context, window)
    memory = weight_bytes(arch, prec) + kv_cache_bytes(arch, prec, 1, context)
    return 1 / result.mean_decode_time, work.prompt_len / result.prefill.time, memory, context


def published_cell(board: str, arch: Architecture, fmt: str) -> str:
    """The published figures for this row, or why there are none."""
    size = size_class(arch)
    if size is None:
        return ""
    found = [p for p in PUBLISHED if (p.board, p.size, p.format) == (board, size, fmt)]
    if not found:
        other = [p for p in PUBLISHED if (p.board, p.size) == (board, size)]
        return "see the other format's row" if other else "none found"
    return "; ".join(f"{p.tok_s:g} tok/s: {p.what} ([source]({p.url}))" for p in found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--board", action="append", metavar="NAME",
                        help="a board preset or a preset-style JSON file (repeatable; default: every board preset)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default: 128)")
    parser.add_argument("--gen-len", type=int, default=128,
                        help="generated tokens the decode speed is the mean over (default: 128, as llama-bench tg128)")
    parser.add_argument("--context", type=int, default=2048,
                        help="KV-cache tokens counted in the memory column (default: 2048)")
    args = parser.parse_args()

    boards = [load_hardware(name) for name in (args.board or board_presets())]
    archs = models()
    print(f"Predicted by `ember analyze`'s roofline (upper bounds, batch 1): decode = mean over {args.gen_len} "
          f"tokens after a {args.prompt_len}-token prompt, prefill = that prompt; memory = weights + float32 KV "
          f"cache of {args.context} tokens (or the model's window). Published llama.cpp figures are published, "
          "not measured here.\n")
    print("| board | model | format | decode tok/s (bound) | prefill tok/s (bound) | memory | "
          "published llama.cpp decode (not measured here) |")
    print("|---|---|---|---:|---:|---:|---|")
    for hw in boards:
        for name, arch in archs.items():
            for fmt in FORMAT_NAMES:
                decode, prefill, memory, context = predict(arch, hw, fmt, args)
                fits = "" if memory <= hw.memory_capacity else f" (over {hw.memory_capacity / _GIB:.0f} GiB)"
                memory_text = (f"{memory / _GIB:.2f} GiB" if memory >= 0.1 * _GIB else f"{memory / 2**20:.1f} MiB")
                window = f" @{context}" if context != args.context else ""
                print(f"| {hw.name} | {name} | {fmt} | {decode:,.1f} | {prefill:,.0f} | "
                      f"{memory_text}{window}{fits} | {published_cell(hw.name, arch, fmt)} |")
    print("\nBandwidth and peaks per board (from targets/hardware/*.json): "
          + "; ".join(f"{hw.name} {hw.memory_bandwidth / 1e9:g} GB/s, int8 {hw.peak('int8') / 1e12:g} TOPS"
                      for hw in boards)
          + ". `--target aarch64` has no such figures, so nothing is predicted for it.")


if __name__ == "__main__":
    main()
