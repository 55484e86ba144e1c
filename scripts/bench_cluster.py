"""What moving one token's hidden state between Ray processes costs: the price of a pipeline stage boundary.

Times, over many repetitions, an actor call that carries nothing (Ray's floor), one that sends a float32
hidden state of each width to the actor, one that brings one back, and ray.put + ray.get in this process,
and prints the median and 90th percentile of each. With --address the actor goes on another node of that
cluster when there is one (loopback nodes: `ray start --head --node-ip-address=127.0.0.1 ...`); without it
a one-node cluster is started here.

    python scripts/bench_cluster.py                       # 2048 and 8192 floats, 2000 calls each
    python scripts/bench_cluster.py --widths 4096 --repeat 500 --address 127.0.0.1:6379
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[2048, 8192], help="hidden sizes (float32)")
    parser.add_argument("--repeat", type=int, default=2000, help="calls timed per row")
    parser.add_argument("--address", help="an existing cluster's head (HOST:PORT); default: start one here")
    args = parser.parse_args()
    if args.address:
        ray.init(address=args.address, logging_level=logging.WARNING, log_to_driver=False)
    else:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=1, logging_level=logging.WARNING,
                 log_to_driver=False)
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
