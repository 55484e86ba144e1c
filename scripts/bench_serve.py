"""`ember serve` under load next to llama.cpp's own server, `llama-server` (continuous batching): one run.

For each model (the ~110M Llama shape and the Llama-3.2-1B shape, random weights made by
`peers.make_random_llama` if missing; `demo` adds the demo model) and each `--quant` format,
ember compiles the checkpoint (`--max-batch` = llama-server's slots, below) and `peers.write_gguf`
writes the same weights as the matching GGUF type with llama.cpp's converter and quantizer
(q8f32 -> Q8_0, q4f32 -> Q4_0).

The peer is llama.cpp's `llama-server` built by `build_llama_cpp.py --server` for
`--llama-cpp-level` (default avx512-vnni: AVX-512 with VNNI and BF16, GGML_NATIVE=OFF and no
AMX, whose llama.cpp path crashes on Q8_0/Q4_0 on the Sapphire Rapids host; cached under
~/.cache/ember/llama-server/). It runs `--parallel` slots (the highest concurrency, or the most
stall streams plus one) over one unified KV cache of slots x per-slot context tokens, the
per-slot context holding the longest request (the stall prompt included), with its own
defaults for flash attention and the KV cache type (printed in the header; f16, as ember's
default `--kv-quant` here). `--servers` may add `llama-cpp-python` (`llama_cpp.server`, one
request at a time) and `ember-api`: the same requests through ember's Python API
(`Scheduler.submit`, the object `ember serve` wraps) in a process of its own, no HTTP.

Every server runs in its own process group on `--threads` threads, loaded side by side and
idle while another is measured; each is ready once its health route answers and is stopped by
its process group. All serve the same requests: random prompt and output lengths drawn once
from `--seed`, each level with prompts of its own (a repeated prompt would come from the
servers' prefix caches), greedy, streamed (read by `sse_client.py`, a lean client: the official `openai`
client's own CPU time, on the cores the server computes on, was up to a quarter of a level's
time; `--client openai` uses it), at each `--concurrency` (that many clients, each sending its
next request when the previous one ends). Levels run round-robin: each round runs each
concurrency on each server in turn, `--rounds` times (this host's speed drifts by up to 20%
over minutes). Per server and concurrency, from the round of median throughput: total output
tok/s (tokens over the level's wall time), p50/p99 time to first token and time per output
token (per request, the time between its first and last token over its tokens after the
first); beside it the lowest and highest tok/s of the rounds, each server's throughput over
its lowest concurrency's (c8/c1 among them; the median of each round's ratio), and ember over
llama.cpp.

All servers read the same token ids. The GGUF's vocabulary is placeholder pieces with byte
fallback, so a prompt is random letters that llama.cpp's server tokenizes (/tokenize, BOS
added as in a completion) into exactly the drawn length; ember gets those ids (a token-id
prompt on /v1/completions). Outputs stop at the model's end-of-sequence token as in any chat,
so the tokens generated are counted (the servers' usage) and shown, not assumed.

Decode stall: `--stall-streams` streams decode, then a `--stall-prompt`-token prompt arrives:
the longest gap between two tokens of any running stream while the long prompt is read, next
to their median gap before, and the long request's time to first token (for models whose
context holds it). Not measured for llama-cpp-python, whose streams would queue.

Prefix caching (`--shared-prefix`): one request at a time, prompts of one shared prefix (a system
prompt) with distinct ends, timed against prompts of the same length that share nothing: the
median TTFT after the first shared one, and for ember the share of the shared prompts' tokens its
prefix cache served (`/metrics`). llama-server reuses a slot's cached prefix, so it gains too.

    python scripts/bench_serve.py --threads 2                   # the full run (110m and 1b, q4f32 and q8f32)
    python scripts/bench_serve.py --models 110m --quant q8f32 --concurrency 1,4 --requests 8 --rounds 1 \
        --stall-streams 1 --shared-prefix 256,16,2             # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import json
import os
import re
import signal
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
SERVERS = ("ember", "ember-api", "llama.cpp", "llama-cpp-python")
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
    """A server process (ember's or llama.cpp's) on a free loopback port, in a process group of its own, and how to
    ask it for tokens (`client`: `client_of`'s kind); ready once `health` answers 200."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], port: int, model: str,
                 log_path: Path, client: str = "raw", health: str = "/v1/models") -> None:
        self.name, self.model, self.port, self.client, self.health = name, model, port, client, health
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = log_path.open("w")
        self.process = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not start; its log: {log_path}")
            time.sleep(0.5)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.base + self.health, timeout=5) as response:
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
        """Stop the server's process group (its pid is the group's id), killing it if it outlives 30 s."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=30)
                break
            except subprocess.TimeoutExpired:
                continue
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


def slot_context(longest_requests: list[int], model_context: int, granule: int = 256) -> int:
    """Tokens of KV cache one llama-server slot needs to hold the longest request it is sent (prompt plus
    max_tokens), rounded up to `granule`, at most the model's context."""
    return min(model_context, -(-max(longest_requests) // granule) * granule)


def llama_server_argv(binary: Path, gguf: Path, port: int, slots: int, per_slot: int, threads: int) -> list[str]:
    """llama-server's command line: `slots` slots sharing one unified KV cache of `slots` x `per_slot` tokens,
    `threads` threads for prompts and decoding, flash attention and KV cache type left at its defaults."""
    return [str(binary), "--model", str(gguf), "--alias", gguf.stem, "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(slots), "--kv-unified", "--ctx-size", str(slots * per_slot),
            "--threads", str(threads), "--threads-batch", str(threads), "--no-webui"]


def llama_server_defaults(binary: Path) -> dict[str, str]:
    """What llama-server's `--help` says its flash attention and K/V cache types default to."""
    text = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60).stdout
    found = {"flash attention": re.search(r"Flash Attention use \(.*default: '(\w+)'", text),
             "K cache": re.search(r"KV cache data type for K\s.*?\(default: (\w+)\)", text, re.DOTALL),
             "V cache": re.search(r"KV cache data type for V\s.*?\(default: (\w+)\)", text, re.DOTALL)}
    return {name: match.group(1) if match else "?" for name, match in found.items()}


def start_llama_server(gguf: Path, binary: Path, slots: int, per_slot: int, threads: int, log_dir: Path,
                       client: str = "raw") -> Served:
    """llama.cpp's own server on `gguf`, ready once its /health answers (the model loaded)."""
    port = free_port()
    return Served("llama.cpp", llama_server_argv(binary, gguf, port, slots, per_slot, threads), dict(os.environ),
                  port, gguf.stem, log_dir / f"llama-server-{gguf.stem}.log", client, health="/health")


def start_llama_cpp_python(gguf: Path, package: Path, context: int, threads: int, log_dir: Path,
                           client: str = "raw") -> Served:
    """llama-cpp-python's `llama_cpp.server`: one request at a time."""
    port = free_port()
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", gguf.stem,
               "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(context), "--n_batch", "512",
               "--n_threads", str(threads), "--n_threads_batch", str(threads), "--verbose", "False",
               # By default a new request interrupts the one streaming: under load most would end cut short.
               "--interrupt_requests", "False"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package), os.environ.get("PYTHONPATH", "")])}
    return Served("llama-cpp-python", command, env, port, gguf.stem, log_dir / f"llama-cpp-{gguf.stem}.log",
                  client)


def random_letters(count: int, rng: np.random.Generator) -> str:
    return "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=count))


def tokenize(server: Served, text: str) -> list[int]:
    """The token ids llama.cpp's server reads `text` as in a completion, BOS included."""
    if server.name == "llama-cpp-python":
        return server.post("/extras/tokenize", {"input": text})["tokens"]
    return server.post("/tokenize", {"content": text, "add_special": True})["tokens"]


def prompt_of_length(server: Served, length: int, rng: np.random.Generator) -> tuple[str, list[int]]:
    """Random letters that llama.cpp's server reads as exactly `length` tokens, and those token ids."""
    letters = random_letters(length, rng)
    count = length
    for _ in range(4):  # the placeholder vocabulary falls back to one byte token per letter, plus BOS and a prefix
        ids = tokenize(server, letters[:count])
        if len(ids) == length:
            return letters[:count], ids
        count -= len(ids) - length
    raise RuntimeError(f"no prompt of {length} tokens: {count} letters give {len(ids)}")


async def stream(client, served: Served, prompt: str | list[int], max_tokens: int,
                 times: list[float] | None = None, stop: asyncio.Event | None = None) -> Reply:
    """Send one greedy streamed completion and time its tokens into `times`; close it early once `stop` is set."""
    body = {"model": served.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    if served.name != "llama-cpp-python":
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


def run_api_levels(artifact: Path, requests: list[list[tuple[list[int], int]]], concurrencies: list[int], rounds: int,
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


def _api_levels_worker(artifact: str, requests: list[list[list]], concurrencies: list[int], rounds: int, threads: int,
                       quiet_wait: float) -> dict[str, Any]:
    """`run_api_levels`' process: `Scheduler` as `ember serve` makes it, greedy, each stream's tokens timed."""
    from ember.runtime import Engine, load_artifact
    from ember.runtime.sampling import SamplingParams
    from ember.serving.scheduler import Scheduler

    todo = [[(prompt, max_tokens) for prompt, max_tokens in level] for level in requests]
    with Scheduler(Engine(load_artifact(artifact, threads=threads))) as scheduler:
        async def send(prompt: list[int], max_tokens: int) -> Reply:
            sent, times = time.perf_counter(), []
            async for event in await scheduler.submit(prompt, SamplingParams(temperature=0.0,
                                                                             max_new_tokens=max_tokens)):
                times += [time.perf_counter()] * len(event.token_ids)
            return Reply(sent, times, len(times))

        asyncio.run(run_concurrently(send, todo[0][:1], 1))  # warm-up
        rows: dict[int, list[dict[str, float]]] = {}
        busy = 0
        for round_ in range(rounds):
            for index, concurrency in enumerate(concurrencies):
                busy += not peers.wait_for_quiet_machine(timeout_s=quiet_wait)
                level = todo[1 + round_ * len(concurrencies) + index]
                rows.setdefault(concurrency, []).append(level_row(*asyncio.run(run_concurrently(send, level,
                                                                                                concurrency))))
    return {"rows": rows, "busy": busy}


async def measure_stall(served: Served, short: str | list[int], long: str | list[int], streams: int, max_tokens: int
                        ) -> dict[str, float]:
    """While `streams` streams of up to `max_tokens` decode, a long prompt arrives: the longest gap between two
    tokens of any running stream while it is read, their median gap before, and the long prompt's TTFT."""
    client = client_of(served)
    token_times: list[list[float]] = [[] for _ in range(streams)]
    done = asyncio.Event()
    running = [asyncio.ensure_future(stream(client, served, short, max_tokens, times, done)) for times in token_times]
    while min(map(len, token_times)) < 16:  # let every stream settle into decoding before the long prompt arrives
        for task, times in zip(running, token_times):
            if task.done():
                await task  # its error, if it failed
                raise RuntimeError(f"{served.name}: a running stream ended after {len(times)} tokens")
        await asyncio.sleep(0.01)
    arrived = time.perf_counter()
    long_reply = await stream(client, served, long, 1)
    done.set()
    await asyncio.gather(*running)
    await client.close()
    gaps = [(a, b) for times in token_times for a, b in zip(times, times[1:])]
    during = [b - a for a, b in gaps if b > arrived and a < long_reply.token_times[0]]
    return {"median_gap": statistics.median(b - a for a, b in gaps if b <= arrived),
            "stall": max(during, default=float("nan")), "long_ttft": long_reply.ttft}


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
        shared.append((text, tokenize(tokenizer, text)))
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
    """Each server's rows by concurrency, its throughput over its lowest concurrency's, and ember over llama.cpp."""
    print(f"\n{title}")
    print(f"{'server':<16} {'conc':>4} {'out tokens':>10} {'tok/s':>8} {'rounds':>15} {'TTFT p50 ms':>11} "
          f"{'TTFT p99 ms':>11} {'TPOT p50 ms':>11} {'TPOT p99 ms':>11}")
    rows = {key: median_round(values) for key, values in rounds.items()}
    for (server, concurrency), row in sorted(rows.items(), key=lambda item: (SERVERS.index(item[0][0]), item[0][1])):
        spread = f"{row['low']:.0f}-{row['high']:.0f}"
        print(f"{server:<16} {concurrency:>4} {row['tokens']:>10} {row['tok_s']:>8.1f} {spread:>15} "
              f"{row['ttft50'] * 1e3:>11.1f} {row['ttft99'] * 1e3:>11.1f} {row['tpot50'] * 1e3:>11.1f} "
              f"{row['tpot99'] * 1e3:>11.1f}")
    for name in SERVERS:
        levels = {c: values for (server, c), values in rounds.items() if server == name}
        if len(levels) > 1:
            first = min(levels)
            # Each round's ratio: its levels ran minutes apart at most, the rounds further apart.
            ratios = {c: statistics.median(row["tok_s"] / base["tok_s"] for row, base in zip(values, levels[first]))
                      for c, values in levels.items()}
            print(f"  {name} tok/s over its c{first} (median of the rounds' ratios): "
                  + ", ".join(f"c{c}/c{first} {ratios[c]:.2f}x" for c in concurrencies if c in ratios and c != first))
    for peer in ("llama.cpp", "llama-cpp-python"):
        both = [c for c in concurrencies if ("ember", c) in rows and (peer, c) in rows]
        if both:
            print(f"  ember / {peer} tok/s: "
                  + ", ".join(f"c{c} {rows['ember', c]['tok_s'] / rows[peer, c]['tok_s']:.2f}x" for c in both))


@dataclass
class Settings:
    """What every model and format of one run shares: the parsed command line and the peers' builds."""

    args: argparse.Namespace
    concurrencies: list[int]
    stall_streams: list[int]
    lengths: dict[str, tuple[int, ...]]
    shared_prefix: tuple[int, ...]
    servers: list[str]
    llama_server: Path | None
    package: Path | None

    @property
    def slots(self) -> int:
        """llama-server's slots: the highest concurrency, and the most stall streams plus the long prompt."""
        return max(self.concurrencies + [streams + 1 for streams in self.stall_streams])


def parse_settings() -> Settings:
    """The command line, checked (exit 2 on a bad option), and the llama.cpp peers built or found."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="110m,1b",
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
    parser.add_argument("--stall-streams", default="1,8",
                        help="how many streams decode while the long prompt arrives, one measurement each")
    parser.add_argument("--shared-prefix", default="1024,32,8",
                        help="PREFIX,SUFFIX,COUNT: COUNT prompts of one PREFIX-token prefix and SUFFIX distinct "
                             "tokens, one at a time, timed against COUNT that share nothing (prefix caching); "
                             "PREFIX is cut to fit the context")
    parser.add_argument("--target", default="cpu",
                        help="ember's compile --target (default cpu: this machine, every extension it has; e.g. "
                             "'{\"kind\": \"llvm\", \"mcpu\": \"cooperlake\"}' for AVX512-VNNI without AMX)")
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
                        help=f"of {', '.join(SERVERS)}; llama.cpp: its own llama-server; ember-api: ember's Python "
                             "API, no HTTP; llama-cpp-python: its llama_cpp.server, one request at a time")
    parser.add_argument("--llama-cpp-level", default="avx512-vnni", choices=tuple(build_llama_cpp.LEVELS),
                        help="the llama.cpp build (scripts/build_llama_cpp.py's ISA levels; default avx512-vnni: "
                             "AVX-512 with VNNI and BF16, no AMX; built on first use, ~20 minutes on 2 cores)")
    parser.add_argument("--quiet-wait", type=float, default=60,
                        help="seconds to wait for an idle machine before each level (then it runs anyway)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/ember-bench-serve"),
                        help="artifacts, GGUF files and server logs")
    args = parser.parse_args()
    split = lambda text: [item for item in text.split(",") if item]  # noqa: E731
    whole = lambda text: [int(v) if v.strip().isdigit() else 0 for v in split(text)]  # noqa: E731
    concurrencies, stall_streams = sorted(whole(args.concurrency)), sorted(whole(args.stall_streams))
    for option, values in (("concurrency", concurrencies), ("stall-streams", stall_streams)):
        if not values or min(values) < 1:
            parser.error(f"--{option} {getattr(args, option.replace('-', '_'))}: comma-separated whole numbers, "
                         "at least 1")
    lengths = {name: tuple(whole(getattr(args, name))) for name in ("prompt_len", "output_len")}
    for name, bounds in lengths.items():
        if len(bounds) != 2 or not 1 <= bounds[0] <= bounds[1]:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: MIN,MAX whole numbers, 1 <= MIN <= MAX")
    for option in ("requests", "stall_prompt", "threads", "rounds"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} {getattr(args, option)}: at least 1")
    parts = args.shared_prefix.split(",")
    shared_prefix = tuple(int(v) for v in parts) if all(v.strip().isdigit() for v in parts) else ()
    if len(shared_prefix) != 3 or min(shared_prefix) < 1 or shared_prefix[2] < 2:
        parser.error(f"--shared-prefix {args.shared_prefix}: PREFIX,SUFFIX,COUNT, positive, COUNT at least 2")
    servers = split(args.servers)
    if not servers or any(server not in SERVERS for server in servers):
        parser.error(f"--servers {args.servers}: a list of {', '.join(SERVERS)}")
    unknown = [q for q in split(args.quant) if q not in GGUF_TYPES]
    if unknown:
        parser.error(f"--quant: {unknown[0]} has no llama.cpp type beside it (known: {', '.join(GGUF_TYPES)})")
    for name in split(args.models):
        if name not in ("110m", "1b", "demo"):
            parser.error(f"--models: unknown model {name!r} (110m, 1b, demo)")
    level = build_llama_cpp.LEVELS[args.llama_cpp_level]
    llama_server = package = None
    if "llama.cpp" in servers or "llama-cpp-python" in servers:
        missing = build_llama_cpp.missing_flags(level)
        if missing:
            parser.error(f"--llama-cpp-level {level.name}: this CPU lacks {', '.join(missing)} (try avx2)")
    if "llama.cpp" in servers:
        llama_server = build_llama_cpp.ensure_server_built(level)
    if "llama-cpp-python" in servers:
        missing = [m for m in LLAMA_SERVER_MODULES if not _importable(m)]
        if missing:
            sys.exit(f"llama_cpp.server needs {', '.join(missing)}: pip install sse-starlette starlette-context "
                     "pydantic-settings fastapi uvicorn (or leave llama-cpp-python out of --servers)")
        package = build_llama_cpp.ensure_built(level)
    return Settings(args, concurrencies, stall_streams, lengths, shared_prefix, servers, llama_server, package)


def print_header(settings: Settings) -> None:
    """The host (CPU, ISA flags, read bandwidth measured now) and what every table shares."""
    args = settings.args
    print(f"{bench_cpu.host_line()}; read bandwidth {bench_cpu.read_bandwidth() / 1e9:.1f} GB/s (measured in this "
          f"run); threads per server: {args.threads}")
    print(f"{args.requests} requests per level, prompt {settings.lengths['prompt_len']} and max_tokens "
          f"{settings.lengths['output_len']} tokens (seed {args.seed}), greedy, streamed by the {args.client} client; "
          f"levels round-robin over the servers, {args.rounds} rounds")
    level = build_llama_cpp.LEVELS[args.llama_cpp_level]
    isa = " ".join(arg for arg in level.cmake_args if "GGML_" in arg)
    if settings.llama_server:
        defaults = llama_server_defaults(settings.llama_server)
        print(f"llama.cpp: llama-server {build_llama_cpp.VERSION} (llama-cpp-python's vendored llama.cpp), "
              f"{level.name} build, {amx_of(level.name)} ({isa}): {settings.llama_server}; --parallel {settings.slots} "
              f"--kv-unified, -c = slots x per-slot context; its defaults: flash attention "
              f"{defaults['flash attention']}, KV cache K {defaults['K cache']} V {defaults['V cache']}")
    if settings.package:
        print(f"llama-cpp-python: llama_cpp.server ({level.name} build, {settings.package}), one request at a time")


def amx_of(level: str) -> str:
    """Whether llama.cpp's build of `level` has AMX code: only -march=native turns it on."""
    return "-march=native, AMX where this CPU has it" if level == "native" else "no AMX"


def start_tokenizer(settings: Settings, gguf: Path, context: int) -> Served | None:
    """A llama.cpp server to read the prompts with (one slot), or None without a llama.cpp peer."""
    args = settings.args
    if settings.llama_server:
        return start_llama_server(gguf, settings.llama_server, 1, context, 1, args.work_dir)
    if settings.package:
        return start_llama_cpp_python(gguf, settings.package, context, 1, args.work_dir)
    return None


def start_servers(settings: Settings, artifact: Path, gguf: Path, context: int, per_slot: int) -> dict[str, Served]:
    """Every HTTP server of the run on this model, loaded and warmed up by one request; stopped if one fails."""
    args, running = settings.args, {}
    try:
        for name in settings.servers:
            if name == "ember":
                running[name] = start_ember(artifact, args.threads, args.work_dir, args.client)
            elif name == "llama.cpp":
                running[name] = start_llama_server(gguf, settings.llama_server, settings.slots, per_slot,
                                                   args.threads, args.work_dir, args.client)
            elif name == "llama-cpp-python":
                running[name] = start_llama_cpp_python(gguf, settings.package, context, args.threads, args.work_dir,
                                                       args.client)
    except BaseException:
        for served in running.values():
            served.stop()
        raise
    return running


def measure_servers(settings: Settings, running: dict[str, Served], requests: dict[str, list[list]],
                    rows: dict[tuple[str, int], list[dict[str, float]]]) -> int:
    """Every level of every server into `rows`, round-robin: each round runs each concurrency on each server in
    turn, level k on `requests[server][1 + k]` (0 warms up). Returns how many levels started on a busy machine."""
    busy = 0
    for served in running.values():
        asyncio.run(run_level(served, requests[served.name][0][:1], 1))  # warm-up
    for round_ in range(settings.args.rounds):
        for index, concurrency in enumerate(settings.concurrencies):
            for name, served in running.items():
                # Two busy cores slow any server, and llama.cpp's spinning threads far more than ember's.
                busy += not peers.wait_for_quiet_machine(timeout_s=settings.args.quiet_wait)
                level = requests[name][1 + round_ * len(settings.concurrencies) + index]
                row = level_row(*asyncio.run(run_level(served, level, concurrency)))
                rows.setdefault((name, concurrency), []).append(row)
                print(f"  round {round_ + 1} c{concurrency} {name}: {row['tok_s']:.1f} tok/s", flush=True)
    return busy


def target_int8_level(target: dict) -> str:
    """How the artifact's int8 matmuls multiply: its target's int8 level (`targets/int8_dot.py`: "amx" puts
    prefill on AMX tiles), or "none"."""
    from ember.targets.registry import resolve_target

    dot = resolve_target(json.dumps(target["tvm_target"])).int8_dot
    return dot.level if dot is not None else "none"


def bench_format(settings: Settings, model_name: str, checkpoint: Path, fmt: str,
                 shapes: list[tuple[int, int]]) -> None:
    """Compile `checkpoint` as `fmt`, write its GGUF, measure every server on it and print the table."""
    from ember.core.manifest import read_manifest
    from ember.driver.compiler import CompileOptions, compile_model

    args = settings.args
    context = json.loads((checkpoint / "config.json").read_text()).get("max_position_embeddings", 2048)
    qtype = GGUF_TYPES[fmt]
    kv_quant = None if args.kv_quant == "none" else args.kv_quant
    target_tag = "" if args.target == "cpu" else "-" + hashlib.sha256(args.target.encode()).hexdigest()[:8]
    artifact = args.work_dir / (f"{model_name}-{fmt}" + (f"-kv-{kv_quant}" if kv_quant else "") + target_tag)
    gguf = args.work_dir / f"{model_name}-{qtype}.gguf"
    start = time.perf_counter()
    # As many sequences as llama-server's slots: the stall measurement's long prompt joins its running streams.
    compile_model(checkpoint, artifact, CompileOptions(target=args.target, quantization=fmt, max_batch=settings.slots,
                                                       kv_quant=kv_quant, show_progress=False))
    target = read_manifest(artifact).target
    print(f"\n{model_name} {fmt}: compiled in {time.perf_counter() - start:.1f} s (max batch "
          f"{settings.slots}, context {context}, KV cache {kv_quant or 'float32'}; target "
          f"{json.dumps(target['tvm_target'])}, int8 matmuls {target_int8_level(target)})", flush=True)
    if not gguf.exists():
        peers._run_isolated("_write_gguf_worker", model_dir=str(checkpoint), out_path=str(gguf), qtype=qtype)
    # The prompts are read by llama.cpp's tokenizer once, for every server.
    tokenizer = start_tokenizer(settings, gguf, context)
    try:
        prompt_rng = np.random.default_rng(args.seed)
        # The same lengths at every level, but prompts of their own: repeated ones would be read from the servers'
        # prefix caches. Set 0 warms up; level k of the rounds reads set 1 + k.
        prompt_sets = [draw_prompts(tokenizer, [p for p, _ in shapes], prompt_rng)
                       for _ in range(1 + args.rounds * len(settings.concurrencies))]
        # A long prompt of its own per measurement: a repeated one would be read from a prefix cache.
        stall_prompts = ({streams: draw_prompts(tokenizer, [16, args.stall_prompt], prompt_rng)
                          for streams in settings.stall_streams} if args.stall_prompt < context else {})
        prefix_len = min(settings.shared_prefix[0], context - settings.shared_prefix[1] - 32)
        shared, unshared = prefix_prompts(tokenizer, prefix_len, settings.shared_prefix[1], settings.shared_prefix[2],
                                          prompt_rng)
    finally:
        if tokenizer:
            tokenizer.stop()
    per_slot = slot_context([max(p + o for p, o in shapes), args.stall_prompt + 1, len(shared[0][1]) + 8], context)
    rows: dict[tuple[str, int], list[dict[str, float]]] = {}
    stalls: dict[tuple[str, int], dict[str, float]] = {}
    if "ember-api" in settings.servers:
        api_requests = [[(prompt[1], out) for prompt, (_, out) in zip(prompts, shapes)] for prompts in prompt_sets]
        api_rows, busy = run_api_levels(artifact, api_requests, settings.concurrencies, args.rounds, args.threads,
                                        args.quiet_wait)
        rows.update((("ember-api", c), levels) for c, levels in api_rows.items())
    else:
        busy = 0
    prefixes = {}
    running = start_servers(settings, artifact, gguf, context, per_slot)
    try:
        pick = {name: 1 if name == "ember" else 0 for name in running}  # ember reads the token ids, llama.cpp text
        requests = {name: [[(prompt[pick[name]], out) for prompt, (_, out) in zip(prompts, shapes)]
                           for prompts in prompt_sets] for name in running}
        busy += measure_servers(settings, running, requests, rows)
        for streams, (short_prompt, long_prompt) in stall_prompts.items():
            for name, served in running.items():
                if name != "llama-cpp-python":  # one request at a time: the streams would queue behind each other
                    short, long = short_prompt[pick[name]], long_prompt[pick[name]]
                    busy += not peers.wait_for_quiet_machine(timeout_s=args.quiet_wait)
                    stalls[name, streams] = asyncio.run(measure_stall(served, short, long, streams, per_slot - 16))
        for name, served in running.items():
            busy += not peers.wait_for_quiet_machine(timeout_s=args.quiet_wait)
            prefixes[name] = asyncio.run(measure_prefix_cache(
                served, [p[pick[name]] for p in shared], [p[pick[name]] for p in unshared], 8))
    finally:
        for served in running.values():
            served.stop()
    slots = (f"; llama-server {args.llama_cpp_level} build ({amx_of(args.llama_cpp_level)}), "
             f"-c {settings.slots}x{per_slot}" if "llama.cpp" in running else "")
    print_table(f"{model_name} {fmt} (llama.cpp {qtype}), {args.threads} threads{slots}", rows, settings.concurrencies)
    if busy:
        print(f"  warning: {busy} measurements started on a busy machine")
    print_stalls_and_prefixes(settings, stalls, prefixes, len(shared[0][1]), prefix_len)
    if not stall_prompts:
        print(f"  decode stall not measured: the context of {context} tokens cannot hold a "
              f"{args.stall_prompt}-token prompt")


def print_stalls_and_prefixes(settings: Settings, stalls: dict[tuple[str, int], dict[str, float]],
                              prefixes: dict[str, dict[str, float]], prompt_len: int, prefix_len: int) -> None:
    """The decode-stall and prefix-cache lines under a table."""
    for (server, streams), stall in stalls.items():
        print(f"  {server}: a {settings.args.stall_prompt}-token prompt arriving while {streams} stream(s) decode: "
              f"longest gap of a running stream {stall['stall'] * 1e3:.0f} ms (median gap before "
              f"{stall['median_gap'] * 1e3:.0f} ms); its own TTFT {stall['long_ttft']:.2f} s")
    for server, prefix in prefixes.items():
        hits = (f"; prefix cache served {prefix['hit_share']:.0%} of the shared prompts' tokens"
                f" ({prefix['cold_hits']:.0f} tokens of the unshared ones)" if "hit_share" in prefix else "")
        print(f"  {server}: {settings.shared_prefix[2]} prompts of {prompt_len} tokens sharing {prefix_len}, one "
              f"at a time: TTFT median {prefix['warm_ttft'] * 1e3:.0f} ms after the first "
              f"({prefix['first_ttft'] * 1e3:.0f} ms), {prefix['cold_ttft'] * 1e3:.0f} ms for prompts sharing "
              f"nothing ({prefix['cold_ttft'] / prefix['warm_ttft']:.1f}x){hits}")


def main() -> None:
    """Parse, print the host, then one table per model and format."""
    settings = parse_settings()
    args = settings.args
    args.work_dir.mkdir(parents=True, exist_ok=True)
    checkpoints = {}
    for name in [item for item in args.models.split(",") if item]:
        if name in ("110m", "1b"):
            directory = args.model if name == "110m" else args.model_1b
            if not (directory / "config.json").exists():
                peers.make_random_llama(directory, **bench_cpu.SHAPES[name])
            checkpoints[name] = directory
        else:
            checkpoints[name] = ember.DEMO_MODEL_DIR
    rng = np.random.default_rng(args.seed)
    low, high = settings.lengths["prompt_len"], settings.lengths["output_len"]
    shapes = [(int(rng.integers(low[0], low[1] + 1)), int(rng.integers(high[0], high[1] + 1)))
              for _ in range(args.requests)]
    print_header(settings)
    for model_name, checkpoint in checkpoints.items():
        for fmt in [item for item in args.quant.split(",") if item]:
            bench_format(settings, model_name, checkpoint, fmt, shapes)


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    main()
