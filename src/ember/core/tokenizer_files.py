"""What a model's tokenizer files mean, read alike by the frontend (checked at compile time) and the
runtime (at load): both sides of the artifact must agree on them, so they live below both.

A `tokenizer.json` is code from whoever published the checkpoint: its normalizer rewrites the
text, its pre-tokenizer runs regular expressions over it. `tokenizer_json_problem` bounds what it
may do before `tokenizers` loads it:

- strings the normalizer, pre-tokenizer or decoder inserts (Replace's content, Prepend's prefix,
  Metaspace's replacement, a decoder's prefix...) are at most `MAX_INSERTED_CHARS` long, and the
  normalizer's steps together turn one input character into at most `MAX_EXPANSION` characters
  (Replace counts 1 + its content's length, Unicode normalization its worst case, e.g. 18 for NFKC);
- regular expressions are at most `MAX_PATTERN_CHARS` long and have no shape whose matching time
  the engine cannot bound: no backreferences or subexpression calls, no repeated group holding a
  repetition or an alternation (`(a+)+`, `(a|aa)+`), no repetition of a repetition, no counts past
  `MAX_REPEAT`; the split regexes of GPT-2, Llama 3, Qwen2 and the like have none of these;
- at most `MAX_ADDED_TOKENS` added tokens, and no token (vocabulary or added) past `MAX_TOKEN_CHARS`.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable
from typing import Any

MAX_INSERTED_CHARS = 64
MAX_EXPANSION = 64
MAX_PATTERN_CHARS = 8192
MAX_REPEAT = 1000
MAX_ADDED_TOKENS = 1 << 17
MAX_TOKEN_CHARS = 1024

# Worst-case characters one input character becomes under each built-in normalizer (Unicode's own bounds).
_UNICODE_EXPANSION = {"NFKC": 18, "NFKD": 18, "NFC": 3, "NFD": 4, "Lowercase": 3, "BertNormalizer": 9,
                      "ByteLevel": 4}
_PATTERN_KEYS = ("Regex", "String")
_NOT_INSERTED = {"type", "precompiled_charsmap", "prepend_scheme", "split"}
_QUANTIFIER = re.compile(r"\{(\d*)(,?)(\d*)\}")


def default_chat_template(template: Any) -> Any:
    """transformers' named templates ([{name, template}, ...]) stand for the one named "default"."""
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        return named.get("default", template)
    return template


def tokenizer_json_problem(data: Any) -> str | None:
    """Why a parsed `tokenizer.json` does more than the bounds above allow, as "JSON.path: reason"; None if it is
    within them (or not an object at all: `tokenizers` refuses that itself)."""
    if not isinstance(data, dict):
        return None
    for key in ("normalizer", "pre_tokenizer", "decoder"):
        problem = _component_problem(data.get(key), key)
        if problem:
            return problem
    expansion, where = _normalizer_expansion(data.get("normalizer"), "normalizer")
    if expansion > MAX_EXPANSION:
        return (f"{where}: the normalizer turns one character into up to {expansion} characters; "
                f"at most {MAX_EXPANSION} are allowed")
    return _tokens_problem(data)


def regex_problem(pattern: str) -> str | None:
    """Why matching `pattern` could take time the regex engine cannot bound, or None."""
    if len(pattern) > MAX_PATTERN_CHARS:
        return f"the regex is {len(pattern)} characters long; at most {MAX_PATTERN_CHARS} are allowed"
    groups: list[bool] = [False]  # per open group: does it hold a repetition or an alternation?
    last_group_risky: bool | None = None  # the atom just read: a group (and its flag), else None
    after_quantifier = False
    i = 0
    while i < len(pattern):
        char = pattern[i]
        quantified = False
        if char == "\\":
            escaped = pattern[i + 1: i + 2]
            if escaped.isdigit() and escaped != "0" or escaped in ("k", "g"):
                return f"a backreference or subexpression call at character {i} ({pattern[i:i + 4]!r}...)"
            i = _after_escape(pattern, i)
            last_group_risky = None
        elif char == "[":
            i = _after_class(pattern, i)
            last_group_risky = None
        elif char == "(":
            if pattern.startswith("(?#", i):
                i = pattern.find(")", i) + 1 or len(pattern)
                continue
            if pattern.startswith("(?(", i):
                return f"a conditional group at character {i}"
            option_only = re.match(r"\(\?[imxWDSPa-]*\)", pattern[i:])
            if option_only:
                i += option_only.end()
                continue
            groups.append(False)
            i += 1
            last_group_risky = None
        elif char == ")":
            risky = groups.pop() if len(groups) > 1 else False
            groups[-1] = groups[-1] or risky
            last_group_risky = risky
            i += 1
        elif char == "|":
            groups[-1] = True
            last_group_risky = None
            i += 1
        elif char in "*+?{":
            end, repeats, problem = _quantifier(pattern, i)
            if problem:
                return problem
            if end == i:  # a '{' that starts no count is a literal
                last_group_risky = None
                i += 1
                after_quantifier = False
                continue
            if after_quantifier:
                return f"a repetition of a repetition at character {i}"
            if repeats:
                if last_group_risky:
                    return f"the group repeated at character {i} holds a repetition or an alternation"
                groups[-1] = True
            quantified = True
            i = end + (end < len(pattern) and pattern[end] in "?+")  # lazy or possessive
            last_group_risky = None
        else:
            last_group_risky = None
            i += 1
        after_quantifier = quantified
    return None


def _after_escape(pattern: str, i: int) -> int:
    """Where the escape at `i` ends (`\\p{L}`, `\\x{41}` and `\\u0041` included)."""
    escaped = pattern[i + 1: i + 2]
    if escaped in ("p", "P", "x", "o") and pattern[i + 2: i + 3] == "{":
        close = pattern.find("}", i)
        return close + 1 if close > 0 else len(pattern)
    return i + 2


def _after_class(pattern: str, i: int) -> int:
    """Where the character class opening at `i` ends (Oniguruma nests classes: `[a-z&&[^aeiou]]`)."""
    depth, i = 1, i + 1
    if pattern[i: i + 1] == "^":
        i += 1
    if pattern[i: i + 1] == "]":
        i += 1
    while i < len(pattern) and depth:
        if pattern[i] == "\\":
            i = _after_escape(pattern, i)
            continue
        if pattern[i] == "[" and pattern[i + 1: i + 2] != ":":
            depth += 1
        elif pattern[i] == "[":  # a POSIX bracket [:alpha:]
            close = pattern.find(":]", i)
            i = close + 2 if close > 0 else len(pattern)
            continue
        elif pattern[i] == "]":
            depth -= 1
        i += 1
    return i


def _quantifier(pattern: str, i: int) -> tuple[int, bool, str | None]:
    """The quantifier at `i`: where it ends (`i` for a literal '{'), whether it repeats more than once, and
    why it is refused (a count past `MAX_REPEAT`)."""
    char = pattern[i]
    if char in "*+":
        return i + 1, True, None
    if char == "?":
        return i + 1, False, None
    count = _QUANTIFIER.match(pattern, i)
    if not count or not (count[1] or count[3]):
        return i, False, None
    low, comma, high = count[1], count[2], count[3]
    numbers = [int(n) for n in (low, high) if n]
    if any(n > MAX_REPEAT for n in numbers):
        return i, False, f"the count {count[0]} at character {i} is over {MAX_REPEAT}"
    most = int(high) if high else (None if comma else int(low))
    return count.end(), most is None or most > 1, None


def _component_problem(node: Any, where: str) -> str | None:
    """The first string too long to insert or regex past the bounds in a normalizer/pre-tokenizer/decoder tree."""
    if isinstance(node, list):
        for index, item in enumerate(node):
            problem = _component_problem(item, f"{where}[{index}]")
            if problem:
                return problem
        return None
    if not isinstance(node, dict):
        return None
    for key, value in node.items():
        here = f"{where}.{key}"
        if key == "pattern" and isinstance(value, dict):
            problem = _pattern_problem(value, here)
        elif isinstance(value, str) and key not in _NOT_INSERTED and len(value) > MAX_INSERTED_CHARS:
            problem = (f"{here}: inserts a string of {len(value)} characters; "
                       f"at most {MAX_INSERTED_CHARS} are allowed")
        else:
            problem = _component_problem(value, here)
        if problem:
            return problem
    return None


def _pattern_problem(pattern: dict, where: str) -> str | None:
    for kind in _PATTERN_KEYS:
        value = pattern.get(kind)
        if not isinstance(value, str):
            continue
        if kind == "String" and len(value) > MAX_PATTERN_CHARS:
            return f"{where}.String: {len(value)} characters long; at most {MAX_PATTERN_CHARS} are allowed"
        problem = regex_problem(value) if kind == "Regex" else None
        if problem:
            return f"{where}.Regex: {problem}"
    return None


def _normalizer_expansion(node: Any, where: str) -> tuple[int, str]:
    """The most characters one input character can become under the normalizer `node`, and the JSON path of
    the step that makes it largest."""
    if not isinstance(node, dict):
        return 1, where
    kind = node.get("type")
    if kind == "Sequence" and isinstance(node.get("normalizers"), list):
        total, worst, worst_where = 1, 0, where
        for index, child in enumerate(node["normalizers"]):
            factor, child_where = _normalizer_expansion(child, f"{where}.normalizers[{index}]")
            total *= factor
            if factor > worst:
                worst, worst_where = factor, child_where
            if total > MAX_EXPANSION:  # refuse at the step that crosses the bound
                return total, child_where
        return total, worst_where
    if kind == "Replace":
        content = node.get("content")
        return 1 + (len(content) if isinstance(content, str) else 0), f"{where}.content"
    if kind == "Prepend":
        prepend = node.get("prepend")
        return 1 + (len(prepend) if isinstance(prepend, str) else 0), f"{where}.prepend"
    if kind == "Precompiled":
        return _charsmap_expansion(node.get("precompiled_charsmap")), f"{where}.precompiled_charsmap"
    return (_UNICODE_EXPANSION.get(kind, 1) if isinstance(kind, str) else 1), where


def _charsmap_expansion(charsmap: Any) -> int:
    """The longest replacement in a SentencePiece precompiled charsmap: a little-endian u32 trie size, the trie,
    then the replacements, each ended by a NUL."""
    try:
        blob = base64.b64decode(charsmap or "", validate=True)
    except (ValueError, TypeError):
        return 1  # tokenizers refuses a charsmap it cannot read
    if len(blob) < 4:
        return 1
    strings = blob[4 + int.from_bytes(blob[:4], "little"):]
    return max([len(piece.decode("utf-8", "replace")) for piece in strings.split(b"\0")] + [1])


def _tokens_problem(data: dict) -> str | None:
    added = data.get("added_tokens")
    if isinstance(added, list):
        if len(added) > MAX_ADDED_TOKENS:
            return f"added_tokens: {len(added)} tokens; at most {MAX_ADDED_TOKENS} are allowed"
        for index, token in enumerate(added):
            content = token.get("content") if isinstance(token, dict) else None
            if isinstance(content, str) and len(content) > MAX_TOKEN_CHARS:
                return f"added_tokens[{index}].content: {len(content)} characters; at most {MAX_TOKEN_CHARS}"
    model = data.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    pieces: Iterable[str]
    if isinstance(vocab, dict):
        pieces = vocab.keys()
    elif isinstance(vocab, list):  # Unigram: [piece, score] pairs
        pieces = (entry[0] for entry in vocab if isinstance(entry, list) and entry and isinstance(entry[0], str))
    else:
        return None
    longest = max(pieces, key=len, default="")
    if len(longest) > MAX_TOKEN_CHARS:
        return f"model.vocab: a token of {len(longest)} characters; at most {MAX_TOKEN_CHARS} are allowed"
    return None
