"""What a model's tokenizer files mean, read alike by the frontend (checked at compile time) and the
runtime (at load): both sides of the artifact must agree on them, so they live below both."""

from __future__ import annotations

from typing import Any


def default_chat_template(template: Any) -> Any:
    """transformers' named templates ([{name, template}, ...]) stand for the one named "default"."""
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        return named.get("default", template)
    return template
