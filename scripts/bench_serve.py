"""`ember serve` under load next to llama.cpp's own server (llama-cpp-python's `llama_cpp.server`): one run.

For each model (the ~110M Llama shape with random weights, made by `peers.make_random_llama`
if missing, and the demo model; `--models 1b` adds the Llama-3.2-1B shape, whose weights outgrow
any CPU cache as real models do) and each `--quant` format, ember compiles the checkpoint
(`--max-batch` = the highest concurrency) and `peers.write_gguf` writes the same weights as the
matching GGUF type (q8f32 -> Q8_0, q4f32 -> Q4_0); llama.cpp is the `--llama-cpp-level`
build (default `native`) of `build_llama_cpp.py` (cached under ~/.cache/ember/llama-cpp/, put
on PYTHONPATH). Each server runs alone in its own process on `--threads` threads, and serves the same requests: random
prompt and output lengths drawn once from `--seed`, greedy, streamed (read by `sse_client.py`, a lean
client: the official `openai` client's own CPU time, on the cores the server computes on, was up to
a quarter of a level's time; `--client openai` uses it), at each `--concurrency` (that many clients,
each sending its next request when the previous one ends). ember's KV cache is `--kv-quant`
(default f16, as llama.cpp's). The levels run round-robin, `--rounds` times (this host's speed
drifts by up to 20% over minutes, and a ratio of two levels measured minutes apart would show
it). Per server and concurrency, from the round of median throughput: total output tok/s
(tokens over the level's wall time), p50/p99 time to first token and time per output token
(per request, the time between its first and last token over its tokens after the first);
beside it the lowest and highest tok/s of the rounds, and ember's throughput over its lowest
concurrency's, the median of each round's ratio.

`--servers` may add `ember-api`: the same requests through ember's Python API (`Scheduler.submit`,
the object `ember serve` wraps) in a process of its own, no HTTP and no HTTP client. Its rows
show what batching gives before the HTTP stack and the client take their share of the cores.

Both servers read the same token ids. The GGUF's vocabulary is placeholder pieces with byte
fallback, so a prompt is random letters that llama.cpp's server tokenizes (/extras/tokenize)
into exactly the drawn length; ember gets those ids (a token-id prompt on /v1/completions).
Outputs stop at the model's end-of-sequence token as in any chat, so the tokens generated are
counted and shown, not assumed.

Decode stall: a stream runs, then a `--stall-prompt`-token prompt arrives: the longest gap
between two tokens of the running stream while the long prompt is read, next to its median
gap before, and the long request's time to first token (for models whose context holds it).
llama_cpp.server serves one request at a time, so there the long prompt waits for the stream.

Prefix caching (`--shared-prefix`): one request at a time, prompts of one shared prefix (a system
prompt) with distinct ends, timed against prompts of the same length that share nothing: the
median TTFT after the first shared one, and for ember the share of the shared prompts' tokens its
prefix cache served (`/metrics`). llama-cpp-python reuses the longest common prefix of the
previous prompt, so it gains on this pattern too.

    python scripts/bench_serve.py --quant q4f32,q8f32 --threads 2            # the full run (minutes)
    python scripts/bench_serve.py --models demo --quant q4f32 --concurrency 1,2 --requests 4   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import ember

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cpu  # noqa: E402
import build_llama_cpp  # noqa: E402
import peers  # noqa: E402
import sse_client  # noqa: E402

GGUF_TYPES = dict((ours, theirs) for ours, theirs in bench_cpu.FORMAT_PAIRS)
SERVERS = ("ember", "ember-api", "llama.cpp")
LLAMA_SERVER_MODULES = ("sse_starlette", "starlette_context", "pydantic_settings", "fastapi", "uvicorn")
START_TIMEOUT = 300  # seconds for a server to load its model and answer


@dataclass
class Reply:
    """One streamed request, client side: when it was sent and when each token arrived."""

    sent: float
    token_times: list[float]
    tokens: int  # the server's usage count where it gives one, else the chunks that carried a token

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def tpot(self) -> float | None:
        times = self.token_times
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


class Served:
    """A server process (ember's or llama.cpp's) on a free loopback port, and how to ask it for tokens (`client`:
    `client_of`'s kind)."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], port: int, model: str,
                 log_path: Path, client: str = "raw") -> None:
        self.name, self.model, self.port, self.client = name, model, port, client
        self.base = f"http://127.0.0.1:{port}"
        self._log = log_path.open("w")
        self.process = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not start; its log: {log_path}")
            time.sleep(0.5)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/v1/models", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def post(self, path: str, body: dict) -> dict:
        """POST `body` as JSON, the parsed answer."""
        request = urllib.request.Request(self.base + path, json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_ember(artifact: Path, threads: int, log_dir: Path, client: str = "raw") -> Served:
    port = free_port()
    command = [sys.executable, "-m", "ember", "serve", str(artifact), "--port", str(port), "--threads", str(threads),
               "--max-queue", "4096"]
    return Served("ember", command, dict(os.environ), port, artifact.name, log_dir / f"ember-{artifact.name}.log",
                  client)


def start_llama_cpp(gguf: Path, package: Path, context: int, threads: int, log_dir: Path,
                    client: str = "raw") -> Served:
    port = free_port()
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", gguf.stem,
               "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(context), "--n_batch", "512",
               "--n_threads", str(threads), "--n_threads_batch", str(threads), "--verbose", "False",
               # By default a new request interrupts the one streaming: under load most would end cut short.
               "--interrupt_requests", "False"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package), os.environ.get("PYTHONPATH", "")])}
    return Served("llama.cpp", command, env, port, gguf.stem, log_dir / f"llama-cpp-{gguf.stem}.log", client)


def random_letters(count: int, rng: np.random.Generator) -> str:
    return "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=count))


def prompt_of_length(server: Served, length: int, rng: np.random.Generator) -> tuple[str, list[int]]:
    """Random letters that llama.cpp's server reads as exactly `length` tokens, and those token ids."""
    letters = random_letters(length, rng)
    count = length
    for _ in range(4):  # the placeholder vocabulary falls back to one byte token per letter, plus BOS and a prefix
        ids = server.post("/extras/tokenize", {"input": letters[:count]})["tokens"]
        if len(ids) == length:
            return letters[:count], ids
        count -= len(ids) - length
    raise RuntimeError(f"no prompt of {length} tokens: {count} letters give {len(ids)}")


async def stream(client, served: Served, prompt: str | list[int], max_tokens: int,
                 times: list[float] | None = None, stop: asyncio.Event | None = None) -> Reply:
    """Send one greedy streamed completion and time its tokens into `times`; close it early once `stop` is set."""
    body = {"model": served.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    if served.name == "ember":
        body["stream_options"] = {"include_usage": True}
    times = [] if times is None else times
    usage = None
    sent = time.perf_counter()
    events = client.events("/v1/completions", body)
    async for chunk in events:
        if chunk.get("usage"):
            usage = chunk["usage"]["completion_tokens"]
        # A token's chunk, unless it is a closing one with no text (llama.cpp's; ember's last token, without a
        # tokenizer, is missed too: a stream's time per token is over the gaps between the chunks timed).
        choice = chunk["choices"][0] if chunk.get("choices") else None
        if choice and (choice.get("text") or choice.get("finish_reason") is None or not times):
            times.append(time.perf_counter())
        if stop is not None and stop.is_set():
            await events.aclose()
            break
    return Reply(sent, times, usage if usage is not None else len(times))


class OpenAIClient:
    """The official `openai` client (`--client openai`), without retries; its chunks as the dicts `stream` reads."""

    def __init__(self, served: Served) -> None:
        import openai

        self._client = openai.AsyncOpenAI(base_url=served.base + "/v1", api_key="unused", max_retries=0, timeout=600)

    async def events(self, path: str, body: dict[str, Any]):
        assert path == "/v1/completions"
        response = await self._client.completions.create(**body)
        try:
            async for chunk in response:
                yield {"usage": chunk.usage and {"completion_tokens": chunk.usage.completion_tokens},
                       "choices": [{"text": c.text, "finish_reason": c.finish_reason} for c in chunk.choices]}
        finally:
            await response.close()

    async def close(self) -> None:
        await self._client.close()


def client_of(served: Served):
    """A client of `served`: `sse_client`'s lean one (raw) or the official `openai` client."""
    return sse_client.ConnectionPool("127.0.0.1", served.port) if served.client == "raw" else OpenAIClient(served)


async def run_concurrently(send: Callable[[str | list[int], int], Awaitable[Reply]],
                           requests: list[tuple[str | list[int], int]], concurrency: int) -> tuple[list[Reply], float]:
    """Every request through `send`, `concurrency` at a time (each client sends its next request when the previous
    one ends); the replies and the wall time."""
    pending = iter(requests)
    replies: list[Reply] = []

    async def worker() -> None:
        for prompt, max_tokens in pending:
            replies.append(await send(prompt, max_tokens))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return replies, time.perf_counter() - start


async def run_level(served: Served, requests: list[tuple[str | list[int], int]], concurrency: int
                    ) -> tuple[list[Reply], float]:
    """Every request to `served`, `concurrency` at a time; the replies and the wall time."""
    client = client_of(served)
    result = await run_concurrently(lambda prompt, max_tokens: stream(client, served, prompt, max_tokens), requests,
                                    concurrency)
    await client.close()
    return result


def run_api_levels(artifact: Path, requests: list[tuple[list[int], int]], concurrencies: list[int], rounds: int,
                   threads: int, quiet_wait: float) -> tuple[dict[int, list[dict[str, float]]], int]:
    """Every level of `rounds` rounds through ember's Python API in a fresh process (TVM's thread count is fixed
    per process, and this one compiled the models): rows by concurrency, and how many started on a busy machine."""
    result = peers._run_isolated("bench_serve._api_levels_worker", artifact=str(artifact), requests=requests,
                                 concurrencies=concurrencies, rounds=rounds, threads=threads, quiet_wait=quiet_wait)
    rows = {int(c): levels for c, levels in result["rows"].items()}
    for round_ in range(rounds):
        for concurrency in concurrencies:
            print(f"  ember-api round {round_ + 1} c{concurrency}: {rows[concurrency][round_]['tok_s']:.1f} tok/s")
    return rows, result["busy"]


def _api_levels_worker(artifact: str, requests: list[list], concurrencies: list[int], rounds: int, threads: int,
                       quiet_wait: float) -> dict[str, Any]:
    """`run_api_levels`' process: `Scheduler` as `ember serve` makes it, greedy, each stream's tokens timed."""
    from ember.runtime import Engine, load_artifact
    from ember.runtime.sampling import SamplingParams
    from ember.runtime.scheduler import Scheduler

    todo = [(prompt, max_tokens) for prompt, max_tokens in requests]
    with Scheduler(Engine(load_artifact(artifact, threads=threads))) as scheduler:
        async def send(prompt: list[int], max_tokens: int) -> Reply:
            sent, times = time.perf_counter(), []
            async for event in await scheduler.submit(prompt, SamplingParams(temperature=0.0,
                                                                             max_new_tokens=max_tokens)):
                times += [time.perf_counter()] * len(event.token_ids)
            return Reply(sent, times, len(times))

        asyncio.run(run_concurrently(send, todo[:1], 1))  # warm-up
        rows: dict[int, list[dict[str, float]]] = {}
        busy = 0
        for _ in range(rounds):
            for concurrency in concurrencies:
                busy += not peers.wait_for_quiet_machine(timeout_s=quiet_wait)
                rows.setdefault(concurrency, []).append(level_row(*asyncio.run(run_concurrently(send, todo,
                                                                                                concurrency))))
    return {"rows": rows, "busy": busy}


async def measure_stall(served: Served, short: str | list[int], long: str | list[int], max_tokens: int
                        ) -> dict[str, float]:
    """The longest gap of a stream of `max_tokens` while a long prompt arrives, its median gap before, the long TTFT."""
    client = client_of(served)
    times: list[float] = []
    done = asyncio.Event()
    running = asyncio.ensure_future(stream(client, served, short, max_tokens, times, done))
    while len(times) < 16:  # let the stream settle into decoding before the long prompt arrives
        if running.done():
            await running  # its error, if it failed
            raise RuntimeError(f"{served.name}: the running stream ended after {len(times)} tokens")
        await asyncio.sleep(0.01)
    arrived = time.perf_counter()
    long_reply = await stream(client, served, long, 1)
    done.set()
    await running
    await client.close()
    gaps_before = [b - a for a, b in zip(times, times[1:]) if b <= arrived]
    during = [b - a for a, b in zip(times, times[1:]) if b > arrived and a < long_reply.token_times[0]]
    return {"median_gap": statistics.median(gaps_before), "stall": max(during, default=float("nan")),
            "long_ttft": long_reply.ttft}


Prompt = tuple[str | None, list[int]]  # its text (None without llama.cpp's tokenizer) and its token ids


def draw_prompts(tokenizer: Served | None, lengths: list[int], rng: np.random.Generator) -> list[Prompt]:
    """(text, token ids) of prompts of `lengths` tokens; without llama.cpp's tokenizer, random byte tokens only."""
    if tokenizer is None:
        return [(None, [1] + rng.integers(3, 259, n - 1).tolist()) for n in lengths]
    return [prompt_of_length(tokenizer, n, rng) for n in lengths]


def prefix_prompts(tokenizer: Served | None, prefix_len: int, suffix_len: int, count: int,
                   rng: np.random.Generator) -> tuple[list[Prompt], list[Prompt]]:
    """`count` prompts of one shared `prefix_len`-token prefix and distinct `suffix_len`-token ends (as a system
    prompt and its questions), and `count` prompts of the same length that share nothing."""
    if tokenizer is None:
        prefix = [1] + rng.integers(3, 259, prefix_len - 1).tolist()
        shared = [(None, prefix + rng.integers(3, 259, suffix_len).tolist()) for _ in range(count)]
        return shared, draw_prompts(None, [prefix_len + suffix_len] * count, rng)
    prefix, _ = prompt_of_length(tokenizer, prefix_len, rng)
    shared = []
    for _ in range(count):
        text = prefix + random_letters(suffix_len, rng)
        shared.append((text, tokenizer.post("/extras/tokenize", {"input": text})["tokens"]))
    return shared, draw_prompts(tokenizer, [len(shared[0][1])] * count, rng)


def metrics_of(served: Served) -> dict[str, float]:
    """ember's /metrics counters without labels, by name."""
    with urllib.request.urlopen(f"{served.base}/metrics", timeout=30) as response:
        text = response.read().decode()
    samples = [line for line in text.splitlines() if line and not line.startswith("#") and "{" not in line]
    return {name: float(value) for name, _, value in (line.partition(" ") for line in samples)}


async def measure_prefix_cache(served: Served, shared: list, unshared: list, max_tokens: int) -> dict[str, float]:
    """One request at a time: the TTFT of prompts that share nothing, then of prompts sharing a prefix (the first
    of which fills the cache), and for ember the share of the shared prompts' tokens its prefix cache served."""
    client = client_of(served)
    before = metrics_of(served) if served.name == "ember" else None
    cold = [(await stream(client, served, prompt, max_tokens)).ttft for prompt in unshared]
    middle = metrics_of(served) if before else None
    warm = [(await stream(client, served, prompt, max_tokens)).ttft for prompt in shared]
    await client.close()
    result = {"cold_ttft": statistics.median(cold), "first_ttft": warm[0], "warm_ttft": statistics.median(warm[1:])}
    if before:
        after = metrics_of(served)
        hit_tokens = "ember_prefix_cache_hit_tokens_total"
        prompted = after["ember_prompt_tokens_total"] - middle["ember_prompt_tokens_total"]
        result["hit_share"] = (after[hit_tokens] - middle[hit_tokens]) / prompted
        result["cold_hits"] = middle[hit_tokens] - before[hit_tokens]
    return result


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def level_row(replies: list[Reply], wall: float) -> dict[str, float]:
    """A concurrency level's figures: tokens, tok/s, TTFT and TPOT percentiles (seconds)."""
    tokens = sum(reply.tokens for reply in replies)
    ttfts = [reply.ttft for reply in replies if reply.token_times]
    tpots = [reply.tpot for reply in replies if reply.tpot is not None]
    return {"tokens": tokens, "tok_s": tokens / wall, "ttft50": percentile(ttfts, 50), "ttft99": percentile(ttfts, 99),
            "tpot50": percentile(tpots, 50), "tpot99": percentile(tpots, 99)}


def median_round(rounds: list[dict[str, float]]) -> dict[str, float]:
    """The round of median throughput (the lower middle one of an even count), with the rounds' lowest and
    highest tok/s."""
    ordered = sorted(rounds, key=lambda row: row["tok_s"])
    return {**ordered[(len(ordered) - 1) // 2], "low": ordered[0]["tok_s"], "high": ordered[-1]["tok_s"]}


def print_table(title: str, rounds: dict[tuple[str, int], list[dict[str, float]]], concurrencies: list[int]) -> None:
    print(f"\n{title}")
    print(f"{'server':<10} {'conc':>4} {'out tokens':>10} {'tok/s':>8} {'rounds':>15} {'TTFT p50 ms':>11} "
          f"{'TTFT p99 ms':>11} {'TPOT p50 ms':>11} {'TPOT p99 ms':>11}")
    rows = {key: median_round(values) for key, values in rounds.items()}
    for (server, concurrency), row in rows.items():
        spread = f"{row['low']:.0f}-{row['high']:.0f}"
        print(f"{server:<10} {concurrency:>4} {row['tokens']:>10} {row['tok_s']:>8.1f} {spread:>15} "
              f"{row['ttft50'] * 1e3:>11.1f} {row['ttft99'] * 1e3:>11.1f} {row['tpot50'] * 1e3:>11.1f} "
              f"{row['tpot99'] * 1e3:>11.1f}")
    for name in ("ember", "ember-api"):
        levels = {c: values for (server, c), values in rounds.items() if server == name}
        if levels:
            first = min(levels)
            # Each round's ratio: its levels ran minutes apart at most, the rounds further apart.
            ratios = {c: statistics.median(row["tok_s"] / base["tok_s"] for row, base in zip(values, levels[first]))
                      for c, values in levels.items()}
            print(f"  {name} tok/s over its concurrency {first} (median of the rounds' ratios): "
                  + ", ".join(f"c{c} {ratios[c]:.2f}x" for c in concurrencies if c in ratios))
    ember = {c for (server, c) in rounds if server == "ember"}
    llama = {c: row["tok_s"] for (server, c), row in rows.items() if server == "llama.cpp"}
    if ember and llama:
        print("  ember / llama.cpp tok/s: "
              + ", ".join(f"c{c} {rows['ember', c]['tok_s'] / llama[c]:.2f}x"
                          for c in concurrencies if c in ember and c in llama))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="110m,demo",
                        help="110m and 1b (random weights, --model, --model-1b) and/or demo")
    parser.add_argument("--model", type=Path, default=Path("/tmp/llama110m"),
                        help="the 110m checkpoint dir; created with random weights if missing")
    parser.add_argument("--model-1b", type=Path, default=Path("/tmp/llama1b"),
                        help="the 1b checkpoint dir (the Llama-3.2-1B shape, 1.2B parameters, 5 GB of float32 "
                             "safetensors); created with random weights if missing")
    parser.add_argument("--quant", default="q4f32,q8f32", help=f"ember formats ({', '.join(GGUF_TYPES)})")
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    parser.add_argument("--rounds", type=int, default=3, help="times each level runs, round-robin over the levels")
    parser.add_argument("--prompt-len", default="16,128", help="MIN,MAX prompt tokens (uniform, seeded)")
    parser.add_argument("--output-len", default="16,96", help="MIN,MAX max_tokens (uniform, seeded)")
    parser.add_argument("--stall-prompt", type=int, default=2000, help="tokens of the prompt that arrives mid-stream")
    parser.add_argument("--shared-prefix", default="1024,32,8",
                        help="PREFIX,SUFFIX,COUNT: COUNT prompts of one PREFIX-token prefix and SUFFIX distinct "
                             "tokens, one at a time, timed against COUNT that share nothing (prefix caching); "
                             "PREFIX is cut to fit the context")
    parser.add_argument("--kv-quant", choices=["none", "q8", "f16"], default="f16",
                        help="ember's KV cache (compile --kv-quant; none: float32). Default f16, the type of "
                             "llama.cpp's cache beside it")
    parser.add_argument("--client", choices=["raw", "openai"], default="raw",
                        help="the load's HTTP client: raw, sse_client.py's (asyncio streams and json, as load "
                             "generators read streams), or the official openai client (pydantic objects per chunk: "
                             "CPU time taken from the server on a small host)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--servers", default="ember,llama.cpp",
                        help=f"of {', '.join(SERVERS)}; ember-api: ember's Python API, no HTTP (see above)")
    parser.add_argument("--llama-cpp-level", default="native", choices=tuple(build_llama_cpp.LEVELS),
                        help="the llama.cpp build (scripts/build_llama_cpp.py's ISA levels; default native, "
                             "-march=native, built on first use in ~10 minutes)")
    parser.add_argument("--quiet-wait", type=float, default=60,
                        help="seconds to wait for an idle machine before each level (then it runs anyway)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/ember-bench-serve"),
                        help="artifacts, GGUF files and server logs")
    args = parser.parse_args()
    split = lambda text: [item for item in text.split(",") if item]  # noqa: E731
    whole = lambda text: [int(v) if v.strip().isdigit() else 0 for v in split(text)]  # noqa: E731
    concurrencies = sorted(whole(args.concurrency))
    if min(concurrencies) < 1:
        parser.error(f"--concurrency {args.concurrency}: comma-separated whole numbers, at least 1")
    lengths = {name: tuple(whole(getattr(args, name))) for name in ("prompt_len", "output_len")}
    for name, bounds in lengths.items():
        if len(bounds) != 2 or not 1 <= bounds[0] <= bounds[1]:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: MIN,MAX whole numbers, 1 <= MIN <= MAX")
    for option in ("requests", "stall_prompt", "threads"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} {getattr(args, option)}: at least 1")
    parts = args.shared_prefix.split(",")
    shared_prefix = tuple(int(v) for v in parts) if all(v.strip().isdigit() for v in parts) else ()
    if len(shared_prefix) != 3 or min(shared_prefix) < 1 or shared_prefix[2] < 2:
        parser.error(f"--shared-prefix {args.shared_prefix}: PREFIX,SUFFIX,COUNT, positive, COUNT at least 2")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    servers = split(args.servers)
    if not servers or any(server not in SERVERS for server in servers):
        parser.error(f"--servers {args.servers}: a list of {', '.join(SERVERS)}")
    unknown = [q for q in split(args.quant) if q not in GGUF_TYPES]
    if unknown:
        parser.error(f"--quant: {unknown[0]} has no llama.cpp type beside it (known: {', '.join(GGUF_TYPES)})")
    package = None
    if "llama.cpp" in servers:
        missing = [m for m in LLAMA_SERVER_MODULES if not _importable(m)]
        if missing:
            sys.exit(f"llama_cpp.server needs {', '.join(missing)}: pip install sse-starlette starlette-context "
                     "pydantic-settings fastapi uvicorn (or --servers ember)")
        package = build_llama_cpp.ensure_built(build_llama_cpp.LEVELS[args.llama_cpp_level])
    args.work_dir.mkdir(parents=True, exist_ok=True)

    from ember.driver.compiler import CompileOptions, compile_model

    checkpoints = {}
    for name in split(args.models):
        if name in ("110m", "1b"):
            directory = args.model if name == "110m" else args.model_1b
            if not (directory / "config.json").exists():
                peers.make_random_llama(directory, **bench_cpu.SHAPES[name])
            checkpoints[name] = directory
        elif name == "demo":
            checkpoints[name] = ember.DEMO_MODEL_DIR
        else:
            parser.error(f"--models: unknown model {name!r} (110m, 1b, demo)")

    rng = np.random.default_rng(args.seed)
    shapes = [(int(rng.integers(lengths["prompt_len"][0], lengths["prompt_len"][1] + 1)),
               int(rng.integers(lengths["output_len"][0], lengths["output_len"][1] + 1))) for _ in range(args.requests)]
    print(f"{bench_cpu.host_line()}; threads per server: {args.threads}")
    print(f"{args.requests} requests per level, prompt {lengths['prompt_len']} and max_tokens {lengths['output_len']} "
          f"tokens (seed {args.seed}), greedy, streamed" + (f"; llama.cpp: llama_cpp.server from {package}" if package
                                                             else ""))

    for model_name, checkpoint in checkpoints.items():
        context = json.loads((checkpoint / "config.json").read_text()).get("max_position_embeddings", 2048)
        for fmt in split(args.quant):
            qtype = GGUF_TYPES[fmt]
            kv_quant = None if args.kv_quant == "none" else args.kv_quant
            artifact = args.work_dir / (f"{model_name}-{fmt}" + (f"-kv-{kv_quant}" if kv_quant else ""))
            gguf = args.work_dir / f"{model_name}-{qtype}.gguf"
            start = time.perf_counter()
            compile_model(checkpoint, artifact, CompileOptions(quantization=fmt, max_batch=max(concurrencies),
                                                               kv_quant=kv_quant, show_progress=False))
            print(f"\n{model_name} {fmt}: compiled in {time.perf_counter() - start:.1f} s (max batch "
                  f"{max(concurrencies)}, context {context}, KV cache {kv_quant or 'float32'})", flush=True)
            if not gguf.exists():
                peers._run_isolated("_write_gguf_worker", model_dir=str(checkpoint), out_path=str(gguf), qtype=qtype)
            # The prompts are read by llama.cpp's tokenizer once, for both servers.
            tokenizer = start_llama_cpp(gguf, package, context, args.threads, args.work_dir) if package else None
            try:
                prompt_rng = np.random.default_rng(args.seed)
                prompts = draw_prompts(tokenizer, [p for p, _ in shapes], prompt_rng)
                stall_prompts = (draw_prompts(tokenizer, [16, args.stall_prompt], prompt_rng)
                                 if args.stall_prompt < context else None)
                prefix_len = min(shared_prefix[0], context - shared_prefix[1] - 32)
                shared, unshared = prefix_prompts(tokenizer, prefix_len, shared_prefix[1], shared_prefix[2], prompt_rng)
            finally:
                if tokenizer:
                    tokenizer.stop()
            rows, stalls, prefixes, busy = {}, {}, {}, 0
            for server in servers:
                if server == "ember-api":
                    requests = [(prompt[1], out) for prompt, (_, out) in zip(prompts, shapes)]
                    api_rows, api_busy = run_api_levels(artifact, requests, concurrencies, args.rounds, args.threads,
                                                        args.quiet_wait)
                    for concurrency, levels in api_rows.items():
                        rows[server, concurrency] = levels
                    busy += api_busy
                    continue
                served = (start_ember(artifact, args.threads, args.work_dir, args.client) if server == "ember" else
                          start_llama_cpp(gguf, package, context, args.threads, args.work_dir, args.client))
                pick = 1 if server == "ember" else 0  # ember reads the token ids, llama.cpp the text
                requests = [(prompt[pick], out) for prompt, (_, out) in zip(prompts, shapes)]
                try:
                    asyncio.run(run_level(served, requests[:1], 1))  # warm-up
                    for round_ in range(args.rounds):
                        for concurrency in concurrencies:
                            # Two busy cores slow any server, and llama.cpp's spinning threads far more than ember's.
                            busy += not peers.wait_for_quiet_machine(timeout_s=args.quiet_wait)
                            row = level_row(*asyncio.run(run_level(served, requests, concurrency)))
                            rows.setdefault((server, concurrency), []).append(row)
                            print(f"  {server} round {round_ + 1} c{concurrency}: {row['tok_s']:.1f} tok/s", flush=True)
                    if stall_prompts:
                        short, long = (prompt[pick] for prompt in stall_prompts)
                        stalls[server] = asyncio.run(measure_stall(served, short, long, min(256, context - 16)))
                    busy += not peers.wait_for_quiet_machine(timeout_s=args.quiet_wait)
                    prefixes[server] = asyncio.run(measure_prefix_cache(
                        served, [p[pick] for p in shared], [p[pick] for p in unshared], 8))
                finally:
                    served.stop()
            print_table(f"{model_name} {fmt} (llama.cpp {qtype}), {args.threads} threads", rows, concurrencies)
            if busy:
                print(f"  warning: {busy} of {sum(map(len, rows.values())) + len(prefixes)} measurements started on a "
                      "busy machine")
            for server, stall in stalls.items():
                print(f"  {server}: a {args.stall_prompt}-token prompt arriving mid-stream: longest gap of the running "
                      f"stream {stall['stall'] * 1e3:.0f} ms (median gap before {stall['median_gap'] * 1e3:.0f} ms); "
                      f"its own TTFT {stall['long_ttft']:.2f} s")
            for server, prefix in prefixes.items():
                hits = (f"; prefix cache served {prefix['hit_share']:.0%} of the shared prompts' tokens"
                        f" ({prefix['cold_hits']:.0f} tokens of the unshared ones)" if "hit_share" in prefix else "")
                print(f"  {server}: {shared_prefix[2]} prompts of {len(shared[0][1])} tokens sharing {prefix_len}, one "
                      f"at a time: TTFT median {prefix['warm_ttft'] * 1e3:.0f} ms after the first "
                      f"({prefix['first_ttft'] * 1e3:.0f} ms), {prefix['cold_ttft'] * 1e3:.0f} ms for prompts sharing "
                      f"nothing ({prefix['cold_ttft'] / prefix['warm_ttft']:.1f}x){hits}")
            if not stall_prompts:
                print(f"  decode stall not measured: the context of {context} tokens cannot hold a "
                      f"{args.stall_prompt}-token prompt")


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    main()
