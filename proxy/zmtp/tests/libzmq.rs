//! Against libzmq itself, through pyzmq: what SGLang 0.5.23 and vLLM 0.33.0 publish KV events
//! with (`ZmqEventPublisher`: a PUB socket and a replay ROUTER). Needs `python3` with `pyzmq`
//! (`tests/python/requirements.txt`); skipped without it unless `LOCKSTEP_REQUIRE_PYZMQ=1`
//! (`.ci/run` sets it).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lockstep_zmtp::{Connection, Error, Limits, Subscriber};

/// A PUB publishing `(b"kv", seq, payload)` every 20 ms, a 300 kB payload every fifth, and a
/// ROUTER that answers a replay request with two batches and the end marker; both bound on
/// loopback, their ports printed; sets `ZMQ_MAXMSGSIZE` nowhere.
const PEER: &str = r#"
import struct, sys, threading, time, zmq
ctx = zmq.Context()
pub = ctx.socket(zmq.PUB)
pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
router = ctx.socket(zmq.ROUTER)
router_port = router.bind_to_random_port("tcp://127.0.0.1")
print(pub_port, router_port, flush=True)
def replay():
    ident, empty, start = router.recv_multipart()
    (s,) = struct.unpack(">q", start)
    for seq in (s, s + 1):
        router.send_multipart([ident, b"", b"kv", struct.pack(">q", seq), b"batch-%d" % seq])
    router.send_multipart([ident, b"", b"", struct.pack(">q", -1), b""])
threading.Thread(target=replay, daemon=True).start()
deadline = time.time() + 20
seq = 0
while time.time() < deadline:
    payload = b"x" * 300000 if seq % 5 == 4 else b"small"
    pub.send_multipart([b"kv", struct.pack(">q", seq), payload])
    seq += 1
    time.sleep(0.02)
"#;

struct Peer(Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn peer() -> Option<(Peer, u16, u16)> {
    let has = Command::new("python3")
        .args(["-c", "import zmq"])
        .status()
        .is_ok_and(|s| s.success());
    if !has {
        assert!(
            std::env::var_os("LOCKSTEP_REQUIRE_PYZMQ").is_none(),
            "pyzmq is required (pip install -r tests/python/requirements.txt)"
        );
        eprintln!("skipped: no pyzmq");
        return None;
    }
    let mut child = Command::new("python3")
        .args(["-c", PEER])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("ports");
    let mut ports = line
        .split_whitespace()
        .map(|p| p.parse::<u16>().expect("port"));
    let (p, r) = (ports.next().expect("pub"), ports.next().expect("router"));
    Some((Peer(child), p, r))
}

#[tokio::test]
async fn reads_libzmqs_pub_and_router_and_refuses_what_is_over_the_limit() {
    let Some((_peer, pub_port, router_port)) = peer() else {
        return;
    };
    let ep = format!("tcp://127.0.0.1:{pub_port}");
    let mut sub = Subscriber::connect(&ep, "kv", Limits::default())
        .await
        .expect("subscribes to libzmq");
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while seen.len() < 6 {
        assert!(Instant::now() < deadline, "{seen:?}");
        let m = tokio::time::timeout(Duration::from_secs(5), sub.recv())
            .await
            .expect("a message in time")
            .expect("a message");
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].as_ref(), b"kv");
        let seq = u64::from_be_bytes(m[1].as_ref().try_into().expect("8 bytes"));
        seen.push((seq, m[2].len()));
    }
    assert!(seen.iter().any(|(_, n)| *n == 300_000), "{seen:?}");
    // A limit under the big payload: refused on its header, the connection dropped.
    let small = Limits {
        max_message: 64 * 1024,
        ..Limits::default()
    };
    let mut sub = Subscriber::connect(&ep, "kv", small)
        .await
        .expect("subscribes");
    let e = loop {
        match tokio::time::timeout(Duration::from_secs(5), sub.recv())
            .await
            .expect("in time")
        {
            Ok(_) => continue,
            Err(e) => break e,
        }
    };
    assert!(matches!(e, Error::TooLarge { .. }), "{e}");
    // The replay ROUTER, asked as a DEALER.
    let mut dealer = Connection::connect(
        &format!("tcp://127.0.0.1:{router_port}"),
        "DEALER",
        Limits::default(),
    )
    .await
    .expect("connects to libzmq's ROUTER");
    dealer
        .send(&[b"", &5u64.to_be_bytes()])
        .await
        .expect("send");
    let mut got = Vec::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(5), dealer.recv())
            .await
            .expect("in time")
            .expect("answer");
        let seq = u64::from_be_bytes(m[2].as_ref().try_into().expect("8 bytes"));
        if seq == u64::MAX {
            break;
        }
        got.push(String::from_utf8_lossy(&m[3]).into_owned());
    }
    assert_eq!(got, ["batch-5", "batch-6"]);
}
