"""`ember COMMAND --help` teaches: a description, examples that parse as the command line they show, and
for chat the commands typed during a conversation."""

from __future__ import annotations

import shlex

import pytest

from ember import cli


def help_text(capsys, *command: str) -> str:
    """What `ember COMMAND --help` prints."""
    with pytest.raises(SystemExit) as exit_:
        cli.main([*command, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def examples(text: str) -> list[list[str]]:
    """The argv of each `ember ...` line under `examples:`, without the explanation after three spaces."""
    lines = text.split("examples:\n", 1)[1].splitlines()
    commands = [line.strip().split("   ")[0] for line in lines if line.startswith("  ") and "ember " in line]
    return [shlex.split(command.split("ember ", 1)[1].split("|")[0]) for command in commands]


@pytest.mark.parametrize("command", ["inspect", "generate", "chat"])
def test_run_commands_describe_themselves_with_examples(capsys, command):
    """A description paragraph between usage and arguments, and at least two examples that parse."""
    text = help_text(capsys, command)
    description = text.split("\n\n")[1]
    assert not description.startswith(("positional", "options")) and len(description.split()) >= 15, text
    parsed = examples(text)
    assert len(parsed) >= 2, text
    for argv in parsed:
        assert argv[0] == command
        args = cli.build_parser().parse_args(argv)
        assert args.command == command


def test_chat_help_names_the_conversation_commands(capsys):
    """chat --help says what /reset and /exit do."""
    text = " ".join(help_text(capsys, "chat").split())
    assert "/reset to forget the conversation" in text
    assert "/exit (or Ctrl-D) to quit" in text


def test_compile_help_names_every_kind_of_model(capsys):
    """The closing paragraph about MODEL names checkpoints (builtin and torch.export), GGUF, ONNX and the demos."""
    text = help_text(capsys, "compile")
    closing = " ".join(text.split("MODEL is ", 1)[1].split())
    for kind in ["Hugging Face checkpoint directory", "--frontend torch-export", "torch.export", "GGUF file",
                 "ONNX file", "--tokenizer", "`demo`", "`demo-draft`"]:
        assert kind in closing, kind
