"""Multi-turn chat over one KV-cache sequence, reusing the cache across turns.

Each turn renders the whole conversation with the model's chat template and feeds
the engine only the tokens after the longest prefix already in the cache, so a
reply costs its new message, not the history.
"""

from __future__ import annotations

from ember.core.errors import GenerationError
from ember.runtime.engine import Engine
from ember.runtime.generate import Generation
from ember.runtime.history import fit_history
from ember.runtime.sampling import SamplingParams
from ember.runtime.speculative import Speculation
from ember.runtime.tokenizer import check_text


class ChatSession:
    """A conversation with an artifact's model."""

    def __init__(self, engine: Engine, system: str | None = None, speculation: Speculation | None = None) -> None:
        if engine.artifact.tokenizer is None:
            raise GenerationError("chat needs a tokenizer; this artifact has none")
        self.engine = engine
        self.tokenizer = engine.artifact.tokenizer
        self.tokenizer.check_chat_template()
        if system is not None:
            check_text(system, "the system message")
        self.system = system
        self.speculation = speculation  # replies verify guessed tokens (`runtime/speculative.py`)
        self.messages: list[dict[str, str]] = []
        self.dropped_turns = 0  # earliest turns the last `send` dropped to fit the context window
        self.seq_id = engine.add_sequence()
        self.cached_ids: list[int] = []
        self._prompt_ids: list[int] = []
        self._reply: Generation | None = None
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (keeps the system message)."""
        self._finish_reply()
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.engine.truncate(self.seq_id, 0)
        self.cached_ids = []

    def send(self, message: str, params: SamplingParams) -> Generation:
        """Add a user message; iterate the returned generation for the reply.

        The earliest turns (a user message and the replies after it; the system message
        stays) are dropped until the conversation leaves room for a reply in the context
        window, and `dropped_turns` says how many. A message that does not fit even alone,
        or that the chat template refuses, raises `GenerationError` and is not added.
        """
        check_text(message, "the message")
        self._finish_reply()
        messages, prompt, self.dropped_turns = self._fit([*self.messages, {"role": "user", "content": message}],
                                                         params)
        shared = 0
        for cached, new in zip(self.cached_ids, prompt):
            if cached != new:
                break
            shared += 1
        shared = min(shared, len(prompt) - 1)  # prefill needs at least one new token
        self.engine.truncate(self.seq_id, shared)
        self.messages = messages
        self.cached_ids, self._prompt_ids = prompt[:shared], prompt
        self._reply = Generation(self.engine, self.tokenizer, self.seq_id, prompt[shared:], params, self.speculation)
        return self._reply

    def _fit(self, messages: list[dict[str, str]],
             params: SamplingParams) -> tuple[list[dict[str, str]], list[int], int]:
        """The latest turns of `messages` whose prompt leaves room for a reply, that prompt, and how
        many turns were dropped."""
        context = self.engine.context_window
        room = min(params.max_new_tokens, context // 4)
        messages, prompt, dropped = fit_history(messages, self._prompt_of, context - room)
        if len(prompt) > context - room:
            raise GenerationError(
                f"the message does not fit: the conversation with only it is {len(prompt)} tokens, and the "
                f"context window of {context} tokens keeps {room} for the reply; it was not sent")
        return messages, prompt, dropped

    def _prompt_of(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages), add_special_tokens=False)

    def _finish_reply(self) -> None:
        """Record the last reply in the history and the cache bookkeeping."""
        if self._reply is None:
            return
        reply = self._reply
        self._reply = None
        self.messages.append({"role": "assistant", "content": self.tokenizer.decode(reply.token_ids)})
        # What the cache holds: the prompt, and the reply but for a last token it had no room for.
        self.cached_ids = (self._prompt_ids + reply.token_ids)[: self.engine.length(self.seq_id)]
