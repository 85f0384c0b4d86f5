//! The `lockstep` command line.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use lockstep::app::{Lockstep, check_deployment};
use lockstep::backend::UpstreamClient;
use lockstep::config::Config;

// Many small short-lived allocations per request (JSON, frames): mimalloc measurably beats glibc.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// lockstep: a router for disaggregated LLM inference that pairs prefill and decode, aborts both
/// halves together, and never returns an answer it cannot prove belongs to the caller.
#[derive(Parser, Debug)]
#[command(name = "lockstep", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the models of a configuration file.
    Serve {
        /// Configuration file (TOML).
        #[arg(short, long, env = "LOCKSTEP_CONFIG")]
        config: PathBuf,
        /// Override `server.http_listen`.
        #[arg(long)]
        http_listen: Option<SocketAddr>,
        /// Override `server.log_level` (e.g. `debug`, `lockstep=debug,info`).
        #[arg(long)]
        log_level: Option<String>,
    },
    /// Validate a configuration file, list every problem, exit non-zero if there is one.
    Check {
        /// Configuration file (TOML).
        #[arg(short, long)]
        config: PathBuf,
        /// Do not ask workers for their KV capacity; check the configured numbers only.
        #[arg(long)]
        offline: bool,
    },
}

fn init_logs(level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .try_init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The runtime's size comes from the config, so the config is read before the runtime exists.
    let threads = match &cli.command {
        Command::Serve { config, .. } => Config::load(config)
            .map(|c| c.server.worker_threads)
            .unwrap_or(0),
        Command::Check { .. } => 1,
    };
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if threads > 0 {
        rt.worker_threads(threads);
    }
    match rt.enable_all().build() {
        Ok(rt) => rt.block_on(run(cli)),
        Err(e) => {
            eprintln!("cannot start the async runtime: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Check { config, offline } => {
            init_logs("warn");
            let cfg = match Config::load(&config) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::FAILURE;
                }
            };
            if !offline {
                let client = UpstreamClient::new(std::time::Duration::from_millis(
                    cfg.server.connect_timeout_ms,
                ));
                let mut failed = false;
                for m in &cfg.models {
                    if let Err(e) = check_deployment(&client, m).await {
                        eprintln!("{}: {e}", config.display());
                        failed = true;
                    }
                }
                if failed {
                    return ExitCode::FAILURE;
                }
            }
            println!("{}: OK ({} model(s))", config.display(), cfg.models.len());
            ExitCode::SUCCESS
        }
        Command::Serve {
            config,
            http_listen,
            log_level,
        } => {
            let mut cfg = match Config::load(&config) {
                Ok(c) => c,
                Err(e) => {
                    init_logs("info");
                    eprintln!("{e}");
                    return ExitCode::FAILURE;
                }
            };
            if let Some(a) = http_listen {
                cfg.server.http_listen = a;
            }
            if let Some(l) = log_level {
                cfg.server.log_level = l;
            }
            init_logs(&cfg.server.log_level);
            let running = match Lockstep::start(cfg).await {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("{}: refusing to start:\n{e}", config.display());
                    return ExitCode::FAILURE;
                }
            };
            serve_until_stopped(&running, &config).await;
            tracing::info!("shutting down");
            running.shutdown().await;
            ExitCode::SUCCESS
        }
    }
}

/// Waits for SIGINT or SIGTERM; on SIGHUP reloads the configuration file (validate, deployment
/// check, swap atomically; an invalid file is refused with its reasons and the old one kept).
async fn serve_until_stopped(running: &Lockstep, path: &std::path::Path) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut hup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
    ) else {
        let _ = tokio::signal::ctrl_c().await;
        return;
    };
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return,
            _ = term.recv() => return,
            _ = hup.recv() => {
                let result = match Config::load(path) {
                    Ok(cfg) => running.reload(cfg).await,
                    Err(e) => Err(e.to_string()),
                };
                if let Err(e) = result {
                    tracing::error!(config = %path.display(), "reload refused, keeping the running configuration:\n{e}");
                }
            }
        }
    }
}
