#!/usr/bin/env python3
"""Chat templates of each family, rendered as transformers renders them.

Usage:
    python3 scripts/template_fixtures.py TEMPLATES_DIR [--out FILE]

TEMPLATES_DIR is llama.cpp's `models/templates` (the llama-cpp-python source package
carries it; `scripts/setup` extracts it into `$BATON_CACHE/llamacpp/templates`). For each
template below, a few conversations (a system message or not, several turns, the
generation prompt or not, a list of tools for templates that take one and, for those, a
history with an assistant's tool call of null content and the tool's result) are rendered
with transformers' own chat-template renderer (jinja2 with its extensions), with a fixed
`date_string` so that the templates that print a date do not print today's. Writes
`worker/tests/fixtures/templates/rendered.json` unless `--out` says otherwise:
{"source", "templates": [{"file", "sha256", "bos_token", "eos_token", "cases":
[{"name", "messages", "tools", "add_generation_prompt", "rendered"}]}]}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import transformers
from transformers.utils.chat_template_utils import render_jinja_template

# (file, bos_token, eos_token, takes tools)
TEMPLATES = [
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>", True),
    ("meta-llama-Llama-3.2-3B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>", True),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "", "<|im_end|>", True),
    ("Qwen-Qwen3-0.6B.jinja", "", "<|im_end|>", True),
    ("google-gemma-2-2b-it.jinja", "<bos>", "<eos>", False),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "<s>", "</s>", True),
    ("microsoft-Phi-3.5-mini-instruct.jinja", "<s>", "<|endoftext|>", False),
    ("HuggingFaceTB-SmolLM3-3B.jinja", "", "<|im_end|>", False),
]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name."}},
            "required": ["city"],
        },
    },
}


def conversations(
    with_system: bool, tools: bool, call_content: str | None = None
) -> list[tuple[str, list[dict], list | None, bool]]:
    system = [{"role": "system", "content": "You are a terse assistant."}] if with_system else []
    out = [
        ("one_turn", system + [{"role": "user", "content": "Hello!"}], None, True),
        (
            "two_turns",
            system
            + [
                {"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": "4."},
                {"role": "user", "content": "And 3 + 3?"},
            ],
            None,
            True,
        ),
        (
            "no_generation_prompt",
            system + [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
            None,
            False,
        ),
    ]
    if tools:
        out.append(("tools", system + [{"role": "user", "content": "Weather in Paris?"}], [WEATHER], True))
        # Mistral's template wants a tool call id of exactly 9 alphanumeric characters.
        call_id = "call9abcd"
        out.append(
            (
                "tool_history",
                system
                + [
                    {"role": "user", "content": "Weather in Paris?"},
                    {
                        "role": "assistant",
                        "content": call_content,
                        "tool_calls": [
                            {
                                "id": call_id,
                                "type": "function",
                                "function": {"name": WEATHER["function"]["name"], "arguments": {"city": "Paris"}},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": call_id, "content": "18°C, sunny."},
                ],
                [WEATHER],
                True,
            )
        )
    return out


def main() -> None:
    repo = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("templates", type=Path)
    parser.add_argument("--out", type=Path, default=repo / "worker/tests/fixtures/templates/rendered.json")
    args = parser.parse_args()
    entries = []
    for file, bos, eos, takes_tools in TEMPLATES:
        source = (args.templates / file).read_text()
        # Gemma's and Mistral Nemo's templates refuse a system message.
        with_system = not file.startswith(("google-gemma", "mistralai-Mistral-Nemo"))
        # Qwen3's template looks for '</think>' in an assistant's content, which fails on a
        # null content (a TypeError): its tool call comes with an empty content instead.
        call_content = "" if file.startswith("Qwen-Qwen3") else None
        cases = []
        for name, messages, tools, gen in conversations(with_system, takes_tools, call_content):
            rendered, _ = render_jinja_template(
                conversations=[messages],
                tools=tools,
                chat_template=source,
                add_generation_prompt=gen,
                bos_token=bos,
                eos_token=eos,
                date_string="02 Dec 2026",
            )
            cases.append(
                {"name": name, "messages": messages, "tools": tools, "add_generation_prompt": gen, "rendered": rendered[0]}
            )
        entries.append(
            {
                "file": file,
                "sha256": hashlib.sha256(source.encode()).hexdigest(),
                "bos_token": bos,
                "eos_token": eos,
                "cases": cases,
            }
        )
        print(f"{file}: {len(cases)} cases")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"source": {"script": "scripts/template_fixtures.py", "transformers": transformers.__version__}, "templates": entries}
    args.out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
