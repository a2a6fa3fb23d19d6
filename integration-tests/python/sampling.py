"""Logprobs and the sampling fields through the official `openai` client.

Usage: sampling.py BASE_URL MODEL CASES_JSON

CASES_JSON holds `prompt` (a chat message), `max_tokens`, `top` (alternatives per
token), `completion_prompt`, and the requests' extra fields: `bias` (a `logit_bias`),
`stop_ids` (`stop_token_ids`), `min_tokens_prompt`, `min_tokens`, `sampled` (penalties,
`min_p`, a seed) and `outside` (a `logit_bias` naming a token past the vocabulary).
Prints one JSON object with what came back; the caller compares it with the engine's
own answers.
"""

import json
import sys

import openai


def entries(logprobs):
    """Chat logprobs entries as plain dicts."""
    if logprobs is None:
        return None
    return [
        {"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
         "top": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes}
                 for t in e.top_logprobs]}
        for e in logprobs.content
    ]


def completion_logprobs(lp):
    return {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs,
            "top_logprobs": lp.top_logprobs, "text_offset": lp.text_offset}


def streamed_completion(stream):
    """A streamed text completion's text and its chunks' logprobs, joined."""
    parts = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    for chunk in stream:
        for ch in chunk.choices:
            text += ch.text
            if ch.logprobs is not None:
                for k, v in completion_logprobs(ch.logprobs).items():
                    parts[k] += v
    return {"text": text, "logprobs": parts}


def chat_answer(r):
    c = r.choices[0]
    details = r.usage.prompt_tokens_details
    return {"text": c.message.content, "finish_reason": c.finish_reason,
            "prompt_tokens": r.usage.prompt_tokens,
            "completion_tokens": r.usage.completion_tokens,
            "cached_tokens": details.cached_tokens if details else None,
            "logprobs": entries(c.logprobs)}


def main() -> None:
    base_url, model, cases = sys.argv[1:4]
    cases = json.loads(cases)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": cases["prompt"]}]
    max_tokens = cases["max_tokens"]
    out = {}

    # Chat logprobs, whole and streamed.
    out["chat"] = chat_answer(client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0,
        logprobs=True, top_logprobs=cases["top"]))
    text, streamed, reason, chunks = "", [], None, 0
    for chunk in client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0,
            logprobs=True, top_logprobs=cases["top"], stream=True):
        for c in chunk.choices:
            chunks += 1
            text += c.delta.content or ""
            reason = c.finish_reason or reason
            streamed += entries(c.logprobs) or []
    out["chat_stream"] = {"text": text, "finish_reason": reason, "logprobs": streamed}
    plain = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    out["chat_plain_logprobs"] = entries(plain.choices[0].logprobs)

    # Text completions: logprobs N, whole and streamed.
    c = client.completions.create(model=model, prompt=cases["completion_prompt"],
                                  max_tokens=max_tokens, temperature=0, logprobs=cases["top"])
    out["completion"] = {"text": c.choices[0].text,
                         "completion_tokens": c.usage.completion_tokens,
                         "logprobs": completion_logprobs(c.choices[0].logprobs)}
    out["completion_stream"] = streamed_completion(client.completions.create(
        model=model, prompt=cases["completion_prompt"], max_tokens=max_tokens,
        temperature=0, logprobs=cases["top"], stream=True))

    # echo: a prompt scored alone (max_tokens 0, as log-likelihood evaluations ask), and
    # echoed before its completion, whole and streamed.
    score = client.completions.create(model=model, prompt=cases["completion_prompt"],
                                      max_tokens=0, temperature=0, echo=True, logprobs=1)
    out["echo_score"] = {"text": score.choices[0].text,
                         "finish_reason": score.choices[0].finish_reason,
                         "completion_tokens": score.usage.completion_tokens,
                         "logprobs": completion_logprobs(score.choices[0].logprobs)}
    echoed = client.completions.create(model=model, prompt=cases["completion_prompt"],
                                       max_tokens=max_tokens, temperature=0, echo=True,
                                       logprobs=cases["top"])
    out["echo"] = {"text": echoed.choices[0].text,
                   "logprobs": completion_logprobs(echoed.choices[0].logprobs)}
    out["echo_stream"] = streamed_completion(client.completions.create(
        model=model, prompt=cases["completion_prompt"], max_tokens=max_tokens,
        temperature=0, echo=True, logprobs=cases["top"], stream=True))

    # The sampling fields.
    out["bias"] = chat_answer(client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0,
        logit_bias=cases["bias"]))
    out["stop_ids"] = chat_answer(client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0,
        extra_body={"stop_token_ids": cases["stop_ids"]}))
    short = [{"role": "user", "content": cases["min_tokens_prompt"]}]
    out["min_tokens_off"] = chat_answer(client.chat.completions.create(
        model=model, messages=short, max_tokens=max_tokens, temperature=0))
    out["min_tokens"] = chat_answer(client.chat.completions.create(
        model=model, messages=short, max_tokens=max_tokens, temperature=0,
        extra_body={"min_tokens": cases["min_tokens"]}))
    s = cases["sampled"]
    out["sampled"] = chat_answer(client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=s["temperature"],
        seed=s["seed"], presence_penalty=s["presence_penalty"],
        frequency_penalty=s["frequency_penalty"], extra_body={"min_p": s["min_p"]}))

    try:
        client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                       logit_bias=cases["outside"])
        out["outside"] = None
    except openai.BadRequestError as e:
        out["outside"] = {"status": e.status_code, "code": e.code, "message": str(e)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
