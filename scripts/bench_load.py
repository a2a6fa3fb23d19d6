"""The load benchmark behind scripts/bench-load (run that script, not this file).

Starts a local cluster per worker count, drives it with closed-loop streaming chat
requests at several concurrencies and with an overload burst, and reports tokens/s,
time to first token, inter-token latency, 429s and the coordinator's peak RSS.
"""

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values, p):
    """Nearest-rank percentile of `values` (NaN when empty)."""
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, round(p / 100 * (len(v) - 1)))]


def prompt(i):
    # Same text as baton_worker::bench::serving_prompt.
    return f"Request {i}: write a short story about a lighthouse keeper and the sea."


class Cluster:
    """nats-server, one coordinator and `workers` workers, stopped on exit."""

    runs = 0

    def __init__(self, args, workers):
        self.args, self.workers = args, workers
        self.dir = tempfile.TemporaryDirectory(prefix="baton-load.")
        self.procs = []

    def spawn(self, name, cmd, env=None):
        log = open(os.path.join(self.dir.name, f"{name}.log"), "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, **(env or {})}, start_new_session=True)
        self.procs.append((name, p))
        return p

    def __enter__(self):
        nats_port, http_port = free_port(), free_port()
        nats = f"nats://127.0.0.1:{nats_port}"
        self.url = f"http://127.0.0.1:{http_port}"
        self.port = http_port
        self.spawn("nats", ["nats-server", "-a", "127.0.0.1", "-p", str(nats_port)])
        time.sleep(0.3)
        threads = self.args.threads or max(1, (os.cpu_count() or 1) // self.workers)
        for w in range(self.workers):
            self.spawn(f"worker-{w}", [
                f"{self.args.bin}/baton-worker", "serve", "--nats-url", nats,
                "--model", self.args.model, "--model-name", "bench",
                "--compute-threads", str(threads)]
                + (["--compute-priority", self.args.compute_priority]
                   if self.args.compute_priority else []))
        self.coordinator = self.spawn("coordinator", [
            f"{self.args.bin}/baton-coordinator", "--nats-url", nats,
            "--listen", f"127.0.0.1:{http_port}",
            "--store", os.path.join(self.dir.name, "store")])
        deadline = time.time() + 60
        while time.time() < deadline:
            for name, p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited; log in {self.dir.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as r:
                    if json.load(r).get("workers") == self.workers:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the cluster did not become healthy in 60 s")

    def peak_rss_mib(self, p):
        with open(f"/proc/{p.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def __exit__(self, *exc):
        # The cluster is thrown away: workers are killed (a drain would finish every
        # queued request first), then the coordinator and NATS are stopped.
        for name, p in sorted(self.procs, key=lambda x: x[0] == "nats"):
            if p.poll() is None:
                p.send_signal(signal.SIGKILL if name.startswith("worker") else signal.SIGTERM)
        for _, p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.args.logs:
            Cluster.runs += 1
            dest = os.path.join(self.args.logs, f"run-{Cluster.runs}-{self.workers}w")
            shutil.copytree(self.dir.name, dest, ignore=shutil.ignore_patterns("store"))
        self.dir.cleanup()


async def request(port, i, max_tokens, on_chunk):
    """One streaming chat request; returns its HTTP status. `on_chunk(t, sent)` is
    called with the arrival time of every content chunk and the time the request was
    sent (connection set-up excluded, as in scripts/bench-serving)."""
    body = json.dumps({
        "model": "bench", "messages": [{"role": "user", "content": prompt(i)}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
    }).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    try:
        sent = time.perf_counter()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nConnection: close\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        status_line = await reader.readline()
        parts = status_line.split()
        status = int(parts[1]) if len(parts) > 1 else 0
        if status != 200:
            return status
        pending = b""
        while True:
            line = await reader.readline()
            if not line:
                break
            # SSE lines arrive inside chunked transfer encoding; a data line may span
            # chunks.
            if pending or line.startswith(b"data: {"):
                pending += line.rstrip(b"\r\n")
                try:
                    chunk = json.loads(pending[6:])
                except ValueError:
                    continue
                pending = b""
                choices = chunk.get("choices") or []
                if choices and choices[0].get("delta", {}).get("content"):
                    on_chunk(time.perf_counter(), sent)
            elif line.startswith(b"data: [DONE]"):
                break
        return status
    finally:
        writer.close()


async def closed_loop(port, concurrency, warmup, duration, max_tokens):
    """`concurrency` clients, each sending its next request when the last one ends.
    Figures cover what arrives in [warmup, warmup + duration] from the start: tokens,
    gaps between two tokens of a stream, and first tokens (TTFT from the request's
    send time, whenever that was: under queueing it is before the window)."""
    t0 = time.perf_counter()
    start, end = t0 + warmup, t0 + warmup + duration
    tokens, ttft, gaps, rejected, errors, done = [0], [], [], [0], [0], [0]
    counter = [0]
    other = {}

    async def client():
        while time.perf_counter() < end:
            i = counter[0]
            counter[0] += 1
            last = [None]

            def on_chunk(t, sent):
                if start <= t <= end:
                    tokens[0] += 1
                    if last[0] is not None and last[0] >= start:
                        gaps.append((t - last[0]) * 1e3)
                if last[0] is None and start <= t <= end:
                    ttft.append((t - sent) * 1e3)
                last[0] = t

            status = await request(port, i, max_tokens, on_chunk)
            if status == 429:
                if start <= time.perf_counter() <= end:
                    rejected[0] += 1
                await asyncio.sleep(0.05)
            elif status != 200:
                errors[0] += 1
                other[str(status)] = other.get(str(status), 0) + 1
                await asyncio.sleep(0.05)
            elif start <= time.perf_counter() <= end:
                done[0] += 1

    tasks = [asyncio.create_task(client()) for _ in range(concurrency)]
    await asyncio.sleep(max(0.0, end - time.perf_counter()))
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "concurrency": concurrency, "tok_s": tokens[0] / duration,
        "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
        "itl_p50_ms": pct(gaps, 50), "itl_p99_ms": pct(gaps, 99),
        "rejected": rejected[0], "errors": errors[0], "error_statuses": other,
        "completed": done[0],
    }


def closed_loop_native(binary, port, concurrency, warmup, duration, max_tokens):
    """`closed_loop` run by `baton-loadgen closed` (one blocking thread a client, kept-alive
    connections): the same figures, at a fraction of the client's CPU per token, which on
    a machine shared with the cluster comes out of what is measured."""
    out = subprocess.run(
        [binary, "closed", str(port), str(concurrency), str(warmup), str(duration),
         str(max_tokens)],
        capture_output=True, text=True, timeout=warmup + duration + 120, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
        if r[key] is None:
            r[key] = float("nan")
    return r


async def burst(port, n, max_tokens):
    """`n` requests at once; counts what each got."""
    statuses = []

    async def one(i):
        got = [0]
        try:
            status = await request(port, 100_000 + i, max_tokens,
                                   lambda _t, _s: got.__setitem__(0, got[0] + 1))
        except OSError:
            status = -1
        statuses.append((status, got[0]))

    t = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t
    kinds = {}
    for s, g in statuses:
        key = "200 without tokens" if s == 200 and g == 0 else str(s)
        kinds[key] = kinds.get(key, 0) + 1
    return {
        "requests": n, "completed": sum(1 for s, g in statuses if s == 200 and g > 0),
        "rejected": sum(1 for s, _ in statuses if s == 429),
        "other": sum(1 for s, g in statuses if s != 429 and not (s == 200 and g > 0)),
        "statuses": kinds, "seconds": wall,
    }


def series(r):
    return (f"{r['workers']} worker" + ("s" if r["workers"] > 1 else "")
            + f" x {r['threads']} thread" + ("s" if r["threads"] > 1 else ""))


def plot(results, path, model):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for i, r in enumerate(results):
        pts = r["points"]
        xs = [p["concurrency"] for p in pts]
        label, color = series(r), f"C{i}"
        axes[0].plot(xs, [p["tok_s"] for p in pts], "o-", color=color, label=label)
        for ax, key in [(axes[1], "ttft"), (axes[2], "itl")]:
            for name, style in [("p50", "o-"), ("p99", "s--")]:
                ax.plot(xs, [p[f"{key}_{name}_ms"] for p in pts], style, color=color,
                        label=f"{label} {name}")
    titles = ["aggregate tokens/s", "time to first token (ms)", "inter-token latency (ms)"]
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xticks([p["concurrency"] for p in results[0]["points"]])
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent streams (closed loop)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylim(bottom=0)
    for ax in axes[1:]:
        ax.set_yscale("log")
        ax.get_yaxis().set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
        ax.get_yaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.get_yaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.suptitle(f"Baton under closed-loop load: {model}, CPU workers, streaming chat")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--duration", type=float, default=25.0,
                    help="measured seconds per point")
    ap.add_argument("--warmup", type=float, default=4.0,
                    help="seconds per point before measuring")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--burst-factor", type=int, default=10)
    ap.add_argument("--burst-max-tokens", type=int, default=16)
    ap.add_argument("--plot", default="docs/load.png")
    ap.add_argument("--json", default=None, help="write the raw figures here")
    ap.add_argument("--logs", default=None, help="keep every cluster's logs here")
    ap.add_argument("--include", action="append", default=[],
                    help="figures of an earlier run (its --json) to show beside these")
    ap.add_argument("--threads", type=int, default=0,
                    help="compute threads per worker (0: cores / workers)")
    ap.add_argument("--compute-priority", default=None, choices=["idle", "normal"],
                    help="the workers' compute threads' class (default: cluster.toml's)")
    ap.add_argument("--client", default="native", choices=["native", "python"],
                    help="closed loops by baton-loadgen (native, the default) or by this "
                         "script's asyncio client (python: ~70 us of CPU per token, taken "
                         "from the cores the cluster runs on)")
    args = ap.parse_args()
    conc = [int(c) for c in args.concurrency.split(",")]
    try:
        with open("cluster.toml", "rb") as f:
            max_running = tomllib.load(f).get("worker", {}).get("max_running", 16)
    except FileNotFoundError:
        max_running = 16

    # A fresh cluster for every point: streams cut off at the end of a point would
    # otherwise stay queued on the workers (nothing tells the coordinator that a client
    # whose stream has not started yet went away) and load the next point.
    results = []
    for workers in [int(w) for w in args.workers.split(",") if w]:
        print(f"==> {workers} worker(s)", file=sys.stderr)
        points = []
        for c in conc:
            with Cluster(args, workers) as cluster:
                if args.client == "native":
                    p = closed_loop_native(os.path.join(args.bin, "baton-loadgen"),
                                           cluster.port, c, args.warmup, args.duration,
                                           args.max_tokens)
                else:
                    p = asyncio.run(closed_loop(cluster.port, c, args.warmup, args.duration,
                                                args.max_tokens))
                p["client"] = args.client
                p["coordinator_peak_rss_mib"] = cluster.peak_rss_mib(cluster.coordinator)
            print(f"    c={c}: {p}", file=sys.stderr)
            points.append(p)
        n = args.burst_factor * workers * max_running
        b = None
        if n > 0:
            with Cluster(args, workers) as cluster:
                b = asyncio.run(burst(cluster.port, n, args.burst_max_tokens))
                b["coordinator_peak_rss_mib"] = cluster.peak_rss_mib(cluster.coordinator)
            print(f"    burst: {b}", file=sys.stderr)
        threads = args.threads or max(1, (os.cpu_count() or 1) // workers)
        results.append({"workers": workers, "threads": threads, "points": points,
                        "burst": b})
    for path in args.include:
        with open(path) as f:
            results.extend(json.load(f))

    print("\n| workers x threads | streams | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
          "| ITL p99 ms | completed | 429 |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        for p in r["points"]:
            print(f"| {r['workers']} x {r['threads']} | {p['concurrency']} | {p['tok_s']:.1f} "
                  f"| {p['ttft_p50_ms']:.0f} | {p['ttft_p99_ms']:.0f} "
                  f"| {p['itl_p50_ms']:.0f} | {p['itl_p99_ms']:.0f} "
                  f"| {p['completed']} | {p['rejected']} |")
    print("\n| workers | burst requests | completed | 429 | other | seconds "
          "| coordinator peak RSS: burst / closed loops |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        b = r["burst"]
        if b is None:
            continue
        loops = max(p["coordinator_peak_rss_mib"] for p in r["points"])
        print(f"| {r['workers']} | {b['requests']} | {b['completed']} | {b['rejected']} "
              f"| {b['other']} | {b['seconds']:.1f} "
              f"| {b['coordinator_peak_rss_mib']:.0f} / {loops:.0f} MiB |")
    print()
    for r in results:
        by_c = {p["concurrency"]: p["tok_s"] for p in r["points"]}
        if r["workers"] == 1 and 1 in by_c and 16 in by_c and by_c[1] > 0:
            print(f"{series(r)}: 16 streams / 1 stream tokens/s = {by_c[16] / by_c[1]:.2f}")
    for one in (r for r in results if r["workers"] == 1):
        for two in (r for r in results if r["workers"] == 2):
            for a, b in zip(one["points"], two["points"]):
                if a["tok_s"] > 0:
                    print(f"{series(two)} / {series(one)} tokens/s at "
                          f"{a['concurrency']} streams = {b['tok_s'] / a['tok_s']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        plot(results, args.plot, os.path.basename(args.model).removesuffix(".gguf"))
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
