//! `baton-loadgen`: open-loop load for a coordinator, measured from the client's side.
//!
//! ```text
//! baton-loadgen PORT RATE REQUESTS MAX_TOKENS [LABEL] [--schedule FILE]
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

fn one(pool: &Pool, i: usize, max_tokens: u32) -> Result<Measured, String> {
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
        return Err(format!("request {i}: HTTP {status}"));
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
                if has_text && measured.ttft.is_none() {
                    measured.ttft = Some(start.elapsed());
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
    Ok(measured)
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
    let pool = Arc::new(Pool {
        port,
        idle: Mutex::new(Vec::new()),
    });
    for _ in 0..WARM_CONNECTIONS {
        match pool.open() {
            Ok(conn) => pool.give(conn),
            Err(e) => {
                eprintln!("cannot connect to 127.0.0.1:{port}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
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
