//! `baton-loadgen`: open- or closed-loop load for a coordinator, measured from the
//! client's side.
//!
//! ```text
//! baton-loadgen PORT RATE REQUESTS MAX_TOKENS [LABEL] [--schedule FILE]
//! baton-loadgen closed PORT CONCURRENCY WARMUP_S DURATION_S MAX_TOKENS
//! ```
//!
//! Request *i* (a streamed chat completion, greedy, `ignore_eos`) is sent at *i*/RATE
//! seconds, or at the *i*-th offset of the schedule file (seconds from the start, one per
//! line; `baton-worker bench-serve --schedule` reads the same file), whatever else is
//! happening, each on a thread of its own. Connections are kept
//! alive and reused, as a client library's pool does: a few are opened before the clock
//! starts, a request takes the one used last, and one is opened (outside the clock) when
//! none is free. Time to first token runs from the moment the request is written to the
//! first chunk with text.
//!
//! Prints one line: `<label> rate=… requests=… tokens=… tok_s=… ttft_p50_ms=…
//! ttft_p99_ms=…` (the label defaults to `cluster`). `scripts/bench-serving` and
//! `scripts/bench-checkpoint` use it for the cluster side: a plain blocking client, so
//! that what is measured is the server's path and not the client's own overhead.
//!
//! `closed`: CONCURRENCY clients, each on a thread of its own, each sending its next
//! request as soon as the last one ends (a 429 or another failure: after 50 ms), for
//! WARMUP_S + DURATION_S seconds. What arrives inside the last DURATION_S counts: tokens
//! (content chunks), time to first token (from the request's write, whenever that was),
//! the gaps between two tokens of a stream, completions and refusals. Prints one JSON
//! object (`concurrency`, `tok_s`, `ttft_p50_ms`, `ttft_p99_ms`, `itl_p50_ms`,
//! `itl_p99_ms`, `rejected`, `errors`, `error_statuses`, `completed`) when the window
//! ends, and exits without waiting for the requests then in flight.
//! `scripts/bench-load` runs its closed loops with it: on a machine the cluster shares
//! with its client, a client that spends less per token takes less of the cores it
//! measures.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Connections opened before the first request.
const WARM_CONNECTIONS: usize = 4;
/// A connection unused for this long is closed rather than reused (the server closes
/// idle ones after a few seconds).
const IDLE_LIMIT: Duration = Duration::from_secs(2);

type Conn = BufReader<TcpStream>;

struct Pool {
    port: u16,
    idle: Mutex<Vec<(Conn, Instant)>>,
}

impl Pool {
    /// A pool for `127.0.0.1:port` holding `n` open connections, or why it cannot
    /// connect.
    fn warmed(port: u16, n: usize) -> Result<Arc<Pool>, String> {
        let pool = Arc::new(Pool {
            port,
            idle: Mutex::new(Vec::new()),
        });
        for _ in 0..n {
            let conn = pool
                .open()
                .map_err(|e| format!("cannot connect to 127.0.0.1:{port}: {e}"))?;
            pool.give(conn);
        }
        Ok(pool)
    }

    fn open(&self) -> std::io::Result<Conn> {
        let stream = TcpStream::connect(("127.0.0.1", self.port))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(120)))?;
        Ok(BufReader::new(stream))
    }

    /// The connection used last, unless it sat too long; else a new one.
    fn take(&self) -> std::io::Result<Conn> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        while let Some((conn, used)) = idle.pop() {
            if used.elapsed() < IDLE_LIMIT {
                return Ok(conn);
            }
        }
        drop(idle);
        self.open()
    }

    fn give(&self, conn: Conn) {
        self.idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((conn, Instant::now()));
    }
}

/// The prompt of request `i`; the same text as `baton_worker::bench::serving_prompt`.
fn prompt(i: usize) -> String {
    format!("Request {i}: write a short story about a lighthouse keeper and the sea.")
}

/// What one request measured.
struct Measured {
    ttft: Option<Duration>,
    tokens: u64,
}

/// How a request ended: its stream read to the end, or the status of a refusal.
enum Reply {
    Streamed(Measured),
    Status(String),
}

/// One request, as the open loop counts it: any status but 200 is an error.
fn one(pool: &Pool, i: usize, max_tokens: u32) -> Result<Measured, String> {
    match request(pool, i, max_tokens, &mut |_, _| {})? {
        Reply::Streamed(m) => Ok(m),
        Reply::Status(status) => Err(format!("request {i}: HTTP {status}")),
    }
}

/// Request `i`; `on_text` gets the arrival time of every chunk with text, and the time
/// the request was written.
fn request(
    pool: &Pool,
    i: usize,
    max_tokens: u32,
    on_text: &mut dyn FnMut(Instant, Instant),
) -> Result<Reply, String> {
    let body = serde_json::json!({
        "model": "bench",
        "messages": [{"role": "user", "content": prompt(i)}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string();
    let mut conn = pool.take().map_err(|e| format!("connect: {e}"))?;
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let start = Instant::now();
    conn.get_mut()
        .write_all(request.as_bytes())
        .map_err(|e| format!("write: {e}"))?;
    let io = |e: std::io::Error| format!("request {i}: {e}");
    let mut line = String::new();
    conn.read_line(&mut line).map_err(io)?;
    let status = line.split(' ').nth(1).unwrap_or("").to_string();
    let (mut chunked, mut length, mut close) = (false, 0usize, false);
    loop {
        line.clear();
        conn.read_line(&mut line).map_err(io)?;
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        let (name, value) = header.split_once(':').unwrap_or((header, ""));
        let value = value.trim().to_ascii_lowercase();
        match name.to_ascii_lowercase().as_str() {
            "transfer-encoding" => chunked = value == "chunked",
            "content-length" => length = value.parse().unwrap_or(0),
            "connection" => close = value == "close",
            _ => {}
        }
    }
    if status != "200" {
        // The connection is dropped with whatever body it still holds.
        return Ok(Reply::Status(status));
    }
    let mut measured = Measured {
        ttft: None,
        tokens: 0,
    };
    let mut pending: Vec<u8> = Vec::new();
    let mut piece = Vec::new();
    loop {
        piece.clear();
        if chunked {
            line.clear();
            conn.read_line(&mut line).map_err(io)?;
            let size = usize::from_str_radix(line.trim_end().split(';').next().unwrap_or(""), 16)
                .map_err(|_| format!("request {i}: bad chunk size {line:?}"))?;
            if size == 0 {
                line.clear();
                conn.read_line(&mut line).map_err(io)?;
                break;
            }
            piece.resize(size + 2, 0);
            conn.read_exact(&mut piece).map_err(io)?;
            piece.truncate(size);
        } else {
            piece.resize(length, 0);
            conn.read_exact(&mut piece).map_err(io)?;
        }
        pending.extend_from_slice(&piece);
        // SSE events end with a blank line; one may span chunks.
        while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = pending.drain(..end + 2).collect();
            for data in event.split(|&b| b == b'\n') {
                let Some(json) = data.strip_prefix(b"data: ") else {
                    continue;
                };
                let Ok(chunk) = serde_json::from_slice::<Value>(json) else {
                    continue;
                };
                if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
                    measured.tokens += n;
                }
                let has_text = chunk["choices"].as_array().is_some_and(|choices| {
                    choices.iter().any(|c| {
                        c["delta"]["content"]
                            .as_str()
                            .is_some_and(|t| !t.is_empty())
                            || c["text"].as_str().is_some_and(|t| !t.is_empty())
                    })
                });
                if has_text {
                    let now = Instant::now();
                    on_text(now, start);
                    if measured.ttft.is_none() {
                        measured.ttft = Some(now - start);
                    }
                }
            }
        }
        if !chunked {
            break;
        }
    }
    if !close {
        pool.give(conn);
    }
    Ok(Reply::Streamed(measured))
}

/// What the closed loop's clients saw inside the window.
#[derive(Default)]
struct Window {
    tokens: u64,
    ttft: Vec<f64>,
    gaps: Vec<f64>,
    rejected: u64,
    errors: u64,
    error_statuses: std::collections::BTreeMap<String, u64>,
    completed: u64,
}

/// Nearest-rank percentile in milliseconds (NaN, printed as null, when empty).
fn percentile(values: &mut [f64], p: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let i = ((p / 100.0) * (values.len() - 1) as f64).round() as usize;
    Some(values[i.min(values.len() - 1)])
}

/// `closed PORT CONCURRENCY WARMUP_S DURATION_S MAX_TOKENS` (see the crate docs).
fn closed(args: &[String]) -> ExitCode {
    let usage = "usage: baton-loadgen closed PORT CONCURRENCY WARMUP_S DURATION_S MAX_TOKENS";
    let parsed = (|| {
        Some((
            args.first()?.parse::<u16>().ok()?,
            args.get(1)?.parse::<usize>().ok().filter(|c| *c > 0)?,
            Duration::try_from_secs_f64(args.get(2)?.parse().ok()?).ok()?,
            Duration::try_from_secs_f64(args.get(3)?.parse().ok()?)
                .ok()
                .filter(|d| !d.is_zero())?,
            args.get(4)?.parse::<u32>().ok()?,
        ))
    })();
    let Some((port, concurrency, warmup, duration, max_tokens)) = parsed else {
        eprintln!("{usage}");
        return ExitCode::from(2);
    };
    let pool = match Pool::warmed(port, concurrency) {
        Ok(pool) => pool,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let t0 = Instant::now();
    let (start, end) = (t0 + warmup, t0 + warmup + duration);
    let window = Arc::new(Mutex::new(Window::default()));
    let counter = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let inside = move |t: Instant| start <= t && t <= end;
    for _ in 0..concurrency {
        let (pool, window, counter) = (pool.clone(), window.clone(), counter.clone());
        std::thread::spawn(move || {
            while Instant::now() < end {
                let i = counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let mut last: Option<Instant> = None;
                let mut on_text = |t: Instant, sent: Instant| {
                    if inside(t) {
                        let mut w = window.lock().unwrap_or_else(|e| e.into_inner());
                        w.tokens += 1;
                        match last {
                            Some(l) if l >= start => w.gaps.push((t - l).as_secs_f64() * 1e3),
                            Some(_) => {}
                            None => w.ttft.push((t - sent).as_secs_f64() * 1e3),
                        }
                    }
                    last = Some(t);
                };
                let reply = request(&pool, i, max_tokens, &mut on_text);
                let now = Instant::now();
                let mut w = window.lock().unwrap_or_else(|e| e.into_inner());
                let failed = match reply {
                    Ok(Reply::Streamed(_)) => {
                        if inside(now) {
                            w.completed += 1;
                        }
                        false
                    }
                    Ok(Reply::Status(status)) if status == "429" => {
                        if inside(now) {
                            w.rejected += 1;
                        }
                        true
                    }
                    Ok(Reply::Status(status)) => {
                        w.errors += 1;
                        *w.error_statuses.entry(status).or_default() += 1;
                        true
                    }
                    Err(e) => {
                        // Connection failures under one key, the first few also told.
                        if w.errors < 5 {
                            eprintln!("{e}");
                        }
                        w.errors += 1;
                        *w.error_statuses.entry("transport".into()).or_default() += 1;
                        true
                    }
                };
                drop(w);
                if failed {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        });
    }
    if let Some(wait) = end.checked_duration_since(Instant::now()) {
        std::thread::sleep(wait);
    }
    let mut w = window.lock().unwrap_or_else(|e| e.into_inner());
    let w = &mut *w;
    let out = serde_json::json!({
        "concurrency": concurrency,
        "tok_s": w.tokens as f64 / duration.as_secs_f64(),
        "ttft_p50_ms": percentile(&mut w.ttft, 50.0),
        "ttft_p99_ms": percentile(&mut w.ttft, 99.0),
        "itl_p50_ms": percentile(&mut w.gaps, 50.0),
        "itl_p99_ms": percentile(&mut w.gaps, 99.0),
        "rejected": w.rejected,
        "errors": w.errors,
        "error_statuses": w.error_statuses,
        "completed": w.completed,
    });
    println!("{out}");
    // The requests still in flight end with the process: their connections close, as a
    // client that leaves closes them.
    std::process::exit(0)
}

/// The schedule file's offsets, or `None` (with a message) when it cannot be used.
fn schedule(path: &str, requests: usize) -> Option<Vec<Duration>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| eprintln!("reading the schedule {path}: {e}"))
        .ok()?;
    let offsets: Option<Vec<Duration>> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| Duration::try_from_secs_f64(l.trim().parse().ok()?).ok())
        .collect();
    match offsets {
        Some(o) if o.len() >= requests => Some(o),
        Some(o) => {
            eprintln!("{path} has {} offsets for {requests} requests", o.len());
            None
        }
        None => {
            eprintln!("{path}: every line must be an offset in seconds");
            None
        }
    }
}

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("closed") {
        return closed(&args[1..]);
    }
    let usage = "usage: baton-loadgen PORT RATE REQUESTS MAX_TOKENS [LABEL] [--schedule FILE]";
    let schedule_file = match args.iter().position(|a| a == "--schedule") {
        Some(i) if i + 1 < args.len() => {
            let file = args.remove(i + 1);
            args.remove(i);
            Some(file)
        }
        Some(_) => {
            eprintln!("{usage}");
            return ExitCode::from(2);
        }
        None => None,
    };
    let parsed = (|| {
        Some((
            args.first()?.parse::<u16>().ok()?,
            args.get(1)?.parse::<f64>().ok().filter(|r| *r > 0.0)?,
            args.get(2)?.parse::<usize>().ok()?,
            args.get(3)?.parse::<u32>().ok()?,
        ))
    })();
    let Some((port, rate, total, max_tokens)) = parsed else {
        eprintln!("{usage}");
        return ExitCode::from(2);
    };
    let label = args.get(4).cloned().unwrap_or_else(|| "cluster".into());
    let offsets: Vec<Duration> = match &schedule_file {
        Some(path) => match schedule(path, total) {
            Some(o) => o,
            None => return ExitCode::FAILURE,
        },
        None => (0..total)
            .map(|i| Duration::from_secs_f64(i as f64 / rate))
            .collect(),
    };
    let pool = match Pool::warmed(port, WARM_CONNECTIONS) {
        Ok(pool) => pool,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let t0 = Instant::now();
    let mut threads = Vec::with_capacity(total);
    for (i, offset) in offsets.into_iter().enumerate().take(total) {
        let due = t0 + offset;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let pool = pool.clone();
        threads.push(std::thread::spawn(move || one(&pool, i, max_tokens)));
    }
    let mut ttft = Vec::with_capacity(total);
    let mut tokens = 0;
    for t in threads {
        match t.join() {
            Ok(Ok(m)) => {
                tokens += m.tokens;
                ttft.extend(m.ttft);
            }
            Ok(Err(e)) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
            Err(_) => return ExitCode::FAILURE,
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    if ttft.is_empty() {
        eprintln!("no request produced a token");
        return ExitCode::FAILURE;
    }
    ttft.sort();
    let pct = |p: f64| {
        let i = ((p / 100.0) * (ttft.len() - 1) as f64).round() as usize;
        ttft[i.min(ttft.len() - 1)].as_secs_f64() * 1e3
    };
    println!(
        "{label} rate={rate} requests={total} tokens={tokens} tok_s={:.1} ttft_p50_ms={:.1} ttft_p99_ms={:.1}",
        tokens as f64 / wall,
        pct(50.0),
        pct(99.0)
    );
    ExitCode::SUCCESS
}
