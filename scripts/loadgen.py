#!/usr/bin/env python3
"""Open-loop load for a coordinator: request i is sent at i/rate seconds, streamed over
HTTP/1.1 SSE by a plain asyncio client, and measured from the moment it is written.

Usage: loadgen.py PORT RATE REQUESTS MAX_TOKENS [LABEL]
Prints one line: `<label> rate=… requests=… tokens=… tok_s=… ttft_p50_ms=… ttft_p99_ms=…`
(the label defaults to "cluster"). Used by scripts/bench-serving and
scripts/bench-checkpoint.
"""
import asyncio, json, sys, time

port, total, max_tokens = int(sys.argv[1]), int(sys.argv[3]), int(sys.argv[4])
rate = float(sys.argv[2])
label = sys.argv[5] if len(sys.argv) > 5 else "cluster"
url = f"http://127.0.0.1:{port}/v1/chat/completions"

def prompt(i):
    # Same text as baton_worker::bench::serving_prompt.
    return f"Request {i}: write a short story about a lighthouse keeper and the sea."

async def one(i, ttft, counts):
    # A plain HTTP/1.1 client on asyncio streams: the least client overhead Python
    # offers, so the comparison measures the server path.
    body = json.dumps({
        "model": "bench", "messages": [{"role": "user", "content": prompt(i)}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    # The clock starts when the request is sent: connection set-up is the client's
    # choice (a keep-alive client pays it once), not part of the serving path.
    start = time.perf_counter()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nConnection: close\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    first = None
    pending = b""
    while True:
        line = await reader.readline()
        if not line:
            break
        # SSE lines arrive inside chunked transfer encoding; a data line may span chunks.
        if pending or line.startswith(b"data: {"):
            pending += line.rstrip(b"\r\n")
            try:
                chunk = json.loads(pending[6:])
            except ValueError:
                continue
            pending = b""
            if chunk.get("usage"):
                counts[0] += chunk["usage"]["completion_tokens"]
            if first is None and chunk.get("choices"):
                first = time.perf_counter()
                ttft.append((first - start) * 1e3)
    writer.close()

async def main():
    ttft, counts = [], [0]
    t0 = time.perf_counter()
    async def at(i):
        await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
        await one(i, ttft, counts)
    await asyncio.gather(*(at(i) for i in range(total)))
    wall = time.perf_counter() - t0
    ttft.sort()
    pct = lambda p: ttft[min(len(ttft) - 1, round(p / 100 * (len(ttft) - 1)))]
    print(f"{label} rate={rate} requests={total} tokens={counts[0]} "
          f"tok_s={counts[0] / wall:.1f} ttft_p50_ms={pct(50):.1f} ttft_p99_ms={pct(99):.1f}")

asyncio.run(main())
