"""The GPU workers of `scripts/gpu_check.py run`: each runs in its own process, in the runtime-only environment
(the bundle's TVM runtime and ember on PYTHONPATH), with torch and transformers from the GPU machine.

    correctness   every "check" artifact against transformers on the same GPU (bounds below)
    serve         one artifact served in-process as `ember serve` serves it, asked through the openai client
    bench-ember   one "bench" artifact: prefill 512/2048, decode batch 1/8/32, one decode step's kernels
    bench-torch   the same checkpoint in PyTorch eager float16 (SDPA) and the device-to-device copy rate
    bench-compile the same checkpoint with torch.compile (a static KV cache, transformers' own compile path)

Bounds, as max |ember - reference| over the logits divided by max |reference|, the reference being
transformers in float32 on the same GPU with the weights the artifact holds (rounded to float16 for a float16
artifact; quantized then dequantized for a quantized one, as `tests/conftest.py` builds it):
- float32 artifacts (q0f32, q4f32, q8f32): 1e-4. Only summation order differs (float32's unit roundoff is
  6e-8; a few thousand terms per output leave ~1e-5 of the logit scale).
- float16 activations (q0f16, q4f16, q8f16, q4f16_zp): 1e-2. ember stores activations in float16 (unit
  roundoff 2^-11 = 4.9e-4) after each of ~10 kernels per layer; independent roundings add like a random walk
  and the final norm and head spread them over the logits, ~10 units of roundoff: the CPU build of the tiny
  Llama at q0f16 measured 3.8e-3 (decode) and 5.5e-3 (prefill) against this reference, PyTorch's float16
  1.1e-3..1.4e-3. PyTorch's own float16 error on the same GPU is measured and recorded beside ember's; a wrong
  kernel (a dropped bias, a transposed weight, a wrong KV page) is off by O(1) of the scale, far above it.
Greedy tokens must be equal for q0f32 (ember on the GPU, transformers on the GPU, transformers on the CPU that
made the bundle); the batch of 4 decoded together must give each prompt's tokens of its solo run.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import gpu_check
import numpy as np

DEVICE = "cuda"  # torch's device for the references and peers
FLOAT32_BOUND, FLOAT16_BOUND = 1e-4, 1e-2
BENCH_PROMPTS, BENCH_DECODE_TOKENS, BENCH_BATCH_STEPS, REPEATS = (512, 2048), 128, 32, 3
DECODE_PROMPT = 512  # tokens before batch-1 decode (and the profiled steps)
BENCH_BATCHES = (8, 32)


def bound(quant: str) -> float:
    """The relative logit bound of an artifact of `quant` (see the module docstring)."""
    return FLOAT32_BOUND if quant.endswith("f32") else FLOAT16_BOUND


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    """max |ours - reference| / max |reference|."""
    return float(np.abs(ours.astype(np.float64) - reference).max() / np.abs(reference).max())


# ---- correctness ------------------------------------------------------------------------------------

def reference_model(checkpoint: Path, quant: str, torch, dtype=None):
    """transformers on the GPU with the weights an artifact of `quant` holds, computing in float32 (or `dtype`)."""
    from transformers import AutoModelForCausalLM

    from ember.ir.quant_formats import FORMATS

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype or torch.float32,
                                                 attn_implementation="eager").eval()
    fmt = FORMATS[quant]
    # GPT-2's Conv1D stores [in, out]: ember quantizes the rows of [out, in], so along its columns.
    stored_transposed = {id(m.weight) for m in model.modules() if type(m).__name__ == "Conv1D"}
    with torch.no_grad():
        for param in model.parameters():
            if fmt.quantizes and param.ndim == 2:  # ember quantizes every 2-D weight along its rows
                flip = id(param) in stored_transposed
                weight = param.float().numpy().T if flip else param.float().numpy()
                unpacked = fmt.dequantize(fmt.quantize(weight), weight.shape[1]).astype(np.float32)
                param.copy_(torch.from_numpy(np.ascontiguousarray(unpacked.T if flip else unpacked)))
            if fmt.dtype == "float16" and dtype is None:
                param.copy_(param.half().float())  # the float16 weights, computed in float32
    return model.to(DEVICE)


def ember_outputs(engine, prompts: dict, forced: list[int]) -> dict[str, np.ndarray]:
    """ember's outputs on the reference workload (the decode steps forced to the CPU reference's tokens)."""
    seq = engine.add_sequence()
    prefill = engine.prefill(seq, prompts["prompt"], all_logits=True)
    decode = [engine.decode([seq], [token])[0] for token in forced]
    engine.remove_sequence(seq)
    solo = [ember_greedy(engine, prompt, gpu_check.BATCH_TOKENS) for prompt in prompts["batch"]]
    return {"prefill_logits": prefill, "decode_logits": np.stack(decode),
            "greedy_tokens": ember_greedy(engine, prompts["prompt"], gpu_check.GREEDY_TOKENS),
            "solo_tokens": solo, "batch_tokens": ember_batch_greedy(engine, prompts["batch"], gpu_check.BATCH_TOKENS)}


def ember_greedy(engine, prompt: list[int], steps: int) -> list[int]:
    """`steps` greedy tokens of ember after `prompt` (a fresh sequence in the paged KV cache)."""
    seq = engine.add_sequence()
    tokens = [int(np.argmax(engine.prefill(seq, prompt)))]
    while len(tokens) < steps:
        tokens.append(int(np.argmax(engine.decode([seq], [tokens[-1]])[0])))
    engine.remove_sequence(seq)
    return tokens


def ember_batch_greedy(engine, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy tokens of `prompts` decoded together, one decode call per step for the whole batch."""
    seqs = [engine.add_sequence() for _ in prompts]
    rows = [[int(np.argmax(engine.prefill(seq, prompt)))] for seq, prompt in zip(seqs, prompts)]
    for _ in range(steps - 1):
        logits = engine.decode(seqs, [row[-1] for row in rows])
        for row, logit in zip(rows, logits):
            row.append(int(np.argmax(logit)))
    for seq in seqs:
        engine.remove_sequence(seq)
    return rows


def torch_outputs(model, prompts: dict, forced: list[int], torch) -> dict[str, np.ndarray]:
    """transformers' logits on the GPU for the prompt and the forced continuation, and its greedy tokens."""
    with torch.no_grad():
        ids = torch.tensor([prompts["prompt"] + forced], device=DEVICE)
        logits = model(ids).logits[0].float().cpu().numpy()
        tokens = gpu_check.greedy(model, prompts["prompt"], gpu_check.GREEDY_TOKENS, torch)
    n = gpu_check.PROMPT_LEN
    return {"prefill_logits": logits[:n], "decode_logits": logits[n: n + len(forced)], "greedy_tokens": tokens}


def check(checks: list[dict], name: str, passed: bool, **detail) -> None:
    """Record one check and print it."""
    checks.append({"name": name, "passed": bool(passed), **detail})
    shown = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in detail.items())
    print(f"{'PASS' if passed else 'FAIL'} {name}: {shown}", flush=True)


def check_artifact(artifact_id: str, entry: dict, workdir: Path, cpu: dict, checks: list[dict], torch) -> None:
    """All checks of one artifact against transformers on the GPU (and the CPU's float32 tokens)."""
    from ember.runtime import Engine, load_artifact

    checkpoint, quant = workdir / "checkpoints" / entry["checkpoint"], entry["quant"]
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    prompts = gpu_check.reference_prompts(vocab)
    forced = [int(t) for t in cpu["greedy_tokens"][:gpu_check.DECODE_STEPS]]
    ours = ember_outputs(Engine(load_artifact(workdir / "artifacts" / artifact_id)), prompts, forced)
    reference = torch_outputs(reference_model(checkpoint, quant, torch), prompts, forced, torch)
    limit, half = bound(quant), None
    if quant == "q0f16":  # PyTorch's own float16 error on the same weights, for scale
        half = torch_outputs(reference_model(checkpoint, quant, torch, torch.float16), prompts, forced, torch)
    for part in ("prefill_logits", "decode_logits"):
        error = relative_error(ours[part], reference[part])
        extra = {} if half is None else {"torch_float16_error": relative_error(half[part], reference[part])}
        check(checks, f"{artifact_id} {part.split('_')[0]} logits", error <= limit, error=error, bound=limit, **extra)
    agree = next((i for i, (a, b) in enumerate(zip(ours["greedy_tokens"], reference["greedy_tokens"])) if a != b),
                 len(reference["greedy_tokens"]))
    if quant == "q0f32":
        cpu_tokens = [int(t) for t in cpu["greedy_tokens"]]
        check(checks, f"{artifact_id} greedy {gpu_check.GREEDY_TOKENS} tokens",
              ours["greedy_tokens"] == reference["greedy_tokens"] == cpu_tokens, leading_equal=agree)
        check(checks, f"{artifact_id} batch tokens = CPU reference",
              ours["batch_tokens"] == cpu["batch_tokens"].tolist())
    else:
        print(f"     {artifact_id}: {agree} of {gpu_check.GREEDY_TOKENS} greedy tokens equal transformers'", flush=True)
    check(checks, f"{artifact_id} batch of {len(prompts['batch'])} = solo runs", ours["batch_tokens"] ==
          ours["solo_tokens"])


def correctness(workdir: Path) -> dict:
    """Every "check" artifact of the plan on the GPU."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # a float32 reference computes in float32, not TF32
    torch.backends.cudnn.allow_tf32 = False
    plan, checks = json.loads((workdir / gpu_check.PLAN_NAME).read_text()), []
    for artifact_id, entry in plan["artifacts"].items():
        if entry["role"] != "check":
            continue
        cpu = dict(np.load(workdir / "references" / f"{entry['checkpoint']}.npz", allow_pickle=False))
        try:
            check_artifact(artifact_id, entry, workdir, cpu, checks, torch)
        except Exception as err:  # one artifact's failure is reported, the others still run
            check(checks, f"{artifact_id} ran", False, error=f"{type(err).__name__}: {err}")
    return {"checks": checks, "device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE}


def serve(workdir: Path) -> dict:
    """One artifact served as `ember serve` serves it (Scheduler + Server) and asked through the openai client:
    its greedy completion equals the engine's greedy tokens. Skipped, with a note, without openai or fastapi."""
    missing = [name for name in ("openai", "fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        note = f"skipped: {', '.join(missing)} not installed on this machine"
        print(f"SKIP serve: {note}", flush=True)
        return {"checks": [], "note": note}
    import openai

    from ember.runtime import Engine, load_artifact
    from ember.serving.scheduler import Scheduler
    from ember.serving.server import Server

    artifact_dir = workdir / "artifacts" / "llama-q0f32"
    artifact, checks, prompt, steps = load_artifact(artifact_dir), [], "the quick brown fox", 8
    engine = Engine(artifact)
    expected = artifact.tokenizer.decode(ember_greedy(engine, artifact.tokenizer.encode(prompt), steps))
    with Scheduler(engine) as scheduler:
        server = Server(scheduler, artifact_dir.name, "127.0.0.1", 0)
        server.start()
        try:
            client = openai.OpenAI(base_url=server.url, api_key="none")
            reply = client.completions.create(model=artifact_dir.name, prompt=prompt, max_tokens=steps,
                                              temperature=0)
            chat = client.chat.completions.create(model=artifact_dir.name, max_tokens=steps, temperature=0,
                                                  messages=[{"role": "user", "content": "hi"}])
        finally:
            server.stop()
    check(checks, "serve: greedy completion = the engine's greedy text", reply.choices[0].text == expected,
          served=repr(reply.choices[0].text), engine=repr(expected))
    check(checks, "serve: chat answers", chat.choices[0].message.content is not None and
          chat.usage.completion_tokens > 0, text=repr(chat.choices[0].message.content))
    return {"checks": checks}


# ---- benchmark ----------------------------------------------------------------------------------------

def bench_prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` random prompts of `length` tokens (the same for every runtime)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, length).tolist() for _ in range(count)]


def median_seconds(run, repeats: int = REPEATS) -> float:
    """The median wall time of `run()` (which returns only once the GPU is done: logits reach the host)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_ember(workdir: Path, artifact_id: str) -> dict:
    """ember's prefill and decode rates for one "bench" artifact, and the kernels of one batch-1 decode step."""
    from ember.runtime import Engine, load_artifact

    artifact = workdir / "artifacts" / artifact_id
    engine = Engine(load_artifact(artifact))
    vocab = engine.artifact.manifest.model["vocab_size"]

    def prefill(prompt: list[int]) -> None:
        seq = engine.add_sequence()
        engine.prefill(seq, prompt)
        engine.remove_sequence(seq)

    def decode(prompts: list[list[int]], steps: int) -> float:
        return timed_decode(engine, prompts, steps)

    return run_bench(prefill, decode, vocab, kernels=lambda: decode_kernels(decode, vocab))


def timed_decode(engine, prompts: list[list[int]], steps: int) -> float:
    """Seconds for `steps` greedy decode steps of `prompts` as one batch (their prefills before, untimed); the
    sequences are removed after. `scripts/bench_gpu.py` measures batches with it too."""
    seqs = [engine.add_sequence() for _ in prompts]
    tokens = [int(np.argmax(engine.prefill(seq, p))) for seq, p in zip(seqs, prompts)]
    start = time.perf_counter()
    for _ in range(steps):
        tokens = [int(t) for t in np.argmax(engine.decode(seqs, tokens), axis=-1)]
    seconds = time.perf_counter() - start
    for seq in seqs:
        engine.remove_sequence(seq)
    return seconds


def run_bench(prefill, decode, vocab: int, kernels=None) -> dict:
    """The shared measurement: prefill at BENCH_PROMPTS tokens, batch-1 decode of BENCH_DECODE_TOKENS after a
    DECODE_PROMPT-token prompt, decode at BENCH_BATCHES (128-token prompts, BENCH_BATCH_STEPS steps); medians of
    REPEATS."""
    decode(bench_prompts(vocab, 1, 16), 4)  # warm-up: kernels loaded, decode graphs captured per batch size
    for batch in BENCH_BATCHES:
        decode(bench_prompts(vocab, batch, 16), 2)
    result = {"prefill_tokens_per_s": {}, "decode_batch_tokens_per_s": {}}
    for length in BENCH_PROMPTS:
        prompt = bench_prompts(vocab, 1, length)[0]
        result["prefill_tokens_per_s"][length] = length / median_seconds(lambda p=prompt: prefill(p))
    prompt = bench_prompts(vocab, 1, DECODE_PROMPT)
    result["decode_tokens_per_s"] = BENCH_DECODE_TOKENS / statistics.median(
        decode(prompt, BENCH_DECODE_TOKENS) for _ in range(REPEATS))
    for batch in BENCH_BATCHES:
        prompts = bench_prompts(vocab, batch, 128)
        result["decode_batch_tokens_per_s"][batch] = batch * BENCH_BATCH_STEPS / statistics.median(
            decode(prompts, BENCH_BATCH_STEPS) for _ in range(REPEATS))
    if kernels is not None:
        result["decode_step_kernels"] = kernels()
    print(json.dumps(result), flush=True)
    return result


def decode_kernels(decode, vocab: int, steps: int = 4) -> list[dict]:
    """The GPU kernels of one batch-1 decode step (torch's profiler reads every kernel of the process through
    CUPTI, TVM's too), averaged over `steps` steps: name, launches and microseconds per step, longest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    prompt = bench_prompts(vocab, 1, DECODE_PROMPT)
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            decode(prompt, steps)
            torch.cuda.synchronize()
    except (AssertionError, RuntimeError) as err:  # no CUPTI: the rates still count
        return [{"error": f"torch.profiler: {err}"}]
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us > 0:
            rows.append({"kernel": event.key[:120], "launches_per_step": event.count / steps,
                         "us_per_step": device_us / steps})
    return sorted(rows, key=lambda row: -row["us_per_step"])[:25]


def bench_torch(workdir: Path, checkpoint_name: str) -> dict:
    """PyTorch eager float16 (SDPA attention) on the same checkpoint, and the device-to-device copy rate."""
    import torch
    from transformers import AutoModelForCausalLM

    checkpoint = workdir / "checkpoints" / checkpoint_name
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float16, attn_implementation="sdpa")
    model = model.to("cuda").eval()
    vocab = model.config.vocab_size

    @torch.inference_mode()
    def prefill(prompt: list[int]) -> None:
        model(input_ids=torch.tensor([prompt], device="cuda"), use_cache=True, logits_to_keep=1).logits.cpu()

    @torch.inference_mode()
    def decode(prompts: list[list[int]], steps: int) -> float:
        out = model(input_ids=torch.tensor(prompts, device="cuda"), use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        token.cpu()
        start = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            token.cpu()  # the host waits for each token, as a generation loop does
        return time.perf_counter() - start

    result = run_bench(prefill, decode, vocab)
    result["copy_bytes_per_s"] = copy_bandwidth(torch)
    result["device"] = torch.cuda.get_device_name()
    return result


def copy_bandwidth(torch, nbytes: int = 2**31, repeats: int = 10) -> float:
    """Device-to-device copy rate in bytes/s, counting the read and the write, timed with CUDA events."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * repeats / (start.elapsed_time(end) / 1e3)


def bench_compile(workdir: Path, checkpoint_name: str) -> dict:
    """torch.compile's batch-1 decode rate, as transformers documents it: a static KV cache and the forward
    compiled with mode="reduce-overhead" (CUDA graphs); rate = (time of 1 + N tokens - time of 1 token) / N,
    after two warm-up runs that compile the prefill and decode shapes."""
    import torch
    from transformers import AutoModelForCausalLM

    checkpoint = workdir / "checkpoints" / checkpoint_name
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float16, attn_implementation="sdpa")
    model = model.to("cuda").eval()
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.tensor(bench_prompts(model.config.vocab_size, 1, 512), device="cuda")

    def generate(new_tokens: int) -> None:
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       cache_implementation="static", disable_compile=True, pad_token_id=0)
        torch.cuda.synchronize()

    for _ in range(2):
        generate(8)
    one = median_seconds(lambda: generate(1))
    many = median_seconds(lambda: generate(1 + BENCH_DECODE_TOKENS))
    result = {"decode_tokens_per_s": BENCH_DECODE_TOKENS / (many - one)}
    print(json.dumps(result), flush=True)
    return result


WORKERS = {"correctness": correctness, "serve": serve, "bench-ember": bench_ember, "bench-torch": bench_torch,
           "bench-compile": bench_compile}


def main() -> None:
    """`gpu_check_device.py WORKER WORKDIR OUT_JSON [ARG]`: run one worker, write its result."""
    worker, workdir, out, *args = sys.argv[1:]
    Path(out).write_text(json.dumps(WORKERS[worker](Path(workdir), *args)), encoding="utf-8")


if __name__ == "__main__":
    main()
