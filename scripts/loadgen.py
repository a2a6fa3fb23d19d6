#!/usr/bin/env python3
"""Open-loop load for a coordinator: request i is sent at i/rate seconds, streamed over
HTTP/1.1 SSE by a plain asyncio client, and measured from the moment it is written.

Connections are kept alive and reused, as an HTTP client library's pool does (the
`openai` package's does): a few are opened before the clock starts, a request takes the
one used last, and one is opened (outside the clock) when none is free.

Usage: loadgen.py PORT RATE REQUESTS MAX_TOKENS [LABEL]
Prints one line: `<label> rate=… requests=… tokens=… tok_s=… ttft_p50_ms=… ttft_p99_ms=…`
(the label defaults to "cluster"). Used by scripts/bench-serving and
scripts/bench-checkpoint.
"""
import asyncio, json, sys, time

port, total, max_tokens = int(sys.argv[1]), int(sys.argv[3]), int(sys.argv[4])
rate = float(sys.argv[2])
label = sys.argv[5] if len(sys.argv) > 5 else "cluster"

# Connections opened before the first request, and how long one may sit unused before it
# is closed here rather than reused (the server closes idle ones after a few seconds).
WARM_CONNECTIONS = 4
IDLE_LIMIT_S = 2.0


def prompt(i):
    # Same text as baton_worker::bench::serving_prompt.
    return f"Request {i}: write a short story about a lighthouse keeper and the sea."


class Pool:
    def __init__(self):
        self.idle = []  # (reader, writer, last used), most recently used last

    async def open(self):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return reader, writer

    async def take(self):
        now = time.perf_counter()
        while self.idle:
            reader, writer, used = self.idle.pop()
            if now - used < IDLE_LIMIT_S and not reader.at_eof():
                return reader, writer
            writer.close()
        return await self.open()

    def give(self, reader, writer):
        self.idle.append((reader, writer, time.perf_counter()))


async def read_head(reader):
    """The status line and headers; returns (status, headers)."""
    status = (await reader.readline()).split(b" ")
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(status[1]) if len(status) > 1 else 0, headers


async def body_pieces(reader, headers):
    """The body's bytes as they arrive: chunked transfer encoding, or Content-Length."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readline()  # the blank line after the last chunk
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    else:
        n = int(headers.get("content-length", "0"))
        if n:
            yield await reader.readexactly(n)


async def one(pool, i, ttft, counts):
    body = json.dumps({
        "model": "bench", "messages": [{"role": "user", "content": prompt(i)}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}).encode()
    reader, writer = await pool.take()
    # The clock starts when the request is written.
    start = time.perf_counter()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    status, headers = await read_head(reader)
    if status != 200:
        raise SystemExit(f"request {i}: HTTP {status}")
    first = None
    pending = b""
    async for piece in body_pieces(reader, headers):
        pending += piece
        # SSE events end with a blank line; one may span chunks.
        while b"\n\n" in pending:
            event, pending = pending.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    counts[0] += chunk["usage"]["completion_tokens"]
                if first is None and any(c.get("delta", {}).get("content")
                                         or c.get("text") for c in chunk.get("choices", [])):
                    first = time.perf_counter()
                    ttft.append((first - start) * 1e3)
    if headers.get("connection", "").lower() == "close":
        writer.close()
    else:
        pool.give(reader, writer)


async def main():
    pool = Pool()
    for conn in await asyncio.gather(*(pool.open() for _ in range(WARM_CONNECTIONS))):
        pool.give(*conn)
    ttft, counts = [], [0]
    t0 = time.perf_counter()

    async def at(i):
        await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
        await one(pool, i, ttft, counts)

    await asyncio.gather(*(at(i) for i in range(total)))
    wall = time.perf_counter() - t0
    ttft.sort()
    pct = lambda p: ttft[min(len(ttft) - 1, round(p / 100 * (len(ttft) - 1)))]
    print(f"{label} rate={rate} requests={total} tokens={counts[0]} "
          f"tok_s={counts[0] / wall:.1f} ttft_p50_ms={pct(50):.1f} ttft_p99_ms={pct(99):.1f}")


asyncio.run(main())
