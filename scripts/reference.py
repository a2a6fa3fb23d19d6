#!/usr/bin/env python3
"""Independent numpy reference for the default model's forward pass and greedy decoding.

What it does
------------
Reads a Llama GGUF (the default model is SmolLM2-135M-Instruct, Q4_1) with the `gguf` package,
dequantizes every weight to float32 with `gguf.quants.dequantize`, and runs the Llama forward pass
in numpy with float64 arithmetic:

    token embedding -> 30 x [RMSNorm -> GQA attention with RoPE -> residual,
                             RMSNorm -> SwiGLU MLP down(silu(gate(x)) * up(x)) -> residual]
    -> RMSNorm -> tied output projection (token_embd, no output.weight)

RoPE is applied to adjacent pairs (x[2i], x[2i+1]) with frequency theta^(-2i/d) -- llama.cpp's
"normal" rope for LLAMA. llama.cpp's converter permutes the rows of attn_q / attn_k so that this
is what the stored weights expect; the Hugging Face "rotate half" layout (`--rope neox`) on the
stored weights garbles the output, which is kept as an option only to show that.

Prompts are tokenized with the Hugging Face tokenizer that `transformers` builds from the GGUF
itself (`AutoTokenizer.from_pretrained(dir, gguf_file=name)`). That loader needs torch; without
torch the script builds the same tokenizer through transformers' own GGUF tokenizer converter
(`convert_gguf_tokenizer`) from metadata read with `gguf.GGUFReader`. Chat prompts are rendered
with the GGUF's chat template (`apply_chat_template(..., tokenize=False,
add_generation_prompt=True)`) and the text is then tokenized; no BOS is added
(`tokenizer.ggml.add_bos_token` is false).

For each case it greedily decodes 40 new tokens (argmax, lowest id wins an exact tie; it does not
stop at EOS id 2 but records where it first appears) using a float64 KV cache, and writes
`greedy.json` into the fixture directory:

    model             file name, sha256, hyperparameters, how the reference computes
    cases[]           name, kind ("raw" | "chat"), prompt (text; chat cases also `messages`),
                      prompt_ids, generated_ids (40), generated_text, eos_at (index into
                      generated_ids of the first id 2, or null),
                      last_logits_top: top-200 [id, value] of the logits at the last prompt
                        position (the ones that produce generated_ids[0]), value-descending,
                      last_logits_stats: min / max / mean / std / logsumexp of that vector,
                      last_logits_file (some cases): the full vector, raw little-endian float32,
                      logits_after_gen_top (some cases): top-200 [id, value] at the final position
                        of prompt + 40 generated tokens (the logits for a 41st token),
                      top2_gaps: logit gap between best and second best at each of the 40 steps,
                      near_ties: steps whose top-2 gap is below 1e-3 (step, top1, top2, gap)
    All logits are float64 results rounded to float32.

It also checks itself: the logits after generation are recomputed with a full forward pass over
the whole sequence (no cache) and must match the cached path.

How to run
----------
    python3 scripts/reference.py models/SmolLM2-135M-Instruct.Q4_1.gguf worker/tests/fixtures/reference

Needs numpy, gguf and transformers (torch optional). Takes one to two minutes on two cores and about
1.5 GB of memory. The output is deterministic; BLAS is pinned to one thread unless the
environment already sets it.
"""

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import gguf  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

DEFAULT_MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = "worker/tests/fixtures/reference"
N_GEN = 40
TOP_K = 200
NEAR_TIE = 1e-3
EOS_ID = 2

# name, kind, prompt text (raw) or messages (chat), store full last logits, store logits after gen
CASES = [
    ("raw_capital_france", "raw", "The capital of France is", True, False),
    ("raw_moon_1969", "raw", "In 1969, the first humans", True, True),
    ("raw_code_fibonacci", "raw", "def fibonacci(n):\n", True, False),
    (
        "raw_unicode",
        "raw",
        "Café, naïve, façade — in Japanese, 東京 (Tokyo) means",
        False,
        False,
    ),
    (
        "chat_capital_france",
        "chat",
        [{"role": "user", "content": "What is the capital of France?"}],
        True,
        False,
    ),
    (
        "chat_haiku_system",
        "chat",
        [
            {"role": "system", "content": "You are a poet. Answer with a single haiku."},
            {"role": "user", "content": "Write a haiku about the sea."},
        ],
        False,
        True,
    ),
    (
        "chat_multi_turn",
        "chat",
        [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "2 + 2 = 4."},
            {"role": "user", "content": "And 3 + 5?"},
        ],
        False,
        False,
    ),
]


# --------------------------------------------------------------------------------------------
# Loading


def field_value(reader, key):
    field = reader.fields[key]
    return field.contents()


class Model:
    def __init__(self, path):
        self.kv_f16 = False
        reader = gguf.GGUFReader(path)
        arch = field_value(reader, "general.architecture")
        if arch != "llama":
            raise SystemExit(f"expected a llama GGUF, got {arch!r}")
        self.n_layer = int(field_value(reader, "llama.block_count"))
        self.n_embd = int(field_value(reader, "llama.embedding_length"))
        self.n_ff = int(field_value(reader, "llama.feed_forward_length"))
        self.n_head = int(field_value(reader, "llama.attention.head_count"))
        self.n_head_kv = int(field_value(reader, "llama.attention.head_count_kv"))
        self.eps = float(field_value(reader, "llama.attention.layer_norm_rms_epsilon"))
        self.rope_base = float(field_value(reader, "llama.rope.freq_base"))
        self.head_dim = self.n_embd // self.n_head
        self.rope_dim = int(field_value(reader, "llama.rope.dimension_count"))
        if self.rope_dim != self.head_dim:
            raise SystemExit("this reference rotates the full head dim only")

        self.tensor_types = {}
        weights = {}
        for t in reader.tensors:
            # ggml dims are fastest-first; the row-major numpy shape is the reverse
            shape = tuple(int(d) for d in reversed(t.shape))
            w = dequantize(t.data, t.tensor_type).reshape(shape)
            weights[t.name] = np.asarray(w, dtype=np.float64)
            self.tensor_types[t.name] = t.tensor_type.name
        self.w = weights
        self.tok_embd = weights["token_embd.weight"]  # (n_vocab, n_embd)
        # tied output projection: the file has no output.weight
        self.output = weights.get("output.weight", self.tok_embd)
        self.n_vocab = self.tok_embd.shape[0]
        self.layers = []
        for i in range(self.n_layer):
            p = f"blk.{i}."
            self.layers.append(
                {
                    name: weights[p + name + ".weight"]
                    for name in (
                        "attn_norm",
                        "attn_q",
                        "attn_k",
                        "attn_v",
                        "attn_output",
                        "ffn_norm",
                        "ffn_gate",
                        "ffn_up",
                        "ffn_down",
                    )
                }
            )
        self.output_norm = weights["output_norm.weight"]
        d = self.head_dim
        self.inv_freq = self.rope_base ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # (d/2,)

    # ----------------------------------------------------------------------------------------
    # Forward

    def rms_norm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, positions, layout):
        """x: (T, H, D); positions: (T,)."""
        ang = positions[:, None].astype(np.float64) * self.inv_freq[None, :]  # (T, D/2)
        cos = np.cos(ang)[:, None, :]
        sin = np.sin(ang)[:, None, :]
        out = np.empty_like(x)
        if layout == "norm":
            # adjacent pairs (2i, 2i+1): llama.cpp LLAMA_ROPE_TYPE_NORM
            x0, x1 = x[..., 0::2], x[..., 1::2]
            out[..., 0::2] = x0 * cos - x1 * sin
            out[..., 1::2] = x0 * sin + x1 * cos
        elif layout == "neox":
            # "rotate half": pairs (i, i + D/2)
            h = x.shape[-1] // 2
            x0, x1 = x[..., :h], x[..., h:]
            out[..., :h] = x0 * cos - x1 * sin
            out[..., h:] = x0 * sin + x1 * cos
        else:
            raise ValueError(layout)
        return out

    def new_cache(self, max_len):
        shape = (self.n_layer, max_len, self.n_head_kv, self.head_dim)
        return {"k": np.zeros(shape), "v": np.zeros(shape), "len": 0}

    def forward(self, tokens, cache, rope_layout="norm"):
        """Run `tokens` at positions cache.len.. and return their logits (T, n_vocab), float64."""
        tokens = np.asarray(tokens, dtype=np.int64)
        T = len(tokens)
        p0 = cache["len"]
        S = p0 + T
        positions = np.arange(p0, S)
        H, Hkv, D = self.n_head, self.n_head_kv, self.head_dim
        group = H // Hkv
        scale = 1.0 / np.sqrt(D)
        # causal mask: query at position p0+t sees keys 0..p0+t
        mask = np.arange(S)[None, :] > positions[:, None]  # (T, S)

        x = self.tok_embd[tokens]  # (T, n_embd)
        for li, L in enumerate(self.layers):
            h = self.rms_norm(x, L["attn_norm"])
            q = (h @ L["attn_q"].T).reshape(T, H, D)
            k = (h @ L["attn_k"].T).reshape(T, Hkv, D)
            v = (h @ L["attn_v"].T).reshape(T, Hkv, D)
            q = self.rope(q, positions, rope_layout)
            k = self.rope(k, positions, rope_layout)
            if self.kv_f16:
                # Keys and values stored as float16, as a worker's host store keeps them
                # (`worker.kv_dtype = "f16"`): rounded to nearest once, read back exactly.
                k = k.astype(np.float16).astype(np.float64)
                v = v.astype(np.float16).astype(np.float64)
            cache["k"][li, p0:S] = k
            cache["v"][li, p0:S] = v
            K = cache["k"][li, :S]  # (S, Hkv, D)
            V = cache["v"][li, :S]
            # query head h reads KV head h // group (ggml broadcast == HF repeat_kv)
            K = np.repeat(K, group, axis=1)  # (S, H, D)
            V = np.repeat(V, group, axis=1)
            scores = np.einsum("thd,shd->hts", q, K) * scale  # (H, T, S)
            scores = np.where(mask[None], -np.inf, scores)
            scores -= scores.max(axis=-1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(axis=-1, keepdims=True)
            o = np.einsum("hts,shd->thd", p, V).reshape(T, H * D)
            x = x + o @ L["attn_output"].T

            h = self.rms_norm(x, L["ffn_norm"])
            g = h @ L["ffn_gate"].T
            u = h @ L["ffn_up"].T
            act = g / (1.0 + np.exp(-g)) * u  # silu(gate) * up
            x = x + act @ L["ffn_down"].T
        cache["len"] = S
        x = self.rms_norm(x, self.output_norm)
        return x @ self.output.T


# --------------------------------------------------------------------------------------------
# Tokenizer


def load_tokenizer(model_path):
    """The Hugging Face tokenizer transformers builds from the GGUF; returns (tokenizer, route)."""
    from transformers import AutoTokenizer

    dirname, basename = os.path.split(os.path.abspath(model_path))
    try:
        return AutoTokenizer.from_pretrained(dirname, gguf_file=basename), "AutoTokenizer(gguf_file)"
    except (ImportError, ModuleNotFoundError) as err:
        print(f"AutoTokenizer from GGUF unavailable ({err}); using transformers' GGUF "
              "tokenizer converter with gguf.GGUFReader metadata", file=sys.stderr)
    return build_tokenizer_without_torch(model_path), "convert_gguf_tokenizer"


def build_tokenizer_without_torch(model_path):
    """Same construction as transformers' GGUF tokenizer path, with metadata from gguf.GGUFReader
    (transformers' own GGUF metadata reader imports torch)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        _SPECIAL_TOKENS,
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    reader = gguf.GGUFReader(model_path)
    metadata = {key: field.contents() for key, field in reader.fields.items()}
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
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config)


# --------------------------------------------------------------------------------------------
# Fixture


def f32(v):
    return float(np.float32(v))


def top_pairs(logits32, k=TOP_K):
    # value-descending, lower id first among equal values (stable sort on -value)
    order = np.argsort(-logits32.astype(np.float64), kind="stable")[:k]
    return [[int(i), float(logits32[i])] for i in order]


def stats(logits64):
    m = logits64.max()
    lse = m + np.log(np.exp(logits64 - m).sum())
    return {
        "min": f32(logits64.min()),
        "max": f32(m),
        "mean": f32(logits64.mean()),
        "std": f32(logits64.std()),
        "logsumexp": f32(lse),
        "argmax": int(np.argmax(logits64)),
    }


def argmax_and_gap(logits32):
    """Greedy pick on the float32-rounded logits (what the fixture stores); lowest id on ties."""
    order = np.argsort(-logits32.astype(np.float64), kind="stable")[:2]
    return int(order[0]), int(order[1]), float(logits32[order[0]]) - float(logits32[order[1]])


def run_case(model, prompt_ids, rope_layout, want_after_gen):
    cache = model.new_cache(len(prompt_ids) + N_GEN + 1)
    logits = model.forward(prompt_ids, cache, rope_layout)[-1]
    last_logits = logits
    generated, gaps, ties = [], [], []
    after_gen = None
    for step in range(N_GEN):
        l32 = logits.astype(np.float32)
        top1, top2, gap = argmax_and_gap(l32)
        generated.append(top1)
        gaps.append(gap)
        if gap < NEAR_TIE:
            ties.append({"step": step, "top1": top1, "top2": top2, "gap": gap})
        if step + 1 < N_GEN or want_after_gen:
            logits = model.forward([top1], cache, rope_layout)[-1]
    if want_after_gen:
        after_gen = logits
    return last_logits, generated, gaps, ties, after_gen


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    ap.add_argument("out_dir", nargs="?", default=DEFAULT_OUT)
    ap.add_argument("--rope", choices=("norm", "neox"), default="norm",
                    help="RoPE pairing on the stored q/k rows (norm = adjacent pairs, correct here)")
    ap.add_argument("--dry-run", action="store_true", help="print the generations, write nothing")
    ap.add_argument("--kv", choices=("f64", "f16"), default="f64",
                    help="how the KV cache keeps keys and values: float64, or rounded to float16 "
                         "(the fixture for workers with kv_dtype f16, "
                         "worker/tests/fixtures/reference-kv16)")
    args = ap.parse_args()

    t_start = time.time()
    tok, route = load_tokenizer(args.model)
    check = tok.encode("In 1969, the first humans", add_special_tokens=False)
    expected = [788, 216, 33, 41, 38, 41, 28, 260, 808, 2973]
    if check != expected:
        raise SystemExit(f"tokenizer sanity check failed: {check} != {expected}")

    model = Model(args.model)
    model.kv_f16 = args.kv == "f16"
    t_loaded = time.time()
    print(f"tokenizer: {route}; model loaded in {t_loaded - t_start:.1f}s", file=sys.stderr)

    cases_out = []
    blobs = {}
    for name, kind, prompt, want_full, want_after_gen in CASES:
        entry = {"name": name, "kind": kind}
        if kind == "chat":
            text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            entry["messages"] = prompt
        else:
            text = prompt
        entry["prompt"] = text
        prompt_ids = tok.encode(text, add_special_tokens=False)
        entry["prompt_ids"] = prompt_ids

        t0 = time.time()
        last, generated, gaps, ties, after = run_case(model, prompt_ids, args.rope, want_after_gen)
        dt = time.time() - t0

        last32 = last.astype(np.float32)
        entry["generated_ids"] = generated
        entry["generated_text"] = tok.decode(generated, skip_special_tokens=False)
        entry["eos_at"] = generated.index(EOS_ID) if EOS_ID in generated else None
        entry["last_logits_top"] = top_pairs(last32)
        entry["last_logits_stats"] = stats(last)
        if want_full:
            fname = f"{name}.last_logits.f32"
            entry["last_logits_file"] = fname
            blobs[fname] = last32.astype("<f4").tobytes()
        if after is not None:
            # check the KV-cache path against a full forward over the whole sequence
            full_seq = prompt_ids + generated
            fresh = model.forward(full_seq, model.new_cache(len(full_seq)), args.rope)[-1]
            diff = float(np.max(np.abs(fresh - after)))
            if diff > 1e-6:
                raise SystemExit(f"{name}: KV-cache logits differ from full recompute by {diff}")
            entry["logits_after_gen_top"] = top_pairs(after.astype(np.float32))
            entry["logits_after_gen_stats"] = stats(after)
            print(f"  {name}: cache vs full recompute max |diff| = {diff:.3g}", file=sys.stderr)
        entry["top2_gaps"] = gaps
        entry["near_ties"] = ties
        cases_out.append(entry)
        print(f"[{name}] {len(prompt_ids)} prompt tokens, {dt:.1f}s, min gap {min(gaps):.4f}"
              f"{', NEAR TIES ' + str(ties) if ties else ''}\n  {text!r}\n  -> "
              f"{entry['generated_text']!r}", file=sys.stderr)

    fixture = {
        "description": "Greedy decoding reference for the default model, produced by "
                       "scripts/reference.py (numpy, float64 arithmetic on dequantized weights).",
        "kv_cache": {"f64": "float64", "f16": "keys and values rounded to float16 when stored"}[args.kv],
        "model": {
            "file": os.path.basename(args.model),
            "sha256": sha256(args.model),
            "n_layer": model.n_layer,
            "n_embd": model.n_embd,
            "n_ff": model.n_ff,
            "n_head": model.n_head,
            "n_head_kv": model.n_head_kv,
            "head_dim": model.head_dim,
            "n_vocab": model.n_vocab,
            "rope_freq_base": model.rope_base,
            "rms_norm_eps": model.eps,
            "rope_layout": {"norm": "adjacent pairs (2i, 2i+1)",
                            "neox": "rotate half (i, i+d/2)"}[args.rope],
            "output": "tied to token_embd.weight",
        },
        "tokenizer": f"transformers tokenizer built from the GGUF ({route}); no BOS added",
        "n_generated": N_GEN,
        "greedy": "argmax over the float32-rounded logits, lowest id on exact ties; "
                  "generation continues past EOS",
        "logits_files": "raw little-endian float32, n_vocab values",
        "top_k": TOP_K,
        "near_tie_threshold": NEAR_TIE,
        "eos_id": EOS_ID,
        "cases": cases_out,
    }

    if args.dry_run:
        print(f"total {time.time() - t_start:.1f}s (dry run, nothing written)", file=sys.stderr)
        return
    os.makedirs(args.out_dir, exist_ok=True)
    for fname, data in blobs.items():
        with open(os.path.join(args.out_dir, fname), "wb") as f:
            f.write(data)
    with open(os.path.join(args.out_dir, "greedy.json"), "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {args.out_dir} in {time.time() - t_start:.1f}s total", file=sys.stderr)


if __name__ == "__main__":
    main()
