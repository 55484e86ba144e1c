"""Fitting a chat's history into the context window by dropping its earliest turns.

A turn is a user message and the messages after it up to the next user message (the replies,
tool calls and tool results it led to). The leading system messages are instructions, not
history: they stay, as does the last turn. `ember chat` (runtime/chat.py) and `ember serve`'s
`truncation: "auto"` (serving/server.py) both drop turns this way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Message = dict[str, Any]

MAX_DEFAULT_REPLY_TOKENS = 1024


def default_reply_tokens(context_window: int) -> int:
    """The room a chat leaves for a reply when the request names none: a quarter of the context window, at most
    MAX_DEFAULT_REPLY_TOKENS (a reply "up to the context" would leave no room for the next message)."""
    return max(1, min(context_window // 4, MAX_DEFAULT_REPLY_TOKENS))


def fit_history(messages: Sequence[Message], prompt_of: Callable[[list[Message]], list[int]],
                limit: int) -> tuple[list[Message], list[int], int]:
    """The latest turns of `messages` (leading system messages kept) whose prompt, `prompt_of(kept)`, is at most
    `limit` tokens; that prompt; and how many turns were dropped. When even the last turn alone is over `limit`,
    that shortest conversation: the caller says it does not fit."""
    instructions = 0
    while instructions < len(messages) and messages[instructions]["role"] in ("system", "developer"):
        instructions += 1
    system, turns = list(messages[:instructions]), list(messages[instructions:])
    dropped = 0
    while True:
        prompt = prompt_of(system + turns)
        later_turns = [i for i, message in enumerate(turns) if message["role"] == "user" and i > 0]
        if len(prompt) <= limit or not later_turns:
            return system + turns, prompt, dropped
        turns = turns[later_turns[0]:]
        dropped += 1
