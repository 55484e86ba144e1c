"""Peer baselines for ember's CPU benchmarks.

ember's numbers only mean something next to other runtimes measured on the same
weights, on the same machine, in the same run. This module provides those
peers, so a benchmark script can put ember's row beside them:

* ``measure_torch_eager``: PyTorch eager through transformers, KV cache via the
  model's own ``past_key_values``.
* ``measure_onnxruntime``: the same checkpoint exported to ONNX with an explicit
  KV cache and run by onnxruntime.
* ``measure_onnxruntime_genai``: onnxruntime-genai, Microsoft's generation runtime,
  on the model its own builder writes from the checkpoint (fused attention
  operators, its KV-cache management and search loop).

Every measurement runs in a fresh Python interpreter, so its peak RSS is that
peer's alone (not the caller's, and not whatever the caller imported, such as
TVM). The heavy libraries are imported only inside those interpreters, which
keeps ``import peers`` cheap.

Each peer does the same work: one warmup run, then a timed greedy generation in
which the prefill (one forward over the prompt, keeping only the last position's
logits, as a generation loop would) is timed apart from the decode
(``new_tokens`` forwards of one token each).

Run as a script for a table of the peers::

    python scripts/peers.py --make-random /tmp/llama-random --prompt-len 128 \\
        --new-tokens 128 --threads 2 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

# How many greedy tokens onnxruntime must reproduce from PyTorch eager.
_REFERENCE_TOKENS = 16


@dataclass
class Measurement:
    """One peer's speed and memory on one prompt.

    ``token_ids`` are the greedy tokens the timed run produced: the token chosen
    from the prefill's logits, then one per decode step (``new_tokens + 1`` in
    all), so runtimes can be checked against each other, not only timed.
    """

    name: str
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    peak_rss_mb: float
    token_ids: list[int] = field(default_factory=list)


def make_random_llama(
    out_dir: str | os.PathLike,
    hidden: int = 768,
    layers: int = 12,
    heads: int = 12,
    kv_heads: int = 4,
    ffn: int = 2048,
    vocab: int = 32000,
    seed: int = 0,
    context: int = 2048,
) -> Path:
    """Write a randomly initialised Llama checkpoint (fp32 safetensors) to ``out_dir``.

    The defaults give 124.7M parameters (75.5M in the layers, 24.6M each in
    the embedding and the untied LM head), a size whose runs take seconds
    rather than minutes on a small CPU. The weights are drawn from
    transformers' own initialiser (normal, std ``initializer_range`` = 0.02):
    with RMSNorm in front of every projection that keeps hidden states and
    logits at trained-model scale, so greedy decoding picks clearly separated
    tokens rather than ties that rounding could flip between runtimes.
    Embeddings are not tied, so the LM head is a separate matrix, as in most
    Llama checkpoints. No tokenizer is written: benchmarks feed token ids.
    ``context`` is the context window (transformers' default, 2048, unless a
    benchmark needs longer prompts).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        initializer_range=0.02,
        tie_word_embeddings=False,
        max_position_embeddings=context,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out


def measure_torch_eager(
    model_dir: str | os.PathLike, prompt_ids: list[int], new_tokens: int, threads: int
) -> Measurement:
    """Time PyTorch eager (transformers, fp32) on ``prompt_ids`` in a fresh process."""
    result = _run_isolated(
        "_torch_eager_worker",
        model_dir=str(model_dir),
        prompt_ids=list(prompt_ids),
        new_tokens=new_tokens,
        threads=threads,
    )
    return Measurement(name="pytorch-eager", **result)


def measure_onnxruntime(
    model_dir: str | os.PathLike, prompt_ids: list[int], new_tokens: int, threads: int
) -> Measurement:
    """Time onnxruntime on ``prompt_ids`` in a fresh process.

    The ONNX model is exported once (in its own process) to
    ``model_dir/onnx/model.onnx`` and reused after that. The measuring process
    imports onnxruntime but not torch, so its peak RSS is onnxruntime's. Raises
    ``RuntimeError`` if its first greedy tokens differ from PyTorch eager's, since
    a fast wrong answer is no baseline.
    """
    onnx_path = Path(model_dir) / "onnx" / "model.onnx"
    if not onnx_path.exists():
        _run_isolated("_export_onnx_worker", model_dir=str(model_dir), onnx_path=str(onnx_path))
    result = _run_isolated(
        "_onnxruntime_worker",
        onnx_path=str(onnx_path),
        prompt_ids=list(prompt_ids),
        new_tokens=new_tokens,
        threads=threads,
    )
    _check_greedy_tokens("onnxruntime", result["token_ids"], model_dir, prompt_ids, new_tokens, threads)
    return Measurement(name="onnxruntime", **result)


def measure_onnxruntime_genai(
    model_dir: str | os.PathLike, prompt_ids: list[int], new_tokens: int, threads: int
) -> Measurement:
    """Time onnxruntime-genai (fp32, CPU) on ``prompt_ids`` in a fresh process.

    The model is built once by onnxruntime-genai's model builder into
    ``model_dir/onnxruntime-genai/`` and reused. Raises ``RuntimeError`` if its first
    greedy tokens differ from PyTorch eager's.
    """
    built = Path(model_dir) / "onnxruntime-genai"
    if not (built / "genai_config.json").exists():
        _run_isolated("_build_onnxruntime_genai_worker", model_dir=str(model_dir), out_dir=str(built))
    result = _run_isolated("_onnxruntime_genai_worker", model_path=str(built), prompt_ids=list(prompt_ids),
                           new_tokens=new_tokens, threads=threads)
    _check_greedy_tokens("onnxruntime-genai", result["token_ids"], model_dir, prompt_ids, new_tokens, threads)
    return Measurement(name="onnxruntime-genai", **result)


def _check_greedy_tokens(name: str, tokens: list[int], model_dir: str | os.PathLike, prompt_ids: list[int],
                         new_tokens: int, threads: int) -> None:
    """Raise if a peer's first greedy tokens differ from PyTorch eager's: a fast wrong answer is no baseline."""
    checked = min(_REFERENCE_TOKENS, new_tokens + 1)
    reference = _run_isolated("_torch_reference_worker", model_dir=str(model_dir), prompt_ids=list(prompt_ids),
                              new_tokens=checked - 1, threads=threads)
    if tokens[:checked] != reference["token_ids"][:checked]:
        raise RuntimeError(f"{name}'s greedy tokens {tokens[:checked]} differ from "
                           f"PyTorch eager's {reference['token_ids'][:checked]}")


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options every timing benchmark takes: prompt and output lengths, threads, repeats, quiet wait."""
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quiet-wait", type=float, default=60,
                        help="seconds to wait for an idle machine before each run (then it runs anyway)")


def wait_for_quiet_machine(max_load: float = 0.3, timeout_s: float = 60) -> bool:
    """Wait until the machine is mostly idle; return whether it got there in time.

    Other work on the machine (on a shared 2-core box, someone's compile) would
    make any runtime look slow, so benchmarks wait for it to pass. ``max_load``
    is in busy cores, the unit of a load average. On Linux the busy share of
    the CPUs is sampled from ``/proc/stat`` over one second, which reacts at
    once, unlike the 1-minute load average that is the fallback elsewhere.
    Never raises on a busy machine: the caller decides what a False means.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if _busy_cores() <= max_load:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(1.0)


def _busy_cores() -> float:
    """How many CPUs' worth of work the machine is doing now.

    Sampled from ``/proc/stat`` over one second (idle and iowait count as
    idle); where that file is missing, the 1-minute load average.
    """

    def cpu_times() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]

    try:
        total0, idle0 = cpu_times()
        time.sleep(1.0)
        total1, idle1 = cpu_times()
    except OSError:
        return os.getloadavg()[0]
    busy_share = 1.0 - (idle1 - idle0) / max(total1 - total0, 1)
    return busy_share * (os.cpu_count() or 1)


def summarize(runs: Sequence[Measurement]) -> Measurement:
    """Combine repeated measurements of one peer: median speeds, largest peak RSS.

    The median shrugs off a run disturbed by other work; the peak RSS is a
    ceiling, so the largest is reported. Token ids are the first run's.
    """
    return Measurement(
        name=runs[0].name,
        prefill_tokens_per_s=statistics.median(r.prefill_tokens_per_s for r in runs),
        decode_tokens_per_s=statistics.median(r.decode_tokens_per_s for r in runs),
        peak_rss_mb=max(r.peak_rss_mb for r in runs),
        token_ids=runs[0].token_ids,
    )


def format_table(rows: Sequence[Measurement]) -> str:
    """Render measurements as a fixed-width text table, one row per runtime."""
    lines = [f"{'runtime':<16} {'prefill tok/s':>14} {'decode tok/s':>13} {'peak RSS MB':>12}"]
    for row in rows:
        lines.append(
            f"{row.name:<16} {row.prefill_tokens_per_s:>14.1f} "
            f"{row.decode_tokens_per_s:>13.2f} {row.peak_rss_mb:>12.0f}"
        )
    return "\n".join(lines)


# --- isolation ---------------------------------------------------------------


def _run_isolated(worker: str, **kwargs: Any) -> dict[str, Any]:
    """Call ``peers.<worker>(**kwargs)`` (or ``<module>.<function>`` for a "module.function" worker of
    another script beside this one) in a fresh interpreter and return its dict.

    A plain subprocess rather than a multiprocessing spawn: spawn re-imports the
    parent's ``__main__`` in the child, which would load the calling benchmark's
    own imports (TVM, say) and count them in the peer's peak RSS. The child
    writes its result as JSON to a file, because libraries print to stdout.
    """
    threads = kwargs.get("threads")
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory(prefix="ember-peer-") as tmp:
        request, response = Path(tmp) / "request.json", Path(tmp) / "response.json"
        request.write_text(json.dumps({"worker": worker, "kwargs": kwargs}))
        code = (
            "import sys; sys.path.insert(0, sys.argv[1]); import peers; "
            "peers._child_main(sys.argv[2], sys.argv[3])"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, str(Path(__file__).resolve().parent), str(request), str(response)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"peer worker {worker} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
        return json.loads(response.read_text())


def _child_main(request_path: str, response_path: str) -> None:
    """Entry point of an isolated child: run the requested worker, save its result."""
    request = json.loads(Path(request_path).read_text())
    module, _, name = request["worker"].rpartition(".")
    worker: Callable[..., dict[str, Any]] = (getattr(importlib.import_module(module), name) if module
                                             else globals()[name])
    result = worker(**request["kwargs"])
    if "peak_rss_mb" in result:
        result["peak_rss_mb"] = _peak_rss_mb()
    Path(response_path).write_text(json.dumps(result))


def _peak_rss_mb() -> float:
    """This process's peak resident set size in MiB, read after the peer's work.

    Linux's ``getrusage(RUSAGE_SELF).ru_maxrss`` carries over the peak of the
    process image replaced by ``exec``, here a fork of the (possibly large)
    caller, so the per-image high-water mark ``VmHWM`` is read instead, with
    ``ru_maxrss`` only where ``/proc`` is missing.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    # ru_maxrss is in KiB on Linux, bytes on macOS.
    scale = 1024 * 1024 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale


def _rates(prompt_len: int, new_tokens: int, prefill_s: float, decode_s: float) -> dict[str, float]:
    """Turn timings into tokens per second (decode over its ``new_tokens`` steps)."""
    return {
        "prefill_tokens_per_s": prompt_len / prefill_s,
        "decode_tokens_per_s": new_tokens / decode_s if new_tokens else float("nan"),
    }


# --- llama.cpp ---------------------------------------------------------------

LLAMA_CPP_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")


def add_placeholder_vocabulary(writer: Any, vocab: int) -> None:
    """A llama (SentencePiece) vocabulary of `vocab` placeholder pieces on a GGUF writer: unk, bos 1, eos 2, the 256
    byte tokens, then `tok<i>`. Benchmarks feed token ids, never text."""
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
                          + [f"tok{i}" for i in range(vocab - 259)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (vocab - 259))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_random_llama_shards(
    out_dir: str | os.PathLike,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    vocab: int,
    seed: int = 0,
    context: int = 8192,
    rope_theta: float = 500000.0,
    shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write a random Llama checkpoint in bfloat16, shard by shard, for models whose float32 weights do not fit memory.

    The weights follow transformers' initialiser as `make_random_llama`'s do (matrices normal with std 0.02, norms
    one), each tensor drawn from its own generator (`seed`, its index) and written as soon as its shard is full, so
    memory holds one shard (``shard_bytes``) and one float32 tensor at a time. The layout is Hugging Face's: shards
    ``model-0000i-of-0000n.safetensors``, their index ``model.safetensors.index.json`` and ``config.json``.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        shapes += [(prefix + "input_layernorm.weight", (hidden,)),
                   (prefix + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
                   (prefix + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
                   (prefix + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
                   (prefix + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
                   (prefix + "post_attention_layernorm.weight", (hidden,)),
                   (prefix + "mlp.gate_proj.weight", (ffn, hidden)), (prefix + "mlp.up_proj.weight", (ffn, hidden)),
                   (prefix + "mlp.down_proj.weight", (hidden, ffn))]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]

    weight_map: dict[str, str] = {}
    shard: dict[str, Any] = {}
    shard_size = total = 0
    partials: list[Path] = []

    def flush() -> None:
        partials.append(out / f"shard-{len(partials) + 1}.partial")
        save_file(shard, str(partials[-1]), metadata={"format": "pt"})
        weight_map.update({name: partials[-1].name for name in shard})
        shard.clear()

    for index, (name, shape) in enumerate(shapes):
        if len(shape) == 1:
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
            tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        if shard and shard_size + tensor.numel() * 2 > shard_bytes:
            flush()
            shard_size = 0
        shard[name] = tensor
        shard_size += tensor.numel() * 2
        total += tensor.numel() * 2
        print(f"\r  {out.name}: {index + 1}/{len(shapes)} tensors", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    flush()
    finals = {p.name: f"model-{number:05d}-of-{len(partials):05d}.safetensors" for number, p in
              enumerate(partials, 1)}
    for partial in partials:
        partial.rename(out / finals[partial.name])
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": {k: finals[v] for k, v in weight_map.items()}}, indent=2))
    LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, vocab_size=vocab, tie_word_embeddings=False,
                max_position_embeddings=context, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                dtype="bfloat16").save_pretrained(out)  # config.json last: its presence marks a complete checkpoint
    return out


def _checkpoint_tensors(model_dir: Path) -> dict[str, tuple[tuple[int, ...], Callable[[], np.ndarray]]]:
    """Each tensor of a safetensors checkpoint (one file or an index of shards): its shape, read from the file's
    header, and a function that reads it as float32, so that a converter holds one tensor at a time."""
    from safetensors import safe_open

    def read(path: Path, name: str) -> np.ndarray:
        with safe_open(str(path), framework="pt") as opened:
            return opened.get_tensor(name).float().numpy()

    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else \
        ["model.safetensors"]
    tensors = {}
    for file in files:
        with safe_open(str(model_dir / file), framework="pt") as shard:
            for name in shard.keys():
                shape = tuple(shard.get_slice(name).get_shape())
                tensors[name] = (shape, functools.partial(read, model_dir / file, name))
    return tensors


def write_gguf(model_dir: str | os.PathLike, out_path: str | os.PathLike, qtype: str) -> Path:
    """Write the Llama checkpoint at ``model_dir`` as a llama.cpp GGUF file, 2-D weights as ``qtype``.

    Written with the ``gguf`` package's writer and numpy quantizers (llama.cpp's own
    Python code), every matrix in ``qtype`` as ``llama-quantize --pure`` does, norms
    in F32. Q and K rows are permuted from Hugging Face's rotate-half RoPE layout to
    llama.cpp's interleaved one, as its ``convert_hf_to_gguf.py`` does. The
    vocabulary is placeholder text (the benchmark feeds token ids, never text).
    Streamed: the tensors' descriptions are written first, then each tensor is read
    (in any float dtype, from one file or shards), converted and written in turn, so
    an 8B checkpoint converts in the memory of its largest tensor.
    """
    import gguf

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    tensors = _checkpoint_tensors(model_dir)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope_theta = (config.get("rope_parameters") or {}).get("rope_theta") or config.get("rope_theta") or 10000.0
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    partial = out_path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), "llama")
    writer.add_name("ember benchmark llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_file_type({"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}[qtype])
    add_placeholder_vocabulary(writer, config["vocab_size"])

    def permute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
        return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    head = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    sources = {"token_embd.weight": ("model.embed_tokens.weight", 0), "output_norm.weight": ("model.norm.weight", 0),
               "output.weight": (head, 0)}
    for layer in range(config["num_hidden_layers"]):
        for hf, short in names.items():
            rope_heads = {"attn_q": heads, "attn_k": kv_heads}.get(short, 0)
            sources[f"blk.{layer}.{short}.weight"] = (f"model.layers.{layer}.{hf}.weight", rope_heads)
    missing = [source for source, _ in sources.values() if source not in tensors]
    if missing:
        raise ValueError(f"{model_dir}: no tensor {missing[0]!r} in the checkpoint")

    def kind_of(ndim: int) -> gguf.GGMLQuantizationType:
        return getattr(gguf.GGMLQuantizationType, qtype) if ndim == 2 else gguf.GGMLQuantizationType.F32

    for name, (source, _) in sources.items():
        shape = tensors[source][0]
        kind = kind_of(len(shape))
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            dtype = np.dtype(np.float32 if kind == gguf.GGMLQuantizationType.F32 else np.float16)
            writer.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize, raw_dtype=kind)
        else:
            byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, kind)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for count, (source, rope_heads) in enumerate(sources.values(), 1):
        w = tensors[source][1]()
        if rope_heads:
            w = permute_rope(w, rope_heads)
        w = np.ascontiguousarray(w, dtype=np.float32)
        kind = kind_of(w.ndim)
        writer.write_tensor_data(w.astype(np.float16) if kind == gguf.GGMLQuantizationType.F16 else (
            w if kind == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(w, kind)))
        print(f"\r  {out_path.name}: {count}/{len(sources)} tensors", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    writer.close()
    partial.rename(out_path)
    return out_path


def measure_llama_cpp(
    model_dir: str | os.PathLike, qtype: str, prompt_ids: list[int], new_tokens: int, threads: int,
    package_dir: str | os.PathLike | None = None,
) -> Measurement:
    """Time llama.cpp (llama-cpp-python) on the checkpoint converted to ``qtype`` GGUF, in a fresh process.

    The GGUF file is written once to ``model_dir/gguf/`` and reused. ``package_dir``, a
    directory holding a ``llama_cpp`` package (one ISA level's build, see
    ``build_llama_cpp.py``), is put first on the worker's ``sys.path``; without it the
    installed llama-cpp-python runs.
    """
    path = Path(model_dir) / "gguf" / f"model-{qtype}.gguf"
    if not path.exists():
        _run_isolated("_write_gguf_worker", model_dir=str(model_dir), out_path=str(path), qtype=qtype)
    return measure_llama_cpp_file(path, prompt_ids, new_tokens, threads, package_dir, name=f"llama.cpp {qtype}")


def measure_llama_cpp_file(
    path: str | os.PathLike, prompt_ids: list[int], new_tokens: int, threads: int,
    package_dir: str | os.PathLike | None = None, name: str = "llama.cpp",
) -> Measurement:
    """Time llama.cpp on the GGUF file ``path`` in a fresh process (``package_dir`` as for `measure_llama_cpp`)."""
    result = _run_isolated("_llama_cpp_worker", gguf_path=str(path), prompt_ids=list(prompt_ids),
                           new_tokens=new_tokens, threads=threads,
                           package_dir=str(package_dir) if package_dir else None)
    return Measurement(name=name, **result)


def _write_gguf_worker(model_dir: str, out_path: str, qtype: str) -> dict[str, Any]:
    write_gguf(model_dir, out_path, qtype)
    return {}


def _llama_cpp_worker(gguf_path: str, prompt_ids: list[int], new_tokens: int, threads: int,
                      package_dir: str | None) -> dict[str, Any]:
    if package_dir:
        sys.path.insert(0, package_dir)
    import llama_cpp
    from llama_cpp import Llama

    # An ISA-level build that failed to import would silently measure another llama.cpp.
    if package_dir and not Path(llama_cpp.__file__).resolve().is_relative_to(Path(package_dir).resolve()):
        raise RuntimeError(f"llama_cpp was imported from {llama_cpp.__file__}, not from {package_dir}")

    llm = Llama(model_path=gguf_path, n_ctx=len(prompt_ids) + new_tokens + 8, n_batch=len(prompt_ids),
                n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False)

    def last_logits() -> np.ndarray:  # logits of the last evaluated token (the only ones kept)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))

    def run() -> tuple[list[int], float, float]:
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt_ids)
        token = int(np.argmax(last_logits()))
        prefill_s = time.perf_counter() - start
        tokens = [token]
        start = time.perf_counter()
        for _ in range(new_tokens):
            llm.eval([token])
            token = int(np.argmax(last_logits()))
            tokens.append(token)
        return tokens, prefill_s, time.perf_counter() - start

    run()  # warm-up
    tokens, prefill_s, decode_s = run()
    return {**_rates(len(prompt_ids), new_tokens, prefill_s, decode_s), "peak_rss_mb": 0.0, "token_ids": tokens}


# --- PyTorch eager -----------------------------------------------------------


def _load_torch_model(model_dir: str, threads: int) -> Any:
    """Load the checkpoint in fp32 for inference on ``threads`` intra-op threads."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _torch_generate(model: Any, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], float, float]:
    """Greedy-generate with the model's own KV cache; return tokens, prefill s, decode s."""
    import torch

    with torch.inference_mode():
        start = time.perf_counter()
        out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1)
        token = int(out.logits[0, -1].argmax())
        prefill_s = time.perf_counter() - start

        tokens = [token]
        start = time.perf_counter()
        for _ in range(new_tokens):
            out = model(
                input_ids=torch.tensor([[token]]),
                past_key_values=out.past_key_values,
                use_cache=True,
                logits_to_keep=1,
            )
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
        decode_s = time.perf_counter() - start
    return tokens, prefill_s, decode_s


def _torch_eager_worker(model_dir: str, prompt_ids: list[int], new_tokens: int, threads: int) -> dict[str, Any]:
    """Child side of ``measure_torch_eager``: warm up, then time one generation."""
    model = _load_torch_model(model_dir, threads)
    _torch_generate(model, prompt_ids, new_tokens)
    tokens, prefill_s, decode_s = _torch_generate(model, prompt_ids, new_tokens)
    return {"token_ids": tokens, "peak_rss_mb": 0.0, **_rates(len(prompt_ids), new_tokens, prefill_s, decode_s)}


def _torch_reference_worker(model_dir: str, prompt_ids: list[int], new_tokens: int, threads: int) -> dict[str, Any]:
    """Child that only computes PyTorch eager's greedy tokens, to check other peers by."""
    tokens, _, _ = _torch_generate(_load_torch_model(model_dir, threads), prompt_ids, new_tokens)
    return {"token_ids": tokens}


# --- onnxruntime -------------------------------------------------------------


def _export_onnx_worker(model_dir: str, onnx_path: str) -> dict[str, Any]:
    """Export the checkpoint to ONNX with the KV cache as explicit inputs and outputs.

    Uses the TorchScript-based exporter (``dynamo=False``): the torch.export one
    needs onnxscript, which is not installed. Tracing records one path through
    the Python code, so nothing shape-dependent may be decided inside the HF
    model: the wrapper passes explicit position ids and a ready 4-D causal mask
    (an HF model uses a 4-D mask as given), which also keeps SDPA from baking in
    an ``is_causal`` chosen for the traced prompt length. The trace uses a
    non-empty past and a multi-token input, with both lengths marked dynamic, so
    the one graph serves the prefill (empty past) and the decode (one token).
    The file is written under a temporary name and renamed, so an interrupted
    export never leaves a broken cache behind.
    """
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    config = model.config
    layers = config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    class KVCacheWrapper(torch.nn.Module):
        """Flat-tensor interface: (input_ids, past k/v per layer) -> (logits, present k/v)."""

        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: torch.Tensor, *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
            past_len = past[0].shape[2]
            seq_len = input_ids.shape[1]
            positions = torch.arange(seq_len, dtype=torch.int64) + past_len
            keys = torch.arange(past_len + seq_len, dtype=torch.int64)
            allowed = keys[None, :] <= positions[:, None]
            mask = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(
                ~allowed, torch.finfo(torch.float32).min
            )
            cache = DynamicCache(ddp_cache_data=list(zip(past[0::2], past[1::2])), config=config)
            out = self.inner(
                input_ids=input_ids,
                position_ids=positions[None, :],
                attention_mask=mask[None, None],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            present = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
            return (out.logits, *present)

    kv_names = [f"{kind}.{i}" for i in range(layers) for kind in ("key", "value")]
    past_names = [f"past_{name}" for name in kv_names]
    present_names = [f"present_{name}" for name in kv_names]
    dummy_past = [torch.zeros(1, config.num_key_value_heads, 3, head_dim) for _ in kv_names]
    dummy_ids = torch.zeros(1, 2, dtype=torch.int64)
    dynamic_axes = {"input_ids": {1: "seq"}}
    dynamic_axes.update({name: {2: "past"} for name in past_names})
    dynamic_axes.update({name: {2: "total"} for name in present_names})

    target = Path(onnx_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    with torch.inference_mode():
        torch.onnx.export(
            KVCacheWrapper(model),
            (dummy_ids, *dummy_past),
            str(partial),
            dynamo=False,
            input_names=["input_ids", *past_names],
            output_names=["logits", *present_names],
            dynamic_axes=dynamic_axes,
            opset_version=17,
        )
    os.replace(partial, target)
    return {}


def _onnxruntime_worker(onnx_path: str, prompt_ids: list[int], new_tokens: int, threads: int) -> dict[str, Any]:
    """Child side of ``measure_onnxruntime``: warm up, then time one generation."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(onnx_path, options, providers=["CPUExecutionProvider"])
    _onnxruntime_generate(session, prompt_ids, new_tokens)
    tokens, prefill_s, decode_s = _onnxruntime_generate(session, prompt_ids, new_tokens)
    return {"token_ids": tokens, "peak_rss_mb": 0.0, **_rates(len(prompt_ids), new_tokens, prefill_s, decode_s)}


def _onnxruntime_generate(session: Any, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], float, float]:
    """Greedy-generate, feeding each step's present k/v back as the next past."""
    past_inputs = [i for i in session.get_inputs() if i.name.startswith("past_")]
    # Past inputs are [batch, kv_heads, past, head_dim]; the prefill's past is empty.
    past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), dtype=np.float32) for i in past_inputs}

    def step(ids: list[int]) -> int:
        logits, *present = session.run(None, {"input_ids": np.array([ids], dtype=np.int64), **past})
        past.update(zip((i.name for i in past_inputs), present))
        return int(logits[0, -1].argmax())

    start = time.perf_counter()
    token = step(prompt_ids)
    prefill_s = time.perf_counter() - start

    tokens = [token]
    start = time.perf_counter()
    for _ in range(new_tokens):
        token = step([token])
        tokens.append(token)
    decode_s = time.perf_counter() - start
    return tokens, prefill_s, decode_s


# --- onnxruntime-genai -------------------------------------------------------


def _build_onnxruntime_genai_worker(model_dir: str, out_dir: str) -> dict[str, Any]:
    """Run onnxruntime-genai's model builder (fp32, CPU) on the checkpoint.

    The builder insists on loading a tokenizer; a random checkpoint has none, so it
    reads a copy of the checkpoint's files next to a word-level tokenizer covering
    the vocabulary (the benchmark feeds token ids and never uses it)."""
    from tokenizers import Tokenizer, models

    source = Path(model_dir)
    with tempfile.TemporaryDirectory(prefix="ember-genai-src-") as tmp:
        for path in source.iterdir():
            if path.is_file():
                (Path(tmp) / path.name).symlink_to(path.resolve())
        if not (source / "tokenizer.json").exists():
            vocab = json.loads((source / "config.json").read_text())["vocab_size"]
            tokenizer = Tokenizer(models.WordLevel({f"<t{i}>": i for i in range(vocab)}, unk_token="<t0>"))
            tokenizer.save(str(Path(tmp) / "tokenizer.json"))
            (Path(tmp) / "tokenizer_config.json").write_text(
                json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<t0>"}))
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", tmp, "-o", out_dir,
                        "-p", "fp32", "-e", "cpu", "-c", str(Path(tmp) / "cache")],
                       check=True, stdout=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return {}


def _onnxruntime_genai_worker(model_path: str, prompt_ids: list[int], new_tokens: int,
                              threads: int) -> dict[str, Any]:
    """Child side of ``measure_onnxruntime_genai``: warm up, then time one greedy generation."""
    import onnxruntime_genai as og

    config_path = Path(model_path) / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    config_path.write_text(json.dumps(config, indent=2))
    model = og.Model(og.Config(model_path))

    def run() -> tuple[list[int], float, float]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt_ids) + new_tokens + 1, do_sample=False)
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(prompt_ids)  # the prefill forward
        generator.generate_next_token()  # picks from the prefill's logits
        tokens = [int(generator.get_next_tokens()[0])]
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(new_tokens):
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
        return tokens, prefill_s, time.perf_counter() - start

    run()  # warm-up
    tokens, prefill_s, decode_s = run()
    return {**_rates(len(prompt_ids), new_tokens, prefill_s, decode_s), "peak_rss_mb": 0.0, "token_ids": tokens}


# --- command line ------------------------------------------------------------

_PEERS: dict[str, Callable[[str, list[int], int, int], Measurement]] = {
    "pytorch-eager": measure_torch_eager,
    "onnxruntime": measure_onnxruntime,
    "onnxruntime-genai": measure_onnxruntime_genai,
}


def main(argv: Sequence[str] | None = None) -> None:
    """Measure every peer ``--repeats`` times and print the summary table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="existing Hugging Face Llama checkpoint directory")
    source.add_argument("--make-random", metavar="DIR", help="write a random 125M-parameter Llama to DIR and use it")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="seed for the random weights and prompt")
    args = parser.parse_args(argv)

    if args.make_random:
        model_dir = str(make_random_llama(args.make_random, seed=args.seed))
    else:
        model_dir = args.model
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    prompt_ids = np.random.default_rng(args.seed).integers(0, vocab, args.prompt_len).tolist()

    rows = []
    for measure in _PEERS.values():
        runs = []
        for _ in range(args.repeats):
            if not wait_for_quiet_machine():
                print("warning: machine still busy, measuring anyway", file=sys.stderr)
            runs.append(measure(model_dir, prompt_ids, args.new_tokens, args.threads))
        rows.append(summarize(runs))
    print(
        f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, {args.threads} threads, "
        f"median of {args.repeats} (peak RSS: largest)"
    )
    print(format_table(rows))


if __name__ == "__main__":
    main()
