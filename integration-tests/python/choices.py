"""`n` choices through the official `openai` client.

Usage: choices.py BASE_URL MODEL CASES_JSON

CASES_JSON holds `prompt` (a user message), `completion_prompt`, `max_tokens`, `n` and
`seed`. Prints one JSON object: each request's choices' texts in index order — seeded
chat twice, the same streamed (deltas joined per index), the same with `n: 1`, greedy
chat, and a seeded text completion.
"""

import json
import sys

import openai


def texts(r):
    return [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]


def streamed(stream, n):
    out = [""] * n
    finish = [None] * n
    for chunk in stream:
        for ch in chunk.choices:
            out[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    return {"texts": out, "finish": finish}


def main() -> None:
    base_url, model, cases = sys.argv[1:4]
    c = json.loads(cases)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    chat = {"model": model, "messages": [{"role": "user", "content": c["prompt"]}],
            "max_tokens": c["max_tokens"]}
    seeded = dict(chat, temperature=0.9, seed=c["seed"], n=c["n"])
    first = client.chat.completions.create(**seeded)
    out = {
        "seeded": [texts(first), texts(client.chat.completions.create(**seeded))],
        "usage": {"prompt": first.usage.prompt_tokens,
                  "completion": first.usage.completion_tokens},
        "streamed": streamed(client.chat.completions.create(stream=True, **seeded), c["n"]),
        "one": texts(client.chat.completions.create(**dict(seeded, n=1))),
        "greedy": texts(client.chat.completions.create(**dict(chat, temperature=0, n=c["n"]))),
    }
    r = client.completions.create(model=model, prompt=c["completion_prompt"],
                                  max_tokens=c["max_tokens"], temperature=0.9,
                                  seed=c["seed"], n=2)
    out["completion"] = [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
