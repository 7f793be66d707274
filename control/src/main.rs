//! `pd-control` binary: parse arguments, set up logging, run the service.

use std::io::IsTerminal;
use std::process::ExitCode;

use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let (config, warnings) =
        match pd_control::Config::try_parse_with_env(std::env::args_os(), |name| {
            std::env::var(name).ok()
        }) {
            Ok(parsed) => parsed,
            Err(error) => error.exit(),
        };
    for warning in warnings {
        tracing::warn!("{warning}");
    }
    match pd_control::run(config).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!(%error, "pd-control failed");
            eprintln!("pd-control: {error}");
            ExitCode::FAILURE
        }
    }
}
