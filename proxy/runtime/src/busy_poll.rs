//! Busy polling for connection threads (`server.busy_poll_us`): before a connection thread's
//! event loop goes to sleep in `epoll_wait`, it first polls for a short while, so that the next
//! event (an upstream's answer, a client's next request) finds the thread running.
//!
//! Why: waking a sleeping thread on another CPU costs an inter-processor interrupt, and on a
//! virtual machine the host may have descheduled the idle vCPU. Measured on the 2-core
//! development VM (a blocking ping-pong between two processes over a socket pair): 10 to 63 µs a
//! round trip across CPUs, 3.4 µs with the receiver polling. HAProxy offers the same trade
//! (`busy-polling`, off by default) for the same reason: lower latency, at the cost of a CPU kept
//! busy while idle. Off by default here too.
//!
//! How: tokio has no polling mode, but it calls a hook just before it parks. The hook polls the
//! runtime's own epoll descriptor (readable exactly when `epoll_wait` would return at once), and
//! between polls yields the CPU to any other runnable thread, so on a loaded machine the poll
//! loop gives way to real work. tokio's epoll descriptor is not exposed, so it is found by
//! comparing the process's epoll descriptors before and after the runtime is built; when that is
//! not exactly one, the thread runs without polling and says so in the log.

#![allow(unsafe_code)]

use std::collections::BTreeSet;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

/// The process's open epoll descriptors (`anon_inode:[eventpoll]` in `/proc/self/fd`).
pub fn epoll_fds() -> std::io::Result<BTreeSet<RawFd>> {
    let mut out = BTreeSet::new();
    for entry in std::fs::read_dir("/proc/self/fd")? {
        let entry = entry?;
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<RawFd>().ok())
        else {
            continue;
        };
        // The directory's own descriptor is gone by now: readlink fails, and it is skipped.
        if std::fs::read_link(entry.path()).is_ok_and(|t| t.as_os_str() == "anon_inode:[eventpoll]")
        {
            out.insert(fd);
        }
    }
    Ok(out)
}

/// Builds a current-thread runtime whose thread polls for up to `budget` before it sleeps.
/// Returns the runtime and the epoll descriptor it polls: `None` when that could not be told
/// apart (another epoll instance was made meanwhile), and then it is a plain runtime.
pub fn runtime(budget: Duration) -> std::io::Result<(tokio::runtime::Runtime, Option<RawFd>)> {
    let fd = Arc::new(AtomicI32::new(-1));
    // Without `/proc` (not Linux), no descriptor is found and the runtime is a plain one.
    let before = epoll_fds().ok();
    let hook = fd.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .on_thread_park(move || {
            let fd = hook.load(Ordering::Relaxed);
            if fd >= 0 {
                poll_until_ready(fd, budget);
            }
        })
        .build()?;
    // tokio keeps two descriptors of its one epoll instance (mio's `Poll` and a clone of its
    // registry), so the new descriptors are grouped by instance: what each one watches.
    let mut instances = BTreeSet::new();
    let mut first = None;
    if let (Some(before), Ok(after)) = (before, epoll_fds()) {
        for new in after.difference(&before) {
            // Unreadable (closed meanwhile): not told apart, so not polled.
            instances.insert(watched(*new).ok());
            first.get_or_insert(*new);
        }
    }
    let found = match (instances.len(), first) {
        (1, Some(one)) if !instances.contains(&None) => {
            fd.store(one, Ordering::Relaxed);
            Some(one)
        }
        _ => None,
    };
    Ok((rt, found))
}

/// What an epoll descriptor watches (its `tfd:` lines in `/proc/self/fdinfo`): the same for
/// every descriptor of one epoll instance, different between instances (each tokio driver
/// watches its own waker).
fn watched(fd: RawFd) -> std::io::Result<Vec<String>> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))?;
    let mut lines: Vec<String> = info
        .lines()
        .filter(|l| l.starts_with("tfd:"))
        .map(str::to_owned)
        .collect();
    lines.sort();
    Ok(lines)
}

/// Polls `fd` until it is readable or `budget` has passed, yielding the CPU between polls.
/// Returns whether it became readable.
pub fn poll_until_ready(fd: RawFd, budget: Duration) -> bool {
    let start = Instant::now();
    loop {
        if readable(fd) {
            return true;
        }
        if start.elapsed() >= budget {
            return false;
        }
        std::thread::yield_now();
    }
}

/// Whether `fd` is readable now (a poll with no timeout).
fn readable(fd: RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `p` is one valid, initialised pollfd on this stack frame, and the count says one.
    // poll(2) reads `fd` as a number only: it neither takes nor closes the descriptor, so a
    // descriptor that was closed meanwhile yields POLLNVAL (not readable), never misuse.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & libc::POLLIN != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn poll_returns_as_soon_as_the_descriptor_is_readable_and_waits_out_the_budget_otherwise() {
        let (mut a, b) = UnixStream::pair().expect("pair");
        let t = Instant::now();
        assert!(!poll_until_ready(b.as_raw_fd(), Duration::from_millis(30)));
        assert!(
            t.elapsed() >= Duration::from_millis(30),
            "{:?}",
            t.elapsed()
        );
        a.write_all(b"x").expect("write");
        let t = Instant::now();
        assert!(poll_until_ready(b.as_raw_fd(), Duration::from_secs(5)));
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    }
}
