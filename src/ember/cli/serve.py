"""`ember serve`: an artifact behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import stat
import sys
from pathlib import Path

from ember.cli.options import (
    add_speculation_arguments,
    add_threads_argument,
    lora_adapter,
    positive_int,
    seconds,
    speculation,
    text,
    web_origin,
    whole_number,
)
from ember.core.errors import EmberError

MAX_KEY_FILE_BYTES = 4096
MAX_TEMPLATE_BYTES = 2**20


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `ember serve` and its options."""
    parser = subparsers.add_parser(
        "serve", help="serve an artifact over an OpenAI-compatible HTTP API",
        description="Serve an artifact over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, "
                    "/health, /metrics), batching concurrent requests. Needs the serve extra: "
                    "pip install 'ember[serve]'.",
        epilog="example:\n  ember serve demo-cpu --port 8000\n"
               "  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\\n"
               "    -d '{\"model\": \"demo-cpu\", \"prompt\": \"And the LORD said\", \"max_tokens\": 32}'",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path, help="artifact directory; its name is the model name clients send")
    parser.add_argument("--chat-template", type=Path, metavar="FILE",
                        help="a Jinja chat template to render chats with instead of the artifact's own (e.g. one "
                             "that knows tool calls: Llama 3.1, Qwen2.5/Hermes or Mistral syntax)")
    parser.add_argument("--lora", type=lora_adapter, action="append", default=[], metavar="NAME=PATH",
                        help="load the PEFT LoRA adapter in directory PATH as the model NAME: a request naming NAME "
                             "runs with it (or picks it by id and scale in llama-server's `lora` field), batched "
                             "with the others; repeat for more, up to the artifact's --lora-slots (compiled with "
                             "--lora-rank)")
    _add_access_arguments(parser)
    _add_scheduling_arguments(parser)
    _add_cluster_arguments(parser)
    add_speculation_arguments(parser, serving=True)
    add_threads_argument(parser)
    return parser


def _add_access_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the server listens and who may use it."""
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default %(default)s: this machine only; 0.0.0.0 for all)")
    parser.add_argument("--port", type=whole_number(0), default=8000, help="TCP port (default %(default)s)")
    key = parser.add_mutually_exclusive_group()
    key.add_argument("--api-key", type=text, metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on /v1/ requests")
    key.add_argument("--api-key-file", type=Path, metavar="FILE",
                     help="as --api-key, the key read from the first line of FILE (not shown in `ps`)")
    parser.add_argument("--allow-origin", type=web_origin, action="append", default=[], metavar="ORIGIN",
                        help="a web page's origin (scheme://host[:port]) whose scripts may call the API (CORS); "
                             "repeatable; * lets any page on the internet in, so pair it with --api-key (default: "
                             "only the server's own chat page at /)")


def _add_scheduling_arguments(parser: argparse.ArgumentParser) -> None:
    """How requests share the engine."""
    parser.add_argument("--max-queue", type=positive_int, default=256, metavar="N",
                        help="requests that may wait for a free sequence; more are answered 429 (default %(default)s)")
    parser.add_argument("--max-decode-stall", type=seconds, metavar="SECONDS",
                        help="how long reading an arriving prompt may hold back the running streams' next token "
                             "(prompts are read in chunks of that much prefill): shorter is smoother, longer serves "
                             "more tokens a second under load; 0: a KV page at a time, inf: whole prompts "
                             "(default 0.1)")
    parser.add_argument("--pooling", choices=("mean", "last"), default="mean",  # ember.runtime.engine.POOLINGS
                        help="how /v1/embeddings makes one vector of an input's last hidden states (artifacts "
                             "compiled with --embeddings): their mean, or the last token's; L2-normalized "
                             "(default %(default)s)")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="free each request's KV pages when it ends instead of reusing them for later prompts "
                             "that start the same way (outputs then never depend on other requests, not even "
                             "in the last float bits)")


def _add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """Replicas on a Ray cluster (the cluster extra; docs/cluster.md)."""
    parser.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                        help="serve from engine replicas on a Ray cluster, behind one endpoint here: the cluster "
                             "whose head is at ADDRESS (HOST:PORT), else a new one on this machine; a pipeline "
                             "artifact gets an actor per stage. Needs pip install 'ember[cluster]'")
    parser.add_argument("--replicas", type=whole_number(0), metavar="N",
                        help="with --ray: how many replicas, each a Ray actor process with --threads CPUs "
                             "(default 1 each) and its own prefix cache (default 2)")
    parser.add_argument("--no-prefix-routing", action="store_true",
                        help="with --ray: send each request to the least loaded replica, not to the one whose prefix "
                             "cache holds its prompt's start (to measure what prefix-aware routing gains)")


def run(args: argparse.Namespace) -> int:
    """Load the artifact and serve it until Ctrl-C."""
    api_key = _api_key(args)
    if args.ray is not None or args.replicas is not None or args.no_prefix_routing:
        return _run_cluster(args, api_key)
    from ember.runtime import Engine, load_artifact
    from ember.serving import server as _  # noqa: F401 - FastAPI is checked for before the artifact is loaded
    from ember.serving.assembly import serve_engine

    settings = _serve_settings(args, api_key)
    _check_adapter_names(args.lora, settings.model_name)
    engine = Engine(load_artifact(args.artifact, threads=args.threads))
    for name, path in args.lora:
        engine.load_adapter(name, path)
    server = serve_engine(engine, settings, args.host, args.port, speculation(args, engine))
    with server.scheduler:
        print(f"ember: serving {server.model_name} at {server.url}, chat page at {server.page_url} (Ctrl-C stops)",
              file=sys.stderr, flush=True)
        for warning in exposure_warnings(args.host, api_key, args.allow_origin):
            print(f"ember: warning: {warning}", file=sys.stderr, flush=True)
        server.run()
    return 0


def _check_adapter_names(adapters: list[tuple[str, Path]], model_name: str) -> None:
    """Refuse --lora names that clash: with the model's own name, or with each other."""
    names = [name for name, _ in adapters]
    for name in names:
        if name == model_name:
            raise EmberError(f"--lora {name}=...: {name} is the model's own name (the artifact directory's); "
                             "give the adapter another")
        if names.count(name) > 1:
            raise EmberError(f"--lora {name}=...: two adapters named {name}")


def _serve_settings(args: argparse.Namespace, api_key: str | None):
    """The scheduler's and server's options, as every way of serving takes them (`ember.serving.assembly`)."""
    from ember.serving.assembly import ServeSettings

    stall = {} if args.max_decode_stall is None else {"max_decode_stall": args.max_decode_stall}
    template = None if args.chat_template is None else _read_chat_template(args.chat_template)
    return ServeSettings(args.artifact.resolve().name, api_key, template, f"--chat-template {args.chat_template}",
                         max_queue=args.max_queue, prefix_cache=not args.no_prefix_cache, pooling=args.pooling,
                         allowed_origins=tuple(args.allow_origin), **stall)


def _run_cluster(args: argparse.Namespace, api_key: str | None) -> int:
    """Serve the artifact from --replicas replicas on the Ray cluster of --ray until Ctrl-C."""
    if args.ray is None:
        raise EmberError(f"{'--replicas' if args.replicas is not None else '--no-prefix-routing'}: applies only "
                         "with --ray")
    replicas = 2 if args.replicas is None else args.replicas
    if replicas == 0:
        raise EmberError("--replicas 0: a cluster needs at least one replica")
    if args.speculate is not None or args.draft is not None:
        raise EmberError("--speculate/--draft: not available with --ray yet; serve without them")
    if args.lora:
        raise EmberError("--lora: not available with --ray yet; serve LoRA adapters without it")
    if not (args.artifact / "manifest.json").is_file():
        raise EmberError(f"{args.artifact}: not an artifact directory (no manifest.json)")
    from ember.core.manifest import check_whole_model, read_manifest

    manifest = read_manifest(args.artifact)
    check_whole_model(args.artifact, manifest)
    pipeline = manifest.pipeline is not None
    if pipeline and args.replicas is not None:
        raise EmberError(f"--replicas: {args.artifact} is a pipeline artifact, served as one chain of its stages")
    if pipeline and args.no_prefix_routing:
        raise EmberError(f"--no-prefix-routing: {args.artifact} is a pipeline artifact, served as one chain of its "
                         "stages, with no replicas to route among")
    from ember.cluster.replica import ReplicaSettings  # Ray is checked for before anything starts
    from ember.cluster.serve import serve

    settings = ReplicaSettings(str(args.artifact.resolve()), _serve_settings(args, api_key), threads=args.threads or 1)
    for warning in exposure_warnings(args.host, api_key, args.allow_origin):
        print(f"ember: warning: {warning}", file=sys.stderr, flush=True)
    if pipeline:
        from ember.cluster.pipeline import serve_pipeline

        serve_pipeline(settings, args.ray or None, args.host, args.port)
    else:
        serve(settings, replicas, args.ray or None, args.host, args.port, prefix_routing=not args.no_prefix_routing)
    return 0


def _read_chat_template(path: Path) -> str:
    """The source of the Jinja template in `path`, checked to be a readable, non-empty text file."""
    if not path.is_file() or path.stat().st_size > MAX_TEMPLATE_BYTES:
        raise EmberError(f"--chat-template {path}: not a file of at most {MAX_TEMPLATE_BYTES // 2**20} MiB")
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise EmberError(f"--chat-template {path}: cannot read it as UTF-8 text: {err}") from None
    if not source.strip():
        raise EmberError(f"--chat-template {path}: the file is empty")
    return source


def _api_key(args: argparse.Namespace) -> str | None:
    """The key of --api-key or --api-key-file's first line; None for none."""
    api_key = args.api_key if args.api_key_file is None else _read_key_file(args.api_key_file)
    if api_key is not None and not api_key.strip():
        raise EmberError("--api-key/--api-key-file: the key is empty")
    return api_key


def _read_key_file(path: Path) -> str:
    """The first line of --api-key-file, a regular file of at most MAX_KEY_FILE_BYTES: a FIFO would block,
    and /dev/zero would be read until memory ran out."""
    try:
        # Non-blocking, so that opening a FIFO returns at once; fstat then checks what was opened.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(descriptor, "rb") as file:
            if not stat.S_ISREG(os.fstat(descriptor).st_mode):
                raise EmberError(f"--api-key-file {path}: not a regular file")
            data = file.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as err:
        raise EmberError(f"--api-key-file {path}: cannot read it: {err.strerror or err}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise EmberError(f"--api-key-file {path}: larger than {MAX_KEY_FILE_BYTES // 1024} KiB; the key goes on "
                         "its first line")
    try:
        return data.decode("utf-8").partition("\n")[0].strip()
    except UnicodeDecodeError:
        raise EmberError(f"--api-key-file {path}: not UTF-8 text") from None


def exposure_warnings(host: str, api_key: str | None, origins: list[str]) -> list[str]:
    """What a server without an API key lets strangers do, by its --host and --allow-origin."""
    if api_key is not None:
        return []
    warnings = []
    address = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]  # the address Server bound
    if not ipaddress.ip_address(address).is_loopback:
        warnings.append(f"--host {host} without --api-key: anyone who can reach this machine can use the model")
    if "*" in origins:
        warnings.append("--allow-origin '*' without --api-key: any web page opened on this machine can use the model")
    return warnings
