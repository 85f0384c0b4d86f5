//! Busy polling watches its own runtime's event loop. The one test of this binary: no other
//! test builds a runtime while it does, so the runtime's epoll descriptor must be found.

use std::io::Write;
use std::time::Duration;

use lockstep_runtime::busy_poll::{poll_until_ready, runtime};

#[test]
fn the_park_hook_polls_the_runtimes_own_event_loop() {
    let (rt, fd) = runtime(Duration::from_micros(100)).expect("runtime");
    let fd = fd.expect("the runtime's epoll descriptor is found when no other is made meanwhile");
    let (mut peer, ours) = std::os::unix::net::UnixStream::pair().expect("pair");
    ours.set_nonblocking(true).expect("nonblocking");
    let ours = rt.block_on(async {
        let s = tokio::net::UnixStream::from_std(ours).expect("registered");
        s.writable().await.expect("writable");
        // Parking takes the registration's first events off the event loop.
        tokio::time::sleep(Duration::from_millis(5)).await;
        s
    });
    assert!(
        !poll_until_ready(fd, Duration::from_millis(20)),
        "nothing is pending on the event loop"
    );
    peer.write_all(b"x").expect("write");
    assert!(
        poll_until_ready(fd, Duration::from_secs(2)),
        "data on a socket this runtime watches shows on the descriptor the hook polls"
    );
    let got = rt.block_on(async {
        ours.readable().await.expect("readable");
        let mut buf = [0u8; 4];
        ours.try_read(&mut buf).map(|n| buf[..n].to_vec())
    });
    assert_eq!(got.expect("read"), b"x");
    // The runtime still serves with its hook in place (it parks, polls, then sleeps).
    let v = rt.block_on(async {
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            let _ = tx.send(7);
        });
        rx.await.expect("sent")
    });
    assert_eq!(v, 7);
}
