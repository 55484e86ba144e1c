"""Replicas of ember's serving engine as Ray actors, and the pool that starts, watches and replaces them.

Each replica is one Ray actor process that loads the artifact, runs its own `Scheduler` (and so its own
engine threads and prefix cache) and answers HTTP with `ember serve`'s own server (serving/server.py) on
its node's address: the front relays requests to it, so every endpoint, field and error is `ember serve`'s.
The artifact must be at the same path on every node that hosts a replica.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.cluster.router import Router
from ember.core.errors import EmberError
from ember.serving.assembly import ServeSettings

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayError, RayTaskError
except ImportError as err:
    raise EmberError(f"ember serve --ray needs Ray ({err.name} is missing): pip install 'ember[cluster]'") from None

log = logging.getLogger(__name__)

START_TIMEOUT = 300.0  # seconds for a replica to be placed, load the artifact and listen
RESTART_DELAY = 2.0  # seconds between tries to replace a dead replica whose replacement failed


@dataclass(frozen=True)
class ReplicaSettings:
    """What every replica serves, and how: the artifact, its threads and `ember serve`'s options, as plain data that
    travels to the actors."""

    artifact_dir: str
    serve: ServeSettings
    threads: int = 1


class ReplicaActor:
    """One replica: an engine, its scheduler and `ember serve`'s HTTP server, in a Ray actor's process."""

    def __init__(self) -> None:
        self._forever = threading.Event()  # never set: wait_stopped returns only by the process's death

    def start(self, settings: ReplicaSettings) -> dict:
        """Load the artifact and serve it on this node's address; returns where (url, pid, node)."""
        from ember.runtime import Engine, load_artifact
        from ember.serving.assembly import serve_engine

        try:
            engine = Engine(load_artifact(Path(settings.artifact_dir), threads=settings.threads))
            node = _node_address()
            server = serve_engine(engine, settings.serve, node, 0)
            server.start()
        except EmberError as err:  # travels to the front as itself: one line there
            raise EmberError(f"replica on {socket.gethostname()}: {err}") from None
        self._server = server  # kept alive with the actor
        return {"url": server.page_url.rstrip("/"), "pid": os.getpid(), "node": node}

    def wait_stopped(self) -> None:
        """Block for the actor's life: its caller learns of the process's death by this call's failure."""
        self._forever.wait()


def wait_started(ready: ray.ObjectRef[dict], name: str, timeout_hint: str) -> dict:
    """What an actor's start call returned; one line naming `name` if it timed out (with `timeout_hint`) or failed."""
    try:
        return ray.get(ready, timeout=START_TIMEOUT)
    except GetTimeoutError:
        raise EmberError(f"{name} did not start within {START_TIMEOUT:g} s: {timeout_hint}") from None
    except RayTaskError as err:
        cause = err.cause if isinstance(err.cause, EmberError) else err
        raise EmberError(f"{name} failed to start: {str(cause).strip().splitlines()[-1]}") from None
    except RayError as err:
        raise EmberError(f"{name} failed to start: {str(err).strip().splitlines()[0]}") from None


def _node_address() -> str:
    """The address this actor's node joined the cluster with (127.0.0.1 for loopback nodes), which the front
    reaches it by; not the machine's outward address that `ray.util.get_node_ip_address` guesses."""
    here = ray.get_runtime_context().get_node_id()
    return next(node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == here)


class ReplicaPool:
    """Starts `router`'s replicas as actors, replaces each one that dies, and stops them all."""

    def __init__(self, router: Router, settings: ReplicaSettings) -> None:
        self.router = router
        self.settings = settings
        # Ray's stubs type ray.remote's task options only; max_concurrency is one of its actor options.
        self._actor_class = ray.remote(  # type: ignore[call-overload]
            num_cpus=settings.threads, max_concurrency=2, max_restarts=0)(ReplicaActor)
        # Actor handles: Ray types a call of an actor's method only where the method is decorated with @ray.method.
        self._actors: dict[int, Any] = {}
        self._stopped_refs: dict[int, ray.ObjectRef[None]] = {}
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        """Start every replica and wait until each serves; if one cannot, stop them all and raise its error."""
        pending = {index: self._launch(index) for index in range(len(self.router.replicas))}
        try:
            for index, ready in pending.items():
                self._serve(index, ready)
        except BaseException:
            self.stop()
            raise
        self._watcher = threading.Thread(target=self._watch, name="ember-replica-watcher", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        """Kill every replica's actor."""
        self._closing.set()
        for actor in list(self._actors.values()):  # the watcher may be replacing one meanwhile
            ray.kill(actor, no_restart=True)
        self._actors.clear()

    def _launch(self, index: int) -> ray.ObjectRef[dict]:
        """A new actor for replica `index`; returns the reference its address will arrive by."""
        actor = self._actor_class.remote()
        self._actors[index] = actor
        return actor.start.remote(self.settings)

    def _serve(self, index: int, ready: ray.ObjectRef[dict]) -> None:
        """Wait for replica `index`'s address and let the router send it requests."""
        info = wait_started(ready, f"replica {index}",
                            f"the cluster may lack a free node with {self.settings.threads} CPU(s) (--threads)")
        self._stopped_refs[index] = self._actors[index].wait_stopped.remote()
        self.router.set_alive(index, info)
        log.warning("ember: replica %d serving at %s (pid %s)", index, info["url"], info["pid"])

    def _watch(self) -> None:
        """Replace each replica whose process dies, until the pool stops."""
        while not self._closing.is_set():
            by_ref = {ref: index for index, ref in self._stopped_refs.items()}
            try:
                ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=0.5)
            except Exception:
                if self._closing.is_set():  # Ray shut down under it: the pool is stopping
                    return
                raise
            for ref in ready:
                if not self._closing.is_set():
                    self._replace(by_ref[ref])

    def _replace(self, index: int) -> None:
        """Take dead replica `index` out of routing and start another in its place, retrying until it serves."""
        self.router.set_dead(index)
        del self._stopped_refs[index]
        log.warning("ember: replica %d died; starting a replacement", index)
        while not self._closing.is_set():
            ray.kill(self._actors[index], no_restart=True)
            try:
                self._serve(index, self._launch(index))
                self.router.replicas[index].restarts += 1
                return
            except EmberError as err:
                log.warning("ember: %s; trying again", err)
                time.sleep(RESTART_DELAY)
