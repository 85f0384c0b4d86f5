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
    /// Serving TLS only (`--tls-port`), with this certificate and key.
    tls: Option<(PathBuf, PathBuf)>,
}

impl RedisServer {
    /// Starts one on a free port and waits (10 s) until it answers PING.
    pub fn start() -> RedisServer {
        let mut r = RedisServer {
            port: crate::gateway::free_port(),
            child: None,
            tls: None,
        };
        r.restart();
        r
    }

    /// Starts one serving TLS only, with `cert` and `key` (PEM; clients not asked for a
    /// certificate), and waits (10 s) until its port accepts.
    pub fn start_tls(cert: &std::path::Path, key: &std::path::Path) -> RedisServer {
        let mut r = RedisServer {
            port: crate::gateway::free_port(),
            child: None,
            tls: Some((cert.to_path_buf(), key.to_path_buf())),
        };
        r.restart();
        r
    }

    /// `redis://127.0.0.1:PORT/0`, or `rediss://localhost:PORT/0` serving TLS.
    pub fn url(&self) -> String {
        match self.tls {
            Some(_) => format!("rediss://localhost:{}/0", self.port),
            None => format!("redis://127.0.0.1:{}/0", self.port),
        }
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
        let port = self.port.to_string();
        let mut args: Vec<String> = match &self.tls {
            None => vec!["--port".into(), port],
            Some((cert, key)) => vec![
                "--port".into(),
                "0".into(),
                "--tls-port".into(),
                port,
                "--tls-cert-file".into(),
                cert.display().to_string(),
                "--tls-key-file".into(),
                key.display().to_string(),
                "--tls-auth-clients".into(),
                "no".into(),
            ],
        };
        for a in [
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
        ] {
            args.push(a.into());
        }
        let child = Command::new(redis_binary())
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts");
        self.child = Some(child);
        for _ in 0..200 {
            let up = match self.tls {
                // A TLS port cannot be asked PING in plain text: accepting is enough.
                Some(_) => std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok(),
                None => self.ping(),
            };
            if up {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("redis-server on port {} did not answer", self.port);
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
