"""Speculative decoding (`runtime/speculative.py`): the same tokens as plain decoding, faster.

Greedy: 20 prompts per proposer on the demo model (prompt lookup, and the demo compiled
to q4f32 as a draft), with stops placed inside the generated text (a stop token, a stop
string, max_new_tokens), against plain greedy decoding of the same artifact, and on the
tiny random llama against transformers' greedy `generate`. Sampling: the first 3 tokens
of many seeded generations against the exact distribution transformers gives them.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from helpers import run_ember

import ember
from ember.core.errors import GenerationError
from ember.runtime import Engine, SamplingParams, generate, load_artifact
from ember.runtime.chat import ChatSession
from ember.runtime.speculative import DraftModel, PromptLookup, Speculation

NEW_TOKENS = 32


def naive_lookup(history: list[int], n: int, k: int) -> list[int] | None:
    """The continuation after the latest earlier occurrence of the last n tokens, by plain search."""
    tail = history[-n:]
    for start in range(len(history) - n - 1, -1, -1):
        if history[start:start + n] == tail:
            return history[start + n:start + n + k]
    return None


def test_prompt_lookup_continues_the_latest_earlier_occurrence_of_the_longest_ngram() -> None:
    rng = np.random.default_rng(0)
    lookup = PromptLookup(max_ngram=3)
    for _ in range(300):
        history = rng.integers(0, 6, rng.integers(1, 40)).tolist()
        k = int(rng.integers(1, 9))
        expected = next((found for n in (3, 2, 1) if len(history) > n
                         for found in [naive_lookup(history, n, k)] if found is not None), [])
        assert lookup.propose(history, k) == expected, (history, k)
    assert lookup.propose([5, 6, 7, 1, 5, 6], 2) == [7, 1]
    assert lookup.propose([1, 2, 3], 4) == []


def test_verify_scores_every_position_as_transformers(tiny_llama) -> None:
    """`Engine.verify` (the artifact's `verify` entry, up to 8 tokens) gives the logits transformers gives
    at each of those positions after a cached prompt; 9 tokens go through prefill, as correctly."""
    engine = tiny_llama.engine()
    assert engine.verify_tokens == 8
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, 256, 20).tolist()
    for count in (1, 5, 8, 9):
        seq = engine.add_sequence()
        engine.prefill(seq, prompt)
        tokens = rng.integers(3, 256, count).tolist()
        ours = engine.verify(seq, tokens)
        theirs = tiny_llama.reference_logits(prompt + tokens)[-count:]
        assert engine.length(seq) == len(prompt) + count
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())
        engine.remove_sequence(seq)


def verse_prompts(tokenizer) -> list[str]:
    """20 prompts of the demo's held-out text: 10 whose end repeats their beginning (the reply can
    copy the prompt: guesses get accepted) and 10 plain passages (free generation)."""
    lines = [line for line in (Path(ember.DEMO_MODEL_DIR) / "validation.txt").read_text().splitlines()
             if len(line) > 60]
    prompts = []
    for i in range(10):
        passage = " ".join(lines[3 * i: 3 * i + 2])
        words = passage.split()
        prompts.append(f"{passage}\n{' '.join(words[:6])}")
        prompts.append(lines[40 + i])
    assert all(len(tokenizer.encode(p)) + NEW_TOKENS < 256 for p in prompts)
    return prompts


@pytest.fixture(scope="module")
def demo(demo_builds):
    """The demo model (q0f32) and, as a draft sharing its tokenizer, the demo in q4f32."""
    return load_artifact(demo_builds.get("cpu", "q0f32")), load_artifact(demo_builds.get("cpu", "q4f32"))


def run(engine: Engine, prompt, params: SamplingParams, speculation: Speculation | None = None):
    """(token ids, text, finish reason, tokens left in the cache) of one generation in a fresh sequence."""
    generation = generate(engine, prompt, params, speculation=speculation)
    text = "".join(generation) if engine.artifact.tokenizer else None
    if text is None:
        list(generation.tokens())
    cached = engine.length(generation.seq_id)
    engine.remove_sequence(generation.seq_id)
    return generation.token_ids, text, generation.stats.finish_reason, cached


@pytest.fixture(scope="module")
def plain_greedy(demo) -> list[tuple[str, SamplingParams, tuple]]:
    """Each prompt three ways, decoded plainly: to max_new_tokens; with a stop token and with a stop
    string taken from the middle of that output (so they fall inside blocks of accepted guesses);
    with a max_new_tokens inside it. (prompt, params, `run`'s result) for each."""
    model, _ = demo
    engine = Engine(model)
    cases = []
    for prompt in verse_prompts(model.tokenizer):
        base = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, stop_token_ids=())
        plain = run(engine, prompt, base)
        text = plain[1]
        stop_string = text[len(text) // 2: len(text) // 2 + 4]
        cases.append((prompt, base, plain))
        for params in (SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS,
                                      stop_token_ids=(plain[0][len(plain[0]) // 2],)),
                       SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, stop_token_ids=(),
                                      stop_strings=(stop_string,)) if stop_string.strip() else None,
                       SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS // 2 + 3, stop_token_ids=())):
            if params is not None:
                cases.append((prompt, params, run(engine, prompt, params)))
    return cases


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_speculation_gives_the_plain_greedy_output_on_the_demo(demo, plain_greedy, proposer) -> None:
    """Tokens, text, finish reason and what the cache holds after each of `plain_greedy`'s cases all
    equal plain decoding's."""
    model, draft = demo
    engine = Engine(model)
    guesser = PromptLookup() if proposer == "ngram" else DraftModel(Engine(draft), engine)  # one draft sequence
    totals = Speculation(guesser).stats
    for prompt, params, expected in plain_greedy:
        speculation = Speculation(guesser)
        assert run(engine, prompt, params, speculation) == expected, (prompt, params)
        for field in ("verify_steps", "proposed", "accepted"):
            setattr(totals, field, getattr(totals, field) + getattr(speculation.stats, field))
    # The comparison covered accepted guesses and rejected ones (ngram measured 38% accepted).
    assert totals.accepted > 200 and 0.2 < totals.acceptance_rate < 1.0, totals


def test_greedy_speculation_matches_transformers_on_a_random_llama(tiny_models) -> None:
    """The tiny random llama, 20 prompts that repeat a random sequence: prompt lookup on half, the random
    qwen2 of the same vocabulary as a (poor) draft on the other half: transformers' greedy tokens each time."""
    target, draft = tiny_models["llama"], tiny_models["qwen2"]
    rng = np.random.default_rng(1)
    engine = target.engine()
    draft_model = DraftModel(draft.engine(), engine)
    for i in range(20):
        motif = rng.integers(3, 256, 12).tolist()
        ids = [1, *motif, *rng.integers(3, 256, 5).tolist(), *motif[:4]]
        expected = target.reference_greedy(ids, 16)
        params = SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=())
        proposer = PromptLookup() if i % 2 == 0 else draft_model
        assert run(engine, ids, params, Speculation(proposer))[0] == expected, ids


@pytest.mark.slow
def test_sampling_with_speculation_draws_from_the_model_distribution(tiny_models) -> None:
    """Temperature 1 and top-k 3 over the tiny llama: the first 3 tokens of N seeded generations of 6,
    with a draft guessing the likeliest tokens (the same model: its guesses are often but not always
    drawn), against the exact distribution of those 27 sequences from transformers' logits.
    Chi-squared goodness of fit over the sequences expected at least 5 times, rejected at
    significance 0.001 (critical value by the Wilson-Hilferty approximation); the same seeds
    without speculation give the same tokens (each emitted token is one draw from the model's own
    distribution, in order), but for draws landing within float rounding of a boundary."""
    import torch

    target = tiny_models["llama"]
    ids = [1, *np.random.default_rng(2).integers(3, 256, 12).tolist()]

    def top3(logits: torch.Tensor) -> dict[int, float]:
        values, indices = torch.topk(logits.double(), 3)
        probs = torch.softmax(values, dim=0)
        return dict(zip(indices.tolist(), probs.tolist()))

    exact: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        for t1, p1 in top3(target.reference(torch.tensor([ids])).logits[0, -1]).items():
            for t2, p2 in top3(target.reference(torch.tensor([ids + [t1]])).logits[0, -1]).items():
                for t3, p3 in top3(target.reference(torch.tensor([ids + [t1, t2]])).logits[0, -1]).items():
                    exact[t1, t2, t3] = p1 * p2 * p3

    engine = target.engine()
    draft = DraftModel(target.engine(), engine)
    samples = 1000
    counts: dict[tuple[int, ...], int] = {}
    same, accepted, proposed = 0, 0, 0
    for seed in range(samples):
        params = SamplingParams(temperature=1.0, top_k=3, top_p=1.0, max_new_tokens=6, seed=seed, stop_token_ids=())
        speculation = Speculation(draft)
        tokens = run(engine, ids, params, speculation)[0]
        counts[tuple(tokens[:3])] = counts.get(tuple(tokens[:3]), 0) + 1
        accepted, proposed = accepted + speculation.stats.accepted, proposed + speculation.stats.proposed
        same += tokens == run(engine, ids, params)[0]
    assert set(counts) <= set(exact)
    assert 0.2 < accepted / proposed < 0.9  # guesses were accepted and rejected
    assert same >= 0.99 * samples
    bins = [key for key, p in exact.items() if p * samples >= 5]
    statistic = sum((counts.get(key, 0) - exact[key] * samples) ** 2 / (exact[key] * samples) for key in bins)
    rest_expected = samples - sum(exact[key] * samples for key in bins)
    rest_observed = samples - sum(counts.get(key, 0) for key in bins)
    if rest_expected >= 5:
        statistic += (rest_observed - rest_expected) ** 2 / rest_expected
        bins.append(None)
    df = len(bins) - 1
    z = 3.09  # one-sided 0.001
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    print(f"chi-squared {statistic:.1f} < {critical:.1f} (df {df}); accepted {accepted}/{proposed}; same {same}")
    assert statistic < critical, (statistic, critical, df)


def test_chat_with_speculation_replies_as_without(demo) -> None:
    """Two turns: the replies and the cache bookkeeping across turns equal plain chat's."""
    model, draft = demo
    params = SamplingParams(temperature=0, max_new_tokens=24)
    replies = []
    for speculation in (None, Speculation(PromptLookup())):
        session = ChatSession(Engine(model), system="Answer as the scripture does.", speculation=speculation)
        turns = [session.send(message, params).text() for message in
                 ("Who is the LORD?", "Repeat: the LORD is my shepherd; I shall not want.")]
        replies.append((turns, session.engine.length(session.seq_id)))
    assert replies[0] == replies[1]


def test_server_with_speculation_answers_as_plain_generate(demo_builds) -> None:
    """`ember serve --speculate ngram`'s scheduler, asked by the official openai client one request at a
    time (streamed and not), then two at once: every text equals plain `generate()`'s, and /metrics
    counts the accepted guesses."""
    from test_serve import Served

    artifact = demo_builds.get("cpu", "q0f32")
    model = load_artifact(artifact)
    prompts = verse_prompts(model.tokenizer)[:6]
    expected = [generate(Engine(model), p, SamplingParams(temperature=0, max_new_tokens=24)).text() for p in prompts]
    served = Served(artifact, speculation=Speculation(PromptLookup()))
    try:
        for index, prompt in enumerate(prompts):
            if index % 2:
                stream = served.client.completions.create(model=served.name, prompt=prompt, max_tokens=24,
                                                          temperature=0, stream=True)
                text = "".join(chunk.choices[0].text for chunk in stream)
            else:
                text = served.client.completions.create(model=served.name, prompt=prompt, max_tokens=24,
                                                        temperature=0).choices[0].text
            assert text == expected[index], prompt

        async def one(client, prompt, max_tokens):
            return (await client.completions.create(model=served.name, prompt=prompt, max_tokens=max_tokens,
                                                    temperature=0)).choices[0].text

        assert served.concurrently(one, [(p, 24, None) for p in prompts[:2]]) == expected[:2]
        metrics = served.metrics()
        accepted = metrics["ember_speculative_accepted_tokens_total"]
        assert 0 < accepted < metrics["ember_speculative_proposed_tokens_total"]
    finally:
        served.close()


def test_a_draft_with_another_tokenizer_is_refused(demo, tiny_llama) -> None:
    model, _ = demo
    with pytest.raises(GenerationError, match="does not share the model's tokenizer"):
        DraftModel(tiny_llama.engine(), Engine(model))


@pytest.mark.slow
def test_cli_generates_the_same_text_with_each_proposer(demo, demo_builds) -> None:
    artifact, draft = demo_builds.get("cpu", "q0f32"), demo_builds.get("cpu", "q4f32")
    prompt = "In the beginning God created the heaven and the earth. In the beginning"
    common = ["generate", str(artifact), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "24"]
    plain = run_ember(*common)
    assert plain.returncode == 0, plain.stderr
    for extra in (["--speculate", "ngram"], ["--draft", str(draft), "--guesses", "6"]):
        result = run_ember(*common, *extra)
        assert result.returncode == 0, result.stderr
        assert result.stdout == plain.stdout
        assert "guessed tokens accepted" in result.stderr
    bad = run_ember(*common, "--guesses", "3")
    assert bad.returncode != 0 and "--guesses: applies only with --speculate or --draft" in bad.stderr
    bad = run_ember(*common, "--speculate", "ngram", "--guesses", "8")
    assert bad.returncode != 0 and "--guesses 8: must be between 1 and 7" in bad.stderr
