"""How ember serves an engine, in one place: `ember serve`, each Ray replica and the pipeline front call `serve_engine`.

A scheduler over the engine (batching, prefix cache, queue bound, decode stall, speculation) and the HTTP server over
the scheduler, with the options every one of them takes from the command line as `ServeSettings`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ember.core.errors import EmberError
from ember.runtime.engine import SequenceEngine
from ember.runtime.speculative import Speculation
from ember.serving.batch_policy import DEFAULT_MAX_DECODE_STALL
from ember.serving.scheduler import DEFAULT_MAX_QUEUE, Scheduler

if TYPE_CHECKING:
    from ember.serving.server import Server


@dataclass(frozen=True)
class ServeSettings:
    """`ember serve`'s options for the scheduler and the server, as plain data (it travels to Ray actors)."""

    model_name: str
    api_key: str | None = None
    chat_template: str | None = None  # a template's source, read by the CLI; None: the artifact's own
    chat_template_name: str = "--chat-template"  # where it came from, for messages ("--chat-template FILE")
    max_queue: int = DEFAULT_MAX_QUEUE
    max_decode_stall: float = DEFAULT_MAX_DECODE_STALL
    prefix_cache: bool = True
    pooling: str = "mean"
    allowed_origins: Sequence[str] = ()


def use_chat_template(engine: SequenceEngine, settings: ServeSettings) -> None:
    """Chat with the settings' template instead of the artifact's own, if they name one."""
    if settings.chat_template is None:
        return
    tokenizer = engine.artifact.tokenizer
    if tokenizer is None:
        raise EmberError(f"{settings.chat_template_name}: this artifact has no tokenizer to chat with")
    tokenizer.use_chat_template(settings.chat_template, settings.chat_template_name)


def serve_engine(engine: SequenceEngine, settings: ServeSettings, host: str, port: int,
                 speculation: Speculation | None = None) -> Server:
    """The HTTP server (`ember.serving.server.Server`, listening from now on) over a new scheduler of `engine`, as
    `settings` say; run or start it, then close its scheduler (`server.scheduler`). The serve extra is needed."""
    from ember.serving.server import Server

    use_chat_template(engine, settings)
    scheduler = Scheduler(engine, max_queue=settings.max_queue, prefix_cache=settings.prefix_cache,
                          max_decode_stall=settings.max_decode_stall, speculation=speculation)
    try:
        return Server(scheduler, settings.model_name, host, port, settings.api_key,
                      allowed_origins=settings.allowed_origins, pooling=settings.pooling)
    except BaseException:
        scheduler.close()
        raise
