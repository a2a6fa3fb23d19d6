//! `baton`: chat, complete, status and drain from the terminal (see `baton --help`).

use baton_client::cli::{run, Cli};
use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    baton_common::exit::report(run(Cli::parse()).await)
}
