#!/usr/bin/env python3
"""Greedy references for the real models beyond the default one, from Hugging Face
`transformers` running the GGUF file itself (`from_pretrained(..., gguf_file=...)`
dequantizes every tensor to float32).

Usage:
    scripts/arch-fixtures --real         (makes the venv, fetches the models, runs this)
    python3 scripts/real_reference.py NAME=PATH... [--out DIR]

For each model: four prompts, each raw (the text as it is) and, when the file has a chat
template, as a chat (one user message through it, `apply_chat_template(...,
add_generation_prompt=True)`), tokenized by the tokenizer transformers builds from the
GGUF; 32 greedy tokens (argmax of float32 logits, eager attention, no EOS stop).

Writes `<DIR>/<NAME>.json` (default DIR `worker/tests/fixtures/real`): {"source",
"model": {"file", "sha256"}, "cases": [{"name", "kind", "prompt", "prompt_ids",
"greedy_ids", "margins", "last_logits_top"}]}; `margins[i]` is the best minus the
second-best logit at step `i`, `last_logits_top` the 20 largest logits after the prompt
as [id, value].
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
import transformers

GREEDY = 32
PROMPTS = [
    ("code", "def fibonacci(n):"),
    ("capital", "The capital of France is"),
    ("haiku", "Write a haiku about the sea."),
    ("hashmap", "Explain what a hash map is in one sentence."),
]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@torch.no_grad()
def greedy(model, ids: list[int]) -> tuple[list[int], list[float], list]:
    out, margins, top = [], [], None
    past = None
    inp = torch.tensor([ids])
    for step in range(GREEDY):
        res = model(inp, past_key_values=past, use_cache=True)
        past = res.past_key_values
        logits = res.logits[0, -1].to(torch.float32)
        if step == 0:
            t = torch.topk(logits, 20)
            top = [[int(i), float(v)] for v, i in zip(t.values, t.indices)]
        t2 = torch.topk(logits, 2)
        margins.append(float(t2.values[0] - t2.values[1]))
        nxt = int(torch.argmax(logits))
        out.append(nxt)
        inp = torch.tensor([[nxt]])
    return out, margins, top


def main() -> None:
    repo = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+", help="NAME=PATH of a GGUF file")
    parser.add_argument("--out", type=Path, default=repo / "worker/tests/fixtures/real")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    for spec in args.models:
        name, path = spec.split("=", 1)
        path = Path(path).resolve()
        tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        cases = []
        for label, text in PROMPTS:
            kinds = [("raw", text)]
            # A base model's file (Gemma-3-270M's) has no chat template: raw prompts only.
            if tok.chat_template is not None:
                chat = tok.apply_chat_template(
                    [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
                )
                kinds.append(("chat", chat))
            for kind, prompt in kinds:
                ids = tok(prompt, add_special_tokens=kind == "raw")["input_ids"]
                out, margins, top = greedy(model, ids)
                cases.append(
                    {
                        "name": f"{kind}_{label}",
                        "kind": kind,
                        "prompt": prompt,
                        "prompt_ids": ids,
                        "greedy_ids": out,
                        "greedy_text": tok.decode(out),
                        "margins": margins,
                        "last_logits_top": top,
                    }
                )
                print(f"{name} {kind}_{label}: {tok.decode(out)!r} (min margin {min(margins):.3f})")
        doc = {
            "source": {
                "script": "scripts/real_reference.py",
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "how": "transformers on the GGUF dequantized to float32, eager attention, greedy",
            },
            "model": {"file": path.name, "sha256": sha256(path)},
            "cases": cases,
        }
        (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
