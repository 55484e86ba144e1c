"""Multi-turn chat over one KV-cache sequence, reusing the cache across turns.

Each turn renders the whole conversation with the model's chat template and feeds
the engine only the tokens after the longest prefix already in the cache, so a
reply costs its new message, not the history.
"""

from __future__ import annotations

from ember.errors import GenerationError
from ember.runtime.engine import Engine
from ember.runtime.generate import Generation
from ember.runtime.sampling import SamplingParams


class ChatSession:
    """A conversation with an artifact's model."""

    def __init__(self, engine: Engine, system: str | None = None) -> None:
        if engine.artifact.tokenizer is None:
            raise GenerationError("chat needs a tokenizer; this artifact has none")
        self.engine = engine
        self.tokenizer = engine.artifact.tokenizer
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.seq_id = engine.add_sequence()
        self.cached_ids: list[int] = []
        self._reply: Generation | None = None
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (keeps the system message)."""
        self._finish_reply()
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.engine.truncate(self.seq_id, 0)
        self.cached_ids = []

    def send(self, message: str, params: SamplingParams) -> Generation:
        """Add a user message; iterate the returned generation for the reply."""
        self._finish_reply()
        self.messages.append({"role": "user", "content": message})
        prompt = self.tokenizer.encode(
            self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True), add_special_tokens=False
        )
        shared = 0
        for cached, new in zip(self.cached_ids, prompt):
            if cached != new:
                break
            shared += 1
        shared = min(shared, len(prompt) - 1)  # prefill needs at least one new token
        self.engine.truncate(self.seq_id, shared)
        self._reply = Generation(self.engine, self.tokenizer, self.seq_id, prompt[shared:], params)
        self.cached_ids = prompt
        return self._reply

    def _finish_reply(self) -> None:
        """Record the last reply in the history and the cache bookkeeping."""
        if self._reply is None:
            return
        reply = self._reply
        self._reply = None
        self.messages.append({"role": "assistant", "content": self.tokenizer.decode(reply.token_ids)})
        in_cache = self.engine.length(self.seq_id) - len(self.cached_ids)
        self.cached_ids = self.cached_ids + reply.token_ids[:in_cache]
