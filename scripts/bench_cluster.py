"""What moving one token's hidden state between Ray processes costs: the price of a pipeline stage boundary.

Times, over many repetitions, an actor call that carries nothing (Ray's floor), one that sends a float32
hidden state of each width to the actor, one that brings one back, and ray.put + ray.get in this process,
and prints the median and 90th percentile of each. With --address the actor goes on another node of that
cluster when there is one (loopback nodes: `ray start --head --node-ip-address=127.0.0.1 ...`); without it
a one-node cluster is started here.

    python scripts/bench_cluster.py                       # 2048 and 8192 floats, 2000 calls each
    python scripts/bench_cluster.py --widths 4096 --repeat 500 --address 127.0.0.1:6379

--split: decode tokens a second of a model split into K = 1, 2, 3 pipeline stages (`ember compile
--pipeline-stages K`), each stage a Ray actor (ember.cluster.pipeline, on nodes of their own where the cluster has
them), for the ~110M Llama shape (random weights by `peers.make_random_llama`; --layers/--hidden/... shrink it for a
smoke run). The rows: the unsplit artifact in this process (no Ray), then K stages as actors; "per hop" is the step
time a stage boundary adds, (step(K) - step(1 actor)) / (K - 1), the activation it carries [batch, hidden] float32.

    python scripts/bench_cluster.py --split --work /tmp/split --rounds 3
    python scripts/bench_cluster.py --split --layers 3 --hidden 64 --ffn 128 --heads 4 --kv-heads 2 --vocab 256 \
        --steps 8 --rounds 1                                # a smoke run

--replicas: `ember serve --ray` on this host over loopback, for the ~110M Llama shape (random weights by
`peers.make_random_llama`, as bench_serve's; --quant q4f32, KV cache f16 as bench_serve's default), each server a
process group of its own with a local Ray cluster it starts and that goes with it (whatever of it outlives the group,
found by its Ray temp directory, is killed by pid). Two tables:
1. `--replicas 1` with --threads threads against `--replicas 2` with half of them each: output tok/s and TTFT p50/p99
   at each --concurrency, the same requests for both (random prompt and output lengths from --seed, token-id prompts
   of their own per level, greedy, streamed by sse_client.py; bench_serve's `run_level`), levels round-robin over the
   two servers, --rounds times, the round of median tok/s shown;
2. shared-prompt traffic on 2 replicas, with prefix routing and with `--no-prefix-routing` (every request to the least
   loaded replica): --prefix-requests requests, each one of --system-prompts prompts of --system-len tokens plus a
   16-48-token user part, at --prefix-concurrency, fresh system prompts each round; TTFT p50/p99 and the share of
   prompt tokens the replicas' prefix caches served (their /metrics through the front's).

    python scripts/bench_cluster.py --replicas --threads 2 --rounds 3        # the full run (~110M shape)
    python scripts/bench_cluster.py --replicas --layers 2 --hidden 64 --ffn 128 --heads 4 --kv-heads 2 --vocab 512 \
        --requests 4 --prefix-requests 8 --system-len 200 --rounds 1      # a smoke run

--plan prints docs/cluster.md's on-paper table (a 70B Llama split 2, 4 and 8 ways).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


@ray.remote(num_cpus=0)
class Stage:
    """A stand-in pipeline stage: takes a hidden state, or hands one out."""

    def __init__(self, widths: list[int]) -> None:
        self.states = {width: np.ones(width, dtype=np.float32) for width in widths}

    def nothing(self) -> None:
        return None

    def take(self, state: np.ndarray) -> int:
        return state.shape[0]

    def give(self, width: int) -> np.ndarray:
        return self.states[width]


def _timed(call, repeat: int) -> list[float]:
    """Microseconds of each of `repeat` calls, after a warm-up."""
    for _ in range(min(100, repeat)):
        call()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e6)
    return times


def _placement(address: str | None) -> dict:
    """Scheduling options that put the actor on a node other than this process's, where one exists."""
    if address is None:
        return {}
    here = ray.get_runtime_context().get_node_id()
    others = [node["NodeID"] for node in ray.nodes() if node["Alive"] and node["NodeID"] != here]
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(others[0], soft=False)} if others else {}


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def plan_table(rows: list[dict]) -> str:
    """`split_costs`'s rows as the markdown table of docs/cluster.md."""
    lines = ["| stages | layers a stage | weights, middle stage | weights, first / last stage | KV cache a token, "
             "a stage | activation a hop, a token | hops a token |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['stages']} | {row['layers_per_stage']} | {_gib(row['middle_weight_bytes'])} | "
                     f"{_gib(row['first_weight_bytes'])} | {row['kv_bytes_per_token'] // 1024} KiB | "
                     f"{row['hop_bytes_per_token'] // 1024} KiB | {row['hops_per_token']} |")
    return "\n".join(lines)


def _split_artifacts(args: argparse.Namespace) -> dict[int, Path]:
    """The checkpoint compiled whole (key 0) and split into 1, 2 and 3 stages, each compiled once into --work."""
    sys.path.insert(0, str(Path(__file__).parent))
    import peers

    work = Path(args.work)
    checkpoint = work / "checkpoint"
    if not (checkpoint / "config.json").exists():
        peers.make_random_llama(checkpoint, hidden=args.hidden, layers=args.layers, heads=args.heads,
                                kv_heads=args.kv_heads, ffn=args.ffn, vocab=args.vocab, context=512)
    artifacts = {}
    for stages in (0, 1, 2, 3):
        out = work / f"k{stages}"
        if not (out / "manifest.json").exists():
            split = ["--pipeline-stages", str(stages)] if stages else []
            subprocess.run([sys.executable, "-m", "ember", "compile", str(checkpoint), "-o", str(out), "--quant",
                            args.quant, "--max-batch", str(args.batch), "--no-progress", *split], check=True)
        artifacts[stages] = out
    return artifacts


def _decode_seconds(engine, batch: int, steps: int) -> float:
    """Seconds a batched decode step takes, median over `steps`, after a 16-token prefill of each sequence."""
    seq_ids = [engine.add_sequence() for _ in range(batch)]
    tokens = [int(engine.prefill(seq_id, list(range(1, 17))).argmax()) for seq_id in seq_ids]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        tokens = [int(token) for token in engine.decode(seq_ids, tokens).argmax(axis=-1)]
        times.append(time.perf_counter() - start)
    for seq_id in seq_ids:
        engine.remove_sequence(seq_id)
    return statistics.median(times)


def bench_split(args: argparse.Namespace) -> None:
    """Decode tok/s of the model whole (in process) and split into K = 1, 2, 3 stages on Ray actors."""
    from ember.cluster.pipeline import PipelineEngine
    from ember.runtime import Engine, load_artifact

    artifacts = _split_artifacts(args)
    whole = Engine(load_artifact(artifacts[0], threads=args.threads))
    engines = {0: whole}
    for stages in (1, 2, 3):
        engines[stages] = PipelineEngine(artifacts[stages], threads=args.threads)
    step: dict[int, list[float]] = {stages: [] for stages in engines}
    for _ in range(args.rounds):  # round-robin: the host's speed drifts
        for stages, engine in engines.items():
            step[stages].append(_decode_seconds(engine, args.batch, args.steps))
    nodes = {stages: len({stage.node.node_id for stage in engine.stages}) for stages, engine in engines.items()
             if stages}
    print(f"Ray {ray.__version__}, batch {args.batch}, {args.steps} decode steps a round, {args.rounds} round(s), "
          f"{args.threads} thread(s) a stage, {args.quant}; median round")
    print(f"{'K':>3} {'nodes':>5} {'step ms':>8} {'tok/s':>8} {'per hop ms':>10} {'hop bytes':>9}")
    one = statistics.median(step[1])
    for stages, times in step.items():
        seconds = statistics.median(times)
        hop = f"{(seconds - one) / (stages - 1) * 1e3:10.2f}" if stages > 1 else f"{'-':>10}"
        where = "whole" if stages == 0 else str(nodes[stages])
        print(f"{stages or 1:>3} {where:>5} {seconds * 1e3:8.2f} {args.batch / seconds:8.1f} {hop} "
              f"{args.batch * args.hidden * 4 if stages > 1 else 0:9}")
    for stages, engine in engines.items():
        if stages:
            engine.stop()


def _scripts() -> tuple:
    """bench_cpu, bench_serve and peers, the sibling scripts the --replicas mode measures with."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_cpu
    import bench_serve
    import peers

    return bench_cpu, bench_serve, peers


def _replica_artifact(args: argparse.Namespace) -> Path:
    """The checkpoint of --hidden/--layers/... (random weights), compiled once into --work for the highest level."""
    from ember.driver.compiler import CompileOptions, compile_model

    _, _, peers = _scripts()
    shape = f"h{args.hidden}-l{args.layers}-a{args.heads}-k{args.kv_heads}-f{args.ffn}-v{args.vocab}"
    checkpoint = Path(args.work) / f"checkpoint-{shape}"
    if not (checkpoint / "config.json").exists():
        peers.make_random_llama(checkpoint, hidden=args.hidden, layers=args.layers, heads=args.heads,
                                kv_heads=args.kv_heads, ffn=args.ffn, vocab=args.vocab, context=args.context)
    batch = max(max(args.concurrency), args.prefix_concurrency)
    artifact = Path(args.work) / f"{shape}-{args.quant}-kv-f16-b{batch}"
    if not (artifact / "manifest.json").exists():
        start = time.perf_counter()
        compile_model(checkpoint, artifact, CompileOptions(quantization=args.quant, max_batch=batch, kv_quant="f16",
                                                           show_progress=False))
        print(f"compiled {artifact.name} in {time.perf_counter() - start:.1f} s", flush=True)
    return artifact


class ClusterServed:
    """`ember serve --ray` (a local Ray cluster of its own, in a temp directory named for it) in a process group of
    its own, as bench_serve's `Served`; stopping it also kills by pid whatever of its Ray cluster outlives it."""

    def __init__(self, name: str, artifact: Path, replicas: int, threads: int, routing: bool, log_dir: Path) -> None:
        _, bench_serve, _ = _scripts()
        self.ray_dir = tempfile.mkdtemp(prefix="ebc-ray-", dir="/tmp")  # short: Ray's socket paths must fit
        port = bench_serve.free_port()
        command = [sys.executable, "-m", "ember", "serve", str(artifact), "--ray", "--replicas", str(replicas),
                   "--threads", str(threads), "--port", str(port), "--max-queue", "4096",
                   *([] if routing else ["--no-prefix-routing"])]
        env = {**os.environ, "RAY_TMPDIR": self.ray_dir}
        self.served = bench_serve.Served(name, command, env, port, artifact.name, log_dir / f"{name}.log",
                                         health="/health")

    def metrics(self) -> dict[str, float]:
        """The front's /metrics samples summed over their labels (the replicas), by name."""
        with urllib.request.urlopen(f"{self.served.base}/metrics", timeout=30) as response:
            text = response.read().decode()
        totals: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.split("{")[0].split(" ")[0], line.rsplit(" ", 1)[1]
                totals[name] = totals.get(name, 0.0) + float(value)
        return totals

    def stop(self) -> None:
        """Stop the server's process group, then any process of its Ray cluster left (by pid)."""
        self.served.stop()
        for pid in _pids_naming(self.ray_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.ray_dir, ignore_errors=True)


def _pids_naming(text: str) -> list[int]:
    """The processes whose command line contains `text`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _level(server: ClusterServed, requests: list, concurrency: int, args: argparse.Namespace | None = None
           ) -> dict[str, float]:
    """bench_serve's figures of `requests` sent to `server`, `concurrency` at a time; a measured level (`args`
    given) waits up to --quiet-wait for an idle machine first and counts in `args.busy` if it never came."""
    _, bench_serve, peers = _scripts()
    if args is not None:
        args.busy += not peers.wait_for_quiet_machine(timeout_s=args.quiet_wait)
    return bench_serve.level_row(*asyncio.run(bench_serve.run_level(server.served, requests, concurrency)))


def _throughput_requests(args: argparse.Namespace, count: int) -> list[list]:
    """`count` levels of the same --requests (prompt length, max_tokens) drawn from --seed, prompts of their own."""
    _, bench_serve, _ = _scripts()
    rng = np.random.default_rng(args.seed)
    shapes = [(int(rng.integers(16, 129)), int(rng.integers(16, 97))) for _ in range(args.requests)]
    levels = []
    for _ in range(count):
        prompts = bench_serve.draw_prompts(None, [length for length, _ in shapes], rng)
        levels.append([(ids, max_tokens) for (_, ids), (_, max_tokens) in zip(prompts, shapes)])
    return levels


def bench_layouts(args: argparse.Namespace, artifact: Path, log_dir: Path) -> dict[tuple[str, int], list[dict]]:
    """Table 1's rounds: 1 replica x --threads against 2 x half, each level round-robin over the two."""
    layouts = {f"1 x {args.threads} threads": (1, args.threads), f"2 x {args.threads // 2} thread(s)":
               (2, args.threads // 2)}
    levels = _throughput_requests(args, 1 + args.rounds * len(args.concurrency))
    servers: dict[str, ClusterServed] = {}
    rows: dict[tuple[str, int], list[dict]] = {}
    try:
        for name, (replicas, threads) in layouts.items():
            servers[name] = ClusterServed(f"replicas-{replicas}", artifact, replicas, threads, True, log_dir)
            _level(servers[name], levels[0][:replicas * 2], replicas * 2)  # warm-up: every replica answers once
        for round_ in range(args.rounds):
            for index, concurrency in enumerate(args.concurrency):
                for name, server in servers.items():
                    row = _level(server, levels[1 + round_ * len(args.concurrency) + index], concurrency, args)
                    rows.setdefault((name, concurrency), []).append(row)
                    print(f"  round {round_ + 1} c{concurrency} {name}: {row['tok_s']:.1f} tok/s", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return rows


def _shared_prompt_requests(args: argparse.Namespace, rng: np.random.Generator) -> list[tuple[list[int], int]]:
    """--prefix-requests requests, each one of --system-prompts fresh system prompts plus a 16-48-token user part."""
    _, bench_serve, _ = _scripts()
    systems = [ids for _, ids in bench_serve.draw_prompts(None, [args.system_len] * args.system_prompts, rng)]
    requests = []
    for _ in range(args.prefix_requests):
        user = rng.integers(3, 259, int(rng.integers(16, 49))).tolist()
        requests.append((systems[int(rng.integers(len(systems)))] + user, int(rng.integers(16, 33))))
    return requests


def bench_prefix_routing(args: argparse.Namespace, artifact: Path, log_dir: Path) -> dict[str, list[dict]]:
    """Table 2's rounds: shared-prompt traffic on 2 replicas with and without prefix routing, round-robin."""
    threads = max(1, args.threads // 2)
    servers: dict[str, ClusterServed] = {}
    rows: dict[str, list[dict]] = {}
    rng = np.random.default_rng(args.seed + 1)
    try:
        for name, routing in (("prefix routing", True), ("least loaded", False)):
            servers[name] = ClusterServed(name.replace(" ", "-"), artifact, 2, threads, routing, log_dir)
            _level(servers[name], _throughput_requests(args, 1)[0][:4], 4)  # warm-up, prompts shared with nothing
        for round_ in range(args.rounds):
            requests = _shared_prompt_requests(args, rng)  # fresh system prompts: every round starts cold
            for name, server in servers.items():
                before = server.metrics()
                row = _level(server, requests, args.prefix_concurrency, args)
                after = server.metrics()
                grew = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
                row["hit_share"] = grew["ember_prefix_cache_hit_tokens_total"] / grew["ember_prompt_tokens_total"]
                row["prefix_routed"] = grew["ember_cluster_prefix_routed_total"]
                rows.setdefault(name, []).append(row)
                print(f"  round {round_ + 1} {name}: TTFT p50 {row['ttft50'] * 1e3:.0f} ms, cache hits "
                      f"{row['hit_share']:.0%} of prompt tokens", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return rows


def bench_replicas(args: argparse.Namespace) -> None:
    """Both --replicas tables, after the host line."""
    bench_cpu, bench_serve, _ = _scripts()
    if args.threads < 2 or args.threads % 2:
        raise SystemExit(f"--threads {args.threads}: an even number, at least 2 (split over 2 replicas)")
    args.system_len = min(args.system_len, args.context - 48 - 32 - 8)
    print(f"{bench_cpu.host_line()}; Ray {ray.__version__}; {args.threads} threads in all per server", flush=True)
    print(f"~{args.hidden}-hidden {args.layers}-layer Llama (random weights), {args.quant}, KV f16; levels of "
          f"{args.requests} requests (prompt 16-128, max_tokens 16-96 tokens, seed {args.seed}), greedy, streamed by "
          f"sse_client; {args.rounds} round(s) round-robin", flush=True)
    log_dir = Path(args.work) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    artifact = _replica_artifact(args)
    start, args.busy = time.perf_counter(), 0
    layouts = bench_layouts(args, artifact, log_dir)
    routing = bench_prefix_routing(args, artifact, log_dir)
    print(f"\nmeasured in {time.perf_counter() - start:.0f} s; round of median tok/s (TTFT of that round), "
          "lowest-highest tok/s of the rounds")
    if args.busy:
        print(f"warning: {args.busy} level(s) started on a busy machine (after --quiet-wait {args.quiet_wait:g} s)")
    print(f"{'replicas x threads':<22} {'conc':>4} {'out tokens':>10} {'tok/s':>8} {'rounds':>11} {'TTFT p50 ms':>11} "
          f"{'TTFT p99 ms':>11}")
    for (name, concurrency), rounds in layouts.items():
        row = bench_serve.median_round(rounds)
        print(f"{name:<22} {concurrency:>4} {row['tokens']:>10} {row['tok_s']:>8.1f} "
              f"{row['low']:>5.0f}-{row['high']:<5.0f} {row['ttft50'] * 1e3:>11.1f} {row['ttft99'] * 1e3:>11.1f}")
    print(f"\nshared prompts: {args.prefix_requests} requests a round, each one of {args.system_prompts} system "
          f"prompts of {args.system_len} tokens + 16-48, max_tokens 16-32, concurrency {args.prefix_concurrency}, "
          f"2 replicas x "
          f"{args.threads // 2} thread(s); round of median TTFT p50")
    print(f"{'routing':<16} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} {'cache hit share':>15} {'prefix-routed':>13} "
          f"{'tok/s':>8}")
    for name, rounds in routing.items():
        row = sorted(rounds, key=lambda row: row["ttft50"])[(len(rounds) - 1) // 2]
        print(f"{name:<16} {row['ttft50'] * 1e3:>11.1f} {row['ttft99'] * 1e3:>11.1f} {row['hit_share']:>15.1%} "
              f"{row['prefix_routed']:>13.0f} {row['tok_s']:>8.1f}")


def _connect(address: str | None, cpus: int) -> None:
    if address:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    else:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=cpus, logging_level=logging.WARNING,
                 log_to_driver=False)


def _add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    """--replicas and its options (--rounds, --threads, --quant, --work and the shape are shared with --split)."""
    group = parser.add_argument_group("--replicas: ember serve --ray with 1 and 2 replicas, and prefix routing")
    group.add_argument("--replicas", action="store_true", help="measure served replicas instead of one hop")
    group.add_argument("--concurrency", type=lambda text: [int(v) for v in text.split(",")], default=[8, 16],
                       help="comma-separated client counts (default 8,16)")
    group.add_argument("--requests", type=int, default=64, help="requests a level")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--context", type=int, default=2048, help="the checkpoint's context (holds a system prompt)")
    group.add_argument("--system-prompts", type=int, default=4, help="distinct shared prompts a round")
    group.add_argument("--system-len", type=int, default=1000, help="tokens of each shared prompt")
    group.add_argument("--prefix-requests", type=int, default=64, help="shared-prompt requests a round")
    group.add_argument("--prefix-concurrency", type=int, default=8)
    group.add_argument("--quiet-wait", type=float, default=30,
                       help="seconds to wait for an idle machine before each level (then it runs anyway)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[2048, 8192], help="hidden sizes (float32)")
    parser.add_argument("--repeat", type=int, default=2000, help="calls timed per row")
    parser.add_argument("--address", help="an existing cluster's head (HOST:PORT); default: start one here")
    parser.add_argument("--plan", action="store_true", help="print the on-paper table of a 70B Llama split")
    split = parser.add_argument_group("--split: decode tok/s of a model split into 1, 2, 3 pipeline stages")
    split.add_argument("--split", action="store_true", help="measure the split instead of one hop")
    split.add_argument("--work", help="checkpoint and artifacts, kept (default /tmp/ember-bench-split, "
                                      "/tmp/ember-bench-replicas with --replicas)")
    split.add_argument("--quant", default="q4f32")
    split.add_argument("--batch", type=int, default=4, help="sequences decoded together")
    split.add_argument("--steps", type=int, default=64, help="decode steps timed a round")
    split.add_argument("--rounds", type=int, default=3)
    split.add_argument("--threads", type=int, help="threads a stage (default 1); with --replicas, threads per server "
                                                   "in all (default 2): 1 replica x all, 2 replicas x half")
    for name, default in (("hidden", 768), ("layers", 12), ("heads", 12), ("kv-heads", 4), ("ffn", 2048),
                          ("vocab", 32000)):
        split.add_argument(f"--{name}", type=int, default=default, help="the model's shape (default: ~110M)")
    _add_replica_arguments(parser)
    args = parser.parse_args()
    args.work = args.work or ("/tmp/ember-bench-replicas" if args.replicas else "/tmp/ember-bench-split")
    args.threads = args.threads or (2 if args.replicas else 1)
    if args.replicas:
        bench_replicas(args)
        return
    if args.plan:
        from ember.cluster.pipeline import split_costs

        print(plan_table(split_costs()))
        return
    _connect(args.address, 6 * args.threads if args.split else 1)  # the split's 1 + 2 + 3 stages live together
    if args.split:
        bench_split(args)
        ray.shutdown()
        return
    placement = _placement(args.address)
    stage = Stage.options(**placement).remote(args.widths)
    ray.get(stage.nothing.remote())
    rows = [("actor call, nothing carried", 0, _timed(lambda: ray.get(stage.nothing.remote()), args.repeat))]
    for width in args.widths:
        state = np.random.default_rng(0).standard_normal(width, dtype=np.float32)
        rows.append(("send a state to the actor", width,
                     _timed(lambda state=state: ray.get(stage.take.remote(state)), args.repeat)))
        rows.append(("bring a state from the actor", width,
                     _timed(lambda width=width: ray.get(stage.give.remote(width)), args.repeat)))
        rows.append(("ray.put + ray.get here", width,
                     _timed(lambda state=state: ray.get(ray.put(state)), args.repeat)))
    where = "another node" if placement else "this node"
    print(f"Ray {ray.__version__}, actor on {where}, {args.repeat} calls a row (microseconds)")
    print(f"{'what':32} {'floats':>7} {'bytes':>7} {'median':>8} {'p90':>8} {'x floor':>8}")
    floor = statistics.median(rows[0][2])
    for what, width, times in rows:
        median = statistics.median(times)
        p90 = statistics.quantiles(times, n=10)[-1]
        print(f"{what:32} {width:7} {width * 4:7} {median:8.0f} {p90:8.0f} {median / floor:8.2f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
