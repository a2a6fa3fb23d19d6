//! `baton-coordinator`: parses the configuration, sets up logging, runs the coordinator.

use anyhow::Context as _;
use baton_common::env;
use baton_coordinator::config::Config;
use clap::Parser;
use tracing_subscriber::EnvFilter;

#[actix_web::main]
async fn main() -> std::process::ExitCode {
    baton_common::exit::report(run().await)
}

async fn run() -> anyhow::Result<()> {
    let filter = EnvFilter::try_from_env(env::LOG).unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var(env::LOG_FORMAT).is_ok_and(|f| f == "json");
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
    let cluster = Config::parse().load().context("configuration")?;
    baton_coordinator::run(cluster).await?;
    Ok(())
}
