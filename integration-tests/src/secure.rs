//! A NATS server that checks who connects and what each may do: the accounts and
//! permissions of `docs/nats-accounts.conf` (the shipped file itself), fresh credentials
//! for every role, and optionally TLS with a CA made for the test.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use baton_integration_tests::{Cluster, ClusterOptions};
//! # use baton_integration_tests::secure::NatsSecurity;
//! let security = Arc::new(NatsSecurity::new().with_tls(false));
//! let cluster = Cluster::start(ClusterOptions::simulated(1).secured(security.clone()));
//! ```
//!
//! The coordinator and the workers get their credentials through the environment
//! (`BATON_NATS_USER`, `BATON_NATS_NKEY`, …) and the TLS files through `cluster.toml`,
//! so that both ways are exercised.

use std::{
    ffi::OsString,
    hash::{BuildHasher, Hasher},
    path::{Path, PathBuf},
};

use baton_common::{config::NatsConfig, env, secret::Secret};
use tempfile::TempDir;

use crate::{process::Nats, workspace_root};

/// The shipped accounts file, relative to the repository root.
pub const ACCOUNTS_CONF: &str = "docs/nats-accounts.conf";

/// The inbox prefix the accounts file reserves for the cluster's own processes.
pub const CLUSTER_INBOX_PREFIX: &str = "_INBOX_baton";

/// The inbox prefix of the accounts file's `tenant` user.
pub const TENANT_INBOX_PREFIX: &str = "_INBOX_tenant";

/// Who connects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A coordinator (user and password).
    Coordinator,
    /// A worker (NKey).
    Worker,
    /// A client of the public API (user and password, the default inbox).
    Client,
    /// A client with its own inbox prefix ([`TENANT_INBOX_PREFIX`]).
    Tenant,
    /// An operator: a client that may also drain workers.
    Operator,
}

/// TLS files made for one test: a CA, the server's certificate (for `localhost` and
/// `127.0.0.1`) and a client certificate, all signed by that CA.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The CA certificate (PEM).
    pub ca: PathBuf,
    /// The server's certificate.
    pub server_cert: PathBuf,
    /// Its key.
    pub server_key: PathBuf,
    /// A client certificate (for mutual TLS).
    pub client_cert: PathBuf,
    /// Its key.
    pub client_key: PathBuf,
    /// Whether the server asks every client for a certificate (`verify: true`).
    pub verify_clients: bool,
}

/// Credentials for every role, and the server configuration that knows them.
#[derive(Debug)]
pub struct NatsSecurity {
    coordinator_password: Secret,
    client_password: Secret,
    tenant_password: Secret,
    operator_password: Secret,
    /// The workers' NKey seed.
    worker_seed: Secret,
    /// Its public key, as the server knows it.
    worker_public_key: String,
    /// TLS, when asked for.
    tls: Option<TlsFiles>,
    /// Holds the server's configuration and the TLS files.
    dir: TempDir,
}

/// A fresh password (not for production: a test's server lives for seconds).
fn password() -> Secret {
    let state = std::collections::hash_map::RandomState::new();
    let mut hasher = state.build_hasher();
    hasher.write_u64(1);
    Secret::new(format!("pw-{:016x}", hasher.finish()))
}

impl Default for NatsSecurity {
    fn default() -> Self {
        Self::new()
    }
}

impl NatsSecurity {
    /// Fresh credentials for every role, without TLS.
    pub fn new() -> Self {
        let worker = nkeys::KeyPair::new_user();
        NatsSecurity {
            coordinator_password: password(),
            client_password: password(),
            tenant_password: password(),
            operator_password: password(),
            worker_seed: Secret::new(worker.seed().expect("a new key pair has a seed")),
            worker_public_key: worker.public_key(),
            tls: None,
            dir: tempfile::tempdir().expect("creating a temporary directory"),
        }
    }

    /// Adds TLS: a new CA and certificates; with `verify_clients`, the server asks
    /// every client for a certificate signed by that CA (mutual TLS).
    pub fn with_tls(mut self, verify_clients: bool) -> Self {
        self.tls = Some(make_tls(self.dir.path(), verify_clients));
        self
    }

    /// The TLS files, when TLS is on.
    pub fn tls(&self) -> Option<&TlsFiles> {
        self.tls.as_ref()
    }

    /// The password of a role that has one.
    pub fn password(&self, role: Role) -> Option<&Secret> {
        match role {
            Role::Coordinator => Some(&self.coordinator_password),
            Role::Client => Some(&self.client_password),
            Role::Tenant => Some(&self.tenant_password),
            Role::Operator => Some(&self.operator_password),
            Role::Worker => None,
        }
    }

    /// The server's configuration: the shipped accounts file, included as the
    /// operations guide shows, and a `tls` block when TLS is on. Written once.
    pub fn server_conf(&self) -> PathBuf {
        let dir = self.dir.path();
        let accounts = dir.join("nats-accounts.conf");
        std::fs::copy(workspace_root().join(ACCOUNTS_CONF), &accounts)
            .expect("copying docs/nats-accounts.conf");
        let mut text = String::from("include \"nats-accounts.conf\"\n");
        if let Some(tls) = &self.tls {
            text.push_str(&format!(
                "tls {{\n  cert_file: {:?}\n  key_file: {:?}\n  ca_file: {:?}\n  verify: {}\n  timeout: 5\n}}\n",
                tls.server_cert.display().to_string(),
                tls.server_key.display().to_string(),
                tls.ca.display().to_string(),
                tls.verify_clients,
            ));
        }
        let conf = dir.join("nats-server.conf");
        std::fs::write(&conf, text).expect("writing the server configuration");
        conf
    }

    /// The server's environment: the secrets the accounts file reads.
    pub fn server_env(&self) -> Vec<(OsString, OsString)> {
        [
            (
                "BATON_COORDINATOR_PASSWORD",
                self.coordinator_password.expose(),
            ),
            ("BATON_CLIENT_PASSWORD", self.client_password.expose()),
            ("BATON_TENANT_PASSWORD", self.tenant_password.expose()),
            ("BATON_OPERATOR_PASSWORD", self.operator_password.expose()),
            ("BATON_WORKER_NKEY", self.worker_public_key.as_str()),
        ]
        .into_iter()
        .map(|(k, v)| (k.into(), v.into()))
        .collect()
    }

    /// Starts `nats-server` with this configuration; `None` when it is not installed.
    pub fn start_nats(&self) -> Option<Nats> {
        let conf = self.server_conf();
        Nats::start_with(vec!["-c".into(), conf.into()], self.server_env())
    }

    /// The `[nats]` lines every process of the cluster shares: the cluster's inbox
    /// prefix and, with TLS, the CA (and client certificate under mutual TLS).
    pub fn cluster_toml_lines(&self) -> String {
        let mut lines = format!("inbox_prefix = \"{CLUSTER_INBOX_PREFIX}\"");
        if let Some(tls) = &self.tls {
            lines.push_str(&format!("\ntls_ca = {:?}", tls.ca.display().to_string()));
            if tls.verify_clients {
                lines.push_str(&format!(
                    "\ntls_cert = {:?}\ntls_key = {:?}",
                    tls.client_cert.display().to_string(),
                    tls.client_key.display().to_string()
                ));
            }
        }
        lines
    }

    /// The environment that gives a process `role`'s credentials (`BATON_NATS_*`);
    /// TLS files are not in it (see [`NatsSecurity::cluster_toml_lines`]).
    pub fn env(&self, role: Role) -> Vec<(&'static str, String)> {
        match role {
            Role::Worker => vec![(env::NATS_NKEY, self.worker_seed.expose().to_string())],
            Role::Coordinator | Role::Client | Role::Tenant | Role::Operator => {
                let mut vars = vec![
                    (env::NATS_USER, user(role).to_string()),
                    (
                        env::NATS_PASSWORD,
                        self.password(role)
                            .map(|p| p.expose().to_string())
                            .unwrap_or_default(),
                    ),
                ];
                if role == Role::Tenant {
                    vars.push((env::NATS_INBOX_PREFIX, TENANT_INBOX_PREFIX.to_string()));
                }
                vars
            }
        }
    }

    /// The environment of a `baton` client process as `role`: credentials, and the TLS
    /// files a client needs.
    pub fn client_env(&self, role: Role) -> Vec<(&'static str, String)> {
        let mut vars = self.env(role);
        if let Some(tls) = &self.tls {
            vars.push((env::NATS_TLS_CA, tls.ca.display().to_string()));
            if tls.verify_clients {
                vars.push((env::NATS_TLS_CERT, tls.client_cert.display().to_string()));
                vars.push((env::NATS_TLS_KEY, tls.client_key.display().to_string()));
            }
        }
        vars
    }

    /// The settings of an in-process connection as `role` to `url`: credentials, inbox
    /// prefix and TLS files.
    pub fn nats_config(&self, role: Role, url: &str) -> NatsConfig {
        let mut config = NatsConfig {
            url: url.to_string(),
            ..NatsConfig::default()
        };
        match role {
            Role::Worker => config.nkey = Some(self.worker_seed.clone()),
            Role::Coordinator | Role::Client | Role::Tenant | Role::Operator => {
                config.user = Some(user(role).to_string());
                config.password = self.password(role).cloned();
            }
        }
        config.inbox_prefix = match role {
            Role::Coordinator | Role::Worker => CLUSTER_INBOX_PREFIX,
            Role::Tenant => TENANT_INBOX_PREFIX,
            Role::Client | Role::Operator => baton_common::config::DEFAULT_INBOX_PREFIX,
        }
        .to_string();
        if let Some(tls) = &self.tls {
            config.tls_ca = Some(tls.ca.clone());
            if tls.verify_clients {
                config.tls_cert = Some(tls.client_cert.clone());
                config.tls_key = Some(tls.client_key.clone());
            }
        }
        config
    }
}

/// The user name of a password role in the accounts file.
fn user(role: Role) -> &'static str {
    match role {
        Role::Coordinator => "coordinator",
        Role::Client => "client",
        Role::Tenant => "tenant",
        Role::Operator => "operator",
        Role::Worker => "",
    }
}

/// Makes a CA, a server certificate and a client certificate under `dir`.
fn make_tls(dir: &Path, verify_clients: bool) -> TlsFiles {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, KeyUsagePurpose,
    };
    let write = |name: &str, text: String| {
        let path = dir.join(name);
        std::fs::write(&path, text).expect("writing a TLS file");
        path
    };
    let ca_key = KeyPair::generate().expect("a CA key");
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "Baton test CA");
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca.self_signed(&ca_key).expect("self-signing the CA");
    let ca_path = write("ca.pem", ca_cert.pem());
    let issuer = Issuer::new(ca, ca_key);

    let leaf = |names: Vec<String>, usage: ExtendedKeyUsagePurpose, stem: &str| {
        let key = KeyPair::generate().expect("a key");
        let mut params = CertificateParams::new(names).expect("certificate parameters");
        params.distinguished_name.push(DnType::CommonName, stem);
        params.extended_key_usages = vec![usage];
        let cert = params.signed_by(&key, &issuer).expect("signing");
        (
            write(&format!("{stem}.pem"), cert.pem()),
            write(&format!("{stem}-key.pem"), key.serialize_pem()),
        )
    };
    let (server_cert, server_key) = leaf(
        vec!["localhost".into(), "127.0.0.1".into()],
        ExtendedKeyUsagePurpose::ServerAuth,
        "server",
    );
    let (client_cert, client_key) = leaf(
        vec!["baton-client".into()],
        ExtendedKeyUsagePurpose::ClientAuth,
        "client",
    );
    TlsFiles {
        ca: ca_path,
        server_cert,
        server_key,
        client_cert,
        client_key,
        verify_clients,
    }
}
