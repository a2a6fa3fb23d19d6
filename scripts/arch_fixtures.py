#!/usr/bin/env python3
"""Tiny random-weight models of each supported architecture, with Hugging Face
`transformers` as the reference.

Usage, in a virtual environment outside the repository with CPU torch, transformers
(the versions are recorded in reference.json) and llama.cpp's gguf package:
    python3 scripts/arch_fixtures.py [--out DIR]

For every family below, the script builds a tiny model with `transformers` (CPU torch,
random weights, seeded), writes it to GGUF with the `gguf` package as llama.cpp's
converter lays it out (its tensor-name map; `attn_q` / `attn_k` rows permuted for `llama`;
llama3 RoPE scaling as `rope_freqs.weight`), in two formats:

- `<name>.f32.gguf`: every tensor F32;
- `<name>.q8_0.gguf`: matrices and the embedding as Q8_0 blocks (norms, biases and
  `rope_freqs` stay F32).

and records what `transformers` computes (float32, eager attention) for a fixed prompt of
token ids: the logits at the last prompt position and 24 greedy tokens. The Q8_0
reference runs the same model with each quantized weight replaced by its Q8_0 values
(`gguf.quants` quantize then dequantize), so both references are of exactly the weights
the file holds.

Families:
- `llama3`: Llama 3.1-style, llama3 RoPE scaling, GQA, an explicit head size wider
  than hidden / heads, untied output;
- `mistral`: Mistral 7B-style (converted as `llama`), tied output;
- `qwen2`: Qwen2.5-style, Q/K/V biases, tied output;
- `qwen3`: Qwen3-style, per-head Q/K RMSNorm, explicit head size;
- `gemma3`: Gemma 3-style, GeGLU, scaled embeddings, norms after attention and after the
  feed-forward block, Q/K norms, one KV head, sliding-window layers (window 8, shorter
  than the prompt) with their own RoPE base, and a global layer;
- `phi3`: Phi-3-style, fused `attn_qkv` and `ffn_up` (gate, then up), a sliding window
  (8) on every layer, untied output;
- `phi3-longrope`: Phi-4-mini-style, LongRoPE (`rope_factors_long/short.weight`, the
  attention factor) over partial rotary embeddings, no window, tied output, its context
  stretched past the original (the long factors);
- `phi3-longrope-short`: the same within its original context (the short factors).

The tokenizer in each file is byte-level BPE (the 256 byte symbols, three control
tokens, merges of letter pairs) with the family's `tokenizer.ggml.pre`; the tests feed
token ids, the tokenizer only has to load.

Writes into `worker/tests/fixtures/arch/` unless `--out` says otherwise: the GGUF files
and `reference.json` ({"source", "models": [{"name", "arch", "files": {"f32", "q8_0"},
"prompt_ids", "reference": {"f32" | "q8_0": {"last_logits", "greedy_ids", "margins",
"min_margin"}}}]}); `margins[i]` is the gap between the best and the second-best logit at
greedy step `i`: how far that choice is from a tie, which says how much rounding it
stands (a test of arithmetic that rounds more compares the tokens up to the first close
call).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as T

SEED = 20261202
VOCAB = 320
PROMPT = 12
GREEDY = 24
MIN_MARGIN = 2e-3


def byte_symbols() -> list[str]:
    """GPT-2's byte-to-character table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def vocabulary() -> tuple[list[str], list[int], list[str]]:
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_symbols()
    types = [3, 3, 3] + [1] * 256
    merges = []
    letters = "etaoinshrdlucmfw"
    for a in letters:
        for b in letters:
            if len(tokens) >= VOCAB:
                break
            merges.append(f"{a} {b}")
            tokens.append(a + b)
            types.append(1)
    assert len(tokens) == VOCAB
    return tokens, types, merges


def families():
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        # Wide enough that the logits spread: greedy choices are then far from ties.
        initializer_range=0.25,
    )
    llama3_rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return [
        (
            "llama3",
            "llama",
            "llama-bpe",
            transformers.LlamaConfig(**common, head_dim=32, tie_word_embeddings=False, rope_parameters=llama3_rope),
            transformers.LlamaForCausalLM,
        ),
        (
            "mistral",
            "llama",
            "gpt2",
            transformers.MistralConfig(
                **common, sliding_window=None, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
            ),
            transformers.MistralForCausalLM,
        ),
        (
            "qwen2",
            "qwen2",
            "qwen2",
            transformers.Qwen2Config(
                **common, use_sliding_window=False, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
            ),
            transformers.Qwen2ForCausalLM,
        ),
        (
            "qwen3",
            "qwen3",
            "qwen2",
            transformers.Qwen3Config(
                **common,
                head_dim=32,
                attention_bias=False,
                use_sliding_window=False,
                tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            ),
            transformers.Qwen3ForCausalLM,
        ),
        (
            "gemma3",
            "gemma3",
            "gpt2",
            transformers.Gemma3TextConfig(
                **{**common, "num_hidden_layers": 7, "num_key_value_heads": 1},
                head_dim=32,
                query_pre_attn_scalar=32,
                # Shorter than the prompt, so that the window cuts both the prompt's
                # rows and the generated ones; layers 0-4 and 6 are local, 5 global.
                sliding_window=8,
                layer_types=["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                },
                tie_word_embeddings=True,
            ),
            transformers.Gemma3ForCausalLM,
        ),
        (
            "phi3",
            "phi3",
            "gpt2",
            transformers.Phi3Config(
                **{k: v for k, v in common.items() if k != "max_position_embeddings"},
                max_position_embeddings=256,
                original_max_position_embeddings=256,
                # Shorter than the prompt: every layer's window cuts it.
                sliding_window=8,
                tie_word_embeddings=False,
                pad_token_id=0,
                bos_token_id=0,
                eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            ),
            transformers.Phi3ForCausalLM,
        ),
        # Phi-4-mini-style: LongRoPE over partial rotary embeddings (12 of 16 head
        # dimensions), no window. Trained for 8 positions, stretched to 256: every
        # sequence here is longer than 8, so transformers rotates with the long factors
        # and the attention factor √(1 + ln 32 / ln 8), as a worker serving more than
        # the original context does. Then the same kind of model served within its
        # original context: the short factors, no attention factor.
        ("phi3-longrope", "phi3", "gpt2", longrope_config(common, 8, tied=True), transformers.Phi3ForCausalLM),
        ("phi3-longrope-short", "phi3", "gpt2", longrope_config(common, 256, tied=False), transformers.Phi3ForCausalLM),
    ]


def longrope_config(common: dict, original: int, tied: bool):
    """A Phi-3 configuration with LongRoPE (see `longrope`), its context 256."""
    return transformers.Phi3Config(
        **{k: v for k, v in common.items() if k != "max_position_embeddings"},
        max_position_embeddings=256,
        original_max_position_embeddings=original,
        sliding_window=None,
        tie_word_embeddings=tied,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=2,
        rope_parameters=longrope(original),
    )


def longrope(original: int) -> dict:
    """Phi-3's LongRoPE over 12 of the 16 head dimensions: six frequency divisors for
    contexts past `original` and six within it (uneven, so that a set read in the
    wrong order or the wrong set shows)."""
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": original,
        "long_factor": [1.0, 1.7, 3.1, 5.3, 9.7, 16.0],
        "short_factor": [1.0, 1.1, 1.3, 1.2, 1.6, 2.1],
    }


def rope_theta(cfg) -> float:
    """The RoPE base of the global layers."""
    p = cfg.rope_parameters
    return p.get("full_attention", p)["rope_theta"]


@torch.no_grad()
def randomize_vectors(model) -> None:
    """transformers starts biases at zero and norm weights at one, which would hide a bias
    never added or a norm weight in the wrong order: give them random values."""
    for name, p in model.named_parameters():
        if p.ndim == 1:
            base = 0.0 if name.endswith(".bias") else 1.0
            p.copy_(base + 0.3 * torch.randn_like(p))


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows reordered so RoPE pairs are adjacent."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg) -> np.ndarray:
    """`rope_freqs.weight` as llama.cpp's converter computes it for llama3 RoPE scaling."""
    p = cfg.rope_parameters
    base, dim = p["rope_theta"], cfg.head_dim
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def quantized(name: str, arr: np.ndarray) -> bool:
    """What the Q8_0 file stores in blocks: matrices and the embedding."""
    return arr.ndim == 2


def write_gguf(path: Path, arch: str, pre: str, cfg, tensors: dict[str, np.ndarray], q8: bool) -> None:
    w = gguf.GGUFWriter(path, arch=arch)
    w.add_name(f"tiny {path.stem}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope = cfg.rope_parameters
    rope = rope.get("full_attention", rope)
    # As llama.cpp's converter counts them: int(fraction · hidden) // heads.
    rot = int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads
    w.add_rope_dimension_count(rot if rope.get("rope_type") == "longrope" else head_dim)
    w.add_rope_freq_base(rope_theta(cfg))
    if rope.get("rope_type") == "longrope":
        # The converter's LongRoPE keys: the original context and the attention factor.
        original = rope["original_max_position_embeddings"]
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)
    if arch in ("gemma3", "phi3"):
        # A model without a window writes 0, as the converter does for Phi-4.
        w.add_sliding_window(cfg.sliding_window or 0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(VOCAB)
    tokens, types, merges = vocabulary()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    for name, arr in tensors.items():
        if q8 and quantized(name, arr):
            w.add_tensor(name, gguf.quants.quantize(arr, T.Q8_0), raw_dtype=T.Q8_0)
        else:
            w.add_tensor(name, arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_tensors(arch: str, model, cfg) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's names, laid out as its converter writes them."""
    model_arch = {
        "llama": gguf.MODEL_ARCH.LLAMA,
        "qwen2": gguf.MODEL_ARCH.QWEN2,
        "qwen3": gguf.MODEL_ARCH.QWEN3,
        "gemma3": gguf.MODEL_ARCH.GEMMA3,
        "phi3": gguf.MODEL_ARCH.PHI3,
    }[arch]
    names = gguf.get_tensor_name_map(model_arch, cfg.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for hf_name, t in model.state_dict().items():
        if cfg.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        arr = t.detach().to(torch.float32).numpy().copy()
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise SystemExit(f"no GGUF name for {hf_name}")
        if arch == "gemma3" and name.endswith("norm.weight"):
            # Gemma's RMSNorm scales by 1 + w; the converter stores 1 + w.
            arr = arr + 1.0
        if arch == "llama":
            if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                arr = permute(arr, cfg.num_attention_heads)
            elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                arr = permute(arr, cfg.num_key_value_heads)
        out[name] = arr
    if cfg.rope_parameters.get("rope_type") == "llama3":
        out["rope_freqs.weight"] = llama3_rope_factors(cfg)
    if cfg.rope_parameters.get("rope_type") == "longrope":
        out["rope_factors_long.weight"] = np.array(cfg.rope_parameters["long_factor"], dtype=np.float32)
        out["rope_factors_short.weight"] = np.array(cfg.rope_parameters["short_factor"], dtype=np.float32)
    return out


@torch.no_grad()
def reference(model, prompt: list[int]) -> dict:
    ids = torch.tensor([prompt])
    logits = model(ids).logits[0, -1]
    last = logits.tolist()
    greedy, margins = [], []
    seq = list(prompt)
    for _ in range(GREEDY):
        out = model(torch.tensor([seq])).logits[0, -1]
        top = torch.topk(out, 2)
        margins.append(float(top.values[0] - top.values[1]))
        nxt = int(torch.argmax(out))
        greedy.append(nxt)
        seq.append(nxt)
    return {"last_logits": last, "greedy_ids": greedy, "margins": margins, "min_margin": min(margins)}


@torch.no_grad()
def with_q8_weights(model, tensors_q8: dict[str, np.ndarray]) -> None:
    """Replaces every weight the Q8_0 file quantizes by its Q8_0 values."""
    for _, p in model.named_parameters():
        arr = p.detach().numpy()
        if arr.ndim == 2:
            q = gguf.quants.dequantize(gguf.quants.quantize(arr, T.Q8_0), T.Q8_0)
            p.copy_(torch.from_numpy(np.ascontiguousarray(q, dtype=np.float32)))


def main() -> None:
    repo = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=repo / "worker/tests/fixtures/arch")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    models = []
    for name, arch, pre, cfg, cls in families():
        cfg._attn_implementation = "eager"
        model = cls(cfg).eval().to(torch.float32)
        randomize_vectors(model)
        tensors = gguf_tensors(arch, model, cfg)
        files = {"f32": f"{name}.f32.gguf", "q8_0": f"{name}.q8_0.gguf"}
        write_gguf(out / files["f32"], arch, pre, cfg, tensors, q8=False)
        write_gguf(out / files["q8_0"], arch, pre, cfg, tensors, q8=True)
        q8_model = cls(cfg).eval().to(torch.float32)
        q8_model.load_state_dict(model.state_dict())
        with_q8_weights(q8_model, tensors)
        # A prompt whose greedy steps are all clear of exact ties (a step decided by less
        # than float32 rounding could go either way in any implementation).
        for _ in range(50):
            prompt = [int(x) for x in rng.integers(3, VOCAB, size=PROMPT)]
            refs = {"f32": reference(model, prompt), "q8_0": reference(q8_model, prompt)}
            if min(r["min_margin"] for r in refs.values()) >= MIN_MARGIN:
                break
        else:
            raise SystemExit(f"{name}: no prompt keeps every greedy step {MIN_MARGIN} from a tie")
        for fmt, r in refs.items():
            print(f"{name} {fmt}: greedy {r['greedy_ids'][:8]}..., min margin {r['min_margin']:.4f}")
        models.append({"name": name, "arch": arch, "pre": pre, "files": files, "prompt_ids": prompt, "reference": refs})
    source = {
        "script": "scripts/arch_fixtures.py",
        "seed": SEED,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "gguf": getattr(gguf, "__version__", "unknown"),
    }
    (out / "reference.json").write_text(json.dumps({"source": source, "models": models}, indent=1) + "\n")


if __name__ == "__main__":
    main()
