"""Structured output through the official `openai` client.

Usage: structured_output.py BASE_URL MODEL SCHEMA_JSON MAX_TOKENS

Asks for chat answers held to SCHEMA_JSON with `response_format` (json_schema): twelve
prompts greedy (whole answers) and sampled with a seed (streamed), one seeded request
twice, a text completion with the schema (vLLM-style, in the body) streamed and whole,
a `guided_choice`, and a schema that cannot be used. Prints one JSON object with the
texts and finish reasons; the caller validates them.
"""

import json
import sys

import openai


def streamed(stream):
    text, reason = "", None
    for chunk in stream:
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            text += (delta.content if delta else choice.text) or ""
            reason = choice.finish_reason or reason
    return {"text": text, "finish_reason": reason}


def main() -> None:
    base_url, model, schema, max_tokens = sys.argv[1:5]
    schema = json.loads(schema)
    max_tokens = int(max_tokens)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": schema, "strict": True},
    }
    names = ["a sailor", "a baker", "a pilot", "a gardener", "a chess player",
             "a painter", "a nurse", "a miner", "a poet", "a judge", "a cook", "a diver"]
    out = {"greedy": [], "sampled": []}
    for i, who in enumerate(names):
        messages = [{"role": "user", "content": f"Describe {who} as JSON."}]
        r = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0,
            response_format=response_format,
        )
        out["greedy"].append({"text": r.choices[0].message.content,
                              "finish_reason": r.choices[0].finish_reason})
        out["sampled"].append(streamed(client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0.9,
            seed=100 + i, response_format=response_format, stream=True,
        )))
    again = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Describe {names[0]} as JSON."}],
        max_tokens=max_tokens, temperature=0.9, seed=100, response_format=response_format,
    )
    out["sampled_again"] = {"text": again.choices[0].message.content,
                            "finish_reason": again.choices[0].finish_reason}

    prompt = "A person, described as JSON: "
    c = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"response_format": response_format},
    )
    out["completion"] = {"text": c.choices[0].text, "finish_reason": c.choices[0].finish_reason}
    out["completion_stream"] = streamed(client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"response_format": response_format},
    ))

    choice = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Is the sea wet?"}],
        max_tokens=8, temperature=0.9, seed=3,
        extra_body={"guided_choice": ["yes", "no", "maybe"]},
    )
    out["choice"] = {"text": choice.choices[0].message.content,
                     "finish_reason": choice.choices[0].finish_reason}

    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "bad", "schema": {"type": "objekt"}}},
        )
        out["bad_schema"] = None
    except openai.BadRequestError as e:
        out["bad_schema"] = {"status": e.status_code, "code": e.code, "param": e.param,
                             "message": str(e)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
