"""ember's serving layer, above the light runtime: many requests over one engine, and the HTTP API over them.

    scheduler.py     continuous batching of requests over an `Engine` (a thread), prefix reuse, `n` groups,
                     speculation, embedding jobs, metrics figures
    server.py        `ember serve`'s HTTP server (FastAPI and uvicorn, the serve extra): the OpenAI, Anthropic and
                     llama-server APIs, the chat page (static/), /health and /metrics
    routes.py        the server's routes as a table, which docs/serving.md's table of endpoints is generated from
    protocol.py      the OpenAI request and response shapes, and their checks
    responses.py     OpenAI's Responses API, mapped onto a chat request
    anthropic_messages.py  Anthropic's Messages API, mapped onto a chat request
    utilities.py     llama-server's /tokenize, /detokenize, /apply-template and /props
    tool_calls.py    tool calling: what a chat template teaches, the call grammar, calls read out of replies
    constrained.py   `response_format` and tool grammars as a token mask (llguidance)
    bounded_json.py  JSON from strangers, parsed within bounds

Only `server` needs the serve extra; the CLI, the Ray replicas and the pipeline front build on it.
"""

from ember.serving.scheduler import Scheduler, StreamEvent

__all__ = ["Scheduler", "StreamEvent"]
