"""A GGUF file's tokenizer metadata as the `tokenizer.json` + `tokenizer_config.json` an artifact carries.

The runtime reads Hugging Face tokenizer files (`runtime/tokenizer.py`), so the
`tokenizer.ggml.*` arrays are rebuilt as a `tokenizers` Tokenizer that splits text
the way llama.cpp's tokenizer does for that model:

    tokenizer.ggml.model   model                                   pre-tokenizer / normalizer
    gpt2                   byte-level BPE over `merges`            the regex named by tokenizer.ggml.pre
    llama                  BPE, merges ordered by the merged       "▁" for spaces (and before the text when
                           token's score, <0xXX> byte fallback     add_space_prefix), no splitting

Tokens of type CONTROL and UNKNOWN become special added tokens (llama.cpp matches
both in text with `special=True`), USER_DEFINED ones plain added tokens. BOS (EOS)
is added by the post-processor iff `tokenizer.ggml.add_bos_token` (`add_eos_token`).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from ember.core.errors import ModelError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4  # llama.cpp's token types
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regex llama.cpp splits with before byte-level BPE (None: GPT-2's own).
PRE_TOKENIZER_REGEXES = {
    "gpt-2": None,
    "llama-bpe": _LLAMA3_REGEX,
    "llama3": _LLAMA3_REGEX,
    "qwen2": _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}"),
}
SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")


def write_tokenizer_files(meta, out_dir: Path) -> list[Path]:
    """Write `tokenizer.json` and `tokenizer_config.json` for the file's tokenizer into `out_dir`; [] if it has none."""
    model = meta.get("tokenizer.ggml.model", str)
    if model is None:
        return []
    tokenizer = build_tokenizer(meta, model)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_path, config_path = out_dir / "tokenizer.json", out_dir / "tokenizer_config.json"
    tokenizer.save(str(tokenizer_path))
    tokens = meta.strings("tokenizer.ggml.tokens", required=True)
    config = {"chat_template": meta.get("tokenizer.chat_template", str)}
    for key in ("bos", "eos"):
        token_id = meta.token_id(f"tokenizer.ggml.{key}_token_id", tokens)
        if token_id is not None:
            config[f"{key}_token"] = tokens[token_id]
    config_path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return [tokenizer_path, config_path]


def build_tokenizer(meta, model: str) -> Tokenizer:
    """The `tokenizers` Tokenizer of the file's `tokenizer.ggml.*` metadata."""
    path = meta.path
    tokens = meta.strings("tokenizer.ggml.tokens", required=True)
    count = len(tokens)
    types = meta.numbers("tokenizer.ggml.token_type", count, int) or [NORMAL] * count
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != count:
        duplicate = next(token for index, token in enumerate(tokens) if vocab[token] != index)
        raise ModelError(f"{path}: metadata 'tokenizer.ggml.tokens' holds {duplicate!r} more than once")
    if model == "gpt2":
        merges = _checked_merges(meta, vocab)
        tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=False))
        pre = meta.get("tokenizer.ggml.pre", str, "gpt-2")
        if pre not in PRE_TOKENIZER_REGEXES:
            raise ModelError(f"{path}: metadata 'tokenizer.ggml.pre' {pre!r} is not supported; "
                             f"supported: {', '.join(PRE_TOKENIZER_REGEXES)}")
        regex = PRE_TOKENIZER_REGEXES[pre]
        if regex is None:
            tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tokenizer.decoder = decoders.ByteLevel()
    elif model == "llama":
        scores = meta.numbers("tokenizer.ggml.scores", count, float)
        if scores is None:
            raise ModelError(f"{path}: metadata 'tokenizer.ggml.scores' is missing (a 'llama' tokenizer needs it)")
        unknown = meta.token_id("tokenizer.ggml.unknown_token_id", tokens, 0)
        tokenizer = Tokenizer(models.BPE(vocab, _merges_by_score(tokens, scores, types), byte_fallback=True,
                                         unk_token=tokens[unknown], fuse_unk=True))
        prefix = meta.get("tokenizer.ggml.add_space_prefix", bool, True)
        steps = [normalizers.Prepend("▁")] if prefix else []
        tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    else:
        raise ModelError(f"{path}: metadata 'tokenizer.ggml.model' {model!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)}")
    tokenizer.add_tokens([AddedToken(tokens[i], special=types[i] != USER_DEFINED, normalized=False)
                          for i in range(count) if types[i] in (UNKNOWN, CONTROL, USER_DEFINED)])
    post_processor = _post_processor(meta, tokens)
    if post_processor is not None:
        tokenizer.post_processor = post_processor
    return tokenizer


def _checked_merges(meta, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """`tokenizer.ggml.merges` as pairs, each "left right" of two tokens whose concatenation is a token too."""
    merges = []
    for merge in meta.strings("tokenizer.ggml.merges", required=True):
        left, space, right = merge.partition(" ")
        if not (space and left and right and left in vocab and right in vocab and left + right in vocab):
            raise ModelError(f"{meta.path}: metadata 'tokenizer.ggml.merges' entry {merge[:40]!r} is not two "
                             "tokens of the vocabulary, separated by a space, whose concatenation is a token")
        merges.append((left, right))
    return merges


def _merges_by_score(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: every split of a normal token into two tokens, best-scored result first."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = []
    for index, token in enumerate(tokens):
        if types[index] != NORMAL or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((-scores[index], index, left, right))
    merges.sort()
    return [(left, right) for _, _, left, right in merges]


def _post_processor(meta, tokens: list[str]):
    single, special = ["$A"], []
    for key, at_start in (("bos", True), ("eos", False)):
        token_id = meta.token_id(f"tokenizer.ggml.{key}_token_id", tokens)
        if token_id is None or not meta.get(f"tokenizer.ggml.add_{key}_token", bool, key == "bos"):
            continue
        single = [tokens[token_id], *single] if at_start else [*single, tokens[token_id]]
        special.append((tokens[token_id], token_id))
    return processors.TemplateProcessing(single=single, special_tokens=special) if special else None
