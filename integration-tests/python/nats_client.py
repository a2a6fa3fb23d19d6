"""A client of Baton's public NATS API written with `nats-py` from docs/protocol.md.

Usage: nats_client.py NATS_URL MODEL CHAT_PROMPT TEXT_PROMPT MAX_TOKENS

Makes greedy requests over NATS — a streamed text completion, a whole text completion,
a streamed chat completion, a replay of the streamed completion after its third chunk,
a status request and a request for an unknown model — checks the headers the protocol
promises on every message, and prints one JSON object with what it got.
"""

import asyncio
import json
import sys

import nats

PREFIX = "baton"
TIMEOUT = 120.0


class ProtocolError(Exception):
    pass


async def ask(nc, subject, body):
    """Subscribes to a fresh inbox, publishes `body` with it as reply subject."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject, json.dumps(body).encode(), reply=inbox,
                     headers={"Content-Type": "application/json"})
    return sub


async def read_answer(sub):
    """Reads messages until Baton-Final or Baton-Error; checks Baton-Seq has no gap."""
    messages = []
    while True:
        msg = await sub.next_msg(timeout=TIMEOUT)
        headers = msg.headers or {}
        seq = int(headers.get("Baton-Seq", "-1"))
        if seq != len(messages):
            raise ProtocolError(f"Baton-Seq {seq}, expected {len(messages)}")
        body = json.loads(msg.data)
        messages.append((headers, body))
        if headers.get("Baton-Error") or headers.get("Baton-Final") == "true":
            await sub.unsubscribe()
            return messages


def chunk_text(body):
    choice = body["choices"][0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def summarize_stream(messages):
    """Text, finish reason, usage and per-chunk positions of a streamed answer."""
    *chunks, (last_headers, last) = messages
    if last_headers.get("Baton-Error"):
        raise ProtocolError(f"stream failed: {last}")
    stream_ids = {h.get("Baton-Stream-Id") for h, _ in messages}
    if len(stream_ids) != 1 or None in stream_ids:
        raise ProtocolError(f"Baton-Stream-Id differs or is missing: {stream_ids}")
    positions = [int(h["Baton-Position"]) for h, _ in chunks]
    if positions != sorted(set(positions)):
        raise ProtocolError(f"positions not increasing: {positions}")
    return {
        "text": "".join(chunk_text(b) for _, b in chunks) + chunk_text(last),
        "finish_reason": last["choices"][0]["finish_reason"],
        "usage": last.get("usage"),
        "chunks": len(chunks),
        "texts": [chunk_text(b) for _, b in chunks],
        "positions": positions,
        "stream": stream_ids.pop(),
        "coordinator": last_headers.get("Baton-Coordinator"),
    }


async def main():
    url, model, chat_prompt, prompt, max_tokens = sys.argv[1:]
    max_tokens = int(max_tokens)
    nc = await nats.connect(url)
    out = {}
    greedy = {"model": model, "max_tokens": max_tokens, "temperature": 0}

    sub = await ask(nc, f"{PREFIX}.v1.completions", {**greedy, "prompt": prompt, "stream": True})
    completion = summarize_stream(await read_answer(sub))
    out["completion_stream"] = completion

    sub = await ask(nc, f"{PREFIX}.v1.completions", {**greedy, "prompt": prompt})
    [(headers, body)] = await read_answer(sub)
    out["completion"] = {
        "text": body["choices"][0]["text"],
        "finish_reason": body["choices"][0]["finish_reason"],
        "usage": body["usage"],
        "object": body["object"],
        "final": headers.get("Baton-Final"),
    }

    messages = [{"role": "user", "content": chat_prompt}]
    sub = await ask(nc, f"{PREFIX}.v1.chat.completions",
                    {**greedy, "messages": messages, "stream": True})
    out["chat_stream"] = summarize_stream(await read_answer(sub))

    # As if every message after the third chunk had been lost.
    after = completion["positions"][2]
    sub = await ask(nc, f"{PREFIX}.v1.streams.replay",
                    {"stream": completion["stream"], "after": after,
                     "coordinator": completion["coordinator"]})
    replayed = await read_answer(sub)
    out["replay"] = {
        "after": after,
        "text": summarize_stream(replayed)["text"],
        "positions": [int(h["Baton-Position"]) for h, _ in replayed[:-1]],
    }

    # Two choices, streamed: each message names its choice and the choice's own stream.
    sub = await ask(nc, f"{PREFIX}.v1.completions",
                    {**greedy, "prompt": prompt, "stream": True, "n": 2})
    both = await read_answer(sub)
    texts, streams = ["", ""], [set(), set()]
    for headers, body in both:
        if headers.get("Baton-Error"):
            raise ProtocolError(f"n = 2 failed: {body}")
        choice = int(headers["Baton-Choice"])
        if body["choices"][0]["index"] != choice:
            raise ProtocolError(f"Baton-Choice {choice} on choice {body['choices'][0]}")
        texts[choice] += chunk_text(body)
        streams[choice].add(headers["Baton-Stream-Id"])
    out["choices_stream"] = {"texts": texts, "streams": [sorted(s) for s in streams],
                             "usage": both[-1][1].get("usage")}
    sub = await ask(nc, f"{PREFIX}.v1.completions", {**greedy, "prompt": prompt, "n": 2})
    [(headers, body)] = await read_answer(sub)
    out["choices"] = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]

    sub = await ask(nc, f"{PREFIX}.v1.tokenize", {"model": model, "prompt": prompt})
    [(headers, tokens)] = await read_answer(sub)
    out["tokenize"] = tokens
    sub = await ask(nc, f"{PREFIX}.v1.detokenize", {"model": model, "tokens": tokens["tokens"]})
    [(headers, text)] = await read_answer(sub)
    out["detokenize"] = text

    sub = await ask(nc, f"{PREFIX}.v1.admin.status", {})
    [(headers, status)] = await read_answer(sub)
    out["status"] = status

    sub = await ask(nc, f"{PREFIX}.v1.chat.completions",
                    {"model": "no-such-model", "messages": messages, "stream": True})
    [(headers, body)] = await read_answer(sub)
    out["unknown_model"] = {"header": headers.get("Baton-Error"), "code": body["error"]["code"]}

    await nc.drain()
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
