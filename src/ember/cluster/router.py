"""Which replica answers a request: prefix-cache-aware, else least loaded.

A request's routing key is the start of its prompt as the client sent it: a chat's leading system
(or developer) messages, else its first message; a completion's first PREFIX_CHARS characters or
PREFIX_TOKENS token ids. Requests with the same key go to the replica that answered the last one,
whose prefix cache then holds those KV pages (as SGLang's and Ray Serve's LLM routers do), unless it
is busier than the least loaded replica by more than `slack` requests: a hot system prompt then
spreads instead of queueing on one replica. Everything else goes to the least loaded replica, as every
request does with `prefix_routing=False` (`ember serve --ray --no-prefix-routing`, to measure what it gains).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

PREFIX_CHARS = 256  # about a KV page or two of text: the part of a prompt that decides where it goes
PREFIX_TOKENS = 64
MAX_KEYS = 4096  # routing keys remembered, least recently used dropped first
DEFAULT_SLACK = 8


def routing_key(path: str, body: bytes) -> str | None:
    """The hash of the prompt start that decides `body`'s replica; None when the body has none to route by."""
    try:
        fields = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(fields, dict):
        return None
    start = _prompt_start(path, fields)
    if start is None:
        return None
    text = json.dumps([path, fields.get("model"), start], sort_keys=True, ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _prompt_start(path: str, fields: dict) -> object | None:
    """The part of the prompt that requests sharing a prefix have in common, as the client wrote it."""
    if path == "/v1/chat/completions":
        messages = fields.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        system = []
        for message in messages:
            if not isinstance(message, dict) or message.get("role") not in ("system", "developer"):
                break
            system.append(message)
        return system or messages[:1]
    if path == "/v1/completions":
        prompt = fields.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt[:PREFIX_CHARS]
        if isinstance(prompt, list) and all(isinstance(token, int) for token in prompt):
            return prompt[:PREFIX_TOKENS]
    return None


@dataclass
class ReplicaLoad:
    """What the router knows of one replica: whether it takes requests, and what it was given."""

    index: int
    alive: bool = False
    in_flight: int = 0
    routed: int = 0
    prefix_routed: int = 0  # requests sent here because this replica had answered their prefix before
    restarts: int = 0
    info: dict = field(default_factory=dict)  # the replica's url, pid and node


class Router:
    """Picks a replica per request and counts what each one holds; safe to call from any thread."""

    def __init__(self, replicas: int, slack: int = DEFAULT_SLACK, prefix_routing: bool = True) -> None:
        self.replicas = [ReplicaLoad(index) for index in range(replicas)]
        self.slack = slack
        self.prefix_routing = prefix_routing
        self._owners: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def pick(self, key: str | None, exclude: frozenset[int] = frozenset()) -> ReplicaLoad | None:
        """The replica for a request with routing key `key` (not one of `exclude`), now counted as in flight
        there; None when no replica is alive."""
        with self._lock:
            alive = [replica for replica in self.replicas if replica.alive and replica.index not in exclude]
            if not alive:
                return None
            least = min(alive, key=lambda replica: (replica.in_flight, replica.routed, replica.index))
            owner = self.replicas[self._owners[key]] \
                if self.prefix_routing and key is not None and key in self._owners else None
            chosen = least
            if owner is not None and owner in alive and owner.in_flight <= least.in_flight + self.slack:
                chosen = owner
                chosen.prefix_routed += 1
            if key is not None:
                self._owners[key] = chosen.index
                self._owners.move_to_end(key)
                while len(self._owners) > MAX_KEYS:
                    self._owners.popitem(last=False)
            chosen.in_flight += 1
            chosen.routed += 1
            return chosen

    def done(self, replica: ReplicaLoad) -> None:
        """A request picked for `replica` has ended."""
        with self._lock:
            replica.in_flight -= 1

    def set_alive(self, index: int, info: dict) -> None:
        """Replica `index` takes requests, at `info["url"]`."""
        with self._lock:
            self.replicas[index].info = info
            self.replicas[index].alive = True

    def set_dead(self, index: int) -> bool:
        """Replica `index` takes no more requests and its prefixes are forgotten; False if it was already dead."""
        with self._lock:
            replica = self.replicas[index]
            was_alive, replica.alive = replica.alive, False
            for key in [key for key, owner in self._owners.items() if owner == index]:
                del self._owners[key]
            return was_alive

    def snapshot(self) -> list[dict]:
        """Each replica's state, for /health."""
        with self._lock:
            return [{"replica": replica.index, "alive": replica.alive, "in_flight": replica.in_flight,
                     "routed": replica.routed, "prefix_routed": replica.prefix_routed, "restarts": replica.restarts,
                     **replica.info} for replica in self.replicas]
