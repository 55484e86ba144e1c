"""llama-server's utility endpoints (/tokenize, /detokenize, /apply-template, /props, /v1/health) and
/v1/completions' `echo` and lists of prompts, against the demo model on loopback with its compact tool template;
and every route of `serving/routes.py`'s table answered by the server, with the API key where the table says so.

Token ids are checked against the artifact's own tokenizer, the template's text against transformers'
apply_chat_template, each prompt's choices against the same prompt asked alone. Servers run in this process on a
free port of 127.0.0.1 and are stopped by their own handle.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import Served

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from ember.serving.routes import ROUTES  # noqa: E402

KEY = "utilities-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SAMPLE = "Crème brûlée, naïve façade — 東京で寿司を食べた 🍣🙂 and Ελληνικά"
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Today's weather.", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def template() -> str:
    import ember

    return (Path(ember.__file__).parent / "demo_model" / "chat_template_tools.jinja").read_text()


@pytest.fixture(scope="module")
def served(demo_builds, template):
    """The demo model with its compact Hermes tool template, behind an API key."""
    with Served(demo_builds.get("cpu", "q0f32"), api_key=KEY) as served:
        served.tokenizer = served.scheduler.engine.artifact.tokenizer
        served.tokenizer.use_chat_template(template, "the demo's tool template")
        yield served


def _post(served: Served, path: str, body: dict) -> tuple[int, dict]:
    return served.request("POST", path, json.dumps(body).encode(), AUTH)


def test_tokenize_and_detokenize_round_trip_unicode(served):
    status, tokenized = _post(served, "/tokenize", {"content": SAMPLE})
    assert status == 200 and tokenized["tokens"] == served.tokenizer.encode(SAMPLE, add_special_tokens=False)
    status, text = _post(served, "/detokenize", {"tokens": tokenized["tokens"]})
    assert (status, text) == (200, {"content": SAMPLE})
    _status, special = _post(served, "/tokenize", {"content": SAMPLE, "add_special": True})
    assert special["tokens"] == [served.tokenizer.bos_token_id, *tokenized["tokens"]]
    _status, pieces = _post(served, "/tokenize", {"content": SAMPLE, "with_pieces": True})
    assert [piece["id"] for piece in pieces["tokens"]] == tokenized["tokens"]
    raw = [piece["piece"] for piece in pieces["tokens"]]
    # Byte-level tokens that hold part of a character come as their bytes, the others as text, as llama-server.
    assert any(isinstance(piece, list) for piece in raw) and any(isinstance(piece, str) for piece in raw)
    assert b"".join(bytes(piece) if isinstance(piece, list) else piece.encode() for piece in raw) == SAMPLE.encode()


@pytest.mark.parametrize("path, body, param, words", [
    ("/detokenize", {"tokens": [5, 4096]}, "tokens", "[0, 4096)"),
    ("/detokenize", {"tokens": [-1]}, "tokens", "token ids"),
    ("/detokenize", {"tokens": "5"}, "tokens", "tokens"),
    ("/tokenize", {"content": 5}, "content", "content"),
    ("/tokenize", {"content": "a", "with_pieces": "yes"}, "with_pieces", "with_pieces"),
    ("/tokenize", {"content": "ab" * 2**20}, "content", "more than the context could hold"),
    ("/apply-template", {"messages": []}, "messages", "messages"),
    ("/apply-template", {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "x"}]}, "tools",
     "tools.0"),
], ids=["past the vocabulary", "negative", "not a list", "content a number", "with_pieces a string", "too long",
        "no messages", "bad tools"])
def test_bad_utility_requests_get_a_400_in_openais_shape(served, path, body, param, words):
    status, answer = _post(served, path, body)
    assert status == 400 and set(answer["error"]) == {"message", "type", "param", "code"}, answer
    assert answer["error"]["param"] == param and words in answer["error"]["message"], answer
    assert "\n" not in answer["error"]["message"]
    assert _post(served, "/tokenize", {"content": "still here"})[0] == 200


@pytest.mark.parametrize("with_tools", [False, True], ids=["chat", "chat with tools"])
def test_apply_template_is_transformers_rendering_of_the_same_chat(served, template, with_tools):
    transformers = pytest.importorskip("transformers")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "Which day?"}, {"role": "user", "content": "Today."}]
    body = {"messages": messages, **({"tools": TOOLS} if with_tools else {})}
    status, rendered = _post(served, "/apply-template", body)
    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=served.tokenizer._tokenizer).apply_chat_template(
        messages, tools=TOOLS if with_tools else None, chat_template=template, tokenize=False,
        add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    assert status == 200 and rendered == {"prompt": reference}
    chat = served.client.chat.completions.create(model=served.name, messages=messages, max_tokens=1,
                                                 **({"tools": TOOLS, "tool_choice": "none"} if with_tools else {}))
    assert chat.usage.prompt_tokens == len(served.tokenizer.encode(reference, add_special_tokens=False))


def test_props_and_health(served, template):
    status, props = served.request("GET", "/props", headers=AUTH)
    engine = served.scheduler.engine
    assert status == 200 and props["default_generation_settings"]["n_ctx"] == engine.context_window == 256
    assert props["default_generation_settings"]["params"]["temperature"] == 1.0
    assert (props["total_slots"], props["model_alias"], props["chat_template"]) == (engine.max_batch, served.name,
                                                                                    template)
    assert Path(props["model_path"]) == engine.artifact.path and props["build_info"].startswith("ember ")
    assert served.request("GET", "/props")[0] == 401
    assert served.request("GET", "/v1/health") == served.request("GET", "/health") == (200, {"status": "ok"})


def test_echo_puts_the_prompt_before_each_choice(served):
    prompt = "And the LORD said unto Moses"
    plain = served.client.completions.create(model=served.name, prompt=prompt, max_tokens=8, temperature=0)
    echoed = served.client.completions.create(model=served.name, prompt=prompt, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    ids = served.tokenizer.encode(prompt)
    from_ids = served.client.completions.create(model=served.name, prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert from_ids.choices[0].text == served.tokenizer.decode(ids) + plain.choices[0].text
    streamed = served.client.completions.create(model=served.name, prompt=prompt, max_tokens=8, temperature=0,
                                                echo=True, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == echoed.choices[0].text
    assert echoed.usage == plain.usage
    with pytest.raises(openai.BadRequestError) as caught:
        served.client.completions.create(model=served.name, prompt=prompt, max_tokens=2, echo=True, logprobs=1)
    assert caught.value.body["param"] == "echo"


@pytest.mark.parametrize("kind", ["texts", "token ids"])
def test_several_prompts_get_their_choices_prompt_major(served, kind):
    texts = ["And the LORD said", "In the beginning", "Blessed are"]
    prompts = texts if kind == "texts" else [served.tokenizer.encode(text) for text in texts]
    alone = [served.client.completions.create(model=served.name, prompt=prompt, max_tokens=6, temperature=0)
             for prompt in prompts]
    together = served.client.completions.create(model=served.name, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [choice.index for choice in together.choices] == list(range(6))
    assert [choice.text for choice in together.choices] == [one.choices[0].text for one in alone for _ in range(2)]
    assert together.usage.prompt_tokens == sum(one.usage.prompt_tokens for one in alone)
    assert together.usage.completion_tokens == 2 * sum(one.usage.completion_tokens for one in alone)
    chunks = list(served.client.completions.create(model=served.name, prompt=prompts, max_tokens=6, temperature=0,
                                                   n=2, stream=True, stream_options={"include_usage": True}))
    streamed = ["" for _ in range(6)]
    for chunk in chunks[:-1]:
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == [choice.text for choice in together.choices] and chunks[-1].usage == together.usage


def test_every_route_of_the_table_answers_and_asks_for_the_key_where_it_says(served):
    for route in ROUTES:
        path = route.path.replace("{model:path}", served.name)
        body = b"{}" if route.method == "POST" else None
        status, _answer = served.request(route.method, path, body, AUTH)
        assert status != 404 and status < 500, (route, status)
        without_key = served.request(route.method, path, body)[0]
        assert (without_key == 401) == route.needs_key, (route, without_key)
    assert served.request("GET", "/v1/nowhere", headers=AUTH)[0] == 404
