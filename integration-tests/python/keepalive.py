"""A streamed chat through the official `openai` client, slow enough that the
coordinator sends keep-alive comments between its events.

Usage: keepalive.py BASE_URL MODEL MAX_TOKENS

Prints one JSON object: the text the deltas spell, how many chunks carried content,
and the finish reason.
"""

import json
import sys

import openai


def main() -> None:
    base_url, model, max_tokens = sys.argv[1:4]
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    text, chunks, finish = "", 0, None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "keep talking"}],
        max_tokens=int(max_tokens), stream=True)
    for chunk in stream:
        for ch in chunk.choices:
            if ch.delta.content:
                text += ch.delta.content
                chunks += 1
            if ch.finish_reason:
                finish = ch.finish_reason
    print(json.dumps({"text": text, "chunks": chunks, "finish": finish}))


if __name__ == "__main__":
    main()
