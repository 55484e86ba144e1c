"""Tokenizer, special tokens and chat template from a checkpoint's tokenizer files.

Encoding goes through the `tokenizers` library with the checkpoint's own
post-processor (so BOS handling matches Hugging Face's fast tokenizer); the chat
template is the checkpoint's Jinja template, rendered in a sandbox.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from ember.errors import ArtifactError, GenerationError


class Tokenizer:
    """Text <-> token ids, plus the model's special tokens and chat template."""

    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any], generation: dict[str, Any]) -> None:
        self._tokenizer = tokenizer
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template = config.get("chat_template")
        eos_ids = generation.get("eos_token_id")
        if eos_ids is None and self.eos_token is not None:
            eos_ids = tokenizer.token_to_id(self.eos_token)
        self.eos_token_ids = tuple([eos_ids] if isinstance(eos_ids, int) else eos_ids or ())

    @classmethod
    def from_dir(cls, path: Path) -> "Tokenizer":
        """Load `tokenizer.json` and, if present, `tokenizer_config.json` and `generation_config.json`."""
        try:
            tokenizer = HFTokenizer.from_file(str(Path(path) / "tokenizer.json"))
        except Exception as err:  # tokenizers raises a bare Exception for a bad file
            raise ArtifactError(f"{path / 'tokenizer.json'}: cannot load tokenizer: {err}") from None
        return cls(tokenizer, _read_optional_json(path / "tokenizer_config.json"),
                   _read_optional_json(path / "generation_config.json"))

    @property
    def bos_token_id(self) -> int | None:
        """Id of the beginning-of-sequence token, if the model has one."""
        return None if self.bos_token is None else self._tokenizer.token_to_id(self.bos_token)

    @property
    def vocab_size(self) -> int:
        """Number of tokens, including added ones."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens dropped."""
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render a conversation with the model's chat template."""
        if not self.chat_template:
            raise GenerationError("this model has no chat template (tokenizer_config.json has no 'chat_template')")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _raise_template_error(message: str) -> None:
    raise GenerationError(f"chat template: {message}")


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ArtifactError(f"{path}: malformed JSON: {err}") from None
