use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zeromq::{Socket, SocketRecv, SocketSend};

use super::*;

fn limits(max: usize) -> Limits {
    Limits {
        max_message: max,
        handshake: Duration::from_secs(2),
    }
}

/// A peer that does the handshake as a ZMTP 3.0 PUB would, then sends `then` and keeps the
/// connection open.
async fn hostile_peer(then: Vec<u8>) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.expect("accept");
        let mut g = [0u8; GREETING];
        s.read_exact(&mut g).await.expect("greeting");
        let mut mine = [0u8; GREETING];
        mine[0] = 0xFF;
        mine[9] = 0x7F;
        mine[10] = 3;
        mine[12..16].copy_from_slice(b"NULL");
        s.write_all(&mine).await.expect("write");
        let mut head = [0u8; 2];
        s.read_exact(&mut head).await.expect("ready head");
        let mut ready = vec![0u8; usize::from(head[1])];
        s.read_exact(&mut ready).await.expect("ready");
        let body = b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB";
        s.write_all(&[COMMAND, body.len() as u8])
            .await
            .expect("write");
        s.write_all(body).await.expect("write");
        s.write_all(&then).await.expect("write");
        // Hold the connection; a reader must not wait for more than it announced.
        tokio::time::sleep(Duration::from_secs(30)).await;
        drop(s);
    });
    format!("tcp://{addr}")
}

fn long_frame_header(flags: u8, size: u64) -> Vec<u8> {
    let mut v = vec![flags | LONG];
    v.extend_from_slice(&size.to_be_bytes());
    v
}

/// A publisher announcing a frame of 2^47 or 2^44 bytes, or a message that adds up past the
/// limit, is refused on the header: nothing of that size is ever reserved.
#[tokio::test]
async fn an_announced_size_over_the_limit_is_refused_before_anything_is_allocated() {
    for size in [1u64 << 47, 1 << 44, u64::MAX, 4 * 1024 * 1024] {
        let ep = hostile_peer(long_frame_header(0, size)).await;
        let mut s = Subscriber::connect(&ep, "", limits(4 * 1024 * 1024))
            .await
            .expect("handshake");
        let started = Instant::now();
        match s.recv().await {
            Err(Error::TooLarge { announced, limit }) => {
                assert!(announced >= size.min(u64::MAX - 1), "{announced}");
                assert_eq!(limit, 4 * 1024 * 1024);
            }
            other => panic!("{size}: {other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(1));
    }
    // Frames within the limit one by one, over it together.
    let mut many = Vec::new();
    for _ in 0..3 {
        many.extend(long_frame_header(MORE, 400));
        many.extend(vec![7u8; 400]);
    }
    let ep = hostile_peer(many).await;
    let mut s = Subscriber::connect(&ep, "", limits(1000))
        .await
        .expect("handshake");
    assert!(matches!(s.recv().await, Err(Error::TooLarge { .. })));
    // An endless run of empty frames counts its headers.
    let empties: Vec<u8> = std::iter::repeat_n([MORE, 0], 2000).flatten().collect();
    let ep = hostile_peer(empties).await;
    let mut s = Subscriber::connect(&ep, "", limits(1000))
        .await
        .expect("handshake");
    assert!(matches!(s.recv().await, Err(Error::TooLarge { .. })));
}

#[tokio::test]
async fn reserved_flags_a_command_inside_a_message_and_error_end_the_connection() {
    let l = limits(1024);
    let e = read_message(&[0x08, 0], l)
        .await
        .expect_err("reserved flag");
    assert!(matches!(e, Error::Protocol(_)), "{e}");
    let mut inside = vec![MORE, 1, b'a'];
    inside.extend([COMMAND, 5, 4, b'P', b'I', b'N', b'G']);
    let e = read_message(&inside, l).await.expect_err("command inside");
    assert!(matches!(e, Error::Protocol(_)), "{e}");
    let mut error = vec![COMMAND, 10, 5];
    error.extend(b"ERROR\x03bad");
    let e = read_message(&error, l).await.expect_err("ERROR");
    assert!(e.to_string().contains("bad"), "{e}");
    // A PING between messages is answered and skipped; the message after it is read.
    let mut ping = vec![COMMAND, 7, 4];
    ping.extend(b"PING\x00\x0a");
    ping.extend([MORE, 1, b't', 0, 2, b'h', b'i']);
    let m = read_message(&ping, l).await.expect("a message");
    assert_eq!(m, vec![Bytes::from_static(b"t"), Bytes::from_static(b"hi")]);
    // Cut short: an error, not a message.
    assert!(read_message(&[MORE, 1, b't', 0, 9, b'h'], l).await.is_err());
}

/// A peer that accepts and never greets holds a connection no longer than the handshake bound.
#[tokio::test]
async fn a_silent_peer_times_out_the_handshake() {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    let held = tokio::spawn(async move {
        let (s, _) = l.accept().await.expect("accept");
        tokio::time::sleep(Duration::from_secs(10)).await;
        drop(s);
    });
    let limits = Limits {
        max_message: 1024,
        handshake: Duration::from_millis(300),
    };
    let started = Instant::now();
    let e = Subscriber::connect(&format!("tcp://{addr}"), "", limits)
        .await
        .expect_err("no greeting");
    assert!(matches!(e, Error::Timeout(_)), "{e}");
    assert!(started.elapsed() < Duration::from_secs(2));
    held.abort();
    assert!(matches!(
        Connection::connect("http://x:1", "SUB", limits).await,
        Err(Error::Endpoint(_))
    ));
}

/// Against another implementation: the `zeromq` crate's PUB and ROUTER.
#[tokio::test]
async fn subscribes_to_a_pub_and_asks_a_router_as_a_dealer() {
    let mut publisher = zeromq::PubSocket::new();
    let ep = publisher.bind("tcp://127.0.0.1:0").await.expect("bind");
    let ep = ep.to_string();
    let mut sub = Subscriber::connect(&ep, "kv", Limits::default())
        .await
        .expect("subscribes");
    let got = tokio::spawn(async move { sub.recv().await });
    // PUB drops what it sends before the subscription arrives: send until it is read.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !got.is_finished() {
        assert!(Instant::now() < deadline, "nothing received");
        for topic in ["other", "kv"] {
            let m = zeromq::ZmqMessage::try_from(vec![
                Bytes::from(topic),
                Bytes::copy_from_slice(&7u64.to_be_bytes()),
                Bytes::from(vec![9u8; 300]),
            ])
            .expect("message");
            publisher.send(m).await.expect("send");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let m = got.await.expect("joined").expect("a message");
    assert_eq!(m.len(), 3);
    assert_eq!(m[0].as_ref(), b"kv", "the subscription filters");
    assert_eq!(m[1].as_ref(), 7u64.to_be_bytes());
    assert_eq!(m[2].len(), 300, "a long frame");

    let mut router = zeromq::RouterSocket::new();
    let ep = router.bind("tcp://127.0.0.1:0").await.expect("bind");
    let mut dealer = Connection::connect(&ep.to_string(), "DEALER", Limits::default())
        .await
        .expect("connects");
    dealer
        .send(&[b"", &3u64.to_be_bytes()])
        .await
        .expect("send");
    let asked = router.recv().await.expect("recv").into_vec();
    assert_eq!(asked.len(), 3, "identity, empty, seq");
    assert_eq!(asked[2].as_ref(), 3u64.to_be_bytes());
    let answer = zeromq::ZmqMessage::try_from(vec![
        asked[0].clone(),
        Bytes::new(),
        Bytes::from_static(b"kv"),
        Bytes::copy_from_slice(&3u64.to_be_bytes()),
        Bytes::from_static(b"payload"),
    ])
    .expect("message");
    router.send(answer).await.expect("send");
    let m = dealer.recv().await.expect("answer");
    assert_eq!(m.len(), 4);
    assert_eq!(m[3].as_ref(), b"payload");
}
