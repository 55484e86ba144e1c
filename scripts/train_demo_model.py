#!/usr/bin/env python3
"""Train Ember's bundled demo model: a tiny Llama trained on the King James Bible.

What
----
Ember needs a small but *real* model to compile, run and evaluate end to end without
network access. This script builds one from scratch on CPU:

1. Corpus: the King James Version of the Bible (1611; public domain), as shipped by
   the Debian packages ``bible-kjv-text`` (data) and ``bible-kjv`` (the ``bible``
   reader that decompresses it). The text is reformatted as one chapter heading per
   chapter followed by one verse per line (verse numbers dropped). The last ~5% of
   the text (whole chapters) is held out for validation.
2. Tokenizer: byte-level BPE trained with Hugging Face ``tokenizers`` on the training
   split. All 256 bytes are in the base alphabet, so any string round-trips. The
   post-processor prepends ``<s>`` like Llama's tokenizer does.
3. Model: ``transformers.LlamaForCausalLM`` with grouped-query attention (2 KV heads
   for 8 query heads) and tied input/output embeddings, trained with AdamW, linear
   warmup and cosine decay, bf16 autocast (where the CPU has bf16 instructions), and no dropout. Training sequences are
   ``<s>`` followed by a random crop of the training token stream.
4. Output: a standard Hugging Face checkpoint (weights stored as float16 so the
   directory stays under 10 MB), ``DATA_SOURCE.md`` and ``validation.txt`` (a
   held-out sample for perplexity checks).

Why these sizes
---------------
The budget is under 30 minutes on one CPU thread of a shared machine: 1.5-3k tokens/s
for this model with bf16 autocast, i.e. 2-4M tokens, or 2-4 passes over the ~1M-token
training split. A ~4.7M-parameter model (6 layers, width 256) is about as large as
that budget can train usefully, and its float16 weights just fit in the 10 MB size
limit for the checkpoint directory.

The learning-rate schedule is driven by progress through the wall-time budget
(``--minutes``), so the run ends on time and the cosine decay completes even when
other jobs slow the machine down. ``--steps`` drives it by step count instead, which
makes a run repeatable (seeds are fixed).

Its draft
---------
``--draft`` trains the demo's draft model for speculative decoding (``ember generate
--draft``): the same corpus and split, the demo's own tokenizer (read from
``--tokenizer-from``, so token ids agree), and a model about a fifth the size (2 layers,
width 128, one KV head): it guesses the demo's next tokens at a fraction of its cost.

Usage::

    apt-get install -y bible-kjv    # also installs bible-kjv-text
    python scripts/train_demo_model.py --out ember/demo_model --minutes 22
    python scripts/train_demo_model.py --draft --out ember/demo_draft --minutes 10
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# --- Data -----------------------------------------------------------------------------
APT_PACKAGES = "bible-kjv bible-kjv-text"
BIBLE_RANGE = "gen1:1-rev22:21"  # the whole Bible, Genesis to Revelation
VAL_FRACTION = 0.05  # held out from the end, rounded to whole chapters
VALIDATION_SAMPLE_CHARS = 48_000  # size of validation.txt (ASCII, so also bytes)

# --- Tokenizer ------------------------------------------------------------------------
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0, 1, 2, 3 (Llama's order)
UNK, BOS, EOS, PAD = SPECIAL_TOKENS
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] | trim }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

# --- Model ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    hidden_size: int
    num_layers: int
    num_heads: int  # head_dim 32 in both
    num_kv_heads: int  # grouped-query attention
    ffn_size: int


DEMO_SHAPE = Shape(hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=2, ffn_size=576)
DRAFT_SHAPE = Shape(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=1, ffn_size=320)
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-5

# --- Training -------------------------------------------------------------------------
SEED = 1611
THREADS = 1  # leave the machine's other core free
CONTEXT = 256  # tokens per training sequence, <s> included; also the context the config declares
BATCH_SIZE = 16  # 4096 tokens per step
PEAK_LR = 2e-3
MIN_LR = 2e-4  # end of the cosine decay
WARMUP_FRACTION = 0.08  # of the run, linear from 0
WEIGHT_DECAY = 0.1  # matrices only; norms are not decayed
ADAM_BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0
DEFAULT_MINUTES = 22.0
FINISH_RESERVE_S = 45.0  # final evaluation, saving and samples
LOG_EVERY = 25
EVAL_EVERY = 100
EVAL_WINDOWS = 32  # validation windows scored during training (full split at the end)
EVAL_BATCH_SIZE = 16
SAMPLE_PROMPTS = ["And the LORD said", "In the beginning", "Blessed are the"]
SAMPLE_NEW_TOKENS = 64


def read_kjv() -> str:
    """Return the raw KJV text as printed by Debian's ``bible`` reader."""
    if shutil.which("bible") is None:
        raise SystemExit(
            "The `bible` program was not found. The demo model is trained on the King James "
            f"Bible from Debian; install it with:  apt-get install -y {APT_PACKAGES}"
        )
    # A huge line width keeps every verse on a single line.
    proc = subprocess.run(
        ["bible", "-l1000000", BIBLE_RANGE], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0 or len(proc.stdout) < 1_000_000:
        raise SystemExit(
            f"`bible {BIBLE_RANGE}` failed (exit {proc.returncode}): {proc.stderr.strip()}\n"
            f"Is the text installed? Try:  apt-get install -y {APT_PACKAGES}"
        )
    return proc.stdout


def split_chapters(raw: str) -> list[str]:
    """Reformat the reader's output into chapters: a heading line, a blank line, then
    one verse per line without its number. Each chapter ends with a blank line."""
    chapters: list[list[str]] = []
    for line in raw.splitlines():
        if not line.strip():
            continue
        verse = re.fullmatch(r"\s+\d+ (.+)", line)
        if verse:
            chapters[-1].append(verse.group(1).strip())
        elif re.fullmatch(r"\S.* \d+", line):  # e.g. "Genesis 1", "1 Kings 3"
            chapters.append([line.strip(), ""])
        else:
            raise SystemExit(f"Unexpected line in the `bible` output: {line!r}")
    return ["\n".join(lines) + "\n\n" for lines in chapters]


def train_val_split(chapters: list[str]) -> tuple[str, str]:
    """Hold out the last VAL_FRACTION of the characters, rounded to whole chapters."""
    total = sum(map(len, chapters))
    held_out, cut = 0, len(chapters)
    while held_out < VAL_FRACTION * total:
        cut -= 1
        held_out += len(chapters[cut])
    return "".join(chapters[:cut]), "".join(chapters[cut:])


def train_tokenizer(text: str) -> Tokenizer:
    """Byte-level BPE: every byte is in the alphabet, so nothing maps to <unk>."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A",
                pair=f"{BOS} $A {BOS} $B",
                special_tokens=[(BOS, tokenizer.token_to_id(BOS))],
            ),
        ]
    )
    return tokenizer


def encode(tokenizer: Tokenizer, text: str) -> torch.Tensor:
    """Token ids of `text` without special tokens."""
    return torch.tensor(tokenizer.encode(text, add_special_tokens=False).ids, dtype=torch.long)


def build_model(tokenizer: Tokenizer, shape: Shape) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.ffn_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        hidden_act="silu",
        max_position_embeddings=CONTEXT,
        rms_norm_eps=RMS_NORM_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
        pad_token_id=tokenizer.token_to_id(PAD),
    )
    return LlamaForCausalLM(config)


def make_optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=PEAK_LR, betas=ADAM_BETAS)


def learning_rate(progress: float) -> float:
    """Linear warmup, then cosine decay from PEAK_LR to MIN_LR; `progress` is in [0, 1)."""
    if progress < WARMUP_FRACTION:
        return PEAK_LR * max(progress / WARMUP_FRACTION, 0.01)
    decay = (progress - WARMUP_FRACTION) / (1.0 - WARMUP_FRACTION)
    return MIN_LR + (PEAK_LR - MIN_LR) * 0.5 * (1.0 + math.cos(math.pi * decay))


def sample_batch(ids: torch.Tensor, bos_id: int, generator: torch.Generator) -> torch.Tensor:
    """BATCH_SIZE sequences of <s> followed by CONTEXT-1 tokens from random offsets."""
    span = CONTEXT - 1
    starts = torch.randint(0, len(ids) - span + 1, (BATCH_SIZE,), generator=generator)
    crops = ids[starts[:, None] + torch.arange(span)]
    return torch.cat([torch.full((BATCH_SIZE, 1), bos_id), crops], dim=1)


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX): elsewhere bf16 autocast
    is emulated, about 12x slower than float32 for the draft on an AVX2 Zen 3."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512_bf16" in flags or "amx_bf16" in flags


def train_step(
    model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, batch: torch.Tensor, lr: float, bf16: bool
) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


@torch.no_grad()
def perplexity(
    model: LlamaForCausalLM, ids: torch.Tensor, bos_id: int, max_windows: int | None = None
) -> float:
    """Per-token perplexity of `ids`, scored in consecutive windows of CONTEXT-1 tokens,
    each prefixed with <s> (every token of `ids` is predicted exactly once)."""
    was_training = model.training
    model.eval()
    span = CONTEXT - 1
    n_full = len(ids) // span
    windows = list(ids[: n_full * span].view(n_full, span)[:max_windows].split(EVAL_BATCH_SIZE))
    if max_windows is None and len(ids) % span:
        windows.append(ids[n_full * span :].unsqueeze(0))
    nll, count = 0.0, 0
    for chunk in windows:
        batch = torch.cat([torch.full((len(chunk), 1), bos_id), chunk], dim=1)
        logits = model(input_ids=batch, use_cache=False).logits.float()
        nll += F.cross_entropy(
            logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(), reduction="sum"
        ).item()
        count += chunk.numel()
    model.train(was_training)
    return math.exp(nll / count)


def greedy_samples(model: LlamaForCausalLM, tokenizer: Tokenizer) -> list[str]:
    model.eval()
    samples = []
    for prompt in SAMPLE_PROMPTS:
        input_ids = torch.tensor([tokenizer.encode(prompt).ids])
        output = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=SAMPLE_NEW_TOKENS,
            do_sample=False,
        )
        samples.append(tokenizer.decode(output[0].tolist(), skip_special_tokens=True))
    return samples


def debian_version(package: str) -> str:
    proc = subprocess.run(
        ["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True
    )
    return proc.stdout.strip() or "unknown"


def write_data_source(out: Path, stats: dict[str, int | float | str], draft: bool) -> None:
    version = debian_version("bible-kjv-text")
    lines = [
        "# Demo draft model training data" if draft else "# Demo model training data",
        "",
        "**Corpus:** The Holy Bible, King James Version (Authorized Version, 1611), the full",
        "text from Genesis 1:1 to Revelation 22:21.",
        "",
        f"**Source:** Debian package `bible-kjv-text` (version {version}), read with the",
        "`bible` program from the Debian package `bible-kjv`",
        f"(`bible -l1000000 {BIBLE_RANGE}`). The text was reformatted as chapter headings",
        "followed by one verse per line, without verse numbers.",
        "",
        "**License:** Public domain. The KJV translation dates from 1611 and its copyright has",
        "long expired; Debian's copyright file for the package states: \"The copyright for the",
        "King James Version text of the Bible is expired since the translation was done in",
        "1611\". (In the United Kingdom only, the Crown retains publishing rights over the",
        "Authorized Version under letters patent.) The Debian packaging and `bible` program",
        "themselves are GPL-2+, but neither is redistributed here: only text and a model",
        "trained on it.",
        "",
        "**Split:** the last ~5% of the text by characters, rounded to whole chapters, is",
        "held out for validation; the tokenizer and model never saw it during training.",
        "The draft uses the demo model's tokenizer and its `validation.txt`." if draft else
        "`validation.txt` is the first part of that held-out split.",
        "",
        "**Statistics:**",
        "",
        *(f"- {key}: {value}" for key, value in stats.items()),
        "",
        "Produced by `scripts/train_demo_model.py`.",
        "",
    ]
    (out / "DATA_SOURCE.md").write_text("\n".join(lines))


def save_checkpoint(model: LlamaForCausalLM, tokenizer: Tokenizer, out: Path) -> None:
    """Save a float16 Hugging Face checkpoint plus its tokenizer files."""
    model.to(torch.float16)
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
    )
    model.save_pretrained(out)
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        model_max_length=CONTEXT,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    hf_tokenizer.save_pretrained(out, save_jinja_files=False)
    # transformers 5 names its own backend class; the generic name also loads in 4.x.
    config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_out = Path(__file__).resolve().parents[1] / "src" / "ember" / "demo_model"
    parser.add_argument("--out", type=Path, default=default_out, help="checkpoint directory")
    parser.add_argument(
        "--minutes", type=float, default=DEFAULT_MINUTES, help="wall-time budget for the whole run"
    )
    parser.add_argument(
        "--steps", type=int, help="train for exactly this many steps instead of by wall time"
    )
    parser.add_argument("--draft", action="store_true",
                        help="train the demo's draft model (2 layers, width 128) with the demo's tokenizer")
    parser.add_argument("--tokenizer-from", type=Path, default=default_out,
                        help="with --draft: the model whose tokenizer.json the draft shares (default: the demo)")
    args = parser.parse_args()

    t0 = time.perf_counter()
    torch.manual_seed(SEED)
    torch.set_num_threads(THREADS)

    chapters = split_chapters(read_kjv())
    train_text, val_text = train_val_split(chapters)
    if args.draft:
        tokenizer = Tokenizer.from_file(str(args.tokenizer_from / "tokenizer.json"))
        tokenizer.no_truncation()
        tokenizer.no_padding()
    else:
        tokenizer = train_tokenizer(train_text)
    bos_id = tokenizer.token_to_id(BOS)
    train_ids, val_ids = encode(tokenizer, train_text), encode(tokenizer, val_text)
    print(
        f"corpus: {len(chapters)} chapters, {len(train_text):,} train chars -> "
        f"{len(train_ids):,} tokens, {len(val_text):,} val chars -> {len(val_ids):,} tokens",
        flush=True,
    )

    model = build_model(tokenizer, DRAFT_SHAPE if args.draft else DEMO_SHAPE)
    bf16 = native_bf16()
    print(f"autocast: {'bfloat16' if bf16 else 'off (float32: this CPU has no native bfloat16)'}", flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)
    optimizer = make_optimizer(model)
    generator = torch.Generator().manual_seed(SEED)
    model.train()
    t_train = time.perf_counter()
    train_seconds = args.minutes * 60 - (t_train - t0) - FINISH_RESERVE_S
    if not args.steps and train_seconds < 30:
        raise SystemExit(f"--minutes {args.minutes} leaves no time for training")
    step, losses = 0, []
    while True:
        elapsed = time.perf_counter() - t_train
        progress = step / args.steps if args.steps else elapsed / train_seconds
        if progress >= 1.0:
            break
        lr = learning_rate(progress)
        losses.append(train_step(model, optimizer, sample_batch(train_ids, bos_id, generator), lr, bf16))
        step += 1
        if step % LOG_EVERY == 0:
            elapsed = time.perf_counter() - t_train
            print(
                f"step {step} ({progress:.0%}) loss {sum(losses) / len(losses):.3f} lr {lr:.2e} "
                f"{step * BATCH_SIZE * CONTEXT / elapsed:.0f} tok/s {elapsed / 60:.1f} min",
                flush=True,
            )
            losses.clear()
        if step % EVAL_EVERY == 0:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                ppl = perplexity(model, val_ids, bos_id, EVAL_WINDOWS)
            print(f"step {step}: val ppl (first {EVAL_WINDOWS} windows) {ppl:.2f}", flush=True)
    total_steps = step
    train_minutes = (time.perf_counter() - t_train) / 60

    # Evaluate exactly what is shipped: float16 weights, computed in float32.
    model.to(torch.float16).to(torch.float32)
    validation_sample = val_text[:VALIDATION_SAMPLE_CHARS]
    validation_sample = validation_sample[: validation_sample.rfind("\n") + 1]
    val_ppl = perplexity(model, val_ids, bos_id)
    sample_ppl = perplexity(model, encode(tokenizer, validation_sample), bos_id)
    tokens_seen = total_steps * BATCH_SIZE * CONTEXT
    print(f"validation perplexity: {val_ppl:.3f} (validation.txt: {sample_ppl:.3f})", flush=True)
    for sample in greedy_samples(model, tokenizer):
        print(f"--- sample ---\n{sample}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, tokenizer, args.out)
    if not args.draft:  # the draft is scored on the demo's
        (args.out / "validation.txt").write_text(validation_sample)
    write_data_source(
        args.out,
        {
            "chapters (train + validation)": len(chapters),
            "training split": f"{len(train_text):,} characters, {len(train_ids):,} tokens",
            "validation split": f"{len(val_text):,} characters, {len(val_ids):,} tokens "
            f"(starts at \"{val_text.splitlines()[0]}\")",
            "validation perplexity (per token)": f"{val_ppl:.3f}",
            "validation.txt perplexity (per token)": f"{sample_ppl:.3f}",
            "training": f"{total_steps} steps x {BATCH_SIZE} x {CONTEXT} tokens = "
            f"{tokens_seen:,} tokens ({tokens_seen / len(train_ids):.1f} epochs), "
            f"{train_minutes:.1f} min",
        },
        args.draft,
    )
    summary = {
        "parameters": n_params,
        "steps": total_steps,
        "tokens_seen": tokens_seen,
        "train_minutes": round(train_minutes, 2),
        "total_minutes": round((time.perf_counter() - t0) / 60, 2),
        "val_ppl": round(val_ppl, 3),
        "validation_txt_ppl": round(sample_ppl, 3),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
