//! A ZMTP 3 client bounded in everything a peer sends (ZMTP 3.0, `rfc.zeromq.org/spec/23`, and
//! what 3.1 adds that a peer may send: `PING`, `SUBSCRIBE` commands), for reading the engines'
//! KV event publishers (SGLang's and vLLM's `ZmqEventPublisher`: a PUB socket and a replay
//! ROUTER, libzmq through pyzmq).
//!
//! Why not a general ZMQ library: the `zeromq` crate reserves whatever length a frame header
//! announces before reading it, so a publisher announcing 2^47 bytes ends the process, and
//! libzmq's `ZMQ_MAXMSGSIZE` would bring a C++ build. Here every frame's announced length is
//! checked against [`Limits::max_message`] (with the message's frames before it) before a byte
//! of it is allocated, and the handshake is bounded in time; a peer that breaks either is an
//! [`Error`], and the connection is dropped.
//!
//! Only what a subscriber and a dealer need: the NULL mechanism, one TCP connection per socket,
//! `tcp://host:port` endpoints.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// What a peer may make this client hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest message (all its frames, with one byte of each frame's header), bytes; a command
    /// is bounded by it too.
    pub max_message: usize,
    /// The connection and the greeting and READY exchange must finish within this.
    pub handshake: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_message: 4 * 1024 * 1024,
            handshake: Duration::from_secs(5),
        }
    }
}

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The endpoint is not `tcp://host:port`.
    #[error("endpoint `{0}` is not tcp://host:port")]
    Endpoint(String),
    /// The connection failed or closed.
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    /// The handshake did not finish in time.
    #[error("the ZMTP handshake did not finish within {0:?}")]
    Timeout(Duration),
    /// The peer broke the protocol.
    #[error("ZMTP protocol: {0}")]
    Protocol(String),
    /// The peer announced a message larger than [`Limits::max_message`].
    #[error(
        "the peer announced a message of at least {announced} bytes, over the {limit}-byte limit"
    )]
    TooLarge {
        /// The bytes the message would have had at least.
        announced: u64,
        /// The limit.
        limit: usize,
    },
}

/// Flag bits of a frame's first byte.
const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;

/// The length of a ZMTP 3 greeting.
const GREETING: usize = 64;

/// One ZMTP connection past its handshake.
#[derive(Debug)]
pub struct Connection<S = TcpStream> {
    io: BufReader<S>,
    limits: Limits,
}

/// A frame as read: its flags and body.
struct Frame {
    flags: u8,
    body: Bytes,
}

impl Connection<TcpStream> {
    /// Connects to `endpoint` (`tcp://host:port`) as a `socket_type` socket (`SUB`, `DEALER`):
    /// greeting, then the NULL mechanism's READY both ways, all within `limits.handshake`.
    pub async fn connect(
        endpoint: &str,
        socket_type: &str,
        limits: Limits,
    ) -> Result<Connection, Error> {
        let addr = endpoint
            .strip_prefix("tcp://")
            .filter(|a| a.contains(':'))
            .ok_or_else(|| Error::Endpoint(endpoint.to_string()))?;
        let shake = async {
            let stream = TcpStream::connect(addr).await?;
            stream.set_nodelay(true)?;
            let mut c = Connection {
                io: BufReader::new(stream),
                limits,
            };
            c.greet().await?;
            c.ready(socket_type).await?;
            Ok::<_, Error>(c)
        };
        tokio::time::timeout(limits.handshake, shake)
            .await
            .map_err(|_| Error::Timeout(limits.handshake))?
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Connection<S> {
    /// A connection over `stream` whose handshake is done (a test's or a fuzzer's peer).
    pub fn past_handshake(stream: S, limits: Limits) -> Connection<S> {
        Connection {
            io: BufReader::new(stream),
            limits,
        }
    }

    async fn greet(&mut self) -> Result<(), Error> {
        let mut mine = [0u8; GREETING];
        mine[0] = 0xFF;
        mine[8] = 0x01;
        mine[9] = 0x7F;
        // Version 3.0: a 3.1 peer then sends no command a 3.0 peer would not know.
        mine[10] = 3;
        mine[11] = 0;
        mine[12..16].copy_from_slice(b"NULL");
        self.io.get_mut().write_all(&mine).await?;
        let mut theirs = [0u8; GREETING];
        self.io.read_exact(&mut theirs).await?;
        if theirs[0] != 0xFF || theirs[9] & 0x01 != 0x01 {
            return Err(Error::Protocol("not a ZMTP greeting".into()));
        }
        if theirs[10] < 3 {
            return Err(Error::Protocol(format!(
                "ZMTP {}.{} (3 or later needed)",
                theirs[10], theirs[11]
            )));
        }
        let mechanism = &theirs[12..32];
        if !mechanism.starts_with(b"NULL") || mechanism[4..].iter().any(|b| *b != 0) {
            return Err(Error::Protocol(
                "a security mechanism other than NULL".into(),
            ));
        }
        Ok(())
    }

    async fn ready(&mut self, socket_type: &str) -> Result<(), Error> {
        let mut body = Vec::new();
        body.push(5);
        body.extend_from_slice(b"READY");
        body.push(11);
        body.extend_from_slice(b"Socket-Type");
        body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
        body.extend_from_slice(socket_type.as_bytes());
        self.write_frame(COMMAND, &body).await?;
        self.io.get_mut().flush().await?;
        let f = self.read_frame(0).await?;
        if f.flags & COMMAND == 0 {
            return Err(Error::Protocol("a message before the peer's READY".into()));
        }
        match command_name(&f.body) {
            Some(b"READY") => Ok(()),
            Some(b"ERROR") => Err(Error::Protocol(format!(
                "the peer refused the handshake: {}",
                String::from_utf8_lossy(f.body.get(7..).unwrap_or_default())
            ))),
            _ => Err(Error::Protocol(
                "the peer's first command is not READY".into(),
            )),
        }
    }

    async fn write_frame(&mut self, flags: u8, body: &[u8]) -> Result<(), Error> {
        let w = self.io.get_mut();
        if body.len() > 255 {
            w.write_all(&[flags | LONG]).await?;
            w.write_all(&(body.len() as u64).to_be_bytes()).await?;
        } else {
            w.write_all(&[flags, body.len() as u8]).await?;
        }
        w.write_all(body).await?;
        Ok(())
    }

    /// Reads one frame; `used`: the bytes of its message already read.
    async fn read_frame(&mut self, used: usize) -> Result<Frame, Error> {
        let flags = self.io.read_u8().await?;
        if flags & !(MORE | LONG | COMMAND) != 0 {
            return Err(Error::Protocol(format!(
                "reserved frame flags {flags:#04x}"
            )));
        }
        let size = if flags & LONG != 0 {
            self.io.read_u64().await?
        } else {
            u64::from(self.io.read_u8().await?)
        };
        // Checked before anything is allocated for it.
        let total = (used as u64).saturating_add(size).saturating_add(1);
        if total > self.limits.max_message as u64 {
            return Err(Error::TooLarge {
                announced: total,
                limit: self.limits.max_message,
            });
        }
        let mut body = BytesMut::zeroed(size as usize);
        self.io.read_exact(&mut body).await?;
        Ok(Frame {
            flags,
            body: body.freeze(),
        })
    }

    /// Sends one message of `frames`.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), Error> {
        for (i, f) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() { MORE } else { 0 };
            self.write_frame(more, f).await?;
        }
        self.io.get_mut().flush().await?;
        Ok(())
    }

    /// The next message, its frames; commands between messages are answered (`PING` with
    /// `PONG`) or skipped, an `ERROR` ends the connection. No read of it allocates more than
    /// [`Limits::max_message`] in all.
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, Error> {
        let mut frames = Vec::new();
        let mut used = 0usize;
        loop {
            let f = self.read_frame(used).await?;
            if f.flags & COMMAND != 0 {
                if !frames.is_empty() {
                    return Err(Error::Protocol("a command inside a message".into()));
                }
                self.command(&f.body).await?;
                continue;
            }
            used += f.body.len() + 1;
            frames.push(f.body);
            if f.flags & MORE == 0 {
                return Ok(frames);
            }
        }
    }

    async fn command(&mut self, body: &[u8]) -> Result<(), Error> {
        match command_name(body) {
            Some(b"PING") => {
                // `PING`: TTL (2 bytes), then a context echoed in the `PONG`.
                let context = body.get(7..).unwrap_or_default();
                let mut pong = Vec::with_capacity(5 + context.len());
                pong.push(4);
                pong.extend_from_slice(b"PONG");
                pong.extend_from_slice(context);
                self.write_frame(COMMAND, &pong).await?;
                self.io.get_mut().flush().await?;
                Ok(())
            }
            Some(b"ERROR") => Err(Error::Protocol(format!(
                "the peer sent ERROR: {}",
                String::from_utf8_lossy(body.get(7..).unwrap_or_default())
            ))),
            Some(_) => Ok(()),
            None => Err(Error::Protocol("a command without a name".into())),
        }
    }
}

/// A command's name (its first byte is the name's length).
fn command_name(body: &[u8]) -> Option<&[u8]> {
    let n = usize::from(*body.first()?);
    body.get(1..1 + n).filter(|n| !n.is_empty())
}

/// A SUB socket on one publisher.
#[derive(Debug)]
pub struct Subscriber(Connection);

impl Subscriber {
    /// Connects to the publisher at `endpoint` and subscribes to `topic` (empty: everything).
    pub async fn connect(endpoint: &str, topic: &str, limits: Limits) -> Result<Subscriber, Error> {
        let mut c = Connection::connect(endpoint, "SUB", limits).await?;
        // ZMTP 3.0's subscription: a message whose first byte is 1, then the topic.
        let mut sub = Vec::with_capacity(1 + topic.len());
        sub.push(1);
        sub.extend_from_slice(topic.as_bytes());
        c.send(&[&sub]).await?;
        Ok(Subscriber(c))
    }

    /// The next message published.
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, Error> {
        self.0.recv().await
    }
}

/// Reads one message from `bytes` as a peer past the handshake would send it, within `limits`:
/// the frame reader alone, for fuzzing and tests.
pub async fn read_message(bytes: &[u8], limits: Limits) -> Result<Vec<Bytes>, Error> {
    // Room for the input and for every `PONG` it can ask for (each no longer than its `PING`).
    let (mut peer, mine) = tokio::io::duplex(2 * bytes.len() + 64);
    peer.write_all(bytes).await?;
    // The input ends (EOF) while the peer stays to take the answers.
    peer.shutdown().await?;
    let out = Connection::past_handshake(mine, limits).recv().await;
    drop(peer);
    out
}

#[cfg(test)]
mod tests;
