#!/usr/bin/env python3
"""Generate the tokenizer and chat-template fixtures of `baton-worker` from Hugging Face.

Usage:
    python3 scripts/tokenizer_fixtures.py models/SmolLM2-135M-Instruct.Q4_1.gguf [--out DIR]

Needs `transformers`, `tokenizers`, `gguf` and `jinja2`; torch is optional.

Three Hugging Face tokenizers are built from the GGUF file, all with the same vocabulary, merges
and special tokens (control tokens, matched whole before BPE):

- `transformers`: what `AutoTokenizer.from_pretrained(dir, gguf_file=name)` builds. That
  loader needs torch, but only to rebuild the model config; without torch the script takes the
  same tokenizer route by hand (metadata read with `gguf.GGUFReader`, grouped the way
  transformers' `get_gguf_tokenizer` groups it, then transformers' own `convert_gguf_tokenizer`,
  wrapped in a `PreTrainedTokenizerFast`); both routes give the same tokenizer. It also renders
  the chat prompts (`apply_chat_template`, the GGUF's `tokenizer.chat_template`).
- `upstream` (for `smollm`): the pre-tokenizer of SmolLM2's own `tokenizer.json`,
  `Digits(individual_digits=True)` then `ByteLevel(use_regex=True)`;
- `llama.cpp`: the patterns llama.cpp applies for the GGUF's `tokenizer.ggml.pre` (for `smollm`:
  every `\\p{N}` alone, then the GPT-2 pattern), each an isolating `Split`, then byte-level.

transformers' GGUF converter has no entry for `smollm` and falls back to plain GPT-2 splitting,
so digits are not cut off first. No merge of SmolLM2's vocabulary joins a whole numeric
character to anything (the script checks), so digit runs come out the same; but the GPT-2
pattern glues whitespace to the number that follows it, and that changes the ids:
"4444  55555" is `"Ġ", "Ġ5"` there but `"ĠĠ", "5"` upstream, "\\n\\n2" is `"Ċ", "Ċ", "2"` there
but `"ĊĊ", "2"` upstream, and " ¾" lets the space merge with the first byte of "¾". The
fixture ids are therefore the upstream ones; the script fails if llama.cpp's pipeline disagrees
with them, and records transformers' ids as `transformers_ids` where they differ. Without
`upstream` (other `pre` values) the llama.cpp pipeline is the reference.

SmolLM2's vocabulary lacks 21 of the 256 byte symbols (0x04, 0x06, 0x13, 0x14, 0x16, 0x1d and
bytes that never occur in UTF-8 text or only in planes 4 to 11); every HF pipeline drops such
bytes silently, so `decoded` can differ from `text` (case `missing_bytes`).

Outputs, in `worker/tests/fixtures/tokenizer/` unless `--out` says otherwise:

- `cases.json`: `{"source": {...}, "cases": [{"name", "text", "ids", "decoded",
  "transformers_ids"?}]}`; `ids` without BOS (the model's `add_bos_token` is false),
  `decoded` is `decode(ids)`.
- `chat_cases.json`: `{"source": {...}, "bos_token", "eos_token", "cases": [{"name",
  "messages", "add_generation_prompt", "prompt", "ids"}]}`; `prompt` is
  `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`, `ids` its
  encoding.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import gguf
import tokenizers
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# llama.cpp's GPT-2 pattern (`llama-vocab.cpp`, LLAMA_VOCAB_PRE_TYPE_GPT2 and others).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

# The patterns llama.cpp applies, one after the other, for each `tokenizer.ggml.pre`.
LLAMA_CPP_PRE = {
    "smollm": [r"\p{N}", GPT2_PATTERN],
    "gpt2": [GPT2_PATTERN],
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2_PATTERN, r"\p{N}+", r"[0-9][0-9][0-9]"],
}

EXAMPLE_TEXT = "In 1969, the first humans"
EXAMPLE_IDS = [788, 216, 33, 41, 38, 41, 28, 260, 808, 2973]  # documented for SmolLM2

RUST_FN = """fn main() {
    let xs: Vec<u32> = (1..=10).map(|x| x * x).collect();
    println!("{:?}", xs);
}
"""

PYTHON_FN = """def fib(n: int) -> int:
    if n < 2:
        return n
    return fib(n - 1) + fib(n - 2)


class Point:
\tdef __init__(self, x, y):
\t\tself.x, self.y = x, y
"""

TEXTS = [
    ("example", EXAMPLE_TEXT),
    ("empty", ""),
    ("single_space", " "),
    ("hello", "Hello, world!"),
    ("sentence", "The quick brown fox jumps over the lazy dog."),
    ("contractions", "I'm sure they'll say it's fine, but we've seen you'd've done it. Don't!"),
    ("contractions_upper", "IT'S WE'VE THEY'LL I'D"),
    ("digits", "0123456789"),
    ("numbers", "Pi is 3.14159, e is 2.71828; 1,000,000 > 999999 and 2024-01-15T10:30:00Z."),
    ("numbers_spaced", "1 22 333 4444  55555"),
    ("letters_digits", "abc123def x86_64 GPT4 v0.1.2 $100 50%"),
    ("unicode_numerics", "½ ¾ x² y³ ① ٣ ४ Ⅻ"),
    ("accents", "Café naïve résumé, façade, Ærøskøbing, Straße, Łódź, São Paulo."),
    ("combining", "e\u0301 n\u0303 a\u0308 \u1e9b\u0323"),
    ("chinese", "你好，世界！今天天气很好。"),
    ("japanese", "こんにちは世界。カタカナとひらがな、漢字。"),
    ("korean", "안녕하세요, 세계!"),
    ("arabic", "مرحبا بالعالم! كيف حالك؟"),
    ("hebrew", "שלום עולם, מה שלומך?"),
    ("mixed_rtl", "The word שלום means peace; سلام too."),
    ("cyrillic_greek", "Привет, мир! Καλημέρα κόσμε!"),
    ("devanagari_thai", "नमस्ते दुनिया ภาษาไทย"),
    ("emoji", "Hi 👋 from 🌍! 🎉🎉🎉"),
    ("emoji_zwj_flags", "Family: 👨\u200d👩\u200d👧\u200d👦, flags: 🇫🇷🇯🇵, skin: 👍🏽"),
    ("multiple_spaces", "a  b   c    d"),
    ("leading_spaces", "   leading spaces"),
    ("trailing_spaces", "trailing spaces   "),
    ("tabs", "\tone\t\ttwo\t"),
    ("newlines", "line one\nline two\n\n\nline five\n"),
    ("crlf", "windows\r\nline\r\nendings\r\n"),
    ("whitespace_mix", " \t \n  \n\t x  \n"),
    ("only_newlines", "\n\n"),
    ("unusual_spaces", "nbsp\u00a0here, thin\u2009space, ideographic\u3000space, zero\u200bwidth"),
    ("control_chars", "bell\x07 null\x00 escape\x1b[0m del\x7f"),
    ("rust_code", RUST_FN),
    ("python_code", PYTHON_FN),
    ("json", '{"name": "Baton", "ids": [1, 2, 3], "ok": true, "nested": {"k": null}}'),
    ("html", '<div class="x"><p>Hello &amp; <b>bye</b></p></div>'),
    ("url_email", "See https://example.com/path?q=1&r=two#frag or mail a.b@example.org."),
    ("markdown", "# Title\n\n- item *one*\n- item **two**\n\n```sh\ncargo test --release\n```\n"),
    ("punctuation", "Wait... what?! (Really?) [yes] {no} <maybe> -- ok; fine: \"quoted\" 'single'"),
    ("long_word", "Antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis"),
    ("repeated", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa ------------------------ ........"),
    ("spaces_before_digits", "x  1\n\n2 \t3  45\n    6. six"),
    ("missing_bytes", "a\x04b\x06c\x13d\x1de"),
    ("special_chat", "<|im_start|>user\nhi<|im_end|>"),
    ("special_adjacent", "<|im_end|><|im_start|>assistant\n<|endoftext|>"),
    ("special_in_text", "before<|endoftext|>after <repo_name>x<file_sep> y"),
    ("special_partial", "<|im_start <|im_end| |im_start|> <|IM_START|>"),
]

CHATS = [
    ("user_only", [{"role": "user", "content": "What is the capital of France?"}], True),
    (
        "with_system",
        [
            {"role": "system", "content": "You are a terse assistant. Answer in one word."},
            {"role": "user", "content": "Name a primary colour."},
        ],
        True,
    ),
    (
        "multi_turn",
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Translate 'good morning' to French."},
            {"role": "assistant", "content": "Bonjour."},
            {"role": "user", "content": "And to Japanese? 日本語で。"},
        ],
        True,
    ),
    (
        "no_generation_prompt",
        [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello! How can I help?\n\nAsk away."},
        ],
        False,
    ),
]


def load_hf_tokenizer(model_path: str):
    """The HF tokenizer transformers builds from the GGUF; returns (tokenizer, route)."""
    from transformers import AutoTokenizer

    dirname, basename = os.path.split(os.path.abspath(model_path))
    try:
        return AutoTokenizer.from_pretrained(dirname, gguf_file=basename), "AutoTokenizer(gguf_file)"
    except ImportError as err:  # ModuleNotFoundError included
        print(f"AutoTokenizer from GGUF unavailable ({err}); using transformers' GGUF "
              "tokenizer converter on gguf.GGUFReader metadata", file=sys.stderr)

    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        _SPECIAL_TOKENS,
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    metadata = read_metadata(model_path)
    grouped = {
        group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                if f"tokenizer.{key}" in metadata}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    tokenizer_config.update(extra)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config), "convert_gguf_tokenizer"


def read_metadata(model_path: str) -> dict:
    reader = gguf.GGUFReader(model_path)
    return {key: field.contents() for key, field in reader.fields.items()}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table (the byte-level alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def independent_tokenizer(metadata: dict, patterns: list[str] | None, upstream_smollm: bool):
    """A byte-level BPE built straight from the GGUF vocabulary with the `tokenizers` library."""
    tokens = metadata["tokenizer.ggml.tokens"]
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    if upstream_smollm:
        steps = [pre_tokenizers.Digits(individual_digits=True),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    else:
        steps = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type") or []
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == 3]
    tok.add_special_tokens(special)
    return tok


def numeric_merges(metadata: dict) -> list[str]:
    """Merges whose result holds a numeric character and anything else."""
    import unicodedata

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    found = []
    for m in metadata["tokenizer.ggml.merges"]:
        joined = m.replace(" ", "", 1)
        if not all(c in byte_of for c in joined):
            continue
        text = bytes(byte_of[c] for c in joined).decode("utf-8", errors="replace")
        if len(text) > 1 and any(unicodedata.category(c).startswith("N") for c in text):
            found.append(m)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="path of the GGUF file")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent
                                             / "worker/tests/fixtures/tokenizer"))
    args = parser.parse_args()

    hf, route = load_hf_tokenizer(args.model)
    metadata = read_metadata(args.model)
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if metadata.get("tokenizer.ggml.model") != "gpt2" or pre not in LLAMA_CPP_PRE:
        print(f"unsupported tokenizer {metadata.get('tokenizer.ggml.model')!r}/{pre!r}",
              file=sys.stderr)
        return 1
    llama_cpp = independent_tokenizer(metadata, LLAMA_CPP_PRE[pre], False)
    reference, reference_name = llama_cpp, "llama.cpp"
    if pre == "smollm":
        reference, reference_name = independent_tokenizer(metadata, None, True), "upstream"
        merges = numeric_merges(metadata)
        print(f"merges joining a numeric character to anything else: {len(merges)} {merges[:10]}")
        if merges:
            print("warning: digit splitting changes BPE results for this vocabulary",
                  file=sys.stderr)

    with open(args.model, "rb") as f:
        sha256 = hashlib.file_digest(f, "sha256").hexdigest()
    source = {
        "model": os.path.basename(args.model),
        "sha256": sha256,
        "generator": "scripts/tokenizer_fixtures.py",
        "reference": reference_name,
        "transformers_route": route,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }

    failures = 0
    differences = []

    def encode(name: str, text: str) -> dict:
        nonlocal failures
        ids = reference.encode(text, add_special_tokens=False).ids
        entry = {"ids": ids}
        theirs = llama_cpp.encode(text, add_special_tokens=False).ids
        if theirs != ids:
            print(f"llama.cpp pipeline disagrees with {reference_name} on {name}:\n"
                  f"  {reference_name} {ids}\n  llama.cpp {theirs}", file=sys.stderr)
            failures += 1
        hf_ids = hf.encode(text, add_special_tokens=False)
        if hf_ids != ids:
            entry["transformers_ids"] = hf_ids
            differences.append(name)
        return entry

    cases = []
    for name, text in TEXTS:
        entry = encode(name, text)
        decoded = reference.decode(entry["ids"], skip_special_tokens=False)
        if decoded != hf.decode(entry["ids"], skip_special_tokens=False):
            print(f"transformers decodes {name} differently", file=sys.stderr)
            failures += 1
        if decoded != text:
            print(f"note: {name} does not round-trip: {decoded!r}")
        cases.append({"name": name, "text": text, **entry, "decoded": decoded})
        if name == "example" and entry["ids"] != EXAMPLE_IDS:
            print(f"example ids {entry['ids']} differ from the documented {EXAMPLE_IDS}",
                  file=sys.stderr)
            failures += 1

    chats = []
    for name, messages, add_generation_prompt in CHATS:
        prompt = hf.apply_chat_template(messages, tokenize=False,
                                        add_generation_prompt=add_generation_prompt)
        chats.append({"name": name, "messages": messages,
                      "add_generation_prompt": add_generation_prompt,
                      "prompt": prompt, **encode(name, prompt)})

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "cases.json", {"source": source, "cases": cases})
    write_json(out / "chat_cases.json", {"source": source, "bos_token": hf.bos_token,
                                         "eos_token": hf.eos_token, "cases": chats})
    print(f"wrote {len(cases)} texts and {len(chats)} chats to {out}; reference "
          f"{reference_name}; transformers ({route}) differs on {len(differences)}: {differences}")
    return 1 if failures else 0


def write_json(path: Path, value) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
