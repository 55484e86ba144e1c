"""The hostile-input corpus, continued, for the surfaces serving added: HTTP bodies to every endpoint that takes one
(OpenAI's chat, completions, Responses and embeddings with tools, `n`, `echo` and lists of prompts among them;
Anthropic's messages and their token count; llama-server's utilities), pipeline stages handed to every command,
`--dump-ir` paths, and `--ray` addresses.

Same property as `test_hostile_corpus.py` (`hostile.py` has the machinery): each case ends refused (for HTTP:
a 4xx in its API's error shape, OpenAI's or Anthropic's, whose message is one line naming what is wrong) or
accepted with a well-formed result, never a 500, a traceback, a crash, a hang or files left behind; and after every
HTTP case the server still answers.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
from pathlib import Path

import artifact_cache
import pytest
from helpers import Served, compile_pipeline_cached, tree_snapshot, write_pipeline_checkpoint
from hostile import JSON_VALUES, SETTINGS, Result, outcome, unchanged
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_templates import TEMPLATES

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

HI = [{"role": "user", "content": "hi"}]
# A good body of each endpoint (the model is added), and what its accepted answer holds.
ENDPOINTS = {
    "/v1/chat/completions": {"messages": HI, "max_tokens": 3},
    "/v1/completions": {"prompt": "ab", "max_tokens": 3},
    "/v1/embeddings": {"input": "ab"},
    "/v1/responses": {"input": "hi", "max_output_tokens": 3},
    "/v1/messages": {"messages": HI, "max_tokens": 3},
    "/v1/messages/count_tokens": {"messages": HI},
    "/tokenize": {"content": "ab"},
    "/detokenize": {"tokens": [5, 6]},
    "/apply-template": {"messages": HI},
}
ANSWER_FIELDS = {"/v1/chat/completions": "choices", "/v1/completions": "choices", "/v1/embeddings": "data",
                 "/v1/responses": "output", "/v1/messages": "content", "/v1/messages/count_tokens": "input_tokens",
                 "/tokenize": "tokens", "/detokenize": "content", "/apply-template": "prompt"}
# How a stream of each endpoint that streams begins.
STREAM_STARTS = {"/v1/chat/completions": "data: ", "/v1/completions": "data: ",
                 "/v1/responses": "event: response.created\n", "/v1/messages": "event: message_start\n"}
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {
    "$defs": {"Place": {"type": "object", "properties": {"city": {"enum": ["oslo", "rome"]}}, "required": ["city"],
                        "additionalProperties": False}},
    "type": "object", "properties": {"at": {"$ref": "#/$defs/Place"}}, "required": ["at"],
    "additionalProperties": False}}}
DEEP = {"a": None}
for _ in range(200):
    DEEP = {"a": DEEP}
RESPONSES_TOOL = {"type": "function", "name": "weather", "parameters": TOOL["function"]["parameters"]}
ANTHROPIC_TOOL = {"name": "weather", "input_schema": TOOL["function"]["parameters"]}
# Values of the fields the endpoints read, at their edges and of the wrong shape.
FIELD_VALUES = {
    "messages": st.sampled_from([[], [{"role": "user"}], [{"role": "tool", "content": "x"}],
                                 [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                                "content": [{"type": "text", "text": "12 C"}]}]}],
                                 [*HI, {"role": "assistant", "content": [{"type": "tool_use", "id": "t",
                                                                          "name": "weather", "input": DEEP}]}],
                                 [{"role": "user", "content": [{"type": "image", "source": {}}]}],
                                 [{"role": "assistant", "tool_calls": [{"function": {"name": "weather",
                                                                                     "arguments": '{"a": [[[['}}]}],
                                 [{"role": "assistant", "tool_calls": [{"function": {"name": "weather",
                                                                                     "arguments": "9" * 400}}]}],
                                 [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                 [{"role": "user", "content": "x" * 3000}]]) | JSON_VALUES,
    "tools": st.sampled_from([[TOOL], [TOOL, TOOL], [{"type": "function", "function": {"name": "a b"}}],
                              [RESPONSES_TOOL], [RESPONSES_TOOL, RESPONSES_TOOL], [{"type": "web_search"}],
                              [ANTHROPIC_TOOL], [{**ANTHROPIC_TOOL, "input_schema": DEEP}],
                              [{"type": "bash_20250124", "name": "bash"}],
                              [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nowhere"}}}],
                              [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]]) | JSON_VALUES,
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "function": "weather"},
                                    {"type": "function", "function": {"name": "weather"}},
                                    {"type": "function", "function": ["weather"]}, ["auto"], {"type": "nope"},
                                    {"type": "function", "name": "weather"}, {"type": "function", "name": "nope"},
                                    {"type": "any"}, {"type": "tool", "name": "weather"}, {"type": "tool"},
                                    {"type": "none"}, {"type": "auto", "disable_parallel_tool_use": "yes"}])
    | JSON_VALUES,
    "n": st.sampled_from([0, 1, 2, 4, 16, 17, -1, 2**63, 1.5, "2"]),
    "max_tokens": st.sampled_from([0, 1, 3, 255, 256, 10**9, -3, 2.5, None]),
    "temperature": st.sampled_from([0, 0.7, 2, 2.01, -0.1, "hot", None]),
    "stream": st.booleans() | JSON_VALUES,
    "stream_options": st.sampled_from([{"include_usage": True}, {"include_usage": "yes"}, []]),
    "logprobs": JSON_VALUES, "top_logprobs": st.sampled_from([0, 5, 20, 21, -1]),
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "json_schema", "json_schema": {
        "schema": TOOL["function"]["parameters"]}}, {"type": "json_schema", "json_schema": {"schema": DEEP}},
        {"type": "xml"}]) | JSON_VALUES,
    "input": st.sampled_from([[], [""], [[]], [[1, 2]], [[-1]], [[10**9]], ["ab"] * 40, [["ab"]], [1.5],
                              HI, [{"type": "function_call", "call_id": "c", "name": "weather", "arguments": "{"}],
                              [{"type": "function_call", "call_id": "c", "name": "weather", "arguments": "9" * 400},
                               {"type": "function_call_output", "call_id": "c", "output": "12 C"}],
                              [{"type": "function_call_output", "call_id": "", "output": [{"type": "input_text"}]}],
                              [{"type": "reasoning", "summary": []}], [{"role": "user", "content": [
                                  {"type": "input_image", "image_url": "x"}]}]])
    | JSON_VALUES,
    "prompt": st.sampled_from([[], [[]], [1, 2, 3], [[1], [2]], [-5], "", "x" * 2000, ["a", "b"], ["a"] * 65,
                               [[1, 2], [10**9]], [[1], []]]) | JSON_VALUES,
    "echo": st.booleans() | JSON_VALUES,
    "instructions": st.sampled_from(["be brief", "", "x" * 3000]) | JSON_VALUES,
    "text": st.sampled_from([{"format": {"type": "json_object"}},
                             {"format": {"type": "json_schema", "name": "f", "schema": TOOL["function"]["parameters"]}},
                             {"format": {"type": "json_schema", "name": "f", "schema": DEEP}},
                             {"format": {"type": "json_schema", "schema": {}}}, {"format": {"type": "xml"}},
                             {"format": "text"}]) | JSON_VALUES,
    "max_output_tokens": st.sampled_from([0, 1, 3, 255, 256, 10**9, -3, 2.5, None]),
    "previous_response_id": st.sampled_from(["resp_1", ""]) | JSON_VALUES,
    "store": JSON_VALUES, "truncation": st.sampled_from(["auto", "disabled", "sometimes"]),
    "system": st.sampled_from(["be brief", [{"type": "text", "text": "x"}], [{"type": "image"}], ""]) | JSON_VALUES,
    "stop_sequences": st.sampled_from([["\n"], [""], [], ["a"] * 100]) | JSON_VALUES,
    "top_k": st.sampled_from([0, 1, 40, -1, 10**12, 1.5]),
    "content": st.sampled_from(["", "日本語 🙂", "x" * 3000, "<s></s>"]) | JSON_VALUES,
    "tokens": st.sampled_from([[], [1, 2, 3], [-1], [10**9], [2**63], [1.5], ["a"]]) | JSON_VALUES,
    "add_special": JSON_VALUES, "with_pieces": JSON_VALUES,
    "stop": JSON_VALUES, "seed": JSON_VALUES, "logit_bias": JSON_VALUES, "parallel_tool_calls": JSON_VALUES,
    "encoding_format": st.sampled_from(["float", "base64", "hex"]), "model": JSON_VALUES,
    # llama-server's per-request adapters, on a server with none loaded.
    "lora": st.sampled_from([[], [{"id": 0}], [{"id": 0, "scale": 0}], [{"id": -1}], [{"id": 0, "scale": 1e9}],
                             [{"id": 0, "scale": 0.5}, {"id": 1}], [{"id": 10**30}], [{}], [{"id": "0"}]])
    | JSON_VALUES,
}
# Whole bodies that are not what a JSON parser should let through.
RAW_BODIES = st.sampled_from([b"", b"{", b"[" * 100_000, b'{"a": ' * 50_000, b'{"model": 1e99999}',
                              b'{"max_tokens": ' + b"9" * 5000 + b"}", b'{"temperature": NaN}', b"\xff\xfe",
                              b'"just a string"', b"null", b'{"messages": [' + b"{}," * 20_000 + b"{}]}"])


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    """The tiny llama compiled with the embed entry, served with a template that has tool-call syntax (Hermes)."""
    from ember.driver.compiler import CompileOptions, compile_model

    model_dir = tiny_models.checkpoint("llama")
    artifact_dir = tmp_path_factory.mktemp("hostile-serving") / "llama-embeddings"
    options = CompileOptions(prefill_chunk=16, max_batch=4, embeddings=True, show_progress=False)
    artifact_cache.build(artifact_cache.artifact_key("tiny-llama-embeddings", options, [model_dir]), artifact_dir,
                         lambda dest: compile_model(model_dir, dest, options))
    server = Served(artifact_dir)
    server.scheduler.engine.artifact.tokenizer.use_chat_template(TEMPLATES["hermes"], "test template")
    yield server
    server.close()


def _answer(served: Served, path: str, body: bytes) -> Result:
    """The HTTP exchange as a case's result: 200 accepted; a 4xx in its API's error shape (Anthropic's on its paths,
    else OpenAI's) with a one-line message refused; anything else (a 500, another shape, no answer) a traceback or
    messy."""
    try:
        status, data = served.request("POST", path, body, {"Content-Type": "application/json"})
    except (OSError, TimeoutError) as err:
        return Result("hang", "", f"no answer: {err}")
    if status == 200:
        return Result(0, json.dumps(data)[:2000] if not isinstance(data, str) else data[:2000], "")
    error = data.get("error") if isinstance(data, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if status >= 500 or not isinstance(message, str):
        return Result("traceback", "", f"Traceback (most recent call last): HTTP {status}: {str(data)[:2000]}")
    shape = ({"type", "error"}, {"type", "message"}) if path in ANTHROPIC_PATHS else \
        ({"error"}, {"message", "type", "param", "code"})
    if not (400 <= status < 500) or "\n" in message or (set(data), set(error)) != shape:
        return Result(3, "", f"HTTP {status}: {message}")
    return Result(1, "", f"ember: error: {message}\n")


def _check_accepted(path: str, result: Result, streamed: bool) -> None:
    if streamed:
        assert result.stdout.startswith(STREAM_STARTS[path]), result.stdout[:200]
        return
    data = json.loads(result.stdout) if result.stdout.endswith("}") else None
    if data is None:
        return  # cut at 2000 characters: the status said 200 and the server parsed it
    assert ANSWER_FIELDS[path] in data, data


@pytest.mark.parametrize("path", list(ENDPOINTS))
@settings(max_examples=50, **SETTINGS)
@given(edits=st.dictionaries(st.sampled_from(list(FIELD_VALUES)), st.none(), max_size=4).flatmap(
           lambda keys: st.fixed_dictionaries({key: FIELD_VALUES[key] for key in keys})))
def test_http_bodies(served, path, edits):
    """A good body with up to four fields replaced by hostile values, to each endpoint."""
    body = {"model": served.name, **ENDPOINTS[path], **edits}
    try:
        raw = json.dumps(body).encode()
    except (ValueError, RecursionError):  # a value json cannot write: nothing to send
        return
    result = _answer(served, path, raw)
    outcome(f"http {path}", result,
            lambda: _check_accepted(path, result, body.get("stream") is True and path in STREAM_STARTS))
    assert served.request("GET", "/health") == (200, {"status": "ok"})


@settings(max_examples=60, **SETTINGS)
@given(path=st.sampled_from(list(ENDPOINTS)), raw=RAW_BODIES)
def test_http_raw_bodies(served, path, raw):
    """Bodies no JSON parser should let through whole: malformed, bottomless, numbers of thousands of digits."""
    outcome("http raw bodies", _answer(served, path, raw))
    assert served.request("GET", "/health") == (200, {"status": "ok"})


# --- whole-model commands given one stage of a pipeline ---------------------------------------------------

@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile-pipeline")
    checkpoint = write_pipeline_checkpoint("llama", root / "checkpoint")
    return compile_pipeline_cached("llama", checkpoint, root / "pipeline", 2)


STAGE_COMMANDS = {
    "generate": ["--prompt", "hi", "--max-new-tokens", "2"], "chat": [], "bench": ["--repeats", "1"],
    "serve": ["--port", "0"], "package": ["-o", "{tmp}/packaged"], "eval": ["--perplexity", "{tmp}/text.txt"],
    "analyze": ["--measure"],
}


@settings(max_examples=30, **SETTINGS)
@given(command=st.sampled_from(list(STAGE_COMMANDS)), stage=st.sampled_from(["stage-0", "stage-1"]),
       spelled=st.sampled_from(["plain", "trailing_slash", "dotted"]))
def test_pipeline_stages_given_to_whole_model_commands(worker, pipeline_dir, command, stage, spelled):
    """Each command that runs or ships a whole model, given one stage (however the path is spelled): refused
    naming the pipeline directory, nothing written. (`analyze --measure` runs the artifact as well.)"""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "text.txt").write_text("words to score")
        path = str(pipeline_dir / stage)
        path = {"plain": path, "trailing_slash": path + "/", "dotted": f"{pipeline_dir}/./{stage}"}[spelled]
        argv = [command, path, *(arg.format(tmp=tmp) for arg in STAGE_COMMANDS[command])]
        before = tree_snapshot(Path(tmp))
        result = worker.run(argv)
        outcome(f"stage as a model {command}", result)
        assert result.outcome == "refused" and str(pipeline_dir.resolve()) in result.stderr, result.stderr
        unchanged(before, Path(tmp), f"stage as a model {command}")


# --- --dump-ir ------------------------------------------------------------------------------------------------

# Each (--dump-ir, -o) pair is bad: nothing can be written there, it is no directory or not empty, or the two are
# the same or one inside the other.
DUMP_CASES = [(place, "{tmp}/out") for place in ("/proc/ember-ir", "/proc/self/ember", "/sys/ember-ir", "/dev/null",
                                                  "/dev/null/ir", "{tmp}/file", "{tmp}/file/ir", "{tmp}/full",
                                                  "{tmp}/link", "{tmp}", "/", "")] + [
    ("{tmp}/out/ir", "{tmp}/out"), ("{tmp}/out", "{tmp}/out/inner"), ("{tmp}/out", "{tmp}/out"),
    ("{tmp}/full/ir", "{tmp}/full"), ("{tmp}/link/ir", "{tmp}/out")]


@settings(max_examples=40, **SETTINGS)
@given(case=st.sampled_from(DUMP_CASES), model=st.sampled_from(["demo", "{tmp}/no-model"]))
def test_dump_ir_paths(worker, case, model):
    """`compile --dump-ir` at places nothing can be written, files, non-empty directories, inside or around -o:
    refused in one line before any compile (the bound of a case is far below a compile of the demo), or for a
    missing model."""
    dump, out = case
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "file").write_text("keep")
        (root / "full").mkdir()
        (root / "full" / "notes.txt").write_text("keep")
        (root / "link").symlink_to("/proc")
        argv = ["compile", model.format(tmp=tmp), "-o", out.format(tmp=tmp), "--dump-ir", dump.format(tmp=tmp),
                "--no-progress"]
        before = tree_snapshot(root)
        result = worker.run(argv, timeout=20)
        outcome("cli compile --dump-ir", result)
        assert result.outcome == "refused", result.stderr
        unchanged(before, root, "cli compile --dump-ir")


# --- --ray addresses ------------------------------------------------------------------------------------------

class _Listener:
    """A loopback server answering each connection as `kind`: HTTP/1, HTTP/2's SETTINGS then silence, junk, close."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def port(self) -> int:
        return self.socket.getsockname()[1]

    def _serve(self) -> None:
        self.socket.settimeout(0.2)
        while not self.stop.is_set():
            try:
                connection, _ = self.socket.accept()
            except OSError:
                continue
            with connection:
                try:
                    connection.recv(64)
                    reply = {"http1": b"HTTP/1.1 400 Bad Request\r\n\r\n",
                             "http2_silent": bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]),
                             "junk": os.urandom(64), "close": b""}[self.kind]
                    connection.sendall(reply)
                    if self.kind == "http2_silent":
                        self.stop.wait(15)
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.socket.close()


@pytest.mark.slow
@settings(max_examples=16, **SETTINGS)
@given(address=st.sampled_from(["nohost", "127.0.0.1", "127.0.0.1:", ":80", "127.0.0.1:99999", "127.0.0.1:abc",
                                "[::1]:1", "256.1.1.1:80", "127.0.0.1:{closed}", "127.0.0.1:{http1}",
                                "127.0.0.1:{junk}", "127.0.0.1:{close}", "127.0.0.1:{http2_silent}"]))
def test_ray_addresses(worker, tiny_models, address):
    """`serve --ray ADDRESS` where no Ray cluster is: one line within the handshake's deadline, nothing started."""
    listeners = {kind: _Listener(kind) for kind in ("http1", "junk", "close", "http2_silent")}
    try:
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        spelled = address.format(closed=closed.getsockname()[1], **{k: v.port for k, v in listeners.items()})
        closed.close()
        result = worker.run(["serve", str(tiny_models["llama"].artifact_dir), "--ray", spelled, "--port", "0"],
                            timeout=25)
    finally:
        for listener in listeners.values():
            listener.close()
    outcome("cli serve --ray address", result)
    assert result.outcome == "refused", result.stderr
