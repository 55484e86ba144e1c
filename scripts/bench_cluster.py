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

--plan prints docs/cluster.md's on-paper table (a 70B Llama split 2, 4 and 8 ways).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import subprocess
import sys
import time
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


def _connect(address: str | None, cpus: int) -> None:
    if address:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    else:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=cpus, logging_level=logging.WARNING,
                 log_to_driver=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[2048, 8192], help="hidden sizes (float32)")
    parser.add_argument("--repeat", type=int, default=2000, help="calls timed per row")
    parser.add_argument("--address", help="an existing cluster's head (HOST:PORT); default: start one here")
    parser.add_argument("--plan", action="store_true", help="print the on-paper table of a 70B Llama split")
    split = parser.add_argument_group("--split: decode tok/s of a model split into 1, 2, 3 pipeline stages")
    split.add_argument("--split", action="store_true", help="measure the split instead of one hop")
    split.add_argument("--work", default="/tmp/ember-bench-split", help="checkpoint and artifacts (kept)")
    split.add_argument("--quant", default="q4f32")
    split.add_argument("--batch", type=int, default=4, help="sequences decoded together")
    split.add_argument("--steps", type=int, default=64, help="decode steps timed a round")
    split.add_argument("--rounds", type=int, default=3)
    split.add_argument("--threads", type=int, default=1, help="threads a stage")
    for name, default in (("hidden", 768), ("layers", 12), ("heads", 12), ("kv-heads", 4), ("ffn", 2048),
                          ("vocab", 32000)):
        split.add_argument(f"--{name}", type=int, default=default, help="the model's shape (default: ~110M)")
    args = parser.parse_args()
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
