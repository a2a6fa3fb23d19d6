"""Drives a Baton coordinator with the official `openai` client.

Usage: openai_client.py BASE_URL MODEL CHAT_PROMPT TEXT_PROMPT MAX_TOKENS [API_KEY]

Makes four greedy requests (chat completions for CHAT_PROMPT as one user message, text
completions for TEXT_PROMPT; each streamed and not), lists the models, asks for an
unknown model, and prints one JSON object: for each request the text, the finish reason
and, when not streamed, the usage. With API_KEY the requests carry it, and one more
request with another key records how it is refused.
"""

import json
import sys

import openai


def main() -> None:
    base_url, model, chat_prompt, prompt, max_tokens = sys.argv[1:6]
    api_key = sys.argv[6] if len(sys.argv) > 6 else None
    client = openai.OpenAI(
        base_url=base_url + "/v1", api_key=api_key or "unused", max_retries=0
    )
    max_tokens = int(max_tokens)
    messages = [{"role": "user", "content": chat_prompt}]
    out = {}

    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0
    )
    out["chat"] = {
        "text": chat.choices[0].message.content,
        "role": chat.choices[0].message.role,
        "finish_reason": chat.choices[0].finish_reason,
        "usage": chat.usage.model_dump() if chat.usage else None,
        "object": chat.object,
    }

    text, reason, chunks = "", None, 0
    for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
    ):
        chunks += 1
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    out["chat_stream"] = {"text": text, "finish_reason": reason, "chunks": chunks}

    completion = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    out["completion"] = {
        "text": completion.choices[0].text,
        "finish_reason": completion.choices[0].finish_reason,
        "usage": completion.usage.model_dump() if completion.usage else None,
        "object": completion.object,
    }

    text, reason, chunks = "", None, 0
    for chunk in client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    ):
        chunks += 1
        for choice in chunk.choices:
            text += choice.text or ""
            reason = choice.finish_reason or reason
    out["completion_stream"] = {"text": text, "finish_reason": reason, "chunks": chunks}

    models = client.models.list()
    out["models"] = [m.id for m in models.data]

    try:
        client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=4)
        out["unknown_model"] = None
    except openai.NotFoundError as e:
        out["unknown_model"] = {"status": e.status_code, "code": e.code}

    if api_key:
        wrong = openai.OpenAI(
            base_url=base_url + "/v1", api_key=api_key + "-wrong", max_retries=0
        )
        try:
            wrong.models.list()
            out["wrong_key"] = None
        except openai.AuthenticationError as e:
            out["wrong_key"] = {"status": e.status_code, "code": e.code}

    print(json.dumps(out))


if __name__ == "__main__":
    main()
