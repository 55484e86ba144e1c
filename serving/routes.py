"""`ember serve`'s HTTP routes as data: the server registers every route from `ROUTES` (its handler, whether it needs
the API key, the shape of its errors), and docs/serving.md's table of endpoints is generated from the same table, so
neither can drift. `python -m ember.serving.routes [docs/serving.md]` rewrites that table in place; a test fails
while the file differs from what it would write.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# The lines between which docs/serving.md holds the generated table.
TABLE_BEGIN = "<!-- endpoints: generated from serving/routes.py by `python -m ember.serving.routes`; edit it there -->"
TABLE_END = "<!-- end of generated endpoints -->"
DOCS = Path("docs") / "serving.md"


@dataclass(frozen=True)
class Route:
    """One HTTP route of the server."""

    method: Literal["GET", "POST"]
    path: str  # as FastAPI matches it (`{model:path}`: a parameter that may hold slashes)
    handler: str  # the name of the server's method that answers it
    follows: str  # whose API it speaks
    summary: str  # what it does, one line of docs/serving.md's table
    needs_key: bool = True  # refused without the server's API key, when it has one
    errors: Literal["openai", "anthropic"] = "openai"  # the shape of its error bodies

    @property
    def shown_path(self) -> str:
        """The path as the docs show it (`{model}`)."""
        return self.path.replace(":path}", "}")


ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/chat/completions", "chat", "OpenAI",
          "Chat through the model's template: tools, `response_format`, `n`, logprobs; streamed or whole"),
    Route("POST", "/v1/completions", "completion", "OpenAI",
          "Text completions of a text or token-id prompt, or a list of them (a choice each); `echo`"),
    Route("POST", "/v1/responses", "responses", "OpenAI",
          "The Responses API, stateless: `input` items, function tools, `text.format`; typed event streams"),
    Route("POST", "/v1/embeddings", "embeddings", "OpenAI", "Embeddings, for an artifact compiled with `--embeddings`"),
    Route("GET", "/v1/models", "models", "OpenAI", "The model served, then its LoRA adapters (each a model name)"),
    Route("GET", "/v1/models/{model:path}", "model", "OpenAI",
          "The model's card (the openai client's `models.retrieve`)"),
    Route("POST", "/v1/messages", "messages", "Anthropic",
          "Messages: text, `tool_use` and `tool_result` blocks, `stop_sequences`; streamed or whole",
          errors="anthropic"),
    Route("POST", "/v1/messages/count_tokens", "count_tokens", "Anthropic",
          "The tokens of a Messages request's prompt (system, tools and messages)", errors="anthropic"),
    Route("POST", "/tokenize", "tokenize", "llama-server", "Token ids of a text, with their pieces if asked"),
    Route("POST", "/detokenize", "detokenize", "llama-server", "The text of token ids (special tokens dropped)"),
    Route("POST", "/apply-template", "apply_template", "llama-server",
          "The prompt a chat's messages (and tools) render to through the chat template"),
    Route("GET", "/lora-adapters", "lora_adapters", "llama-server",
          "The LoRA adapters loaded (`ember serve --lora`): the id a request's `lora` list names, name, path"),
    Route("GET", "/props", "props", "llama-server",
          "Default sampling settings, context window, sequences at once, artifact, chat template, version"),
    Route("GET", "/health", "health", "llama-server", "`{\"status\": \"ok\"}` while the server runs", needs_key=False),
    Route("GET", "/v1/health", "health", "llama-server", "The same as `/health`", needs_key=False),
    Route("GET", "/metrics", "metrics", "Prometheus", "Requests, tokens, queue, KV cache, prefix cache, latencies",
          needs_key=False),
    Route("GET", "/", "chat_page", "ember", "The chat page (it asks for the API key itself)", needs_key=False),
)


def endpoint_table(routes: Sequence[Route] = ROUTES) -> str:
    """The Markdown table of `routes`, as docs/serving.md holds it."""
    rows = ["| Method | Path | API | Key | What it does |", "|---|---|---|---|---|"]
    rows += [f"| {route.method} | `{route.shown_path}` | {route.follows} | {'yes' if route.needs_key else 'no'} | "
             f"{route.summary} |" for route in routes]
    return "\n".join(rows)


def with_table(text: str) -> str:
    """`text` (docs/serving.md) with the table between its markers generated anew."""
    begin, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if begin < 0 or end < begin:
        raise ValueError(f"the text has no '{TABLE_BEGIN}' line followed by a '{TABLE_END}' line")
    return f"{text[:begin]}{TABLE_BEGIN}\n{endpoint_table()}\n{text[end:]}"


def main(argv: Sequence[str] | None = None) -> int:
    """Rewrite the endpoints table of the docs file named (docs/serving.md by default)."""
    args = sys.argv[1:] if argv is None else list(argv)
    path = Path(args[0]) if args else DOCS
    try:
        text = path.read_text(encoding="utf-8")
        updated = with_table(text)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        print(f"{path}: {err}", file=sys.stderr)
        return 1
    if updated != text:
        path.write_text(updated, encoding="utf-8")
    print(f"{path}: the endpoints table is {'rewritten' if updated != text else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
