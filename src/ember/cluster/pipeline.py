"""A pipeline artifact (`ember compile --pipeline-stages K`) served from a Ray cluster: one actor per stage.

Each stage is a Ray actor process holding the stage's `StageEngine` (runtime/pipeline.py), on a node of its own
where the cluster has enough nodes, on one whose memory holds the stage in any case. `PipelineEngine` chains them
and offers the methods of `Engine` that the scheduler and the server use, so `ember serve --ray ADDR PIPELINE`
serves the split model through `ember serve`'s own scheduler and server, in the front's process. A decode step
is one call per stage; each stage's output goes to the next stage's actor straight from the object store, and
only the last stage's logits come back to the front.

A stage process that dies fails the step it was in: every request then running ends with one error (a stream
with an OpenAI error event, then `data: [DONE]`), and the stage is restarted at once on its node (elsewhere if the
node is gone). The KV cache of every running sequence lost that stage's layers, so every sequence then known is
dropped; later requests wait for the restarted stage to load, then are served (a stage that died while
nothing ran is found dead by the next request, whose prompt then goes through the restarted stage). The prefix
cache is off for a pipeline: its entries would outlive a stage's restart without their pages.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from ember.cluster.ray_session import StartUp, connect
from ember.cluster.replica import ReplicaSettings, ray, wait_started
from ember.core.errors import EmberError, GenerationError
from ember.core.manifest import Manifest, pipeline_field, read_manifest
from ember.runtime.engine import SequenceChecks

try:
    from ray.actor import ActorClass
    from ray.exceptions import RayActorError, RayError, RayTaskError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as err:
    raise EmberError(f"ember serve --ray needs Ray ({err.name} is missing): pip install 'ember[cluster]'") from None

if TYPE_CHECKING:
    from ember.runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Caps the memory (bytes) each node offers the stages, below what Ray says it has: to plan for a smaller
# machine than this one, and what the tests use to run out of memory without running out of it.
NODE_MEMORY_ENV = "EMBER_RAY_NODE_MEMORY"
_SIZES = ("prefill_chunk", "max_batch", "context_window", "page_size", "kv_capacity")


def is_pipeline_artifact(artifact_dir: Path) -> bool:
    """Whether `artifact_dir` holds a pipeline artifact (a manifest with a `pipeline` field)."""
    return read_manifest(artifact_dir).pipeline is not None


@dataclass(frozen=True)
class StageSpec:
    """One stage as the planner sees it: its directory and the bytes of memory it needs on its node."""

    index: int
    directory: str
    layers: tuple[int, int]
    needed_bytes: int
    weight_bytes: int


@dataclass(frozen=True)
class NodeOffer:
    """A live node of the cluster and the memory it offers the stages."""

    node_id: str
    address: str
    memory_bytes: int


def stage_specs(artifact_dir: Path) -> list[StageSpec]:
    """The stages of the pipeline artifact at `artifact_dir`, each with what its manifest says it needs: its
    weights, its workspace and its whole KV cache (the engine allocates all three up front)."""
    from ember.runtime.pipeline import pipeline_stage_dirs

    pipeline = pipeline_field(artifact_dir, read_manifest(artifact_dir))
    specs = []
    for index, stage_dir in enumerate(pipeline_stage_dirs(artifact_dir)):  # every stage's files checked
        manifest = read_manifest(stage_dir)
        memory, kv = manifest.memory, manifest.kv_cache
        needed = memory["weight_bytes"] + memory["peak_workspace_bytes"] + kv["max_total_tokens"] * \
            memory["kv_bytes_per_token"]
        specs.append(StageSpec(index, str(stage_dir.resolve()), tuple(pipeline["layers"][index]),
                               int(needed), memory["weight_bytes"]))
    return specs


def plan_placement(stages: Sequence[StageSpec], nodes: Sequence[NodeOffer]) -> list[NodeOffer]:
    """The node of each stage: each on a node of its own while there are nodes left, the stages' memory within
    each node's; one line naming the stage that fits nowhere."""
    left = {node.node_id: node.memory_bytes for node in nodes}
    used: dict[str, int] = {}
    placed = []
    for stage in stages:
        fits = [node for node in nodes if left[node.node_id] >= stage.needed_bytes]
        if not fits:
            largest, cap = max(left.values(), default=0), _node_memory_cap()
            capped = f" ({NODE_MEMORY_ENV} caps each node at {_mib(cap)})" if cap is not None else ""
            raise EmberError(
                f"stage {stage.index} (layers {stage.layers[0]}-{stage.layers[1] - 1}) needs {_mib(stage.needed_bytes)}"
                f" of memory (weights {_mib(stage.weight_bytes)}), and no node of the Ray cluster has that much left:"
                f" the most is {_mib(largest)}{capped}; add a node or compile more --pipeline-stages")
        # Fewest stages first (a node of its own while one is free), then the most memory left.
        node = min(fits, key=lambda node: (used.get(node.node_id, 0), -left[node.node_id]))
        left[node.node_id] -= stage.needed_bytes
        used[node.node_id] = used.get(node.node_id, 0) + 1
        placed.append(node)
    return placed


def cluster_nodes() -> list[NodeOffer]:
    """The live nodes of the joined cluster, each with the memory Ray lets its tasks use (capped by
    EMBER_RAY_NODE_MEMORY)."""
    cap = _node_memory_cap()
    offers = []
    for node in ray.nodes():
        if node["Alive"]:
            memory = int(node["Resources"].get("memory", 0))
            offers.append(NodeOffer(node["NodeID"], node["NodeManagerAddress"],
                                    memory if cap is None else min(memory, cap)))
    return offers


def _node_memory_cap() -> int | None:
    value = os.environ.get(NODE_MEMORY_ENV)
    if value is None:
        return None
    if not value.strip().isdigit():
        raise EmberError(f"{NODE_MEMORY_ENV}={value}: not a whole number of bytes")
    return int(value)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def split_costs(layers: int = 80, hidden: int = 8192, intermediate: int = 28672, heads: int = 64, kv_heads: int = 8,
                vocab: int = 128256, bits_per_weight: float = 4.5, kv_dtype_bytes: int = 2,
                stages: Sequence[int] = (2, 4, 8)) -> list[dict]:
    """On paper, what a Llama split into each count of `stages` asks of each stage (defaults: a 70B Llama at
    q4, ~4.5 bits a weight, the KV cache in float16): the weight bytes of a middle stage (the first adds the
    embedding, the last the output projection), the KV cache bytes per token of context, and the float32
    activation each hop carries per token (K - 1 hops a token)."""
    head_dim = hidden // heads
    layer_weights = hidden * hidden * 2 + hidden * kv_heads * head_dim * 2 + hidden * intermediate * 3
    table_bytes = vocab * hidden * bits_per_weight / 8
    rows = []
    for count in stages:
        per_stage = -(-layers // count)  # the first stages take the extra layers
        middle = per_stage * layer_weights * bits_per_weight / 8
        rows.append({"stages": count, "layers_per_stage": per_stage, "middle_weight_bytes": middle,
                     "first_weight_bytes": middle + table_bytes, "last_weight_bytes": middle + table_bytes,
                     "kv_bytes_per_token": per_stage * 2 * kv_heads * head_dim * kv_dtype_bytes,
                     "hop_bytes_per_token": hidden * 4, "hops_per_token": count - 1})
    return rows


class StageLostError(GenerationError):
    """A stage's process died under a step: the step failed, and the stage is restarting."""


class StageActor:
    """One stage in a Ray actor's process: its `StageEngine`, over sequences named by the front's ids."""

    def start(self, stage_dir: str, threads: int) -> dict:
        """Load the stage; returns where it runs (pid, node) and its engine's sizes."""
        os.environ["TVM_NUM_THREADS"] = str(threads)  # before TVM's thread pool starts
        from ember.runtime.pipeline import StageEngine

        try:
            self.engine = StageEngine(Path(stage_dir))
        except EmberError as err:  # travels to the front as itself: one line there
            raise EmberError(f"stage {Path(stage_dir).name} on {socket.gethostname()}: {err}") from None
        self._ids: dict[int, int] = {}  # the front's sequence id -> this engine's
        here = ray.get_runtime_context().get_node_id()
        node = next(node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == here)
        sizes = {name: int(getattr(self.engine, name)) for name in _SIZES if hasattr(self.engine, name)}
        return {"pid": os.getpid(), "node": node, **sizes}

    def prefill(self, key: int, x: np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Append `x` to the front's sequence `key` (made here on its first tokens); this stage's output."""
        if key not in self._ids:
            self._ids[key] = self.engine.add_sequence()
        return np.array(self.engine.prefill(self._ids[key], x, all_logits=all_logits))

    def decode(self, keys: list[int], x: np.ndarray) -> np.ndarray:
        """One token (or hidden state) for each of the front's sequences `keys`; this stage's output."""
        return np.array(self.engine.decode([self._ids[key] for key in keys], x))

    def fork(self, parent: int, child: int, length: int) -> None:
        """The front's sequence `child` shares `parent`'s first `length` tokens."""
        self._ids[child] = self.engine.fork_sequence(self._ids[parent], length)

    def truncate(self, key: int, length: int) -> None:
        """Drop the tokens of `key` after the first `length`."""
        if key in self._ids:
            self.engine.truncate(self._ids[key], length)

    def remove(self, key: int) -> None:
        """Free `key`'s pages; a sequence this process never saw (it started after the sequence) is no error."""
        if key in self._ids:
            self.engine.remove_sequence(self._ids.pop(key))


class _Stage:
    """The front's handle on one stage's actor: where it runs, and how to start it again there."""

    # The actor's handle: Ray types a call of an actor's method only where the method is decorated with @ray.method.
    actor: Any
    ready: ray.ObjectRef[dict]  # what the actor's start returns
    loading: bool  # launched, and not yet seen ready

    def __init__(self, spec: StageSpec, node: NodeOffer, threads: int, actor_class: ActorClass[StageActor]) -> None:
        self.spec, self.node, self.threads = spec, node, threads
        self.info: dict = {}
        self.restarts = 0
        self.launch(actor_class)

    def launch(self, actor_class: ActorClass[StageActor]) -> None:
        """A new actor on this stage's node (another node if it is gone), loading the stage."""
        strategy = NodeAffinitySchedulingStrategy(self.node.node_id, soft=True)
        self.actor = actor_class.options(scheduling_strategy=strategy).remote()
        self.ready = self.actor.start.remote(self.spec.directory, self.threads)
        self.loading = True

    def wait_ready(self) -> None:
        """Wait for the stage to load; one line if it cannot."""
        self.info = wait_started(self.ready, f"stage {self.spec.index}", f"the cluster may lack a free CPU on node "
                                 f"{self.node.address} (--threads {self.threads})")
        self.loading = False
        log.warning("ember: stage %d (layers %d-%d) serving on node %s, pid %s", self.spec.index,
                    self.spec.layers[0], self.spec.layers[1] - 1, self.info["node"], self.info["pid"])


class PipelineEngine(SequenceChecks):
    """The stages chained as one engine: the parts of `Engine`'s API that `Scheduler` and `Server` use."""

    verify_tokens = 0  # no speculation: `verify` goes through prefill
    has_embeddings = False
    adapters: Mapping[str, Path] = MappingProxyType({})  # no adapter slots (`compile --lora-rank` refuses a split)
    # With max_batch and context_window, the stages' smallest figures (`_SIZES`), set once they are loaded.
    prefill_chunk: int
    page_size: int
    kv_capacity: int

    def __init__(self, artifact_dir: Path, threads: int = 1, nodes: Sequence[NodeOffer] | None = None) -> None:
        artifact_dir = Path(artifact_dir)
        specs = stage_specs(artifact_dir)
        placement = plan_placement(specs, cluster_nodes() if nodes is None else nodes)
        self.artifact = _front_artifact(artifact_dir)
        self.vocab_size = int(self.artifact.manifest.model["vocab_size"])
        self._actor_class = ray.remote(num_cpus=threads, max_restarts=0)(StageActor)
        self.stages = [_Stage(spec, node, threads, self._actor_class) for spec, node in zip(specs, placement)]
        try:
            for stage in self.stages:
                stage.wait_ready()
        except BaseException:
            self.stop()
            raise
        for name in _SIZES:  # the stages were compiled alike; the smallest figure binds all the same
            setattr(self, name, min(stage.info[name] for stage in self.stages))
        self._lengths: dict[int, int] = {}
        self._epoch: dict[int, int] = {}  # sequence -> how many stage deaths there had been when it started
        self._deaths = 0
        self._ids = itertools.count()

    def stop(self) -> None:
        """Kill every stage's actor."""
        for stage in self.stages:
            ray.kill(stage.actor, no_restart=True)

    def add_sequence(self) -> int:
        """Start an empty sequence (made on the stages with its first tokens); returns its id."""
        self._check_free_slot()
        seq_id = next(self._ids)
        self._lengths[seq_id] = 0
        self._epoch[seq_id] = self._deaths
        return seq_id

    def fork_sequence(self, parent: int, length: int | None = None) -> int:
        """A new sequence sharing `parent`'s first `length` tokens (all by default), on every stage."""
        self._check_live(parent)
        length = self._fork_length(parent, length)
        child = self.add_sequence()
        self._call_all("fork", parent, child, length)
        self._lengths[child] = length
        return child

    def remove_sequence(self, seq_id: int) -> None:
        """Free a sequence's pages on every stage that holds it (a dead stage holds none)."""
        self._check_known(seq_id)
        for stage in self.stages:
            stage.actor.remove.remote(seq_id)  # in order before any later call; its failure is the stage's death
        del self._lengths[seq_id], self._epoch[seq_id]

    def truncate(self, seq_id: int, length: int) -> None:
        """Drop the tokens of `seq_id` after the first `length`."""
        self._check_known(seq_id)
        self._check_truncate(seq_id, length)
        if length < self._lengths[seq_id]:
            self._call_all("truncate", seq_id, length)
            self._lengths[seq_id] = length

    def length(self, seq_id: int) -> int:
        """Tokens currently cached for `seq_id`."""
        self._check_known(seq_id)
        return self._lengths[seq_id]

    def prefill(self, seq_id: int, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Append `token_ids` to `seq_id` through every stage; logits [n, vocab], or [vocab] for the last."""
        self._check_live(seq_id)
        if not token_ids:
            raise GenerationError("prefill needs at least one token")
        self._check_context({seq_id: len(token_ids)})
        tokens = self._check_tokens(token_ids)
        last = len(self.stages) - 1

        def run() -> np.ndarray:
            return self._chain(lambda i, x: self.stages[i].actor.prefill.remote(seq_id, x, all_logits and i == last),
                               tokens)

        try:
            out = run()
        except StageLostError:
            if self._lengths[seq_id]:  # it held tokens that the dead stage's cache took with it
                raise
            # A stage that died while this new sequence had nothing yet (it was idle, say): start it again on
            # the restarted chain, so a request after the death is served, not failed.
            for stage in self.stages:
                stage.actor.remove.remote(seq_id)
            self._epoch[seq_id] = self._deaths
            out = run()
        self._lengths[seq_id] += len(tokens)
        return out

    def verify(self, seq_id: int, token_ids: Sequence[int]) -> np.ndarray:
        """Logits at each of `token_ids` appended to `seq_id` (through prefill: the stages have no verify entry)."""
        return self.prefill(seq_id, token_ids, all_logits=True)

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        """Append one token to each sequence; logits [len(seq_ids), vocab]."""
        if len(seq_ids) != len(token_ids) or not seq_ids:
            raise GenerationError("decode needs one token per sequence")
        for seq_id in seq_ids:
            self._check_live(seq_id)
        self._check_context({seq_id: 1 for seq_id in seq_ids})
        tokens = self._check_tokens(token_ids)
        keys = list(seq_ids)
        out = self._chain(lambda i, x: self.stages[i].actor.decode.remote(keys, x), tokens)
        for seq_id in seq_ids:
            self._lengths[seq_id] += 1
        return out

    def embed(self, token_ids: Sequence[int]) -> np.ndarray:
        """Not available: the stages have no embed entry."""
        raise GenerationError("a pipeline artifact has no embed function")

    def set_adapter(self, seq_id: int, name: str | None, scale: float = 1.0) -> None:
        """Not available: a split model has no adapter slots."""
        if name is not None:
            raise GenerationError("a pipeline artifact has no LoRA adapter slots")

    def health(self) -> list[dict]:
        """Each stage's layers, node, pid and restarts."""
        return [{"stage": stage.spec.index, "layers": list(stage.spec.layers), "node": stage.info.get("node"),
                 "pid": stage.info.get("pid"), "restarts": stage.restarts} for stage in self.stages]

    def _chain(self, call, x: np.ndarray) -> np.ndarray:
        """Run `call(i, input)` for each stage in turn, each stage's output (an object reference, not fetched
        here) the next one's input; the last stage's output. A stage that died is restarted, and the step fails
        with one line."""
        self._await_restarts()
        refs: list[ray.ObjectRef[np.ndarray]] = []
        for index in range(len(self.stages)):
            refs.append(call(index, x if index == 0 else refs[-1]))
        try:
            return ray.get(refs[-1])
        except RayTaskError as err:
            if isinstance(err.cause, EmberError):
                raise type(err.cause)(str(err.cause)) from None
            if not isinstance(err.cause, RayActorError):
                raise
        except RayActorError:
            pass
        raise self._lost(refs)

    def _lost(self, refs: list) -> StageLostError:
        """Restart each stage whose process died under `refs`; the error that ends the step."""
        dead = []
        for stage, ref in zip(self.stages, refs):
            try:
                ray.get(ref)
            except RayActorError:
                dead.append(stage)
                break  # the stages after it failed for want of its output
            except RayError:
                break
        self._deaths += 1
        for stage in dead:
            log.warning("ember: stage %d (pid %s) died; restarting it", stage.spec.index, stage.info.get("pid"))
            ray.kill(stage.actor, no_restart=True)
            stage.restarts += 1
            stage.launch(self._actor_class)
        where = ", ".join(f"stage {stage.spec.index} (layers {stage.spec.layers[0]}-{stage.spec.layers[1] - 1})"
                          for stage in dead) or "a stage"
        return StageLostError(f"pipeline {where} stopped mid-answer; it is restarting: send the request again")

    def _await_restarts(self) -> None:
        """Wait for each restarted stage to load (an `EmberError` if it cannot: this step fails, the next waits
        again)."""
        for stage in self.stages:
            if stage.loading:
                stage.wait_ready()

    def _call_all(self, method: str, *args: object) -> None:
        """`method(*args)` on every stage, waited for."""
        self._await_restarts()
        refs = [getattr(stage.actor, method).remote(*args) for stage in self.stages]
        try:
            ray.get(refs)
        except RayActorError:
            raise self._lost(refs) from None

    def _check_live(self, seq_id: int) -> None:
        self._check_known(seq_id)
        if self._epoch[seq_id] != self._deaths:
            raise GenerationError(f"sequence {seq_id} lost its cache when a pipeline stage died: send the request "
                                  "again")


@dataclass(frozen=True)
class FrontArtifact:
    """What the server reads of a pipeline artifact (`ArtifactView`), without its weights: stage 0's directory, the
    whole model's manifest, and the tokenizer every stage keeps (stage 0's)."""

    path: Path
    manifest: Manifest
    tokenizer: Tokenizer | None


def _front_artifact(artifact_dir: Path) -> FrontArtifact:
    """The `FrontArtifact` of the pipeline artifact at `artifact_dir`."""
    from ember.runtime.tokenizer import Tokenizer

    manifest = read_manifest(artifact_dir)
    first = artifact_dir / pipeline_field(artifact_dir, manifest)["stages"][0]
    context = int(read_manifest(first).kv_cache["max_context"])
    tokenizer = Tokenizer.from_dir(first, context) if (first / "tokenizer.json").exists() else None
    return FrontArtifact(first, manifest, tokenizer)


class PipelineServer:
    """`ember serve`'s server and scheduler, in this process, over a pipeline's stages on the Ray cluster."""

    def __init__(self, settings: ReplicaSettings, address: str | None, host: str = "127.0.0.1",
                 port: int = 8000) -> None:
        from ember.serving.assembly import serve_engine

        artifact_dir = Path(settings.artifact_dir)
        stages = len(pipeline_field(artifact_dir, read_manifest(artifact_dir))["stages"])
        with StartUp() as start_up:
            self.session = connect(address, settings.threads, 1, start_up)
            try:
                cpus = ray.cluster_resources().get("CPU", 0)
                if stages * settings.threads > cpus:
                    raise EmberError(f"{settings.artifact_dir}: its {stages} stages take {settings.threads} CPU(s) "
                                     f"each (--threads) and the Ray cluster has {cpus:g}")
                self.engine = PipelineEngine(Path(settings.artifact_dir), settings.threads)
                try:
                    # One chain of stages over KV caches of their own: no prefix cache to keep across requests.
                    self.server = serve_engine(self.engine, dataclasses.replace(settings.serve, prefix_cache=False),
                                               host, port)
                    self.scheduler = self.server.scheduler
                except BaseException:
                    self.engine.stop()
                    raise
            except BaseException:
                self.session.close()
                raise

    def run(self) -> None:
        """Serve until interrupted, then stop the stages and leave the cluster."""
        try:
            self.server.run()
        finally:
            self.scheduler.close()
            self.engine.stop()
            self.session.close()


def serve_pipeline(settings: ReplicaSettings, address: str | None, host: str, port: int) -> None:
    """Serve the pipeline artifact `settings.artifact_dir` from its stages on Ray until Ctrl-C."""
    server = PipelineServer(settings, address, host, port)
    print(f"ember: serving {settings.serve.model_name} at {server.server.url} from {len(server.engine.stages)} "
          f"pipeline stages on Ray ({address or 'a local cluster'}; Ctrl-C stops)", file=sys.stderr, flush=True)
    server.run()
