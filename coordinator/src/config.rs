//! Command line and `cluster.toml`: one [`Config`] for the coordinator binary.
//!
//! The file gives every setting (missing fields take their defaults); environment
//! variables and flags override the few settings an operator changes per process.

use std::path::PathBuf;

use baton_common::config::{CheckpointMode, ClusterConfig, ConfigError};
use baton_common::env;
use baton_common::nats::NatsArgs;
use baton_common::secret::Secret;
use clap::Parser;

/// Default location of `cluster.toml`; a missing file there means "all defaults".
pub const DEFAULT_CONFIG_PATH: &str = "cluster.toml";

/// `baton-coordinator` command line.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "baton-coordinator",
    version,
    about = "OpenAI-compatible front of a Baton cluster"
)]
pub struct Config {
    /// Cluster configuration file (default: `cluster.toml`, all defaults when absent).
    #[arg(long, env = env::CONFIG)]
    pub config: Option<PathBuf>,
    /// NATS server URL(s), comma-separated (overrides `nats.url`).
    #[arg(long, env = env::NATS_URL)]
    pub nats_url: Option<String>,
    /// HTTP listen address (overrides `coordinator.listen`).
    #[arg(long, env = env::LISTEN)]
    pub listen: Option<String>,
    /// Prefix of every NATS subject (overrides `nats.subject_prefix`).
    #[arg(long, env = env::SUBJECT_PREFIX)]
    pub subject_prefix: Option<String>,
    /// Directory of the checkpoint store (overrides `coordinator.store_path`).
    #[arg(long, env = env::STORE)]
    pub store: Option<String>,
    /// Checkpoint mode: sync, async or off (overrides `coordinator.checkpoint`).
    #[arg(long, env = env::CHECKPOINT, value_parser = parse_checkpoint)]
    pub checkpoint: Option<CheckpointMode>,
    /// NATS credentials and TLS (override `nats.user`, `nats.tls_ca`, …).
    #[command(flatten)]
    pub nats: NatsArgs,
    /// API keys, comma-separated (replace `auth.api_keys` when they hold at least one
    /// key). Prefer the environment variable: a command line is visible to every user
    /// of the machine.
    #[arg(long, env = env::API_KEYS, hide_env_values = true, value_delimiter = ',', value_parser = parse_key)]
    pub api_keys: Option<Vec<Secret>>,
    /// Admin keys, comma-separated (replace `auth.admin_keys` when they hold at least
    /// one key). Prefer the environment variable, as for `--api-keys`.
    #[arg(long, env = env::ADMIN_KEYS, hide_env_values = true, value_delimiter = ',', value_parser = parse_key)]
    pub admin_keys: Option<Vec<Secret>>,
}

/// One key of a comma-separated list, without the spaces around it.
fn parse_key(s: &str) -> Result<Secret, String> {
    Ok(Secret::new(s.trim()))
}

/// A list of keys without the empty entries a stray comma leaves.
fn keys(list: &[Secret]) -> Vec<Secret> {
    list.iter().filter(|k| !k.is_empty()).cloned().collect()
}

fn parse_checkpoint(s: &str) -> Result<CheckpointMode, String> {
    match s {
        "sync" => Ok(CheckpointMode::Sync),
        "async" => Ok(CheckpointMode::Async),
        "off" => Ok(CheckpointMode::Off),
        other => Err(format!("{other:?} is not sync, async or off")),
    }
}

impl Config {
    /// Reads the configuration file and applies the overrides of the command line and
    /// environment. A file named explicitly must exist; the default one may be absent.
    pub fn load(&self) -> Result<ClusterConfig, ConfigError> {
        let (path, must_exist) = match &self.config {
            Some(path) => (path.clone(), true),
            None => (PathBuf::from(DEFAULT_CONFIG_PATH), false),
        };
        let file = ClusterConfig::load(&path, must_exist)?;
        Ok(self.apply(file))
    }

    /// Applies the overrides to a configuration read from a file.
    pub fn apply(&self, mut cluster: ClusterConfig) -> ClusterConfig {
        if let Some(url) = &self.nats_url {
            cluster.nats.url = url.clone();
        }
        if let Some(listen) = &self.listen {
            cluster.coordinator.listen = listen.clone();
        }
        if let Some(prefix) = &self.subject_prefix {
            cluster.nats.subject_prefix = prefix.clone();
        }
        if let Some(store) = &self.store {
            cluster.coordinator.store_path = store.clone();
        }
        if let Some(mode) = self.checkpoint {
            cluster.coordinator.checkpoint = mode;
        }
        self.nats.apply(&mut cluster.nats);
        // A list with no key in it (an empty variable, stray commas) leaves the file's
        // list alone: it must never open an API the file closes.
        if let Some(list) = self.api_keys.as_deref().map(keys).filter(|l| !l.is_empty()) {
            cluster.auth.api_keys = list;
        }
        if let Some(list) = self
            .admin_keys
            .as_deref()
            .map(keys)
            .filter(|l| !l.is_empty())
        {
            cluster.auth.admin_keys = list;
        }
        cluster
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_override_the_file() {
        let config = Config::try_parse_from([
            "baton-coordinator",
            "--nats-url",
            "nats://10.0.0.1:4222",
            "--listen",
            "0.0.0.0:9000",
            "--subject-prefix",
            "acme",
            "--store",
            "/srv/baton/store",
            "--checkpoint",
            "sync",
            "--nats-user",
            "coordinator",
            "--nats-password",
            "hunter2",
        ])
        .expect("parse");
        let cluster = config.apply(ClusterConfig::default());
        assert_eq!(cluster.nats.url, "nats://10.0.0.1:4222");
        assert_eq!(cluster.coordinator.listen, "0.0.0.0:9000");
        assert_eq!(cluster.nats.subject_prefix, "acme");
        assert_eq!(cluster.coordinator.store_path, "/srv/baton/store");
        assert_eq!(cluster.coordinator.checkpoint, CheckpointMode::Sync);
        assert_eq!(cluster.nats.user.as_deref(), Some("coordinator"));
        assert_eq!(
            cluster.nats.password.as_ref().map(|p| p.expose()),
            Some("hunter2")
        );
        assert!(Config::try_parse_from(["baton-coordinator", "--checkpoint", "maybe"]).is_err());
    }

    #[test]
    fn key_lists_replace_the_file_and_never_print() {
        let config = Config::try_parse_from([
            "baton-coordinator",
            "--api-keys",
            "sk-one, sk-two,",
            "--admin-keys",
            "sk-root",
        ])
        .expect("parse");
        let mut file = ClusterConfig::default();
        file.auth.api_keys = vec![Secret::new("sk-file")];
        let cluster = config.apply(file);
        let exposed: Vec<&str> = cluster.auth.api_keys.iter().map(Secret::expose).collect();
        assert_eq!(exposed, ["sk-one", "sk-two"]);
        assert_eq!(cluster.auth.admin_keys[0].expose(), "sk-root");
        assert!(!format!("{config:?}").contains("sk-"), "{config:?}");
        // An empty list never replaces the file's keys (that would open the API).
        for empty in ["", " , ,"] {
            let config =
                Config::try_parse_from(["baton-coordinator", "--api-keys", empty]).expect("parse");
            let mut file = ClusterConfig::default();
            file.auth.api_keys = vec![Secret::new("sk-file")];
            assert_eq!(config.apply(file).auth.api_keys[0].expose(), "sk-file");
        }
    }

    #[test]
    fn without_flags_the_file_stands() {
        let config = Config::try_parse_from(["baton-coordinator"]).expect("parse");
        let mut file = ClusterConfig::default();
        file.coordinator.listen = "127.0.0.1:1234".into();
        assert_eq!(config.apply(file.clone()), file);
    }

    #[test]
    fn a_named_file_must_exist() {
        let config = Config::try_parse_from([
            "baton-coordinator",
            "--config",
            "/nonexistent/baton/cluster.toml",
        ])
        .expect("parse");
        assert!(config.load().is_err());
    }
}
