"""Tool calling through the official `openai` client.

Usage: tools.py BASE_URL MODEL CASES_JSON

CASES_JSON holds `prompt` (a user message), `tools` (OpenAI's array), `max_tokens`,
`named` (the function a named choice asks for) and `result` (what the tool answers in
the conversation). Prints one JSON object: for `tool_choice: "required"` and a named
function, the whole answer and the streamed one (its deltas joined as OpenAI's
clients join them); a seeded sampled call twice; and the second turn of a conversation
that carries the first turn's call and the tool's result.
"""

import json
import sys

import openai


def whole(r):
    c = r.choices[0]
    return {
        "content": c.message.content,
        "finish_reason": c.finish_reason,
        "tool_calls": [
            {"id": t.id, "type": t.type, "name": t.function.name,
             "arguments": t.function.arguments}
            for t in (c.message.tool_calls or [])
        ],
        "prompt_tokens": r.usage.prompt_tokens,
    }


def streamed(stream):
    calls = {}
    content = ""
    finish = None
    for chunk in stream:
        for ch in chunk.choices:
            if ch.delta.content:
                content += ch.delta.content
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": None, "type": None, "name": "",
                                               "arguments": ""})
                if d.id:
                    c["id"] = d.id
                if d.type:
                    c["type"] = d.type
                if d.function is not None:
                    c["name"] += d.function.name or ""
                    c["arguments"] += d.function.arguments or ""
            if ch.finish_reason:
                finish = ch.finish_reason
    return {"content": content or None, "finish_reason": finish,
            "tool_calls": [calls[i] for i in sorted(calls)]}


def main() -> None:
    base_url, model, cases = sys.argv[1:4]
    cases = json.loads(cases)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": cases["prompt"]}]
    common = {"model": model, "messages": messages, "tools": cases["tools"],
              "max_tokens": cases["max_tokens"], "temperature": 0,
              "parallel_tool_calls": False}
    named = {"type": "function", "function": {"name": cases["named"]}}
    out = {}
    for name, choice in [("required", "required"), ("named", named)]:
        out[name + "_whole"] = whole(client.chat.completions.create(
            tool_choice=choice, **common))
        out[name + "_stream"] = streamed(client.chat.completions.create(
            tool_choice=choice, stream=True, **common))
    sampled = dict(common, temperature=0.9, seed=5)
    out["seeded"] = [whole(client.chat.completions.create(tool_choice="required", **sampled))
                     for _ in range(2)]
    first = out["required_whole"]
    call = first["tool_calls"][0]
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": cases["result"]},
    ]
    out["answer"] = whole(client.chat.completions.create(
        **dict(common, messages=history, tool_choice="auto")))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
