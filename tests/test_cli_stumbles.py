"""Where `ember generate`, `ember chat` and `ember analyze` met a first user badly: a prompt past the context
window, counts of one, a piped chat whose replies ran into the next prompt, analyze's defaults on a small model."""

from __future__ import annotations

import re
import subprocess
import sys

from helpers import REPO_ROOT, assert_one_line_error, run_main

from ember.cli.generate import speeds
from ember.runtime.generate import GenerationStats

SENTENCE = "the quick brown fox jumps over the lazy dog and the cat "


def test_generate_refuses_a_prompt_past_the_context_window_before_printing(tiny_llama, capsys, monkeypatch):
    """One error line with the prompt's token count and the window; nothing on stdout, not even the prompt."""
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    prompt = SENTENCE * 50
    tokens = len(tiny_llama.artifact.tokenizer.encode(prompt))
    assert tokens > 256
    result = run_main(capsys, "generate", str(tiny_llama.artifact_dir), "--prompt", prompt)
    assert_one_line_error(result, f"the prompt has {tokens} tokens", "context window is 256")
    assert result.stdout == ""


def test_generate_counts_one_token_in_the_singular(tiny_llama, capsys, monkeypatch):
    """--max-new-tokens 1: `decode 1 token`, and no decode speed where no decode step ran."""
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    result = run_main(capsys, "generate", str(tiny_llama.artifact_dir), "--prompt", "hi", "--max-new-tokens", "1",
                      "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert re.search(r"^\[prefill \d+ tokens at [0-9.]+ tok/s, decode 1 token\]$", result.stderr, re.M), result.stderr


def test_speeds_reads_right_for_one_and_for_many():
    """`1 token`, `2 tokens`; a decode speed only with decode steps to time."""
    one = GenerationStats(prompt_tokens=1, new_tokens=1, prefill_seconds=0.5, decode_seconds=0.0)
    assert speeds(one) == "prefill 1 token at 2.0 tok/s, decode 1 token"
    many = GenerationStats(prompt_tokens=4, new_tokens=3, prefill_seconds=0.5, decode_seconds=1.0)
    assert speeds(many) == "prefill 4 tokens at 8.0 tok/s, decode 3 tokens at 2.0 tok/s"
    none = GenerationStats(prompt_tokens=4, new_tokens=0, prefill_seconds=0.5)
    assert speeds(none) == "prefill 4 tokens at 8.0 tok/s, decode 0 tokens"


def test_piped_chat_ends_each_reply_with_a_newline(tiny_llama):
    """Replies cut at --max-new-tokens end their line, so each `> ` prompt starts one; a conversation that
    outgrows the window by one turn says `dropped its earliest turn`."""
    message = SENTENCE * 2
    lines = [f"0 {message}", f"1 {message}", "/exit"]
    result = subprocess.run(
        [sys.executable, "-m", "ember", "chat", str(tiny_llama.artifact_dir), "--temperature", "0",
         "--max-new-tokens", "40", "--threads", "1"],
        cwd=REPO_ROOT, input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    replies = result.stdout.split("> ")
    assert replies[0] == "" and replies[-1] == "", result.stdout
    assert len(replies) == 4 and all(reply.endswith("\n") and reply.strip() for reply in replies[1:-1]), \
        result.stdout
    assert "dropped its earliest turn" in result.stderr, result.stderr
    assert re.findall(r"^\[\d+ tokens?, [0-9.]+ s(, [0-9.]+ tok/s)?\]$", result.stderr, re.M), result.stderr


def test_analyze_defaults_fit_a_small_model(capsys):
    """The demo's window is 256: the default lengths shrink to fit it, and one stderr line says so."""
    result = run_main(capsys, "analyze", "demo", "--hardware", "raspberry-pi-5")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ("ember: --prompt-len 192 (default 1024) and --gen-len 64 (default 256) to fit demo's "
                             "context window of 256 tokens\n")
    assert "prompt 192 tokens, generate 64" in result.stdout


def test_analyze_fills_the_window_around_a_given_length(capsys):
    """--gen-len 100 alone: the prompt takes the rest of the window."""
    result = run_main(capsys, "analyze", "demo", "--hardware", "raspberry-pi-5", "--gen-len", "100")
    assert result.returncode == 0, result.stderr
    assert "prompt 156 tokens, generate 100" in result.stdout
    assert result.stderr.count("\n") == 1 and "--prompt-len 156 (default 1024)" in result.stderr


def test_analyze_refuses_given_lengths_past_the_window(capsys):
    """Lengths the user gave are not shortened: too long is one error line."""
    result = run_main(capsys, "analyze", "demo", "--hardware", "raspberry-pi-5", "--prompt-len", "1024")
    assert_one_line_error(result, "--prompt-len 1024", "exceeds demo's context window of 256 tokens")
    result = run_main(capsys, "analyze", "demo", "--hardware", "raspberry-pi-5", "--prompt-len", "200",
                      "--gen-len", "100")
    assert_one_line_error(result, "--prompt-len 200 + --gen-len 100")


def test_a_mistyped_option_names_the_nearest_one(tmp_path):
    """argparse's own error, and the option a mistyped one is nearest to; exit 2, nothing written."""
    from helpers import run_ember

    result = run_ember("generate", str(tmp_path), "--promt", "hi")
    assert_one_line_error(result, "--promt: did you mean --prompt?", returncode=2)
    result = run_ember("compile", "demo", "-o", str(tmp_path / "out"), "--qunt", "q4f32")
    assert_one_line_error(result, "--qunt: did you mean --quant?", returncode=2)
    assert not (tmp_path / "out").exists()


def test_a_missing_artifact_path_says_so(tmp_path, capsys):
    result = run_main(capsys, "generate", str(tmp_path / "nowhere"), "--prompt", "hi")
    assert_one_line_error(result, f"{tmp_path / 'nowhere'}: no such artifact directory")
