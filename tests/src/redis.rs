//! A real `redis-server` (Debian's `redis-server` package) on a loopback port, for the tests of
//! tenant limits shared between replicas (`[shared]`). No persistence: a restart starts empty,
//! as a Redis that lost its memory does. Killed by its pid (SIGKILL) when dropped.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The `redis-server` binary: `LOCKSTEP_REDIS_SERVER`, else the one on `PATH`.
pub fn redis_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("LOCKSTEP_REDIS_SERVER") {
        return PathBuf::from(p);
    }
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("redis-server"))
            .find(|p| p.is_file())
    });
    found.expect(
        "no redis-server on PATH (apt-get install redis-server, or set LOCKSTEP_REDIS_SERVER)",
    )
}

/// A running `redis-server`.
pub struct RedisServer {
    /// Its port on 127.0.0.1.
    pub port: u16,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts one on a free port and waits (10 s) until it answers PING.
    pub fn start() -> RedisServer {
        let mut r = RedisServer {
            port: crate::gateway::free_port(),
            child: None,
        };
        r.restart();
        r
    }

    /// `redis://127.0.0.1:PORT/0`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Kills it at once (SIGKILL, by pid): whatever it held is gone.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// (Re)starts it on the same port, empty, and waits until it answers.
    pub fn restart(&mut self) {
        self.kill();
        let child = Command::new(redis_binary())
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts");
        self.child = Some(child);
        for _ in 0..200 {
            if self.ping() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("redis-server on port {} did not answer PING", self.port);
    }

    /// Whether it answers PING now.
    pub fn ping(&self) -> bool {
        self.command("PING\r\n")
            .is_some_and(|a| a.starts_with("+PONG"))
    }

    /// One raw RESP command (inline form); its reply as text.
    pub fn command(&self, line: &str) -> Option<String> {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], self.port));
        let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()?;
        s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
        s.write_all(line.as_bytes()).ok()?;
        let mut buf = [0u8; 4096];
        let n = s.read(&mut buf).ok()?;
        Some(String::from_utf8_lossy(&buf[..n]).into_owned())
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
