//! A real PostgreSQL server (Debian's `postgresql` package) in a fresh data directory on a
//! loopback port, for the tests of stored responses and conversations (`[state] url`). As root
//! it runs as the `postgres` user (PostgreSQL refuses root). Stopped by its pid (SIGINT: fast
//! shutdown, clients cut) when dropped; [`Postgres::stop`] and [`Postgres::start_again`] take it
//! away and bring it back with its data.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The directory of PostgreSQL's programs: `LOCKSTEP_PG_BIN`, else Debian's
/// `/usr/lib/postgresql/<version>/bin` (the newest).
pub fn pg_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("LOCKSTEP_PG_BIN") {
        return PathBuf::from(p);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|p| p.join("initdb").is_file())
        .collect();
    found.sort();
    found.pop().expect(
        "no PostgreSQL under /usr/lib/postgresql (apt-get install postgresql, or set LOCKSTEP_PG_BIN)",
    )
}

/// The uid and gid of user `postgres` when running as root (`None` otherwise).
fn run_as() -> Option<(u32, u32)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let euid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .nth(1)?;
    if euid != "0" {
        return None;
    }
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    let line = passwd.lines().find(|l| l.starts_with("postgres:"))?;
    let f: Vec<&str> = line.split(':').collect();
    Some((f.get(2)?.parse().ok()?, f.get(3)?.parse().ok()?))
}

/// A running PostgreSQL.
pub struct Postgres {
    /// Its port on 127.0.0.1.
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

fn as_user(cmd: &mut Command) -> &mut Command {
    if let Some((uid, gid)) = run_as() {
        cmd.uid(uid).gid(gid);
    }
    cmd
}

impl Postgres {
    /// Initializes a cluster (user `lockstep`, trusted on loopback only) and starts it on a free
    /// port, waiting (20 s) until it accepts connections.
    pub fn start() -> Postgres {
        let dir = tempfile::tempdir().expect("tempdir");
        if let Some((uid, gid)) = run_as() {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).expect("chown");
        }
        let data = dir.path().join("data");
        let out = as_user(
            Command::new(pg_bin().join("initdb"))
                .args([
                    "-U",
                    "lockstep",
                    "-A",
                    "trust",
                    "--no-sync",
                    "-E",
                    "UTF8",
                    "-D",
                ])
                .arg(&data),
        )
        .stdout(Stdio::null())
        .output()
        .expect("run initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut pg = Postgres {
            port: crate::gateway::free_port(),
            dir,
            child: None,
        };
        pg.start_again();
        pg
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// `postgres://lockstep@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://lockstep@127.0.0.1:{}/postgres", self.port)
    }

    /// Starts the server (again, after [`Postgres::stop`]) on the same data and port.
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "already running");
        let log = std::fs::File::create(self.dir.path().join("postgres.log")).expect("log file");
        let child = as_user(
            Command::new(pg_bin().join("postgres"))
                .arg("-D")
                .arg(self.data())
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-k"])
                .arg(self.dir.path())
                .args(["-c", "fsync=off", "-c", "max_connections=50"]),
        )
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start postgres");
        self.child = Some(child);
        self.wait_ready(Duration::from_secs(20));
    }

    fn wait_ready(&self, within: Duration) {
        let start = Instant::now();
        while start.elapsed() < within {
            let ok = Command::new(pg_bin().join("pg_isready"))
                .args([
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-U",
                    "lockstep",
                ])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "postgres not ready on port {} after {within:?}: {}",
            self.port,
            self.log()
        );
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default()
    }

    /// Stops the server (fast shutdown: every client is cut) and waits for it to exit.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let pid = c.id();
            let _ = Command::new("kill")
                .args(["-INT", &pid.to_string()])
                .status();
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(20) {
                if c.try_wait().ok().flatten().is_some() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The data directory's path (for a test that checks files).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop();
    }
}
