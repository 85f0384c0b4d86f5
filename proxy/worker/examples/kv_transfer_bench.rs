//! KV transfer throughput between two processes' worth of endpoints on loopback: the worker
//! service's `PushKv` (the exact messages a prefill worker sends: manifest, then pages, over one
//! h2 connection, into a real decode worker's room) against a plain TCP copy of the same bytes
//! (`write_all` into a socket whose reader discards them, one 1-byte ack per set, like the push's
//! reply). Same process, same runtime, same loopback.
//!
//! ```text
//! cargo run --release -p lockstep-worker --example kv_transfer_bench -- [--pages 64] [--sets 20] [--tls]
//! ```
//!
//! `--tls`: the worker plane under mutual TLS (a CA and a leaf made here), as deployed off
//! loopback; the plain TCP copy stays plaintext, as the floor.
//!
//! Needs the model file (the decode worker loads it): `scripts/fetch-model.sh`. Prints a table
//! and one JSON line.

use std::time::{Duration, Instant};

use lockstep_engine::pool::KvDtype;
use lockstep_engine::transfer::{KvManifest, KvTransfer, ModelFingerprint, PageData};
use lockstep_proto::MAX_MESSAGE_BYTES;
use lockstep_proto::v1 as pb;
use lockstep_proto::v1::worker_client::WorkerClient;
use lockstep_worker::kvmac::KvKey;
use lockstep_worker::pb::push_messages;
use lockstep_worker::{Role, RunningWorker, WorkerFile};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

// The allocator the `lockstep` binary runs with.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// SmolLM2-135M's f16 page of 16 tokens: 30 layers × 3 KV heads × 64 × (K, V) × 16 × 2 bytes.
const PAGE_BYTES: usize = 30 * 3 * 64 * 2 * 16 * 2;

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn set(pair_id: u64, pages: usize, model: ModelFingerprint) -> KvTransfer {
    let mut seed = pair_id.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let pages: Vec<PageData> = (0..pages)
        .map(|i| {
            let bytes: Vec<u8> = (0..PAGE_BYTES)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect();
            let bytes = bytes.into();
            PageData {
                index: i as u32,
                pair_id,
                bytes,
            }
        })
        .collect();
    let mut manifest = KvManifest {
        pair_id,
        model,
        tokens: (pages.len() * 16) as u64,
        page_size: 16,
        dtype: KvDtype::F16,
        page_count: pages.len() as u32,
        page_checksums: pages
            .iter()
            .map(|p| xxhash_rust::xxh3::xxh3_64(&p.bytes))
            .collect(),
        manifest_checksum: 0,
    };
    manifest.manifest_checksum = manifest.compute_checksum();
    KvTransfer {
        manifest,
        pages,
        prompt_logprobs: None,
    }
}

/// A CA and one leaf for 127.0.0.1 it signs, as the plane's files in `dir`.
fn plane_files(
    dir: &std::path::Path,
) -> Result<lockstep_runtime::tls::PlaneTlsFiles, Box<dyn std::error::Error>> {
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let issuer = rcgen::CertifiedIssuer::self_signed(ca, rcgen::KeyPair::generate()?)?;
    let key = rcgen::KeyPair::generate()?;
    let leaf =
        rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])?.signed_by(&key, &issuer)?;
    let files = lockstep_runtime::tls::PlaneTlsFiles {
        cert_file: dir.join("leaf.pem"),
        key_file: dir.join("leaf-key.pem"),
        ca_file: dir.join("ca.pem"),
    };
    std::fs::write(&files.ca_file, issuer.pem())?;
    std::fs::write(&files.cert_file, leaf.pem())?;
    std::fs::write(&files.key_file, key.serialize_pem())?;
    Ok(files)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pages = arg("--pages", 64);
    let sets = arg("--sets", 20);
    let tls = std::env::args().any(|a| a == "--tls");
    let mut file = WorkerFile::defaults(std::path::Path::new("."));
    file.worker.listen = "127.0.0.1:0".parse()?;
    file.worker.log_level = "warn".into();
    let dir = tempfile::tempdir()?;
    if tls {
        file.worker.tls = Some(plane_files(dir.path())?);
    }
    let decode = RunningWorker::start(Role::Decode, file.clone()).await?;
    let prefill = RunningWorker::start(Role::Prefill, file.clone()).await?;
    let url = format!("{}://{}", if tls { "https" } else { "http" }, decode.addr);
    let plane = match &file.worker.tls {
        Some(f) => Some(lockstep_runtime::tls::PlaneTls::load(f)?),
        None => None,
    };
    let ch = lockstep_runtime::tls::worker_channel(&url, Duration::from_secs(2), plane.as_ref())?;
    let mut client = WorkerClient::new(ch).max_encoding_message_size(MAX_MESSAGE_BYTES);
    let model = ModelFingerprint(
        client
            .capacity(pb::CapacityRequest {})
            .await?
            .into_inner()
            .model_fingerprint,
    );
    let transfers: Vec<KvTransfer> = (0..sets as u64 + 1)
        .map(|i| set(i + 1, pages, model))
        .collect();
    // Any 32 bytes: nothing claims these sets; each is aborted after its push.
    let key = KvKey::from_request(&[7; 32])?;
    let set_bytes = (pages * PAGE_BYTES) as f64;

    // gRPC push (first set warms the connection and is not counted).
    let mut grpc_s = 0.0;
    for (i, t) in transfers.iter().enumerate() {
        let msgs = push_messages(t.clone(), &key.sign(&t.manifest));
        let pair_id = t.manifest.pair_id;
        let t0 = Instant::now();
        let ack = client.push_kv(tokio_stream::iter(msgs)).await?.into_inner();
        let dt = t0.elapsed().as_secs_f64();
        assert_eq!(ack.bytes as f64, set_bytes);
        client.abort(pb::WorkerAbortRequest { pair_id }).await?;
        if i > 0 {
            grpc_s += dt;
        }
    }

    // The worker data plane (what a prefill worker with kv_transport = "tcp" does).
    let mut data_s = 0.0;
    for (i, t) in transfers.iter().enumerate() {
        let pair_id = t.manifest.pair_id;
        let t0 = Instant::now();
        prefill.service.push_set(&url, t.clone(), &key).await?;
        let dt = t0.elapsed().as_secs_f64();
        client.abort(pb::WorkerAbortRequest { pair_id }).await?;
        if i > 0 {
            data_s += dt;
        }
    }

    // Plain TCP copy of the same bytes.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let total = pages * PAGE_BYTES;
    let sink = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        s.set_nodelay(true)?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let mut got = 0;
            while got < total {
                let n = s.read(&mut buf).await?;
                if n == 0 {
                    return Ok::<_, std::io::Error>(());
                }
                got += n;
            }
            s.write_all(&[1]).await?;
        }
    });
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let mut tcp_s = 0.0;
    let mut ack = [0u8; 1];
    for (i, t) in transfers.iter().enumerate() {
        let t0 = Instant::now();
        for p in &t.pages {
            s.write_all(&p.bytes).await?;
        }
        s.read_exact(&mut ack).await?;
        if i > 0 {
            tcp_s += t0.elapsed().as_secs_f64();
        }
    }
    drop(s);
    let _ = tokio::time::timeout(Duration::from_secs(2), sink).await;

    // What verifying a set costs the importer (xxh3 of every page), for context.
    let t0 = Instant::now();
    let mut x = 0u64;
    for t in &transfers[1..] {
        for p in &t.pages {
            x ^= xxhash_rust::xxh3::xxh3_64(&p.bytes);
        }
    }
    let verify_s = t0.elapsed().as_secs_f64();
    std::hint::black_box(x);

    let gb = set_bytes * sets as f64 / 1e9;
    let (grpc, data, tcp, verify) = (gb / grpc_s, gb / data_s, gb / tcp_s, gb / verify_s);
    println!("| path | GB/s | MB per set | sets |");
    println!("| --- | ---: | ---: | ---: |");
    println!(
        "| gRPC PushKv (manifest + pages) | {grpc:.2} | {:.1} | {sets} |",
        set_bytes / 1e6
    );
    println!(
        "| worker data plane (kv_transport = tcp) | {data:.2} | {:.1} | {sets} |",
        set_bytes / 1e6
    );
    println!(
        "| plain TCP copy | {tcp:.2} | {:.1} | {sets} |",
        set_bytes / 1e6
    );
    println!("| xxh3 verify (one core) | {verify:.2} | | |");
    println!(
        "data plane / TCP copy: {:.0}%; gRPC PushKv / TCP copy: {:.0}%",
        100.0 * data / tcp,
        100.0 * grpc / tcp
    );
    println!(
        "{{\"data_plane_gbps\":{data:.3},\"grpc_gbps\":{grpc:.3},\"tcp_gbps\":{tcp:.3},\"data_plane_ratio\":{:.3},\"grpc_ratio\":{:.3},\"verify_gbps\":{verify:.3},\"pages\":{pages},\"sets\":{sets}}}",
        data / tcp,
        grpc / tcp
    );
    prefill.shutdown().await;
    decode.shutdown().await;
    Ok(())
}
