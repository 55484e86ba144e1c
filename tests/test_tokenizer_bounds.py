"""A tokenizer.json and a chat template are code from whoever published the checkpoint: what they may
do is bounded (`ember.core.tokenizer_files`, checked by compile and again at load; the bounded Jinja
sandbox of `runtime/tokenizer.py`), the text handed to the tokenizer is bounded by the context it could
fill, and whatever still fails inside `tokenizers` (a Rust panic included) is one line: `ember
generate` exits 1, `ember serve` answers 400 and keeps serving."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO_ROOT, assert_one_line_error, ember_serve
from tokenizers import Tokenizer as HFTokenizer

from ember.core.errors import ArtifactError, GenerationError, ModelError
from ember.core.tokenizer_files import MAX_EXPANSION, regex_problem, tokenizer_json_problem
from ember.frontend.gguf_tokenizer import PRE_TOKENIZER_REGEXES
from ember.runtime.tokenizer import RENDER_SECONDS, Tokenizer

DEMO_TOKENIZER = REPO_ROOT / "src" / "ember" / "demo_model" / "tokenizer.json"
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
O200K_REGEX = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])
REAL_REGEXES = {"gpt2": GPT2_REGEX, "llama3": PRE_TOKENIZER_REGEXES["llama3"], "qwen2": PRE_TOKENIZER_REGEXES["qwen2"],
                "o200k": O200K_REGEX, "deepseek-letters": r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓ]+",
                "deepseek-cjk": r"[一-龥ࠀ-一가-퟿]+", "t5-spaces": " {2,}", "trailing-space": r"\s+$"}
# Backtracking the regex engine cannot bound; tokenizers panics (retry limit) or runs for ages on these.
HOSTILE_REGEXES = {"(a|aa)+$": "holds a repetition or an alternation", "(a+)+$": "holds a repetition",
                   "(a*)*b": "holds a repetition", "(?:x|xy){2,}z": "holds a repetition or an alternation",
                   "((ab)*c)+": "holds a repetition", r"(\w+)\1": "backreference", r"(?<n>a)\k<n>": "backreference",
                   r"(?<n>a|b\g<n>)": "subexpression call", "a**": "repetition of a repetition",
                   "a{5000}": "over 1000", "x" * 9000: "at most 8192"}
SLOW_REGEX = "a*a*a*a*a*a*$"  # within the bounds, yet polynomial: onig's retry limit makes tokenizers panic


def _demo_json() -> dict:
    return json.loads(DEMO_TOKENIZER.read_text())


def _with_split(data: dict, pattern: str) -> dict:
    """`data` whose pre-tokenizer first splits on the regex `pattern`."""
    data = copy.deepcopy(data)
    split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
    rest = [data["pre_tokenizer"]] if data.get("pre_tokenizer") else []
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, *rest]}
    return data


def _with_normalizer(data: dict, normalizer: dict) -> dict:
    return {**copy.deepcopy(data), "normalizer": normalizer}


def _replace(content: str, pattern: str = "a") -> dict:
    return {"type": "Replace", "pattern": {"String": pattern}, "content": content}


# --- the tokenizer.json checker -------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(REAL_REGEXES))
def test_real_split_regexes_pass_and_tokenizers_uses_them(name):
    """The split regexes of GPT-2, Llama 3, Qwen2, GPT-4o and DeepSeek are within the bounds, and tokenizers
    itself compiles and runs each."""
    pattern = REAL_REGEXES[name]
    assert regex_problem(pattern) is None
    data = _with_split(_demo_json(), pattern)
    assert tokenizer_json_problem(data) is None
    assert HFTokenizer.from_str(json.dumps(data)).encode("Hello world, it's 2024!\n\n  ok").ids


@pytest.mark.parametrize("pattern", sorted(HOSTILE_REGEXES))
def test_unbounded_regexes_are_refused_naming_the_json_path(pattern):
    problem = tokenizer_json_problem(_with_split(_demo_json(), pattern))
    assert problem and problem.startswith("pre_tokenizer.pretokenizers[0].pattern.Regex: "), problem
    assert HOSTILE_REGEXES[pattern] in problem and "\n" not in problem


def test_the_demo_and_test_model_tokenizers_pass(tiny_models):
    """Every tokenizer this repository ships or tests with is within the bounds, and compile's check passes."""
    from ember.frontend.config import load_model_config
    from ember.frontend.hf import checked_tokenizer_files

    assert tokenizer_json_problem(_demo_json()) is None
    checked_tokenizer_files(DEMO_TOKENIZER.parent, load_model_config(DEMO_TOKENIZER.parent))
    checkpoint = tiny_models.checkpoint("llama")
    assert tokenizer_json_problem(json.loads((checkpoint / "tokenizer.json").read_text())) is None
    checked_tokenizer_files(checkpoint, load_model_config(checkpoint))


NORMALIZER_CASES = {
    "probe: 'a' becomes 200,000 characters": (_replace("b" * 200_000),
                                              "normalizer.content: inserts a string of 200000"),
    "a Replace inside a Sequence": ({"type": "Sequence", "normalizers": [{"type": "NFC"}, _replace("b" * 65)]},
                                    "normalizer.normalizers[1].content: inserts a string of 65"),
    "doubling Replaces that multiply": ({"type": "Sequence", "normalizers": [_replace("aa")] * 10},
                                        f"normalizer.normalizers[3].content: the normalizer turns one character into "
                                        f"up to 81 characters; at most {MAX_EXPANSION}"),
    "NFKC then a long Replace": ({"type": "Sequence", "normalizers": [{"type": "NFKC"}, _replace("b" * 8)]},
                                 "normalizer.normalizers[1].content: the normalizer turns one character into "
                                 "up to 162"),
    "a Prepend": ({"type": "Prepend", "prepend": "▁" * 100}, "normalizer.prepend: inserts a string of 100"),
    "a Regex Replace that backtracks": ({"type": "Replace", "pattern": {"Regex": "(a|aa)+$"}, "content": "b"},
                                        "normalizer.pattern.Regex: the group repeated at character 6"),
}


@pytest.mark.parametrize("case", sorted(NORMALIZER_CASES))
def test_expanding_normalizers_are_refused_naming_the_json_path(case):
    normalizer, expected = NORMALIZER_CASES[case]
    problem = tokenizer_json_problem(_with_normalizer(_demo_json(), normalizer))
    assert problem and problem.startswith(expected), problem


def test_real_normalizers_pass():
    """Llama 2's (Prepend '▁', Replace ' ' by '▁'), NFKC + lowercase, and BERT's are within the bounds."""
    for normalizer in ({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, _replace("▁", " ")]},
                       {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]},
                       {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
                        "strip_accents": None, "lowercase": True}):
        data = _with_normalizer(_demo_json(), normalizer)
        assert tokenizer_json_problem(data) is None
        HFTokenizer.from_str(json.dumps(data)).encode("Hello World")


def test_decoder_and_token_bounds():
    data = _demo_json()
    data["decoder"] = {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "a"},
                                                         "content": "z" * 1000}]}
    assert tokenizer_json_problem(data).startswith("decoder.decoders[0].content: inserts a string of 1000")
    data = _demo_json()
    data["added_tokens"] = [{**data["added_tokens"][0], "content": "x" * 2000}]
    assert tokenizer_json_problem(data).startswith("added_tokens[0].content: 2000 characters")
    data = _demo_json()
    data["added_tokens"] = data["added_tokens"] * 70_000
    assert tokenizer_json_problem(data).startswith("added_tokens: 280000 tokens")


def _checkpoint_with(tiny_models, tmp_path: Path, data: dict) -> Path:
    import shutil

    checkpoint = Path(shutil.copytree(tiny_models.checkpoint("llama"), tmp_path / "checkpoint"))
    (checkpoint / "tokenizer.json").write_text(json.dumps(data))
    return checkpoint


@pytest.mark.parametrize("hostile", ["normalizer", "regex"])
def test_compile_and_load_refuse_a_hostile_tokenizer(tiny_models, tmp_path, hostile):
    """The frontend's check (ModelError) and the runtime's load (ArtifactError) both refuse, naming the file
    and the field, before tokenizers loads it."""
    from ember.frontend.config import load_model_config
    from ember.frontend.hf import checked_tokenizer_files

    base = json.loads((tiny_models.checkpoint("llama") / "tokenizer.json").read_text())
    data = _with_normalizer(base, _replace("b" * 200_000)) if hostile == "normalizer" else _with_split(base, "(a|aa)+$")
    field = "normalizer.content" if hostile == "normalizer" else "pre_tokenizer.pretokenizers[0].pattern.Regex"
    checkpoint = _checkpoint_with(tiny_models, tmp_path, data)
    expected = "^" + re.escape(f"{checkpoint / 'tokenizer.json'}: {field}: ")
    with pytest.raises(ModelError, match=expected):
        checked_tokenizer_files(checkpoint, load_model_config(checkpoint))
    with pytest.raises(ArtifactError, match=expected):
        Tokenizer.from_dir(checkpoint)


# --- the text handed to the tokenizer ----------------------------------------------------------------------

def test_text_longer_than_the_context_could_hold_is_refused_before_encoding():
    tokenizer = Tokenizer(HFTokenizer.from_file(str(DEMO_TOKENIZER)), {}, {}, context_tokens=64)
    longest = max(len(token.encode()) for token in tokenizer.vocabulary())
    assert tokenizer.max_text_bytes == 64 * max(longest, 4) + 4096
    assert tokenizer.encode("x" * tokenizer.max_text_bytes)
    with pytest.raises(GenerationError, match=r"^the text to encode is \d+ bytes, more than the context could hold"):
        tokenizer.encode("é" * tokenizer.max_text_bytes)


def test_a_panic_inside_tokenizers_is_one_generation_error():
    """pyo3's PanicException derives from BaseException; it comes out as one line."""
    hostile = HFTokenizer.from_str(json.dumps(_with_split(_demo_json(), SLOW_REGEX)))
    tokenizer = Tokenizer(hostile, {}, {})
    with pytest.raises(GenerationError, match=r"^the tokenizer failed on the text: .*retry-limit") as caught:
        tokenizer.encode("a" * 3000 + "b")
    assert "\n" not in str(caught.value)
    assert tokenizer.encode("hello")


# --- through the CLI and the server -------------------------------------------------------------------------

def _artifact_with_tokenizer(tiny_llama, copy_artifact, edit) -> Path:
    """A copy of the tiny llama's artifact whose tokenizer.json is `edit(tokenizer.json)`, sealed again."""
    from ember.core.manifest import read_manifest, write_manifest

    artifact = copy_artifact(tiny_llama)
    path = artifact / "tokenizer.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    write_manifest(artifact, read_manifest(artifact))
    return artifact


def _generate(artifact: Path, prompt: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember", "generate", str(artifact), "--prompt", prompt,
                           "--max-new-tokens", "2", "--temperature", "0"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("hostile", ["normalizer", "regex"])
def test_generate_refuses_the_probe_tokenizers_in_one_line(tiny_llama, copy_artifact, hostile):
    """The probe's tokenizers (a normalizer turning 'a' into 200,000 characters, a `(a|aa)+$` split) give
    exit 1 and one line naming tokenizer.json and the field, not an abort or a Rust traceback."""
    if hostile == "normalizer":
        artifact = _artifact_with_tokenizer(tiny_llama, copy_artifact,
                                            lambda data: _with_normalizer(data, _replace("b" * 200_000)))
    else:
        artifact = _artifact_with_tokenizer(tiny_llama, copy_artifact, lambda data: _with_split(data, "(a|aa)+$"))
    field = "normalizer.content" if hostile == "normalizer" else "pre_tokenizer.pretokenizers[0].pattern.Regex"
    assert_one_line_error(_generate(artifact, "a" * 2000), f"{artifact / 'tokenizer.json'}: {field}: ")


def test_generate_refuses_an_overlong_prompt_in_one_line(tiny_llama):
    result = _generate(tiny_llama.artifact_dir, "abc " * 10_000)  # the tiny llama's bound is a few kB
    assert_one_line_error(result, "the text to encode is 40000 bytes, more than the context could hold")


def test_serve_answers_a_tokenizer_panic_with_400_and_goes_on(tiny_llama, copy_artifact, tmp_path):
    """Through the openai client against `ember serve`: a prompt that makes tokenizers panic is a 400
    (BadRequestError) in OpenAI's shape; /health and a normal completion succeed after it."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    import urllib.request

    artifact = _artifact_with_tokenizer(tiny_llama, copy_artifact, lambda data: _with_split(data, SLOW_REGEX))
    key_file = tmp_path / "key"
    key_file.write_text("test-key\n")
    with ember_serve(artifact, key_file, 60) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="test-key", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=artifact.name, prompt="a" * 3000 + "b", max_tokens=2)
        assert "tokenizer failed" in refused.value.message
        with urllib.request.urlopen(f"{url}/health", timeout=60) as health:
            assert health.status == 200
        reply = client.completions.create(model=artifact.name, prompt="hello", max_tokens=2, temperature=0)
        assert reply.choices[0].finish_reason in ("length", "stop")


# --- chat templates ---------------------------------------------------------------------------------------

PROBE_TEMPLATES = {
    "lipsum": ("{{ lipsum(1000000, false, 1000000, 1000001) }}", "'lipsum' is undefined"),
    "percent width": ("{{ '%3000000000s' % 'x' }}", "would exceed"),
    "str.format width": ("{{ '{:>3000000000}'.format(1) }}", "would exceed"),
    "percent precision": ("{{ '%.3000000000f' % 1.0 }}", "would exceed"),
    "star width": ("{{ '%*d' % (3000000000, 1) }}", "would exceed"),
    "format filter": ("{{ '%3000000000d'|format(1) }}", "would exceed"),
    "nested str.format width": ("{{ '{:{}}'.format(1, 900000) ~ '{:{}}'.format(1, 900000) }}", "would exceed"),
    "repetition": ("{{ 'x' * 3000000000 }}", "would exceed"),
    "concatenation": ("{% set a = 'x' * 1000000 %}{{ a ~ a ~ a ~ a }}", "would exceed"),
    "addition": ("{% set a = 'x' * 1000000 %}{{ a + a + a }}", "would exceed"),
    "replace filter": ("{{ ('x' * 1000)|replace('x', 'y' * 100000) }}", "would exceed"),
    "str.replace": ("{{ ('x' * 1000).replace('x', 'y' * 100000) }}", "would exceed"),
    "join": ("{{ range(100000)|join('x' * 1000) }}", "would exceed"),
    "str.join": ("{{ ('x' * 1000).join(range(100000)) }}", "would exceed"),
    "indent": ("{{ ('\\n' * 1000)|indent(100000) }}", "would exceed"),
    "wordwrap": ("{{ 'a b c d'|wordwrap(1, true, 'y' * 1000000) }}", "would exceed"),
    "expandtabs": ("{{ ('\\t' * 100000).expandtabs(1000) }}", "would exceed"),
    "aliased list as text": ("{{ (['x' * 1000000] * 1000)|string }}", "would exceed"),
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     f"rendering took more than {RENDER_SECONDS:g} s"),
}


def _tokenizer_with_template(template: str) -> Tokenizer:
    return Tokenizer(HFTokenizer.from_file(str(DEMO_TOKENIZER)), {"chat_template": template}, {})


@pytest.mark.parametrize("case", sorted(PROBE_TEMPLATES))
def test_hostile_templates_fail_in_one_line_quickly(case):
    """Each is refused before it builds its text: in about the render bound at most, one line naming the
    template (a few seconds' margin for a loaded machine, never a speed claim)."""
    template, expected = PROBE_TEMPLATES[case]
    tokenizer = _tokenizer_with_template(template)
    started = time.monotonic()
    with pytest.raises(GenerationError) as refused:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert time.monotonic() - started < RENDER_SECONDS + 10
    message = str(refused.value)
    assert message.startswith("tokenizer_config.json: chat template: ") and expected in message, message
    assert "\n" not in message


def test_bounded_operations_still_render_normal_text():
    template = ("{% for m in messages %}{{ '%s: %5d|' % (m['role'], 3) }}{{ '{}-{:>4}'.format(m['content'], 'x') }}"
                "{{ (m['content'] ~ '!') + '?' }}{{ m['content']|replace('i', 'I')|indent(2) }}"
                "{{ ['a', 'b']|join(', ') }}{{ '-' * 3 }}{% endfor %}")
    rendered = _tokenizer_with_template(template).apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "user:     3|hi-   xhi!?hIa, b---"


def test_the_chat_template_is_compiled_only_when_a_chat_needs_it():
    """Loading a tokenizer whose template would build 3 GB when evaluated does not evaluate it (Jinja's
    constant folding is off too); the first chat refuses it."""
    started = time.monotonic()
    tokenizer = _tokenizer_with_template("{{ '%3000000000s' % 'x' }}")
    assert tokenizer.encode("hello")
    tokenizer.check_chat_template()
    assert time.monotonic() - started < 10
    broken = _tokenizer_with_template("{% if %}")
    assert broken.encode("hello")
    with pytest.raises(GenerationError, match="chat template: line 1"):
        broken.check_chat_template()


def test_generate_never_evaluates_the_chat_template(tiny_llama, copy_artifact):
    """`ember generate` of an artifact whose template is the probe's `'%3000000000s' % 'x'` succeeds."""
    from ember.core.manifest import read_manifest, write_manifest

    artifact = copy_artifact(tiny_llama)
    path = artifact / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": "{{ '%3000000000s' % 'x' }}"}))
    write_manifest(artifact, read_manifest(artifact))
    result = _generate(artifact, "hello")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("hello")


@pytest.mark.parametrize("case", ["lipsum", "nested loops", "percent width"])
def test_serve_answers_hostile_templates_with_400_and_goes_on(tiny_llama, copy_artifact, tmp_path, case):
    """Through the openai client against `ember serve`: 8 concurrent chat requests with a hostile chat template
    each get a 400 in OpenAI's shape (none ties up the server), then /health and a completion answer."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from ember.core.manifest import read_manifest, write_manifest

    template, expected = PROBE_TEMPLATES[case]
    artifact = copy_artifact(tiny_llama)
    config = artifact / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": template}))
    write_manifest(artifact, read_manifest(artifact))
    key_file = tmp_path / "key"
    key_file.write_text("test-key\n")
    with ember_serve(artifact, key_file, 60) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="test-key", max_retries=0, timeout=60)

        def chat() -> str:
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model=artifact.name, max_tokens=2,
                                               messages=[{"role": "user", "content": "hello"}])
            return refused.value.message

        with ThreadPoolExecutor(8) as pool:
            messages = list(pool.map(lambda _: chat(), range(8)))
        assert all(expected in message for message in messages), messages
        with urllib.request.urlopen(f"{url}/health", timeout=60) as health:
            assert health.status == 200
        reply = client.completions.create(model=artifact.name, prompt="hello", max_tokens=2, temperature=0)
        assert reply.choices[0].finish_reason in ("length", "stop")
