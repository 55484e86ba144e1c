"""Text in, text out: the tokenizer files travel with the artifact, generate streams text,
stop strings cut it, and a chat reuses its KV cache across turns."""

from __future__ import annotations

import pytest
from helpers import run_ember

from ember.runtime import SamplingParams, generate
from ember.runtime.chat import ChatSession

PROMPT = "the quick brown fox jumps over the lazy dog"
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=())


def test_tokenizer_matches_transformers(tiny_llama):
    """The artifact's tokenizer encodes like transformers' fast tokenizer of the checkpoint."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(tiny_llama.model_dir)
    tokenizer = tiny_llama.artifact.tokenizer
    for text in (PROMPT, "Hello, World!\nsecond line", "  spaces  and ~symbols~ {}"):
        assert tokenizer.encode(text) == reference(text).input_ids
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.eos_token_ids == (2,)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "x"}]
    assert tokenizer.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_generate_text_matches_transformers(tiny_llama):
    """Generating from text streams the decoded greedy continuation transformers produces."""
    tokenizer = tiny_llama.artifact.tokenizer
    prompt_ids = tokenizer.encode(PROMPT)
    assert prompt_ids[0] == 1  # <s> from the tokenizer's post-processor
    expected = tiny_llama.reference_greedy(prompt_ids, GREEDY.max_new_tokens)

    generation = generate(tiny_llama.engine(), PROMPT, GREEDY)
    pieces = list(generation)
    assert generation.token_ids == expected
    assert "".join(pieces) == tokenizer.decode(expected)
    assert len(pieces) > 1, "text should stream in pieces"
    assert generation.stats.prompt_tokens == len(prompt_ids)
    assert generation.stats.new_tokens == GREEDY.max_new_tokens


def test_stop_string_cuts_the_text(tiny_llama):
    """A stop string ends generation; the text before it is returned whole, the stop string not."""
    full = generate(tiny_llama.engine(), PROMPT, GREEDY).text()
    stop = full[len(full) // 2: len(full) // 2 + 2]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=(), stop_strings=(stop,))
    generation = generate(tiny_llama.engine(), PROMPT, params)
    assert generation.text() == full[: full.index(stop)]
    assert generation.stats.finish_reason == "stop"


def test_sampling_is_reproducible_with_a_seed(tiny_llama):
    """The same seed gives the same sampled tokens; top_k=1 is greedy."""
    def sample(**options) -> list[int]:
        params = SamplingParams(max_new_tokens=16, stop_token_ids=(), **options)
        return list(generate(tiny_llama.engine(), PROMPT, params).tokens())

    first = sample(temperature=1.0, top_k=40, top_p=0.9, seed=3)
    assert sample(temperature=1.0, top_k=40, top_p=0.9, seed=3) == first
    assert sample(temperature=1.0, top_k=40, top_p=0.9, seed=4) != first
    negative = sample(temperature=1.0, seed=-3)  # int64 seeds, as OpenAI's API takes them
    assert sample(temperature=1.0, seed=-3) == negative != sample(temperature=1.0, seed=3)
    assert sample(temperature=1.0, seed=-2**63) == sample(temperature=1.0, seed=-2**63)
    assert sample(temperature=1.0, top_k=1, seed=5) == sample(temperature=0.0)


def test_cli_generate_prints_prompt_and_continuation(tiny_llama):
    """`ember generate --temperature 0` prints the prompt and the greedy continuation."""
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    expected = generate(tiny_llama.engine(), PROMPT, params).text()
    result = run_ember("generate", str(tiny_llama.artifact_dir), "--prompt", PROMPT,
                       "--temperature", "0", "--max-new-tokens", "10")
    assert result.returncode == 0, result.stderr
    assert result.stdout == PROMPT + expected + "\n"
    assert "prefill" in result.stderr and "tok/s" in result.stderr


def test_chat_second_turn_reuses_the_cache(tiny_llama):
    """Turn 2 prefills only the new tokens, the cache grows, and the reply equals a fresh run
    of the whole rendered conversation."""
    engine = tiny_llama.engine()
    tokenizer = tiny_llama.artifact.tokenizer
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    session = ChatSession(engine)
    seq = session.seq_id

    first = session.send("hello there", params)
    first_text = first.text()
    turn1 = tokenizer.encode(tokenizer.apply_chat_template(session.messages), add_special_tokens=False)
    assert first.prompt_ids == turn1
    length_after_first = engine.length(seq)
    assert length_after_first == len(turn1) + len(first.token_ids)

    second = session.send("what is new", params)
    second_text = second.text()
    messages = [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": first_text},
        {"role": "user", "content": "what is new"},
    ]
    assert session.messages == messages
    full = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert len(second.prompt_ids) <= len(full) - len(turn1), "turn 1 was prefilled again"
    assert second.prompt_ids == full[len(full) - len(second.prompt_ids):]
    assert engine.length(seq) == len(full) + len(second.token_ids)
    assert engine.length(seq) > length_after_first

    fresh = generate(tiny_llama.engine(), full, params)
    assert fresh.text() == second_text
    assert fresh.token_ids == second.token_ids


def test_chat_reset_starts_over(tiny_llama):
    """After reset the cache is empty and the same message gets the same reply."""
    engine = tiny_llama.engine()
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    session = ChatSession(engine, system="be brief")
    reply = session.send("hi", params).text()
    session.send("again", params).text()
    session.reset()
    assert engine.length(session.seq_id) == 0
    assert session.messages == [{"role": "system", "content": "be brief"}]
    assert session.send("hi", params).text() == reply


def test_chat_needs_a_tokenizer(tiny_llama, copy_artifact):
    """An artifact without tokenizer.json refuses text prompts and chat with a clear message."""
    from ember.core.errors import GenerationError
    from ember.core.manifest import read_manifest, write_manifest
    from ember.runtime import Engine, load_artifact

    artifact = copy_artifact(tiny_llama)
    manifest = read_manifest(artifact)
    (artifact / "tokenizer.json").unlink()
    write_manifest(artifact, manifest)  # re-records the files and reseals, as a compile without a tokenizer would
    engine = Engine(load_artifact(artifact))
    with pytest.raises(GenerationError, match="chat needs a tokenizer"):
        ChatSession(engine)
    with pytest.raises(GenerationError, match="no tokenizer; pass token ids"):
        generate(engine, "hello", GREEDY)
    assert len(list(generate(engine, [1, 5, 6], GREEDY).tokens())) == GREEDY.max_new_tokens
