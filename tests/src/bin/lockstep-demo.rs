//! One command on a fresh machine: the bundled PD mock plus lockstep in front of it, configured
//! by `config/mock-pd.toml` (the mock listens where that file's workers point).

use std::path::PathBuf;

use clap::Parser;
use lockstep_core::config::Config;
use lockstep_router::app::Lockstep;
use lockstep_tests::sglang_mock::{MockConfig, PdMock};
use lockstep_tests::tokenizer;

/// Start the SGLang PD mock and lockstep in front of it.
#[derive(Parser, Debug)]
struct Args {
    /// lockstep configuration; its first model's first prefill and decode URLs are where the mock listens.
    #[arg(long, default_value = "config/mock-pd.toml")]
    config: PathBuf,
}

fn addr_of(url: &str) -> Result<std::net::SocketAddr, String> {
    url.trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .map_err(|e| format!("{url}: {e}"))
}

#[tokio::main]
async fn main() -> Result<(), String> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
        .with_target(false)
        .init();
    let args = Args::parse();
    let cfg = Config::load(&args.config).map_err(|e| e.to_string())?;
    let m = cfg.models.first().ok_or("no model")?;
    let p = addr_of(&m.prefill.workers.first().ok_or("no prefill worker")?.url)?;
    let d = addr_of(&m.decode.workers.first().ok_or("no decode worker")?.url)?;
    let mock = PdMock::start_on(
        MockConfig {
            total_pages: 4096,
            ..MockConfig::default()
        },
        tokenizer::build(),
        p,
        d,
    )
    .await
    .map_err(|e| format!("mock: {e}"))?;
    tracing::info!(prefill = %mock.prefill_url(), decode = %mock.decode_url(), "SGLang PD mock listening");
    let running = Lockstep::start(cfg).await?;
    tracing::info!(
        "try: curl -s http://{}/v1/chat/completions -H 'content-type: application/json' -d '{{\"model\":\"mock-pd\",\"messages\":[{{\"role\":\"user\",\"content\":\"hello world\"}}]}}'",
        running.http_addr
    );
    tokio::signal::ctrl_c().await.map_err(|e| e.to_string())?;
    running.shutdown().await;
    Ok(())
}
