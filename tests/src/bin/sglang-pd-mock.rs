//! Runs the PD-faithful SGLang mock pair on fixed ports (for benchmarks and manual use).

use clap::Parser;
use lockstep_tests::sglang_mock::{MockConfig, PdMock};
use lockstep_tests::tokenizer;

/// Serve a mock SGLang prefill server and decode server on loopback.
#[derive(Parser, Debug)]
struct Args {
    /// Prefill server address.
    #[arg(long, default_value = "127.0.0.1:30001")]
    prefill: std::net::SocketAddr,
    /// Decode server address.
    #[arg(long, default_value = "127.0.0.1:30002")]
    decode: std::net::SocketAddr,
    /// Pages in the shared KV pool.
    #[arg(long, default_value_t = 4096)]
    pages: usize,
    /// Delay between decode tokens, in microseconds.
    #[arg(long, default_value_t = 0)]
    token_delay_us: u64,
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let a = Args::parse();
    let cfg = MockConfig {
        total_pages: a.pages,
        token_delay: std::time::Duration::from_micros(a.token_delay_us),
        ..MockConfig::default()
    };
    let mock = PdMock::start_on(cfg, tokenizer::build(), a.prefill, a.decode).await?;
    println!(
        "prefill {} decode {}",
        mock.prefill_url(),
        mock.decode_url()
    );
    tokio::signal::ctrl_c().await?;
    Ok(())
}
