"""`serving/protocol.py` without HTTP: request bodies, their checks and sampling parameters, and the responses
and stream chunks built from a request's events, whose shapes are checked against the official `openai`
package's types (every field ember sends is one of theirs, of their type)."""

from __future__ import annotations

import json

import pytest
from helpers import assert_declared_fields_only

openai = pytest.importorskip("openai")
pytest.importorskip("pydantic")

from openai.types import Completion, Model  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

from ember.core.errors import GenerationError  # noqa: E402
from ember.runtime.sampling import TokenLogprob  # noqa: E402
from ember.serving.protocol import (  # noqa: E402
    COMPLETION_FIELDS,
    ApiError,
    ChatRequest,
    CompletionRequest,
    Reply,
    chat_messages,
    check_model,
    completion_prompts,
    generation_error,
    model_card,
    parse_request,
    request_error,
    sampling_params,
    sse,
)
from ember.serving.scheduler import QueueFullError, StreamEvent  # noqa: E402

VOCAB = 100
CONTEXT = 64


def _chat(**fields) -> ChatRequest:
    return ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def _completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def _refusal(call, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call(*args, **kwargs)
    return caught.value


@pytest.mark.parametrize("body, status, param, words", [
    (b'{"model": "m", "prompt": ', 400, None, "not valid JSON"),
    (b'{"model": "\xff"}', 400, None, "not UTF-8"),
    (b"[1]", 400, None, "JSON object"),
    (b'{"model": "m", "prompt": "a", "max_tokens": "5"}', 400, "max_tokens", "max_tokens"),
    (b'{"model": "m", "prompt": "a", "temperature": 3}', 400, "temperature", "temperature"),
    (b'{"model": "m", "prompt": "a", "n": 17}', 400, "n", "n"),
    (b'{"model": "m", "prompt": "a", "echo": 1}', 400, "echo", "echo"),
    (b'{"model": "m", "prompt": ' + b"[" * 100_000, 400, None, "64 levels deep"),
    (b'{"model": "m", "prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", 400, None, "64 digits"),
    (b'{"model": "m", "prompt": "a", "temperature": NaN}', 400, None, "NaN, which is not JSON"),
    (b'{"model": "m", "prompt": "a", "temperature": 1e999}', 400, "temperature", "temperature"),
], ids=["truncated JSON", "not UTF-8", "array", "string number", "temperature above 2", "n above 16", "echo a number",
        "nested 100,000 deep", "5,000 digits", "NaN", "infinite number"])
def test_a_bad_body_is_refused_naming_its_field(body, status, param, words):
    error = _refusal(parse_request, body, CompletionRequest)
    assert (error.status, error.param, error.code) == (status, param, "invalid_json" if param is None else
                                                       "invalid_value")
    assert words in error.message and "\n" not in error.message
    assert error.body() == {"error": {"message": error.message, "type": "invalid_request_error", "param": param,
                                      "code": error.code}}


def test_the_deepest_failing_union_branch_names_the_field():
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    error = _refusal(parse_request, json.dumps(body).encode(), ChatRequest)
    assert error.param == "messages" and error.message.startswith("messages.0.content.0.type:"), error.message


def test_unknown_fields_are_ignored_and_a_good_body_parses():
    request = parse_request(b'{"model": "m", "prompt": [[1, 2]], "vendor": {"x": 1}, "max_tokens": 3}',
                            CompletionRequest)
    assert request.prompt == [[1, 2]] and request.token_limit() == 3


def test_another_model_name_is_a_404_naming_model():
    check_model("m", "m")
    error = _refusal(check_model, "gpt-4", "m")
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")


def test_chat_messages_take_the_chat_templates_form():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = _chat(messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": parts},
                              {"role": "assistant", "content": None}])
    assert chat_messages(request) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
                                      {"role": "assistant", "content": ""}]


@pytest.mark.parametrize("fields, param", [({"functions": [{"name": "f"}]}, "functions"),
                                           ({"top_logprobs": 2}, "top_logprobs")])
def test_chat_refuses_what_ember_does_not_do(fields, param):
    error = _refusal(chat_messages, _chat(**fields))
    assert (error.status, error.param) == (400, param)


@pytest.mark.parametrize("prompt, expected", [("hi", ["hi"]), (["hi"], ["hi"]), ([1, 2], [[1, 2]]),
                                              ([[3, 99]], [[3, 99]]), (["a", "b"], ["a", "b"]),
                                              ([[1], [2, 3]], [[1], [2, 3]])])
def test_a_completion_has_prompts_of_text_or_token_ids(prompt, expected):
    assert completion_prompts(_completion(prompt=prompt), VOCAB) == expected


@pytest.mark.parametrize("fields, words", [({"prompt": [1, VOCAB]}, "token ids"), ({"prompt": [[-1, 2]]}, "token ids"),
                                           ({"prompt": []}, "empty"), ({"prompt": [[1], []]}, "prompt.1: the prompt"),
                                           ({"prompt": ["a"] * 65}, "at most 64"),
                                           ({"echo": True, "logprobs": 1}, "prompt's logprobs")],
                         ids=["id past the vocabulary", "negative id", "no tokens", "a second prompt empty",
                              "too many prompts", "echo with logprobs"])
def test_a_bad_completion_prompt_is_refused_naming_its_field(fields, words):
    error = _refusal(completion_prompts, _completion(**fields), VOCAB)
    assert error.status == 400 and error.param == ("echo" if "echo" in fields else "prompt"), error.param
    assert words in error.message and "\n" not in error.message, error.message


def test_sampling_parameters_follow_the_request():
    params = sampling_params(_completion(temperature=0.5, top_p=0.9, top_k=3, stop="\n", seed=7, logprobs=2,
                                         logit_bias={"5": -100}), 10, CONTEXT, VOCAB, COMPLETION_FIELDS)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.5, 0.9, 3, 7)
    assert params.stop_strings == ("\n",) and params.logprobs == 2 and params.logit_bias == {5: -100}
    assert params.max_new_tokens == CONTEXT - 10  # no max_tokens: up to the context window
    chat = sampling_params(_chat(max_tokens=9, max_completion_tokens=4, logprobs=True), 10, CONTEXT, VOCAB)
    assert chat.max_new_tokens == 4 and chat.logprobs == 0
    assert sampling_params(_chat(), 10, CONTEXT, VOCAB).logprobs is None


@pytest.mark.parametrize("fields, prompt_len, param, code", [
    ({}, CONTEXT + 1, "messages", "context_length_exceeded"),
    ({"max_tokens": CONTEXT}, 1, "max_tokens", "context_length_exceeded"),
    ({"stop": ["a", ""]}, 1, "stop", "invalid_value"),
    ({"logit_bias": {"100": 1}}, 1, "logit_bias", "invalid_value"),
    ({"logit_bias": {"-1": 1}}, 1, "logit_bias", "invalid_value"),
], ids=["prompt past the context", "prompt and max_tokens past it", "empty stop", "bias past the vocabulary",
        "bias of a negative id"])
def test_sampling_parameters_refuse_what_cannot_run(fields, prompt_len, param, code):
    error = _refusal(sampling_params, _chat(**fields), prompt_len, CONTEXT, VOCAB)
    assert (error.status, error.param, error.code) == (400, param, code)


class _Panic(BaseException):
    """A stand-in for pyo3's PanicException, which a Rust panic in tokenizers raises."""


@pytest.mark.parametrize("err, status, kind, message", [
    (QueueFullError("3 requests are already waiting"), 429, "rate_limit_exceeded", "3 requests are already waiting"),
    (GenerationError("the text is bad"), 400, "invalid_request_error", "the text is bad"),
    (_Panic("index out of bounds at src/lib.rs:1"), 500, "server_error", "internal error: _Panic"),
    (KeyError("secret"), 500, "server_error", "internal error: KeyError"),
])
def test_a_request_failure_becomes_its_openai_error(err, status, kind, message):
    error = request_error(err, "prompt")
    assert (error.status, error.kind, error.message) == (status, kind, message)
    assert error.param == ("prompt" if status == 400 else None)


def test_a_generation_failure_is_a_500_that_says_only_what_ember_says():
    assert generation_error(GenerationError("the engine failed")).body()["error"] == {
        "message": "the engine failed", "type": "server_error", "param": None, "code": None}
    assert generation_error(_Panic("at src/lib.rs")).message == "internal error: _Panic"


def _events() -> list[StreamEvent]:
    logprob = TokenLogprob(token_id=7, logprob=-0.5, top=[(7, -0.5), (8, -1.5)])
    return [StreamEvent("He", [7], [logprob], prompt_tokens=3, completion_tokens=1),
            StreamEvent("", [], []),
            StreamEvent("llo", [8], [TokenLogprob(8, -0.25, [(8, -0.25), (7, -2.0)])], "stop", 3, 2)]


def _token_text(token_id: int) -> str:
    return {7: "He", 8: "llo"}[token_id]


@pytest.mark.parametrize("logprobs", [False, True])
def test_a_whole_chat_reply_is_an_openai_chat_completion(logprobs):
    reply = Reply(chat=True, model="m", logprobs=logprobs, token_text=_token_text)
    completion = ChatCompletion.model_validate(reply.whole(_events()))
    assert_declared_fields_only(completion)
    assert completion.id.startswith("chatcmpl-") and completion.object == "chat.completion"
    choice = completion.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", "Hello", "stop")
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 2, 5)
    if logprobs:
        first = choice.logprobs.content[0]
        assert (first.token, first.logprob, first.bytes) == ("He", -0.5, list(b"He"))
        assert [(top.token, top.logprob) for top in first.top_logprobs] == [("He", -0.5), ("llo", -1.5)]
    else:
        assert choice.logprobs is None


def test_a_whole_text_reply_is_an_openai_completion_with_text_offsets():
    reply = Reply(chat=False, model="m", logprobs=True, token_text=_token_text)
    completion = Completion.model_validate(reply.whole(_events()))
    assert_declared_fields_only(completion)
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"
    choice = completion.choices[0]
    assert (choice.text, choice.finish_reason) == ("Hello", "stop")
    assert choice.logprobs.tokens == ["He", "llo"] and choice.logprobs.text_offset == [0, 2]
    assert choice.logprobs.token_logprobs == [-0.5, -0.25] and choice.logprobs.top_logprobs[1] == {"llo": -0.25,
                                                                                                  "He": -2.0}


def _stream(reply: Reply) -> list[dict]:
    chunks, offset, first = [], 0, True
    for event in _events():
        chunks += reply.chunks(event, offset, first)
        offset, first = offset + len(event.text), False
    return chunks


def test_chat_stream_chunks_are_openai_chunks_ending_in_usage():
    reply = Reply(chat=True, model="m", stream=True, include_usage=True, logprobs=True, token_text=_token_text)
    chunks = [ChatCompletionChunk.model_validate(chunk) for chunk in _stream(reply)]
    for chunk in chunks:
        assert_declared_fields_only(chunk)
    assert len({chunk.id for chunk in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    assert len(chunks) == 3  # the empty event makes no chunk; the last one is followed by usage alone
    assert (chunks[0].choices[0].delta.role, chunks[0].choices[0].delta.content) == ("assistant", "He")
    assert (chunks[1].choices[0].delta.role, chunks[1].choices[0].delta.content) == (None, "llo")
    assert chunks[1].choices[0].finish_reason == "stop" and chunks[0].usage is None
    assert chunks[2].choices == [] and chunks[2].usage.total_tokens == 5


def test_text_stream_chunks_are_openai_completions_with_running_offsets():
    reply = Reply(chat=False, model="m", stream=True, logprobs=True, token_text=_token_text)
    streamed = _stream(reply)
    assert [chunk["choices"][0]["finish_reason"] for chunk in streamed] == [None, "stop"]
    # OpenAI's own text chunks carry finish_reason null until the last, which its Completion type does not allow
    chunks = [Completion.model_validate({**chunk, "choices": [{**chunk["choices"][0], "finish_reason": "stop"}]})
              for chunk in streamed]
    for chunk in chunks:
        assert_declared_fields_only(chunk)
    assert [chunk.choices[0].text for chunk in chunks] == ["He", "llo"]
    assert [chunk.choices[0].logprobs.text_offset for chunk in chunks] == [[0], [2]]
    assert all(chunk.usage is None for chunk in chunks)


def test_a_first_empty_event_still_opens_the_chat_stream():
    reply = Reply(chat=True, model="m", stream=True)
    [chunk] = reply.chunks(StreamEvent("", [], []), 0, True)
    assert ChatCompletionChunk.model_validate(chunk).choices[0].delta.role == "assistant"
    assert reply.chunks(StreamEvent("", [], []), 0, False) == []


def test_server_sent_events_and_the_model_card():
    assert sse({"a": 1}) == 'data: {"a": 1}\n\n' and sse("[DONE]") == "data: [DONE]\n\n"
    card = Model.model_validate(model_card("m", 5, CONTEXT))
    assert (card.id, card.created, card.owned_by, card.model_extra) == ("m", 5, "ember", {"max_model_len": CONTEXT})


def test_several_prompts_answer_prompt_major_with_their_text_echoed_and_each_prompt_counted_once():
    reply = Reply(chat=False, model="m", choices=2, prompts=2, echo=("A", "B"))
    events = [StreamEvent("x", [1], [], "stop", 3, 1, index) for index in (0, 1)]
    events += [StreamEvent("y", [2, 2], [], "length", 5, 2, index) for index in (2, 3)]
    completion = Completion.model_validate(reply.whole(events[::-1]))  # in any order, as the scheduler ends them
    assert_declared_fields_only(completion)
    assert [(choice.index, choice.text) for choice in completion.choices] == [(0, "Ax"), (1, "Ax"), (2, "By"),
                                                                              (3, "By")]
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (3 + 5, 1 + 1 + 2 + 2)
    streamed = Reply(chat=False, model="m", stream=True, echo=("A",), include_usage=True)
    sent = [text for event in _events() for text in streamed.feed(event)] + streamed.closing()
    chunks = [json.loads(text.removeprefix("data: ")) for text in sent[:-1]]
    assert [chunk["choices"][0]["text"] for chunk in chunks[:-1]] == ["AHe", "llo"]
    assert chunks[-1]["usage"]["prompt_tokens"] == 3 and sent[-1] == "data: [DONE]\n\n"


def test_named_server_sent_events():
    assert sse({"type": "ping"}, "ping") == 'event: ping\ndata: {"type": "ping"}\n\n'
