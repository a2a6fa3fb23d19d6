//! Connecting to NATS. One function turns a [`NatsConfig`] into
//! [`async_nats::ConnectOptions`], so that the coordinator, the workers, the `baton`
//! client and the test harness authenticate and encrypt in the same way.
//!
//! - [`connect_options`] checks the settings (at most one way to authenticate, a client
//!   key with its certificate, files that can be read, an NKey seed that is one) and
//!   builds the options; call it at start to refuse a bad configuration early.
//! - [`connect`] connects with them and says plainly why a connection failed: the
//!   server refused the credentials ([`NatsConnectError::Authorization`]), TLS failed,
//!   or no server answered.
//! - [`NatsArgs`]: the flags and environment variables of these settings, shared by
//!   every binary.
//!
//! Passwords, tokens and seeds are [`Secret`]s: they never reach a log.

use std::path::{Path, PathBuf};

use async_nats::{ConnectErrorKind, ConnectOptions, Event, ServerAddr};

use crate::config::NatsConfig;
use crate::env;
use crate::secret::Secret;

/// One NATS setting, named as `cluster.toml` and the environment name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NatsSetting {
    /// `nats.user`.
    User,
    /// `nats.password`.
    Password,
    /// `nats.token`.
    Token,
    /// `nats.nkey`.
    Nkey,
    /// `nats.nkey_file`.
    NkeyFile,
    /// `nats.creds`.
    Creds,
    /// `nats.tls_ca`.
    TlsCa,
    /// `nats.tls_cert`.
    TlsCert,
    /// `nats.tls_key`.
    TlsKey,
    /// `nats.inbox_prefix`.
    InboxPrefix,
}

impl NatsSetting {
    /// The field of `cluster.toml`.
    pub fn field(self) -> &'static str {
        match self {
            NatsSetting::User => "nats.user",
            NatsSetting::Password => "nats.password",
            NatsSetting::Token => "nats.token",
            NatsSetting::Nkey => "nats.nkey",
            NatsSetting::NkeyFile => "nats.nkey_file",
            NatsSetting::Creds => "nats.creds",
            NatsSetting::TlsCa => "nats.tls_ca",
            NatsSetting::TlsCert => "nats.tls_cert",
            NatsSetting::TlsKey => "nats.tls_key",
            NatsSetting::InboxPrefix => "nats.inbox_prefix",
        }
    }

    /// The environment variable that overrides it.
    pub fn env(self) -> &'static str {
        match self {
            NatsSetting::User => env::NATS_USER,
            NatsSetting::Password => env::NATS_PASSWORD,
            NatsSetting::Token => env::NATS_TOKEN,
            NatsSetting::Nkey => env::NATS_NKEY,
            NatsSetting::NkeyFile => env::NATS_NKEY_FILE,
            NatsSetting::Creds => env::NATS_CREDS,
            NatsSetting::TlsCa => env::NATS_TLS_CA,
            NatsSetting::TlsCert => env::NATS_TLS_CERT,
            NatsSetting::TlsKey => env::NATS_TLS_KEY,
            NatsSetting::InboxPrefix => env::NATS_INBOX_PREFIX,
        }
    }
}

impl std::fmt::Display for NatsSetting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.field(), self.env())
    }
}

/// Why the NATS settings cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum NatsConfigError {
    /// Two ways to authenticate are set; NATS takes one.
    #[error("contradictory NATS settings: {first} and {second} are both set; give one way to authenticate")]
    Conflict {
        /// One of them.
        first: NatsSetting,
        /// The other.
        second: NatsSetting,
    },
    /// A setting needs another that is missing.
    #[error("incomplete NATS settings: {set} is set without {missing}")]
    Incomplete {
        /// The one given.
        set: NatsSetting,
        /// The one it needs.
        missing: NatsSetting,
    },
    /// A file named by a setting cannot be read.
    #[error("cannot read {setting}, {}: {source}", path.display())]
    Read {
        /// The setting.
        setting: NatsSetting,
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The NKey seed is not a user's seed.
    #[error("{0} is not the seed of a NATS user NKey (a seed starts with \"SU\")")]
    InvalidNkey(NatsSetting),
    /// The credentials file does not hold a user JWT and seed.
    #[error("{path} is not a NATS credentials file ({setting}): {source}", path = path.display(), setting = NatsSetting::Creds)]
    InvalidCreds {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The inbox prefix is not a subject token sequence.
    #[error("{setting} {0:?} is not a valid subject prefix (empty, or with spaces or wildcards)", setting = NatsSetting::InboxPrefix)]
    InvalidInboxPrefix(String),
}

impl NatsConfigError {
    /// A stable name of the error.
    pub fn kind(&self) -> &'static str {
        match self {
            NatsConfigError::Conflict { .. } => "conflict",
            NatsConfigError::Incomplete { .. } => "incomplete",
            NatsConfigError::Read { .. } => "unreadable_file",
            NatsConfigError::InvalidNkey(_) => "invalid_nkey",
            NatsConfigError::InvalidCreds { .. } => "invalid_creds",
            NatsConfigError::InvalidInboxPrefix(_) => "invalid_inbox_prefix",
        }
    }
}

/// How a process proves who it is to NATS: the one way [`NatsConfig`] gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NatsCredentials {
    /// Nothing (a server without authorization).
    None,
    /// A user name and password.
    UserPassword {
        /// The user.
        user: String,
        /// The password.
        password: Secret,
    },
    /// A token.
    Token(Secret),
    /// An NKey: the server sends a nonce, the seed signs it.
    Nkey {
        /// The user's seed (`SU…`).
        seed: Secret,
        /// Its public key (`U…`), as the server's configuration names the user.
        public_key: String,
    },
    /// A credentials file: a user JWT and the seed that signs nonces.
    Creds(PathBuf),
}

impl NatsCredentials {
    /// The credentials `config` asks for, or why they are contradictory or incomplete.
    /// An empty value counts as unset. Reads `nkey_file` (not `creds`).
    pub fn from_config(config: &NatsConfig) -> Result<Self, NatsConfigError> {
        let user = config.user.as_deref().filter(|u| !u.is_empty());
        let password = config.password.as_ref().filter(|p| !p.is_empty());
        let token = config.token.as_ref().filter(|t| !t.is_empty());
        let nkey = config.nkey.as_ref().filter(|s| !s.is_empty());
        let nkey_file = non_empty(&config.nkey_file);
        let creds = non_empty(&config.creds);

        let given: Vec<NatsSetting> = [
            (user.is_some() || password.is_some(), NatsSetting::User),
            (token.is_some(), NatsSetting::Token),
            (nkey.is_some(), NatsSetting::Nkey),
            (nkey_file.is_some(), NatsSetting::NkeyFile),
            (creds.is_some(), NatsSetting::Creds),
        ]
        .into_iter()
        .filter_map(|(set, setting)| set.then_some(setting))
        .collect();
        if let [first, second, ..] = given[..] {
            return Err(NatsConfigError::Conflict { first, second });
        }
        match (user, password) {
            (Some(_), None) => {
                return Err(NatsConfigError::Incomplete {
                    set: NatsSetting::User,
                    missing: NatsSetting::Password,
                })
            }
            (None, Some(_)) => {
                return Err(NatsConfigError::Incomplete {
                    set: NatsSetting::Password,
                    missing: NatsSetting::User,
                })
            }
            (Some(user), Some(password)) => {
                return Ok(NatsCredentials::UserPassword {
                    user: user.to_string(),
                    password: password.clone(),
                })
            }
            (None, None) => {}
        }
        if let Some(token) = token {
            return Ok(NatsCredentials::Token(token.clone()));
        }
        if let Some(seed) = nkey {
            return nkey_credentials(seed.expose(), NatsSetting::Nkey);
        }
        if let Some(path) = nkey_file {
            let text = std::fs::read_to_string(path).map_err(|source| NatsConfigError::Read {
                setting: NatsSetting::NkeyFile,
                path: path.to_path_buf(),
                source,
            })?;
            return nkey_credentials(text.trim(), NatsSetting::NkeyFile);
        }
        if let Some(path) = creds {
            return Ok(NatsCredentials::Creds(path.to_path_buf()));
        }
        Ok(NatsCredentials::None)
    }

    /// Who these credentials say we are, for messages (never a secret).
    pub fn describe(&self) -> String {
        match self {
            NatsCredentials::None => "no credentials".into(),
            NatsCredentials::UserPassword { user, .. } => format!("user {user:?} with a password"),
            NatsCredentials::Token(_) => "a token".into(),
            NatsCredentials::Nkey { public_key, .. } => format!("the NKey {public_key}"),
            NatsCredentials::Creds(path) => format!("the credentials file {}", path.display()),
        }
    }
}

fn non_empty(path: &Option<PathBuf>) -> Option<&Path> {
    path.as_deref().filter(|p| !p.as_os_str().is_empty())
}

fn nkey_credentials(seed: &str, setting: NatsSetting) -> Result<NatsCredentials, NatsConfigError> {
    let pair =
        nkeys::KeyPair::from_seed(seed).map_err(|_| NatsConfigError::InvalidNkey(setting))?;
    if !matches!(pair.key_pair_type(), nkeys::KeyPairType::User) {
        return Err(NatsConfigError::InvalidNkey(setting));
    }
    Ok(NatsCredentials::Nkey {
        seed: Secret::new(seed),
        public_key: pair.public_key(),
    })
}

/// A file a setting names, checked readable now so that a typo fails at start.
fn readable(path: &Path, setting: NatsSetting) -> Result<PathBuf, NatsConfigError> {
    std::fs::File::open(path)
        .map(|_| path.to_path_buf())
        .map_err(|source| NatsConfigError::Read {
            setting,
            path: path.to_path_buf(),
            source,
        })
}

/// Whether `prefix` can start a subject: tokens of printable characters without
/// wildcards, none empty.
fn valid_inbox_prefix(prefix: &str) -> bool {
    !prefix.is_empty()
        && prefix.split('.').all(|token| {
            !token.is_empty()
                && token
                    .chars()
                    .all(|c| !c.is_whitespace() && !c.is_control() && c != '*' && c != '>')
        })
}

/// The options every Baton process connects to NATS with: `name` (shown by the
/// server's monitoring), the credentials, TLS, the inbox prefix, and an event callback
/// that logs disconnections and the server's errors (a permissions violation among
/// them) through `tracing`. Refuses contradictory or incomplete settings and files
/// that cannot be read.
pub fn connect_options(config: &NatsConfig, name: &str) -> Result<ConnectOptions, NatsConfigError> {
    let credentials = NatsCredentials::from_config(config)?;
    let tls_ca = non_empty(&config.tls_ca)
        .map(|p| readable(p, NatsSetting::TlsCa))
        .transpose()?;
    let client_cert = match (non_empty(&config.tls_cert), non_empty(&config.tls_key)) {
        (Some(cert), Some(key)) => Some((
            readable(cert, NatsSetting::TlsCert)?,
            readable(key, NatsSetting::TlsKey)?,
        )),
        (Some(_), None) => {
            return Err(NatsConfigError::Incomplete {
                set: NatsSetting::TlsCert,
                missing: NatsSetting::TlsKey,
            })
        }
        (None, Some(_)) => {
            return Err(NatsConfigError::Incomplete {
                set: NatsSetting::TlsKey,
                missing: NatsSetting::TlsCert,
            })
        }
        (None, None) => None,
    };
    if !valid_inbox_prefix(&config.inbox_prefix) {
        return Err(NatsConfigError::InvalidInboxPrefix(
            config.inbox_prefix.clone(),
        ));
    }

    let mut options = ConnectOptions::new()
        .name(name)
        .custom_inbox_prefix(&config.inbox_prefix)
        .ping_interval(std::time::Duration::from_millis(
            config.ping_interval_ms.max(100),
        ))
        .event_callback(|event| async move { log_event(event) });
    options = match credentials {
        NatsCredentials::None => options,
        NatsCredentials::UserPassword { user, password } => {
            options.user_and_password(user, password.expose().to_string())
        }
        NatsCredentials::Token(token) => options.token(token.expose().to_string()),
        NatsCredentials::Nkey { seed, .. } => options.nkey(seed.expose().to_string()),
        NatsCredentials::Creds(path) => {
            let text = std::fs::read_to_string(&path).map_err(|source| NatsConfigError::Read {
                setting: NatsSetting::Creds,
                path: path.clone(),
                source,
            })?;
            options
                .credentials(&text)
                .map_err(|source| NatsConfigError::InvalidCreds { path, source })?
        }
    };
    let tls = config.tls_required || tls_ca.is_some() || client_cert.is_some();
    if let Some(ca) = tls_ca {
        options = options.add_root_certificates(ca);
    }
    if let Some((cert, key)) = client_cert {
        options = options.add_client_certificate(cert, key);
    }
    if tls {
        options = options.require_tls(true);
    }
    Ok(options)
}

fn log_event(event: Event) {
    match event {
        Event::Connected => tracing::info!("NATS connected"),
        Event::Disconnected => tracing::warn!("NATS disconnected; reconnecting"),
        Event::LameDuckMode => tracing::warn!("the NATS server is shutting down (lame duck mode)"),
        Event::Draining => tracing::info!("NATS connection draining"),
        Event::Closed => tracing::warn!("NATS connection closed"),
        Event::SlowConsumer(sid) => {
            tracing::warn!(subscription = sid, "NATS slow consumer: messages dropped")
        }
        // Permissions violations arrive here: the server refused a publish or a
        // subscription, and nothing else tells this process.
        Event::ServerError(error) => tracing::warn!(%error, "NATS server error"),
        Event::ClientError(error) => tracing::warn!(%error, "NATS client error"),
    }
}

/// Why a connection to NATS failed.
#[derive(Debug, thiserror::Error)]
pub enum NatsConnectError {
    /// The settings are contradictory, incomplete or name unreadable files.
    #[error(transparent)]
    Config(#[from] NatsConfigError),
    /// The server refused the credentials (or wants some and none were given).
    #[error("NATS authorization failed at {url}: {reason} ({error})")]
    Authorization {
        /// The server URL(s).
        url: String,
        /// Who we said we were, and what to check.
        reason: String,
        /// What the client library said.
        error: async_nats::ConnectError,
    },
    /// The TLS handshake failed: an unknown CA, a client certificate the server
    /// wanted and did not get or did not trust, a server without TLS.
    #[error("TLS with NATS at {url} failed (check nats.tls_ca, tls_cert and tls_key): {error}")]
    Tls {
        /// The server URL(s).
        url: String,
        /// What the client library said.
        error: async_nats::ConnectError,
    },
    /// The URL is not a NATS server address.
    #[error("{url:?} is not a NATS server URL: {error}")]
    InvalidUrl {
        /// The URL(s).
        url: String,
        /// Why.
        error: String,
    },
    /// No server answered (refused, unreachable, timed out).
    #[error("cannot connect to NATS at {url}: {error}")]
    Unreachable {
        /// The server URL(s).
        url: String,
        /// What the client library said.
        error: async_nats::ConnectError,
    },
}

impl NatsConnectError {
    /// A stable name of the error.
    pub fn kind(&self) -> &'static str {
        match self {
            NatsConnectError::Config(_) => "config",
            NatsConnectError::Authorization { .. } => "authorization",
            NatsConnectError::Tls { .. } => "tls",
            NatsConnectError::InvalidUrl { .. } => "invalid_url",
            NatsConnectError::Unreachable { .. } => "unreachable",
        }
    }

    fn from_connect(
        url: &str,
        credentials: &NatsCredentials,
        error: async_nats::ConnectError,
    ) -> Self {
        let url = url.to_string();
        match error.kind() {
            ConnectErrorKind::AuthorizationViolation | ConnectErrorKind::Authentication => {
                let reason = match credentials {
                    NatsCredentials::None => "the server requires credentials and none were \
                        given (set nats.user and nats.password, nats.token, nats.nkey, \
                        nats.nkey_file or nats.creds, or their BATON_NATS_* variables)"
                        .to_string(),
                    _ => format!(
                        "the server refused {}; check them against its users",
                        credentials.describe()
                    ),
                };
                NatsConnectError::Authorization { url, reason, error }
            }
            ConnectErrorKind::Tls => NatsConnectError::Tls { url, error },
            ConnectErrorKind::ServerParse => NatsConnectError::InvalidUrl {
                url,
                error: error.to_string(),
            },
            // A failed handshake reaches the library as an I/O error carrying rustls's.
            ConnectErrorKind::Io
            | ConnectErrorKind::Dns
            | ConnectErrorKind::TimedOut
            | ConnectErrorKind::MaxReconnects => {
                if caused_by_tls(&error) {
                    NatsConnectError::Tls { url, error }
                } else {
                    NatsConnectError::Unreachable { url, error }
                }
            }
        }
    }
}

/// Whether a rustls error is somewhere in `error`'s chain (an `io::Error` hides its
/// inner error from `source()`; `get_ref` finds it).
fn caused_by_tls(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if e.is::<async_nats::rustls::Error>() {
            return true;
        }
        if let Some(inner) = e
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::get_ref)
        {
            if caused_by_tls(inner) {
                return true;
            }
        }
        next = e.source();
    }
    false
}

/// The server addresses of `url`: one or more, comma-separated.
fn server_addrs(url: &str) -> Result<Vec<ServerAddr>, NatsConnectError> {
    url.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(|u| {
            u.parse::<ServerAddr>()
                .map_err(|e| NatsConnectError::InvalidUrl {
                    url: url.to_string(),
                    error: e.to_string(),
                })
        })
        .collect::<Result<Vec<_>, _>>()
        .and_then(|addrs| {
            if addrs.is_empty() {
                Err(NatsConnectError::InvalidUrl {
                    url: url.to_string(),
                    error: "no server address".into(),
                })
            } else {
                Ok(addrs)
            }
        })
}

/// Connects to `config.url` (comma-separated URLs: any of them) with
/// [`connect_options`]; `name` names the connection on the server.
pub async fn connect(
    config: &NatsConfig,
    name: &str,
) -> Result<async_nats::Client, NatsConnectError> {
    let options = connect_options(config, name)?;
    let credentials = NatsCredentials::from_config(config)?;
    let addrs = server_addrs(&config.url)?;
    options
        .connect(addrs)
        .await
        .map_err(|e| NatsConnectError::from_connect(&config.url, &credentials, e))
}

/// The command-line flags of the NATS credentials and TLS settings, each with its
/// environment variable; every Baton binary flattens it into its own command line.
/// Secrets are best given through the environment (a command line is visible to every
/// user of the machine); `--help` never shows their values.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct NatsArgs {
    /// NATS user name, with --nats-password (overrides `nats.user`).
    #[arg(long = "nats-user", env = env::NATS_USER, global = true)]
    pub user: Option<String>,
    /// NATS password (overrides `nats.password`).
    #[arg(long = "nats-password", env = env::NATS_PASSWORD, hide_env_values = true, global = true, value_parser = secret)]
    pub password: Option<Secret>,
    /// NATS token (overrides `nats.token`).
    #[arg(long = "nats-token", env = env::NATS_TOKEN, hide_env_values = true, global = true, value_parser = secret)]
    pub token: Option<Secret>,
    /// NATS user NKey seed, SU… (overrides `nats.nkey`).
    #[arg(long = "nats-nkey", env = env::NATS_NKEY, hide_env_values = true, global = true, value_parser = secret)]
    pub nkey: Option<Secret>,
    /// File holding a NATS user NKey seed (overrides `nats.nkey_file`).
    #[arg(long = "nats-nkey-file", env = env::NATS_NKEY_FILE, global = true)]
    pub nkey_file: Option<PathBuf>,
    /// NATS credentials file, .creds (overrides `nats.creds`).
    #[arg(long = "nats-creds", env = env::NATS_CREDS, global = true)]
    pub creds: Option<PathBuf>,
    /// CA certificate (PEM) of the NATS server; implies TLS (overrides `nats.tls_ca`).
    #[arg(long = "nats-tls-ca", env = env::NATS_TLS_CA, global = true)]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS (overrides `nats.tls_cert`).
    #[arg(long = "nats-tls-cert", env = env::NATS_TLS_CERT, global = true)]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --nats-tls-cert (overrides `nats.tls_key`).
    #[arg(long = "nats-tls-key", env = env::NATS_TLS_KEY, global = true)]
    pub tls_key: Option<PathBuf>,
    /// Refuse a NATS connection without TLS (sets `nats.tls_required`).
    #[arg(long = "nats-tls-required", env = env::NATS_TLS_REQUIRED, global = true,
          action = clap::ArgAction::SetTrue, value_parser = clap::builder::FalseyValueParser::new())]
    pub tls_required: bool,
    /// First token of this process's reply subjects (overrides `nats.inbox_prefix`).
    #[arg(long = "nats-inbox-prefix", env = env::NATS_INBOX_PREFIX, global = true)]
    pub inbox_prefix: Option<String>,
}

fn secret(value: &str) -> Result<Secret, std::convert::Infallible> {
    Ok(Secret::new(value))
}

impl NatsArgs {
    /// Overrides the settings of `config` that these arguments give.
    pub fn apply(&self, config: &mut NatsConfig) {
        fn set<T: Clone>(target: &mut Option<T>, value: &Option<T>) {
            if let Some(v) = value {
                *target = Some(v.clone());
            }
        }
        set(&mut config.user, &self.user);
        set(&mut config.password, &self.password);
        set(&mut config.token, &self.token);
        set(&mut config.nkey, &self.nkey);
        set(&mut config.nkey_file, &self.nkey_file);
        set(&mut config.creds, &self.creds);
        set(&mut config.tls_ca, &self.tls_ca);
        set(&mut config.tls_cert, &self.tls_cert);
        set(&mut config.tls_key, &self.tls_key);
        if self.tls_required {
            config.tls_required = true;
        }
        if let Some(prefix) = &self.inbox_prefix {
            config.inbox_prefix = prefix.clone();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(edit: impl FnOnce(&mut NatsConfig)) -> NatsConfig {
        let mut c = NatsConfig::default();
        edit(&mut c);
        c
    }

    fn user_seed() -> (String, String) {
        let pair = nkeys::KeyPair::new_user();
        (
            pair.seed().expect("a new pair has a seed"),
            pair.public_key(),
        )
    }

    #[test]
    fn no_credentials_by_default() {
        let c = NatsConfig::default();
        assert_eq!(
            NatsCredentials::from_config(&c).expect("valid"),
            NatsCredentials::None
        );
        connect_options(&c, "test").expect("valid");
    }

    #[test]
    fn one_way_to_authenticate_at_a_time() {
        let c = config(|c| {
            c.user = Some("a".into());
            c.password = Some("p".into());
            c.token = Some("t".into());
        });
        let e = NatsCredentials::from_config(&c).expect_err("conflict");
        assert_eq!(e.kind(), "conflict");
        let text = e.to_string();
        assert!(
            text.contains("nats.user") && text.contains("nats.token"),
            "{text}"
        );
        assert!(text.contains("BATON_NATS_TOKEN"), "{text}");

        let (seed, _) = user_seed();
        let c = config(|c| {
            c.nkey = Some(seed.as_str().into());
            c.creds = Some("x.creds".into());
        });
        assert_eq!(
            NatsCredentials::from_config(&c)
                .expect_err("conflict")
                .kind(),
            "conflict"
        );
    }

    #[test]
    fn a_user_needs_a_password_and_a_password_a_user() {
        let e = NatsCredentials::from_config(&config(|c| c.user = Some("a".into())))
            .expect_err("incomplete");
        assert!(matches!(
            e,
            NatsConfigError::Incomplete {
                set: NatsSetting::User,
                missing: NatsSetting::Password
            }
        ));
        let e = NatsCredentials::from_config(&config(|c| c.password = Some("p".into())))
            .expect_err("incomplete");
        assert!(matches!(
            e,
            NatsConfigError::Incomplete {
                set: NatsSetting::Password,
                ..
            }
        ));
    }

    #[test]
    fn empty_values_count_as_unset() {
        let c = config(|c| {
            c.user = Some(String::new());
            c.token = Some("".into());
            c.creds = Some(PathBuf::new());
        });
        assert_eq!(
            NatsCredentials::from_config(&c).expect("valid"),
            NatsCredentials::None
        );
    }

    #[test]
    fn an_nkey_seed_is_checked_and_its_public_key_named() {
        let (seed, public) = user_seed();
        let c = config(|c| c.nkey = Some(seed.as_str().into()));
        let creds = NatsCredentials::from_config(&c).expect("valid");
        assert_eq!(creds.describe(), format!("the NKey {public}"));
        assert!(!format!("{creds:?}").contains(&seed));

        let bad = config(|c| c.nkey = Some("SUNOTASEED".into()));
        assert_eq!(
            NatsCredentials::from_config(&bad)
                .expect_err("invalid")
                .kind(),
            "invalid_nkey"
        );
        // An account seed is a seed, not a user's.
        let account = nkeys::KeyPair::new_account().seed().expect("seed");
        let c = config(|c| c.nkey = Some(account.as_str().into()));
        assert!(NatsCredentials::from_config(&c).is_err());
    }

    #[test]
    fn an_nkey_file_is_read_and_trimmed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (seed, public) = user_seed();
        let path = dir.path().join("worker.nk");
        std::fs::write(&path, format!("{seed}\n")).expect("write");
        let c = config(|c| c.nkey_file = Some(path.clone()));
        assert!(matches!(
            NatsCredentials::from_config(&c).expect("valid"),
            NatsCredentials::Nkey { public_key, .. } if public_key == public
        ));
        let missing = config(|c| c.nkey_file = Some(dir.path().join("absent.nk")));
        let e = NatsCredentials::from_config(&missing).expect_err("unreadable");
        assert_eq!(e.kind(), "unreadable_file");
        assert!(e.to_string().contains("absent.nk"), "{e}");
    }

    #[test]
    fn files_are_checked_before_connecting() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = dir.path().join("ca.pem");
        let c = config(|c| c.tls_ca = Some(ca.clone()));
        let e = connect_options(&c, "test").expect_err("missing CA");
        assert!(
            matches!(
                e,
                NatsConfigError::Read {
                    setting: NatsSetting::TlsCa,
                    ..
                }
            ),
            "{e}"
        );
        std::fs::write(&ca, "").expect("write");
        connect_options(&c, "test").expect("readable");

        let c = config(|c| c.tls_cert = Some(ca.clone()));
        assert!(matches!(
            connect_options(&c, "test").expect_err("no key"),
            NatsConfigError::Incomplete {
                set: NatsSetting::TlsCert,
                missing: NatsSetting::TlsKey
            }
        ));
        let garbage = dir.path().join("bad.creds");
        std::fs::write(&garbage, "not a creds file").expect("write");
        let c = config(|c| c.creds = Some(garbage.clone()));
        assert_eq!(
            connect_options(&c, "test").expect_err("invalid").kind(),
            "invalid_creds"
        );
    }

    #[test]
    fn inbox_prefixes_are_subject_tokens() {
        for good in ["_INBOX", "_INBOX_tenant", "acme.replies"] {
            assert!(valid_inbox_prefix(good), "{good}");
        }
        for bad in ["", "a b", "_INBOX.*", ">", "a..b", "a."] {
            assert!(!valid_inbox_prefix(bad), "{bad}");
        }
        let c = config(|c| c.inbox_prefix = "bad prefix".into());
        assert_eq!(
            connect_options(&c, "test").expect_err("invalid").kind(),
            "invalid_inbox_prefix"
        );
    }

    #[test]
    fn urls_may_be_comma_separated() {
        assert_eq!(
            server_addrs("nats://a:4222, nats://b:4222")
                .expect("valid")
                .len(),
            2
        );
        assert!(server_addrs("").is_err());
        assert!(server_addrs("nats://a:notaport").is_err());
    }

    #[test]
    fn flags_override_the_file() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            nats: NatsArgs,
        }
        let cli = Cli::try_parse_from([
            "x",
            "--nats-user",
            "client",
            "--nats-password",
            "hunter2",
            "--nats-tls-ca",
            "ca.pem",
            "--nats-tls-required",
            "--nats-inbox-prefix",
            "_INBOX_client",
        ])
        .expect("parse");
        let mut c = NatsConfig::default();
        cli.nats.apply(&mut c);
        assert_eq!(c.user.as_deref(), Some("client"));
        assert_eq!(c.password.as_ref().map(Secret::expose), Some("hunter2"));
        assert_eq!(c.tls_ca, Some(PathBuf::from("ca.pem")));
        assert!(c.tls_required);
        assert_eq!(c.inbox_prefix, "_INBOX_client");
        assert!(!format!("{:?}", cli.nats).contains("hunter2"));

        let untouched = Cli::try_parse_from(["x"]).expect("parse");
        let mut d = NatsConfig::default();
        untouched.nats.apply(&mut d);
        assert_eq!(d, NatsConfig::default());
    }

    #[tokio::test]
    async fn an_unreachable_server_is_named() {
        // A port nothing listens on: bound, then released.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("bind")
            .port();
        let c = config(|c| c.url = format!("nats://127.0.0.1:{port}"));
        let e = connect(&c, "test").await.expect_err("nothing listens");
        assert_eq!(e.kind(), "unreachable", "{e}");
        assert!(e.to_string().contains(&port.to_string()), "{e}");
    }
}
