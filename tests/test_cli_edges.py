"""The runtime commands at their edges (issues #23, #24): options out of range, text that is
not UTF-8, hostile chat templates, conversations that outgrow the context window, odd
--perplexity files, and what `main` does with errors it did not expect.

Argument errors are checked in-process through `ember.cli.main`; a subprocess only where
the behaviour needs one (stdin of `ember chat`, a closed stdout, what is imported).
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import re
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import models
import pytest
from helpers import REPO_ROOT, assert_one_line_error, run_main, run_python

from ember import cli
from ember.cli import inspect as cli_inspect
from ember.core.errors import ArtifactError, GenerationError
from ember.runtime import SamplingParams
from ember.runtime.chat import ChatSession
from ember.runtime.evaluate import stream_token_ids
from ember.runtime.tokenizer import Tokenizer

DEMO_MODEL = REPO_ROOT / "src" / "ember" / "demo_model"


BAD_OPTIONS = [
    ("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "-0.5"), ("--temperature", "hot"),
    ("--top-p", "0"), ("--top-p", "1.5"), ("--top-p", "nan"), ("--top-k", "-1"), ("--top-k", "2.5"),
    ("--repetition-penalty", "nan"), ("--repetition-penalty", "0"), ("--repetition-penalty", "-inf"),
    ("--max-new-tokens", "0"), ("--max-new-tokens", "-3"), ("--seed", str(-2**63 - 1)), ("--seed", str(2**63)),
    ("--stop", ""),
]


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("option, value", BAD_OPTIONS)
def test_sampling_options_are_checked_by_argparse(capsys, tmp_path, command, option, value):
    """Exit 2 and argparse's one error line naming the option, before any loading."""
    prompt = ["--prompt", "hi"] if command == "generate" else []
    result = run_main(capsys, command, str(tmp_path / "missing"), *prompt, f"{option}={value}")
    assert_one_line_error(result, f"argument {option}:", returncode=2)


@pytest.mark.parametrize("options", [
    {"temperature": float("nan")}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": float("inf")}, {"top_k": -1},
    {"repetition_penalty": float("nan")}, {"repetition_penalty": 0.0}, {"max_new_tokens": 0}, {"seed": -2**63 - 1},
    {"seed": 2**63}, {"stop_strings": ("",)}, {"seed": 1.5},
])
def test_sampling_params_refuse_bad_values(options):
    """The API is as safe as the CLI: SamplingParams raises a GenerationError naming the field."""
    with pytest.raises(GenerationError, match=next(iter(options))):
        SamplingParams(**options)


def test_tiny_temperature_samples_the_top_token():
    """A temperature so small that logits / T overflows picks the maximum instead of NaN probabilities."""
    import numpy as np

    from ember.runtime.sampling import sample_token

    params = SamplingParams(temperature=1e-320)
    assert sample_token(np.array([1.0, 3.0, 2.0]), params, np.random.default_rng(0), []) == 1


@pytest.mark.parametrize("args, option", [
    (["generate", "A", "--prompt", "\udcff\udcfe"], "--prompt"),
    (["chat", "A", "--system", "caf\udce9"], "--system"),
    (["generate", "A", "--prompt", "hi", "--stop", "\udcff"], "--stop"),
    (["eval", "A", "--perplexity", "t.txt", "--window", "0"], "--window"),
    (["eval", "A", "--perplexity", "t.txt", "--window", "1"], "--window"),
    (["eval", "A", "--perplexity", "t.txt", "--max-tokens", "-1"], "--max-tokens"),
    (["eval", "A", "--perplexity", "t.txt", "--max-tokens", "0"], "--max-tokens"),
])
def test_text_and_eval_options_are_checked_by_argparse(capsys, args, option):
    """Bytes that were not UTF-8 (surrogate escapes), a window under 2 tokens, a token count under 1."""
    assert_one_line_error(run_main(capsys, *args), f"argument {option}:", returncode=2)


def test_runtime_refuses_surrogates():
    """Tokenizer.encode refuses text holding undecodable bytes instead of a TypeError from tokenizers."""
    tokenizer = Tokenizer.from_dir(DEMO_MODEL)
    with pytest.raises(GenerationError, match="not valid UTF-8"):
        tokenizer.encode("ok \udcff")


# --- threads


@pytest.fixture
def two_cpus_one_core(monkeypatch):
    """use_cpu_threads on a machine of 2 CPUs that are hyperthreads of 1 core; TVM_NUM_THREADS restored after."""
    from ember.runtime import device

    monkeypatch.setattr(device, "_usable_cpus", lambda: {0, 1})
    monkeypatch.setattr(device, "physical_cores", lambda: 1)
    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    return device


@pytest.mark.parametrize("threads, env, expected", [
    (3, None, "--threads 3: this process may run on only 2 CPUs"),
    (256, None, "--threads 256: this process may run on only 2 CPUs"),
    (None, "256", "TVM_NUM_THREADS=256: this process may run on only 2 CPUs"),
    (None, "two", "TVM_NUM_THREADS=two: not a positive whole number"),
    (0, None, "--threads 0: the thread count must be at least 1"),
])
def test_thread_count_is_bounded_by_the_cpus(two_cpus_one_core, monkeypatch, threads, env, expected):
    """More threads than CPUs (TVM's pool aborts the process at 256) is an error naming the setting."""
    if env is not None:
        monkeypatch.setenv("TVM_NUM_THREADS", env)
    with pytest.raises(ArtifactError) as raised:
        two_cpus_one_core.use_cpu_threads(threads)
    assert str(raised.value).startswith(expected)


def test_threads_above_the_cores_warn(two_cpus_one_core, caplog):
    """Two threads on one core's hyperthreads run, with one warning line."""
    with caplog.at_level(logging.WARNING):
        assert two_cpus_one_core.use_cpu_threads(2) == 2
        assert two_cpus_one_core.use_cpu_threads(1) == 1
    assert [record.getMessage().count("\n") for record in caplog.records] == [0]
    assert "--threads 2 is more than the 1 physical cores" in caplog.records[0].getMessage()


def test_cli_refuses_too_many_threads(tiny_llama, capsys, monkeypatch):
    """`ember generate --threads 256` is one error line, not an abort inside TVM."""
    monkeypatch.setenv("TVM_NUM_THREADS", "1")  # restored after: main sets it when it succeeds
    result = run_main(capsys, "generate", str(tiny_llama.artifact_dir), "--prompt", "hi", "--threads", "256")
    assert_one_line_error(result, "--threads 256", "may run on only")


# --- chat templates


HOSTILE_TEMPLATES = {
    "undefined_index": ("{{ messages[5]['content'] }}", "UndefinedError"),
    "raise_exception": ("{{ raise_exception('roles must alternate') }}", "refused the conversation: roles must"),
    "huge_range": ("{% for i in range(10**9) %}x{% endfor %}", "too large"),
    "string_repetition": ("{{ 'x' * 10**9 }}", "would exceed"),
    "power": ("{{ 2 ** (10**9) }}", "too large"),
    "wide_filter": ("{{ 'x'|center(10**9) }}", "too large"),
    "wide_method": ("{{ 'x'.ljust(10**9) }}", "too large"),
    "nested_output": ("{% for i in range(100000) %}{% for j in range(100000) %}xx{% endfor %}{% endfor %}",
                      "would exceed"),
    "silent_loops": ("{% set r = range(100000)|list %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
                     "took more than"),
    "doubling": ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                 "{{ ns.s }}", "would exceed"),
    "macro_recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursion"),
    "loop_recursion": ("{% for m in [messages] recursive %}{{ loop([m]) }}{% endfor %}", "recursion"),
}


def tokenizer_with_template(tmp_path: Path, template) -> Tokenizer:
    """The tiny models' tokenizer with `template` as its chat template."""
    models.write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return Tokenizer.from_dir(tmp_path)


def render_within(tokenizer: Tokenizer, seconds: float = 30) -> Exception | str:
    """Render one message in a thread; what it returned or raised (the test fails, not hangs, on a hang)."""
    outcome = []

    def render():
        try:
            outcome.append(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]))
        except Exception as err:  # noqa: BLE001 - the test looks at what was raised
            outcome.append(err)

    thread = threading.Thread(target=render, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "rendering the template did not end"
    return outcome[0]


@pytest.mark.parametrize("case", HOSTILE_TEMPLATES)
def test_hostile_chat_templates_fail_in_one_line(tmp_path, case):
    """Each hostile template ends, bounded, in one GenerationError line naming the template."""
    template, expected = HOSTILE_TEMPLATES[case]
    error = render_within(tokenizer_with_template(tmp_path, template))
    assert isinstance(error, GenerationError), repr(error)
    message = str(error)
    assert message.startswith(f"{tmp_path / 'tokenizer_config.json'}: chat template"), message
    assert expected in message and "\n" not in message


@pytest.mark.parametrize("template", ["{% for m in messages %}{{ m.content }", 42])
def test_broken_chat_template_is_reported_before_chatting(tiny_llama, tmp_path, template):
    """A template that does not compile loads (generate needs none), and ChatSession refuses it at once."""
    tokenizer = tokenizer_with_template(tmp_path, template)
    engine = tiny_llama.engine()
    engine.artifact = dataclasses.replace(engine.artifact, tokenizer=tokenizer)
    with pytest.raises(GenerationError, match="tokenizer_config.json: chat template: "):
        ChatSession(engine)
    assert tokenizer.encode("hi") == tiny_llama.artifact.tokenizer.encode("hi")


def test_chat_survives_a_refused_message(tiny_llama, tmp_path):
    """A message the template refuses raises and leaves the conversation as it was; the next one works."""
    template = "{% if messages[-1]['content'] == 'boom' %}{{ raise_exception('no boom') }}{% endif %}" + \
        models.CHAT_TEMPLATE
    engine = tiny_llama.engine()
    engine.artifact = dataclasses.replace(engine.artifact, tokenizer=tokenizer_with_template(tmp_path, template))
    session = ChatSession(engine)
    params = SamplingParams(temperature=0, max_new_tokens=4)
    reply = session.send("hello", params).text()
    with pytest.raises(GenerationError, match="refused the conversation: no boom"):
        session.send("boom", params)
    assert session.messages == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": reply}]
    session.send("fine", params).text()
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["hello", "fine"]


def test_chat_drops_the_earliest_turns_to_fit(tiny_llama):
    """When the conversation outgrows the context window, the oldest turns go (the system message
    stays) and the reply still has room; a message too long even alone is refused and not added."""
    engine = tiny_llama.engine()
    session = ChatSession(engine, system="be brief")
    params = SamplingParams(temperature=0, max_new_tokens=32, stop_token_ids=())
    message = "the quick brown fox jumps over the lazy dog " * 2
    for turn in range(6):
        reply = session.send(f"{turn} {message}", params).text()
        assert engine.length(session.seq_id) <= engine.context_window
    assert session.dropped_turns > 0
    assert session.messages[0] == {"role": "system", "content": "be brief"}
    assert session.messages[1]["content"].startswith(("1 ", "2 ", "3 ", "4 ", "5 "))
    before = [*session.messages, {"role": "assistant", "content": reply}]
    with pytest.raises(GenerationError, match="does not fit.*it was not sent"):
        session.send("x" * 2000, params)
    assert session.messages == before


def test_cli_chat_keeps_the_session(tiny_llama):
    """Through `ember chat`: non-UTF-8 input, an over-long message and /reset each print one line and the
    session goes on; a conversation past the context window says how many turns it dropped."""
    message = b"the quick brown fox jumps over the lazy dog and the cat " * 2
    lines = [b"caf\xe9 \xff", b"x" * 3000, b"/reset", *(b"%d " % i + message for i in range(5)), b"/exit"]
    result = subprocess.run(
        [sys.executable, "-m", "ember", "chat", str(tiny_llama.artifact_dir), "--temperature", "0",
         "--max-new-tokens", "40"],
        cwd=REPO_ROOT, input=b"\n".join(lines) + b"\n", capture_output=True, timeout=300,
    )
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr
    assert "Traceback" not in stderr and "internal error" not in stderr
    assert "ember: the message is not valid UTF-8 text" in stderr
    assert "does not fit" in stderr and "it was not sent" in stderr
    assert "starting over" in stderr
    assert re.search(r"outgrew the context window \(\d+ tokens\): dropped its (earliest turn|[2-9]\d* earliest turns)$",
                     stderr, re.M), stderr


def artifact_with_template(tiny_llama, copy_artifact, template: str) -> Path:
    """A copy of the tiny llama's artifact whose chat template is `template`, sealed again as compile seals it."""
    from ember.core.manifest import read_manifest, write_manifest

    artifact = copy_artifact(tiny_llama)
    path = artifact / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": template}))
    write_manifest(artifact, read_manifest(artifact))
    return artifact


def run_chat(artifact: Path, lines: list[str]) -> subprocess.CompletedProcess:
    """`ember chat ARTIFACT` (greedy, 8 tokens a reply) given `lines` on stdin."""
    return subprocess.run([sys.executable, "-m", "ember", "chat", str(artifact), "--temperature", "0",
                           "--max-new-tokens", "8"], cwd=REPO_ROOT, input="\n".join(lines) + "\n",
                          capture_output=True, text=True, timeout=300)


def test_cli_chat_refuses_a_template_that_does_not_compile(tiny_llama, copy_artifact):
    """Before the banner: exit 1 and one `ember: error:` line naming the template's file."""
    artifact = artifact_with_template(tiny_llama, copy_artifact, "{% for m in messages %}{{ m.content }")
    result = run_chat(artifact, ["hello", "/exit"])
    assert_one_line_error(result, f"{artifact / 'tokenizer_config.json'}: chat template: ")
    assert result.stdout == ""


@pytest.mark.parametrize("case", ["huge_range", "string_repetition", "silent_loops", "macro_recursion"])
def test_cli_chat_survives_a_hostile_template(tiny_llama, copy_artifact, case):
    """A template that runs away on one message (a huge loop or string, 40 s of loops, recursion): that
    message gets one line naming the template and the bound it hit, and the chat goes on to answer the next."""
    template, expected = HOSTILE_TEMPLATES[case]
    trigger = "{% if messages[-1]['content'] == 'boom' %}" + template + "{% endif %}"
    artifact = artifact_with_template(tiny_llama, copy_artifact, trigger + models.CHAT_TEMPLATE)
    result = run_chat(artifact, ["boom", "hello", "/exit"])
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("ember: ")]
    assert len(notes) == 1, result.stderr
    assert notes[0].startswith(f"ember: {artifact / 'tokenizer_config.json'}: chat template") and expected in notes[0]
    assert len(re.findall(r"^\[\d+ tokens?, ", result.stderr, re.M)) == 1, "one reply: to the next message"


# --- generation that fills the context window


def test_cli_generate_says_when_the_context_window_ended_it(tiny_llama, capsys, monkeypatch):
    """--max-new-tokens beyond the context window: the text stops at the window, exit 0, and one line says why."""
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    result = run_main(capsys, "generate", str(tiny_llama.artifact_dir), "--prompt", "the quick brown fox " * 10,
                      "--max-new-tokens", "5000", "--temperature", "1", "--seed", "0")
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("ember: ")]
    assert len(notes) == 1, result.stderr
    assert notes[0].startswith("ember: the context window (256 tokens) is full: stopped after ")
    assert notes[0].endswith(" of --max-new-tokens 5000")


# --- eval


def test_eval_refuses_odd_text_files(tiny_llama, capsys, tmp_path, monkeypatch):
    """An empty file, a directory, /dev/zero, a missing file and bytes that are not UTF-8 are one line each."""
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b"hello world\n" * 10 + b"caf\xe9\n")
    cases = [(empty, "too few tokens"), (tmp_path, "not a regular file"), (Path("/dev/zero"), "not a regular file"),
             (tmp_path / "missing.txt", "cannot read it"), (latin1, "not UTF-8 text")]
    for path, expected in cases:
        result = run_main(capsys, "eval", str(tiny_llama.artifact_dir), "--perplexity", str(path), "--no-progress")
        assert_one_line_error(result, str(path), expected)


def test_eval_scores_exactly_max_tokens(tiny_llama, capsys, tmp_path, monkeypatch):
    """--max-tokens N scores exactly N tokens, none dropped at the end, in windows of --window."""
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    result = run_main(capsys, "eval", str(tiny_llama.artifact_dir), "--perplexity", str(text), "--max-tokens", "50",
                      "--window", "20", "--json", "--no-progress")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert (out["tokens"], out["windows"], out["window"]) == (50, 3, 20)


@pytest.mark.parametrize("piece_chars", [97, 1000, 2**16])
def test_streamed_tokenization_equals_whole_text(piece_chars):
    """The demo text tokenized in pieces cut after a newline (or before a space) is the whole text's tokens."""
    tokenizer = Tokenizer.from_dir(DEMO_MODEL)
    text = (DEMO_MODEL / "validation.txt").read_text(encoding="utf-8")
    streamed = list(stream_token_ids(tokenizer, io.StringIO(text), piece_chars=piece_chars))
    assert streamed == tokenizer.encode(text, add_special_tokens=False)


def test_streaming_stops_reading_at_max_tokens():
    """With max_tokens, a long text is read only as far as needed."""
    tokenizer = Tokenizer.from_dir(DEMO_MODEL)
    text = io.StringIO("And the LORD said unto Moses,\n" * 200_000)
    ids = list(stream_token_ids(tokenizer, text, max_tokens=10, piece_chars=1000))
    assert len(ids) == 10
    assert text.tell() <= 2000


# --- main: version, help, -v, unexpected errors


def test_version_does_not_import_tvm():
    """`ember --version` names ember's and TVM's versions from package metadata, without importing TVM."""
    program = ("import sys\nfrom ember.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
               "print('tvm imported' if 'tvm' in sys.modules else 'tvm not imported')")
    result = run_python("-c", program)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ember 0.1.0 (TVM 0.")
    assert result.stdout.strip().endswith("tvm not imported")


@pytest.mark.parametrize("command", ["inspect", "package"])
def test_commands_reading_an_artifact_do_not_import_tvm(tiny_llama, tmp_path, command):
    """`ember inspect` (the manifest's table) and `ember package` (the artifact and the runtime's files copied) read
    the artifact without importing TVM."""
    packaged = tmp_path / "packaged"
    args = [command, str(tiny_llama.artifact_dir), *(["-o", str(packaged)] if command == "package" else [])]
    program = f"import sys\nfrom ember.cli import main\ncode = main({args!r})\nprint(code, 'tvm' in sys.modules)"
    result = run_python("-c", program)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("0 False")
    if command == "inspect":
        assert "quantization" in result.stdout
    else:
        assert (packaged / "ember" / "runtime" / "engine.py").is_file()
        requirements = (REPO_ROOT / "runtime" / "requirements.txt").read_text()
        assert (packaged / "requirements-runtime.txt").read_text() == requirements


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_help_shows_the_sampling_defaults(capsys, command):
    """generate/chat --help state each sampling option's default."""
    result = run_main(capsys, command, "--help")
    assert result.returncode == 0
    help_text = " ".join(result.stdout.split())
    for default in ["(default 128;", "greedy (default 0.7)", "disables (default 0)", "to P (default 0.95)",
                    "likely (default 1.0)", "(default: a fresh one each run)"]:
        assert default in help_text


def test_unexpected_errors_are_one_line_unless_verbose(capsys, monkeypatch):
    """An exception ember did not expect: exit 70 with one line asking for a report; MemoryError says
    what ran out; -v after the command re-raises for the traceback."""
    def fail(exception):
        def run(_args):
            raise exception
        return run

    monkeypatch.setattr(cli_inspect, "run", fail(ValueError("bad\nthing")))
    result = run_main(capsys, "inspect", "x")
    assert result.returncode == 70
    assert result.stderr == ("ember: internal error: ValueError: bad thing (rerun with --verbose for the traceback, "
                             "and please report it)\n")
    with pytest.raises(ValueError):
        cli.main(["inspect", "x", "-v"])
    monkeypatch.setattr(cli_inspect, "run", fail(MemoryError()))
    result = run_main(capsys, "inspect", "x")
    assert_one_line_error(result, "out of memory", "ember inspect")


def test_a_ctrl_c_python_ignores_still_interrupts(capsys, monkeypatch):
    """A KeyboardInterrupt raised where Python ignores exceptions (here a weakref callback, as when Ctrl-C lands in
    the import machinery) still ends the command: exit 130, one line, instead of running on to exit 0."""
    class Thing:
        pass

    def callback(_ref):
        raise KeyboardInterrupt  # what the SIGINT handler raises when the signal arrives inside the callback

    def run(_args):
        thing = Thing()
        ref = weakref.ref(thing, callback)
        del thing  # the callback runs, and Python reports its exception as unraisable instead of raising it
        assert ref() is None
        for _ in range(100):
            time.sleep(0.01)  # where the command's own code goes on: the interrupt must land here
        return 0

    monkeypatch.setattr(cli_inspect, "run", run)
    hook = sys.unraisablehook
    result = run_main(capsys, "inspect", "x")
    assert (result.returncode, result.stderr) == (130, "ember: interrupted\n")
    assert sys.unraisablehook is hook


def test_closed_stdout_exits_quietly(tiny_llama):
    """`ember generate ... | head -1` when head has gone: no traceback, no 'Exception ignored'."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ember", "generate", str(tiny_llama.artifact_dir), "--prompt", "hello",
         "--max-new-tokens", "20"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    proc.stdout.close()
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 141, stderr
    assert stderr == ""
