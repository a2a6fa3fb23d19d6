//! What crosses the wire between Baton's processes, and nothing else: ids, message
//! types, subject names, configuration types, and how every process connects to NATS.
//!
//! # Layout
//! - [`chain`]: the token hash chain that names KV states.
//! - [`ids`]: worker, coordinator and stream ids.
//! - [`subjects`]: NATS subject names, built in one place.
//! - [`protocol`]: coordinator ⇄ worker messages (rkyv), checked decoding.
//! - [`public`]: the public NATS API's headers, admin bodies and rkyv replies.
//! - [`grammar`]: structured output's grammars compiled with llguidance.
//! - [`config`]: `cluster.toml` types.
//! - [`nats`]: connecting to NATS with the configured credentials and TLS.
//! - [`secret`]: values that never print (keys, passwords).
//! - [`throttle`]: warnings a remote party can repeat, logged once per interval.
//! - [`env`](mod@env): the names of every environment variable Baton reads.
//! - [`fuzz`]: what the `wire` fuzz target feeds arbitrary bytes to, and the replay of
//!   past crash inputs that every crate's regression test runs.

#![deny(missing_docs)]

pub mod chain;
pub mod config;
pub mod env;
pub mod exit;
pub mod fuzz;
pub mod grammar;
pub mod ids;
pub mod nats;
pub mod protocol;
pub mod public;
pub mod secret;
pub mod subjects;
pub mod throttle;
pub mod tools;
