//! The `baton` command line.
//!
//! ```text
//! baton [--nats URL | --url URL] chat --model M "prompt"      # streams to the terminal
//! baton [--nats URL | --url URL] complete --model M "prompt"
//! baton [--nats URL | --url URL] status
//! baton [--nats URL | --url URL] drain WORKER
//! baton [--nats URL | --url URL] load-model WORKER FILE [--sha256 HEX] [--name N] [--add]
//! baton [--nats URL | --url URL] unload-model WORKER MODEL
//! baton --url URL --api-key KEY chat …                      # or BATON_API_KEY=KEY
//! baton --nats URL --url URL bench --model M                 # NATS vs HTTP per token
//! ```
//!
//! NATS credentials and TLS come from `--nats-user`/`--nats-password`, `--nats-token`,
//! `--nats-nkey`, `--nats-nkey-file`, `--nats-creds`, `--nats-tls-ca`,
//! `--nats-tls-cert`/`--nats-tls-key`, `--nats-tls-required`, `--nats-inbox-prefix`, or
//! their environment variables (`BATON_NATS_USER`, `BATON_NATS_PASSWORD`, …).
//!
//! Given neither `--url` nor `--nats` (nor their environment variables), the client talks
//! to the cluster `scripts/up` runs on this machine, through the endpoints it wrote
//! ([`Endpoints`]); without one, to NATS at `nats://127.0.0.1:4222`.

use std::io::Write;
use std::path::PathBuf;

use baton_common::config::NatsConfig;
use baton_common::env;
use baton_common::nats::NatsArgs;
use baton_common::secret::Secret;
use clap::{Args, Parser, Subcommand};
use futures::StreamExt;

use crate::{Client, ClientError, Event, Request};

/// The default NATS URL when neither `--nats` nor `--url` is given.
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

/// A client of a Baton cluster.
#[derive(Debug, Parser)]
#[command(name = "baton", version, about)]
pub struct Cli {
    /// NATS server URL (the public NATS API); used unless `--url` is given. With
    /// neither, the cluster `scripts/up` runs here (its HTTP URL), else
    /// nats://127.0.0.1:4222.
    #[arg(long, global = true, env = env::NATS_URL)]
    pub nats: Option<String>,
    /// Coordinator HTTP base URL (`http://host:port`); when given, `chat`, `complete`
    /// and `status` use HTTP.
    #[arg(long, global = true, env = env::URL)]
    pub url: Option<String>,
    /// Subject prefix of the cluster.
    #[arg(long, global = true, env = env::SUBJECT_PREFIX, default_value = baton_common::subjects::DEFAULT_PREFIX)]
    pub prefix: String,
    /// Over NATS, ask for JSON replies instead of rkyv.
    #[arg(long, global = true)]
    pub json: bool,
    /// NATS credentials and TLS.
    #[command(flatten)]
    pub auth: NatsArgs,
    /// API key sent to the coordinator over HTTP (`Authorization: Bearer <key>`); an
    /// admin key for `drain`, `load-model` and `unload-model`. Prefer the environment
    /// variable: a command line is visible to every user of the machine.
    #[arg(long, global = true, env = env::API_KEY, hide_env_values = true, value_parser = parse_key)]
    pub api_key: Option<Secret>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Chat: the prompt is one user message.
    Chat(Generate),
    /// Text completion.
    Complete(Generate),
    /// The cluster's workers, models and load, as JSON.
    Status,
    /// Drain a worker: it takes no new work, finishes what it runs, and leaves.
    Drain {
        /// The worker's id (from `baton status`).
        worker: String,
    },
    /// Load a GGUF file on a worker beside what it serves, then serve it: in place of
    /// the model of its name, or the only one (its streams finish on it), or, with
    /// --add, beside the others.
    LoadModel {
        /// The worker's id (from `baton status`).
        worker: String,
        /// The GGUF file, as the worker's host sees it.
        path: String,
        /// The file's SHA-256 (hex); without it the worker reads `FILE.sha256`.
        #[arg(long)]
        sha256: Option<String>,
        /// The name to serve it as (default: the replaced model's).
        #[arg(long)]
        name: Option<String>,
        /// Serve it beside the models the worker serves.
        #[arg(long)]
        add: bool,
    },
    /// Stop a worker serving a model; its streams finish on it.
    UnloadModel {
        /// The worker's id.
        worker: String,
        /// The model's name.
        model: String,
    },
    /// Per-token overhead of NATS (JSON, rkyv) and HTTP SSE, in one run; needs both
    /// `--nats` and `--url`.
    Bench(crate::bench::BenchArgs),
}

/// Arguments of `chat` and `complete`.
#[derive(Debug, Args)]
pub struct Generate {
    /// Model name.
    #[arg(long, short)]
    pub model: String,
    /// Most tokens to generate.
    #[arg(long)]
    pub max_tokens: Option<u32>,
    /// Temperature (0: greedy).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Sampler seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Print the whole answer at once instead of streaming it.
    #[arg(long)]
    pub no_stream: bool,
    /// Print how the stream ended and its token counts on stderr.
    #[arg(long, short)]
    pub verbose: bool,
    /// The prompt.
    pub prompt: String,
}

/// Runs the command line.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    if let Command::Bench(args) = &cli.command {
        return crate::bench::run(&cli, args).await;
    }
    let client = connect(&cli).await?;
    match cli.command {
        Command::Chat(g) => {
            let mut r = Request::chat(&g.model, &g.prompt);
            fill(&mut r, &g);
            generate(&client, &r, &g).await
        }
        Command::Complete(g) => {
            let mut r = Request::completion(&g.model, &g.prompt);
            fill(&mut r, &g);
            generate(&client, &r, &g).await
        }
        Command::Status => {
            let status = client.status().await?;
            println!("{}", serde_json::to_string_pretty(&status)?);
            Ok(())
        }
        Command::Drain { worker } => {
            let answer = client.drain(&worker).await?;
            println!("{}", serde_json::to_string_pretty(&answer)?);
            Ok(())
        }
        Command::LoadModel {
            worker,
            path,
            sha256,
            name,
            add,
        } => {
            let answer = client
                .load_model(&worker, &path, sha256.as_deref(), name.as_deref(), add)
                .await?;
            println!("{}", serde_json::to_string_pretty(&answer)?);
            Ok(())
        }
        Command::UnloadModel { worker, model } => {
            let answer = client.unload_model(&worker, &model).await?;
            println!("{}", serde_json::to_string_pretty(&answer)?);
            Ok(())
        }
        Command::Bench(_) => unreachable!("handled above"),
    }
}

fn parse_key(s: &str) -> Result<Secret, String> {
    Ok(Secret::new(s.trim()))
}

/// The HTTP client of `url`, with the command line's API key if any.
pub fn http_client(cli: &Cli, url: &str) -> Result<Client, ClientError> {
    let client = Client::http(url)?;
    Ok(match cli.api_key.clone().filter(|k| !k.is_empty()) {
        Some(key) => client.api_key(key),
        None => client,
    })
}

/// The endpoints of the cluster `scripts/up` runs on this machine, as it wrote them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Endpoints {
    /// The coordinator's HTTP base URL.
    pub url: Option<String>,
    /// Its NATS server.
    pub nats: Option<String>,
}

impl Endpoints {
    /// The file `scripts/up` writes: `BATON_ENDPOINTS`, else
    /// `$XDG_STATE_HOME/baton/endpoints`, else `~/.local/state/baton/endpoints`.
    pub fn path() -> Option<PathBuf> {
        if let Some(p) = std::env::var_os(env::ENDPOINTS).filter(|p| !p.is_empty()) {
            return Some(PathBuf::from(p));
        }
        let state = std::env::var_os("XDG_STATE_HOME")
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state")))?;
        Some(state.join("baton").join("endpoints"))
    }

    /// The endpoints in `text` (`url=…` and `nats=…` lines; others are ignored).
    pub fn parse(text: &str) -> Self {
        let mut out = Self::default();
        for line in text.lines() {
            let Some((key, value)) = line.split_once('=') else {
                continue;
            };
            let value = value.trim();
            if value.is_empty() {
                continue;
            }
            match key.trim() {
                "url" => out.url = Some(value.into()),
                "nats" => out.nats = Some(value.into()),
                _ => {}
            }
        }
        out
    }

    /// Those of the running `scripts/up`, if it wrote any.
    pub fn find() -> Self {
        Self::path()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .map(|text| Self::parse(&text))
            .unwrap_or_default()
    }
}

/// The client `--url` / `--nats` ask for; with neither, the coordinator's HTTP URL that
/// `scripts/up` wrote ([`Endpoints`]), else NATS at its default URL.
pub async fn connect(cli: &Cli) -> Result<Client, ClientError> {
    let found = match (&cli.url, &cli.nats) {
        (None, None) => Endpoints::find(),
        _ => Endpoints::default(),
    };
    match (cli.url.as_ref().or(found.url.as_ref()), &cli.nats) {
        (Some(url), _) => http_client(cli, url),
        (None, _) => Ok(Client::connect_nats_with(&nats_config(cli))
            .await?
            .json_replies(cli.json)),
    }
}

/// The NATS settings of the command line: `--nats` (else the NATS server `scripts/up`
/// wrote, else the default URL), `--prefix` and the credentials and TLS flags (or their
/// environment variables).
pub fn nats_config(cli: &Cli) -> NatsConfig {
    let url = match &cli.nats {
        Some(url) => url.clone(),
        None => Endpoints::find()
            .nats
            .unwrap_or_else(|| DEFAULT_NATS_URL.to_string()),
    };
    let mut config = NatsConfig {
        url,
        subject_prefix: cli.prefix.clone(),
        ..NatsConfig::default()
    };
    cli.auth.apply(&mut config);
    config
}

fn fill(r: &mut Request, g: &Generate) {
    r.max_tokens = g.max_tokens;
    r.temperature = g.temperature;
    r.seed = g.seed;
}

async fn generate(client: &Client, r: &Request, g: &Generate) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    if g.no_stream {
        let c = client.generate(r).await?;
        writeln!(out, "{}", c.text)?;
        if g.verbose {
            eprintln!(
                "[{}; {} prompt + {} generated tokens]",
                c.finish.reason, c.finish.prompt_tokens, c.finish.completion_tokens
            );
        }
        return Ok(());
    }
    let mut events = client.stream(r).await?;
    while let Some(event) = events.next().await {
        match event? {
            Event::Text { text, .. } => {
                write!(out, "{text}")?;
                out.flush()?;
            }
            Event::Finished(f) => {
                writeln!(out)?;
                if g.verbose {
                    eprintln!(
                        "[{}; {} prompt + {} generated tokens]",
                        f.reason, f.prompt_tokens, f.completion_tokens
                    );
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_read_from_key_value_lines() {
        let e = Endpoints::parse("url=http://127.0.0.1:8000\nnats=nats://127.0.0.1:4222\n");
        assert_eq!(e.url.as_deref(), Some("http://127.0.0.1:8000"));
        assert_eq!(e.nats.as_deref(), Some("nats://127.0.0.1:4222"));
        let e = Endpoints::parse("# a comment\nurl=\nother=1\n nats = nats://h:1 \n");
        assert_eq!(
            e,
            Endpoints {
                url: None,
                nats: Some("nats://h:1".into())
            }
        );
        assert_eq!(Endpoints::parse(""), Endpoints::default());
    }
}
