//! `lockstep probe`: a canary prober for operators. It sends, from several synthetic tenants,
//! short requests that each carry one unique secret word, interleaved with over-long prompts and
//! with clients that leave mid-stream, over chat, completions and `/generate` (where served),
//! streamed and not, and checks every answer for another request's whole secret: the incident
//! this project exists to prevent, watched from outside. It speaks plain OpenAI-compatible HTTP,
//! so it audits any gateway, and lockstep's gRPC API with `--grpc`.
//!
//! Exit codes: 1 on a foreign secret in any answer or an over-long prompt answered as if it fit;
//! 2 when no response ever arrived; 3 when something answered but nothing could be verified on
//! some endpoint it was asked to watch (every request refused, say a 401 for a missing key, or
//! the endpoint not served): a prober that checked nothing must not say "no leak"; 0 otherwise
//! (other errors beside verified answers are counted and reported).

pub mod canary;
pub mod grpc;
pub mod http;
pub mod plan;
pub mod stats;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use canary::Secrets;
use plan::{Api, Job, Plan, Shape};
use stats::{Record, Stats};

/// `lockstep probe` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct ProbeArgs {
    /// Base URL of the endpoint to watch (`http://host:port` or `https://...`).
    #[arg(long)]
    pub target: String,
    /// Model to ask for (default: the first of `/v1/models`, or of `ListModels` with `--grpc`).
    #[arg(long)]
    pub model: Option<String>,
    /// An API key: one synthetic tenant per key (repeat the flag, or comma-separate them in
    /// `LOCKSTEP_PROBE_API_KEYS`). Without any, three anonymous tenants (open mode). A key on the
    /// command line is visible to every local user (`ps`): prefer `--api-key-file` or the
    /// environment variable.
    #[arg(
        long = "api-key",
        env = "LOCKSTEP_PROBE_API_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Vec<String>,
    /// A file of API keys, one per line (blank lines and `#` comments skipped), added to
    /// `--api-key`'s.
    #[arg(long)]
    pub api_key_file: Option<std::path::PathBuf>,
    /// An endpoint to watch (repeat the flag): `chat`, `completions`, `generate` (default: all
    /// three over HTTP, chat and generate with `--grpc`). Each must complete requests, or the
    /// probe exits 3: give only those the target serves.
    #[arg(long = "endpoint", value_enum)]
    pub endpoints: Vec<Api>,
    /// Probe for this many seconds (requests in flight at the end get 10 s, then are cancelled
    /// and not counted).
    #[arg(long, conflicts_with = "once")]
    pub duration: Option<u64>,
    /// Send one round (every tenant, endpoint, mode and shape once) and stop (the default).
    #[arg(long)]
    pub once: bool,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// Words in an over-long prompt (default: `max_model_len` + 1 from `/v1/models`; without
    /// either, no over-long prompts are sent).
    #[arg(long)]
    pub long_prompt_words: Option<u64>,
    /// Serve Prometheus metrics (`/metrics`) on this address while probing.
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
    /// Probe lockstep's gRPC API (`lockstep.v1`: Chat and Generate) instead of HTTP.
    #[arg(long)]
    pub grpc: bool,
}

/// The grace after `--duration` for requests in flight.
pub const GRACE: Duration = Duration::from_secs(10);

#[derive(Clone, Debug)]
enum Target {
    Http(http::HttpTarget),
    Grpc(grpc::GrpcTarget),
}

impl Target {
    async fn discover(&self, key: Option<&str>) -> http::Discovery {
        match self {
            Target::Http(t) => t.discover(key).await,
            Target::Grpc(t) => t.discover(key).await,
        }
    }

    async fn run(&self, job: &Job, model: &str, key: Option<&str>) -> http::Answer {
        match self {
            Target::Http(t) => t.run(job, model, key).await,
            Target::Grpc(t) => t.run(job, model, key).await,
        }
    }
}

/// The shared state of one probe run.
struct Run {
    target: Target,
    model: String,
    keys: Vec<String>,
    grpc: bool,
    secrets: Secrets,
    stats: Arc<Stats>,
    plan: Plan,
    queue: tokio::sync::Mutex<(VecDeque<Job>, usize)>,
    once: bool,
    deadline: Option<Instant>,
}

impl Run {
    /// The next job: from the current round, or a new round (until the deadline; one round with
    /// `--once`).
    async fn next(&self) -> Option<Job> {
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return None;
        }
        let mut q = self.queue.lock().await;
        if q.0.is_empty() {
            if self.once && q.1 > 0 {
                return None;
            }
            let n = q.1;
            q.0 = self.plan.round(&self.secrets, n).into();
            q.1 += 1;
        }
        q.0.pop_front()
    }

    async fn one(&self, job: &Job) {
        let endpoint = job.endpoint(self.grpc);
        if self.stats.skipped(&endpoint) {
            return;
        }
        let key = match self.keys.len() {
            0 => None,
            n => Some(self.keys[job.tenant % n].as_str()),
        };
        let a = self.target.run(job, &self.model, key).await;
        // An endpoint the target does not serve is skipped, not counted (a 404 naming the
        // model is an error of a served endpoint).
        if matches!(a.status, Some(404 | 405)) && !a.raw.contains("model") {
            self.stats.responded();
            self.stats
                .skip(&endpoint, &format!("answered {}", a.status.unwrap_or(0)));
            return;
        }
        let leaks = self
            .secrets
            .foreign_in(&format!("{}\n{}", a.text, a.raw), job.secret.as_deref());
        self.stats.record(&Record {
            endpoint,
            over_long: job.shape == Shape::OverLong,
            outcome: a.outcome,
            responded: a.responded,
            leaks,
            latency: a.latency,
        });
    }
}

/// What a probe run ends with.
#[derive(Debug, Clone)]
pub struct Report {
    /// The exit code (0, 1 or 2).
    pub code: u8,
    /// The summary (what `lockstep probe` prints).
    pub text: String,
    /// The run's totals.
    pub totals: stats::Totals,
}

/// Runs the probe, prints its summary to stdout and returns its exit code.
pub async fn run(args: ProbeArgs) -> u8 {
    let r = probe(args).await;
    print!("{}", r.text);
    r.code
}

/// Runs the probe and returns its exit code and summary.
pub async fn probe(args: ProbeArgs) -> Report {
    use std::fmt::Write as _;
    let mut text = String::new();
    let target = if args.grpc {
        grpc::GrpcTarget::new(&args.target).map(Target::Grpc)
    } else {
        http::HttpTarget::new(&args.target).map(Target::Http)
    };
    let target = match target {
        Ok(t) => t,
        Err(e) => {
            return Report {
                code: 2,
                text: format!("lockstep probe: {e}\n"),
                totals: stats::Totals::default(),
            };
        }
    };
    let mut args = args;
    if let Some(path) = args.api_key_file.take() {
        match std::fs::read_to_string(&path) {
            Ok(t) => args.api_keys.extend(
                t.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(str::to_string),
            ),
            Err(e) => {
                return Report {
                    code: 2,
                    text: format!("lockstep probe: --api-key-file {}: {e}\n", path.display()),
                    totals: stats::Totals::default(),
                };
            }
        }
    }
    let apis = match (args.endpoints.is_empty(), args.grpc) {
        (false, _) => {
            let mut a = args.endpoints.clone();
            a.sort();
            a.dedup();
            a
        }
        (true, true) => vec![Api::Chat, Api::Generate],
        (true, false) => vec![Api::Chat, Api::Completions, Api::Generate],
    };
    if args.grpc && apis.contains(&Api::Completions) {
        return Report {
            code: 2,
            text: "lockstep probe: --endpoint completions is not in lockstep's gRPC API (chat, generate)\n".into(),
            totals: stats::Totals::default(),
        };
    }
    let modes = if args.grpc {
        vec![true]
    } else {
        vec![false, true]
    };
    let expected: Vec<String> = apis
        .iter()
        .flat_map(|&api| {
            modes
                .iter()
                .map(move |&stream| api.endpoint(stream, args.grpc))
        })
        .collect();
    let stats = Arc::new(Stats::default());
    let _metrics = match args.metrics_listen {
        Some(addr) => match serve_metrics(addr, stats.clone()).await {
            Ok(h) => Some(h),
            Err(e) => {
                return Report {
                    code: 2,
                    text: format!("lockstep probe: --metrics-listen {addr}: {e}\n"),
                    totals: stats::Totals::default(),
                };
            }
        },
        None => None,
    };
    let found = target
        .discover(args.api_keys.first().map(String::as_str))
        .await;
    if found.responded {
        stats.responded();
    }
    let Some(model) = args.model.clone().or(found.first.clone()) else {
        let _ = writeln!(
            text,
            "lockstep probe: {}: {}; give --model",
            args.target,
            if found.responded {
                "the model list named no model"
            } else {
                "no answer to the model list"
            }
        );
        let code = stats.exit_code(&expected);
        if code == 3 {
            let _ = writeln!(text, "result: NOT VERIFIED: no request was sent (exit 3)");
        }
        return Report {
            code,
            text,
            totals: stats.totals(),
        };
    };
    let long_words = args.long_prompt_words.or_else(|| {
        found
            .max_model_len
            .iter()
            .find(|(m, _)| *m == model)
            .map(|(_, n)| n + 1)
    });
    let plan = Plan {
        apis,
        modes,
        tenants: args
            .api_keys
            .len()
            .max(if args.api_keys.is_empty() { 3 } else { 1 }),
        long_words,
    };
    let started = Instant::now();
    let run = Arc::new(Run {
        target,
        model: model.clone(),
        keys: args.api_keys.clone(),
        grpc: args.grpc,
        secrets: Secrets::default(),
        stats: stats.clone(),
        plan,
        queue: tokio::sync::Mutex::new((VecDeque::new(), 0)),
        once: args.duration.is_none(),
        deadline: args.duration.map(|s| started + Duration::from_secs(s)),
    });
    let hard_stop = run.deadline.map(|d| d + GRACE);
    let mut workers = Vec::new();
    for _ in 0..args.concurrency.max(1) {
        let run = run.clone();
        workers.push(tokio::spawn(async move {
            while let Some(job) = run.next().await {
                match hard_stop {
                    Some(stop) => {
                        let stop = tokio::time::Instant::from_std(stop);
                        tokio::select! {
                            _ = run.one(&job) => {}
                            // Cancelled after the grace: not counted.
                            _ = tokio::time::sleep_until(stop) => break,
                        }
                    }
                    None => run.one(&job).await,
                }
            }
        }));
    }
    for w in workers {
        let _ = w.await;
    }
    let code = stats.exit_code(&expected);
    let _ = writeln!(
        text,
        "lockstep probe: {} ({}), model {model}, {:.1} s, over-long prompts: {}",
        args.target,
        if args.grpc { "gRPC" } else { "HTTP" },
        started.elapsed().as_secs_f64(),
        match long_words {
            Some(n) => format!("{n} words"),
            None => "off (no max_model_len and no --long-prompt-words)".into(),
        }
    );
    text.push_str(&stats.table());
    let unverified = stats.unverified(&expected).join(", ");
    let _ = writeln!(
        text,
        "result: {} (exit {code})",
        match code {
            0 => "no foreign content seen".to_string(),
            1 => "FAILED: foreign content, or an over-long prompt answered as if it fit".into(),
            2 => "no response ever arrived".into(),
            _ => format!(
                "NOT VERIFIED: no request completed on {unverified} (refused, failed or not served: check the key, the model and --endpoint)"
            ),
        }
    );
    Report {
        code,
        text,
        totals: stats.totals(),
    }
}

async fn serve_metrics(
    addr: SocketAddr,
    stats: Arc<Stats>,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let stats = stats.clone();
            async move {
                (
                    [(
                        ::http::header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    stats.prometheus(),
                )
            }
        }),
    );
    Ok(tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    }))
}
