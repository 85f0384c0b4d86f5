//! Rooms: where a pushed KV set waits for its pair's decode call, and a decode call for its set.
//!
//! A set is kept only with its MAC ([`crate::kvmac`]); the decode call brings the pair's key, and
//! a set whose MAC does not verify under it is dropped, never imported. A set that arrives after
//! the key is known is checked at once (a forgery is refused to its sender); before that, a room
//! keeps at most [`MAX_UNVERIFIED`] sets, so one pushed early by a forger cannot crowd out the real
//! one. Every waiting set holds a reservation of its bytes against the worker's bound
//! (`worker.max_pending_kv_bytes`), taken before its pages are read; over the bound a push is
//! refused as busy (retry-safe: nothing was kept). A room nobody claims within the lease is
//! dropped ([`Rooms::sweep`]), so a lost peer strands nothing for longer than that.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use lockstep_engine::transfer::KvTransfer;
use tokio::sync::Notify;

use crate::kvmac::{KvKey, Tag};

/// Sets a room holds before its decode call brings the key.
pub const MAX_UNVERIFIED: usize = 2;

/// Rooms one worker keeps open at once (pairs waiting on either side).
pub const MAX_ROOMS: usize = 65_536;

/// Bytes of pushed KV held against the worker's bound; given back when dropped.
#[derive(Debug)]
pub struct Reservation {
    bytes: u64,
    counter: Arc<AtomicU64>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// A pushed set, its MAC and the bytes it holds.
#[derive(Debug)]
pub struct PendingSet {
    /// The set.
    pub set: KvTransfer,
    /// The MAC its sender attached.
    pub tag: Tag,
    /// Its bytes, held until the set is imported or dropped.
    pub hold: Reservation,
}

/// Why a room or a push was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Over a bound (pending bytes, rooms, unverified sets): nothing was kept; retry later.
    Busy(String),
    /// The set can never be taken as sent (malformed, over the pool, wrong page size).
    Invalid(String),
    /// The set's MAC does not verify under the pair's key.
    Forged,
    /// The pair was aborted or already took its set.
    Closed,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Busy(why) => write!(f, "busy: {why}"),
            Refusal::Invalid(why) => f.write_str(why),
            Refusal::Forged => f.write_str("the KV set does not carry the pair's MAC"),
            Refusal::Closed => f.write_str("the pair is closed (aborted, or its set was taken)"),
        }
    }
}

#[derive(Default)]
struct RoomState {
    key: Option<KvKey>,
    sets: Vec<PendingSet>,
    closed: bool,
    /// Until when a decode call waits here (its caller's deadline): the sweep leaves the room
    /// open that long even past the lease.
    waited_until: Option<Instant>,
}

/// One pair's room.
pub struct Room {
    state: Mutex<RoomState>,
    ready: Notify,
    created: Instant,
}

impl std::fmt::Debug for Room {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Room")
            .field("age", &self.created.elapsed())
            .finish_non_exhaustive()
    }
}

impl Room {
    fn new() -> Room {
        Room {
            state: Mutex::new(RoomState::default()),
            ready: Notify::new(),
            created: Instant::now(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RoomState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Leaves a set for the decode call: checked at once when the key is known (a second good
    /// set is dropped as a duplicate), else kept among at most [`MAX_UNVERIFIED`].
    pub fn put(&self, p: PendingSet) -> Result<(), Refusal> {
        let mut s = self.lock();
        if s.closed {
            return Err(Refusal::Closed);
        }
        match s.key {
            Some(k) if !k.verifies(&p.set.manifest, &p.tag) => return Err(Refusal::Forged),
            Some(_) if !s.sets.is_empty() => return Ok(()),
            Some(_) => {}
            None if s.sets.len() >= MAX_UNVERIFIED => {
                return Err(Refusal::Busy(format!(
                    "{MAX_UNVERIFIED} sets already wait for this pair's decode call"
                )));
            }
            None => {}
        }
        s.sets.push(p);
        drop(s);
        self.ready.notify_one();
        Ok(())
    }

    /// Closes the room: a waiting or later `take` gets `Closed`, held sets are dropped.
    pub fn close(&self) {
        let mut s = self.lock();
        s.closed = true;
        s.sets.clear();
        drop(s);
        self.ready.notify_one();
    }

    /// Waits for a set whose MAC verifies under `key` (sets that do not are dropped; their
    /// count is returned with the set), until `until` at the latest (the caller bounds the wait;
    /// the sweep respects it). Taking closes the room.
    pub async fn take(&self, key: KvKey, until: Instant) -> Result<(KvTransfer, usize), Refusal> {
        let mut forged = 0;
        loop {
            {
                let mut s = self.lock();
                if s.closed {
                    return Err(Refusal::Closed);
                }
                s.key = Some(key);
                s.waited_until = Some(until);
                let before = s.sets.len();
                s.sets.retain(|p| key.verifies(&p.set.manifest, &p.tag));
                forged += before - s.sets.len();
                if !s.sets.is_empty() {
                    let p = s.sets.swap_remove(0);
                    s.sets.clear();
                    s.closed = true;
                    return Ok((p.set, forged));
                }
            }
            self.ready.notified().await;
        }
    }

    /// How long ago the room was opened.
    pub fn age(&self) -> Duration {
        self.created.elapsed()
    }

    /// Whether the sweep may drop it: older than `lease`, and no decode call still waiting in it.
    fn expired(&self, lease: Duration) -> bool {
        self.age() >= lease && self.lock().waited_until.is_none_or(|t| Instant::now() >= t)
    }

    /// Whether a set is waiting in the room.
    pub fn is_ready(&self) -> bool {
        !self.lock().sets.is_empty()
    }
}

/// The rooms of one worker, by pair id, and the bytes their sets hold.
#[derive(Debug)]
pub struct Rooms {
    by_pair: DashMap<u64, Arc<Room>>,
    lease: Duration,
    pending: Arc<AtomicU64>,
    max_pending: u64,
}

impl Rooms {
    /// No rooms; each lives at most `lease` unclaimed; sets waiting hold at most `max_pending`
    /// bytes together.
    pub fn new(lease: Duration, max_pending: u64) -> Rooms {
        Rooms {
            by_pair: DashMap::new(),
            lease,
            pending: Arc::new(AtomicU64::new(0)),
            max_pending,
        }
    }

    /// How long a set waits for its decode call, and a decode call for its set.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// Bytes of pushed sets waiting (reserved) now.
    pub fn pending_bytes(&self) -> u64 {
        self.pending.load(Ordering::Acquire)
    }

    /// Reserves `bytes` of pushed KV against the bound, before any of it is read.
    pub fn reserve(&self, bytes: u64) -> Result<Reservation, Refusal> {
        let max = self.max_pending;
        self.pending
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                cur.checked_add(bytes).filter(|n| *n <= max)
            })
            .map_err(|cur| {
                Refusal::Busy(format!(
                    "{bytes} more bytes of pushed KV would exceed this worker's bound ({cur} of {max} held)"
                ))
            })?;
        Ok(Reservation {
            bytes,
            counter: self.pending.clone(),
        })
    }

    /// The room of `pair_id`, opened if absent (refused past [`MAX_ROOMS`]).
    pub fn room(&self, pair_id: u64) -> Result<Arc<Room>, Refusal> {
        if let Some(r) = self.by_pair.get(&pair_id) {
            return Ok(r.clone());
        }
        if self.by_pair.len() >= MAX_ROOMS {
            return Err(Refusal::Busy(format!(
                "{MAX_ROOMS} pairs already wait here"
            )));
        }
        Ok(self
            .by_pair
            .entry(pair_id)
            .or_insert_with(|| Arc::new(Room::new()))
            .clone())
    }

    /// Closes and forgets the room of `pair_id` (its decode call is done with it, or an abort): a
    /// waiting decode call ends, a pushed set is dropped.
    pub fn close(&self, pair_id: u64) {
        if let Some((_, room)) = self.by_pair.remove(&pair_id) {
            room.close();
        }
    }

    /// Drops rooms older than the lease (their pushed KV, or the wait for it); returns how many.
    pub fn sweep(&self) -> usize {
        let mut n = 0;
        self.by_pair.retain(|_, r| {
            let keep = !r.expired(self.lease);
            if !keep {
                r.close();
                n += 1;
            }
            keep
        });
        n
    }

    /// Sets pushed and not yet claimed.
    pub fn ready(&self) -> usize {
        self.by_pair.iter().filter(|r| r.is_ready()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_engine::pool::KvDtype;
    use lockstep_engine::transfer::{KvManifest, ModelFingerprint};

    fn set(pair: u64) -> KvTransfer {
        let mut m = KvManifest {
            pair_id: pair,
            model: ModelFingerprint(1),
            tokens: 1,
            page_size: 16,
            dtype: KvDtype::F16,
            page_count: 1,
            page_checksums: vec![5],
            manifest_checksum: 0,
        };
        m.manifest_checksum = m.compute_checksum();
        KvTransfer {
            manifest: m,
            pages: Vec::new(),
            prompt_logprobs: None,
        }
    }

    fn pending(rooms: &Rooms, t: KvTransfer, key: KvKey) -> PendingSet {
        let tag = key.sign(&t.manifest);
        PendingSet {
            set: t,
            tag,
            hold: rooms.reserve(100).expect("room for 100 bytes"),
        }
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(60)
    }

    fn key(b: u8) -> KvKey {
        KvKey::from_request(&[b; 32]).expect("key")
    }

    #[tokio::test]
    async fn a_forgery_pushed_first_neither_wins_nor_crowds_out_the_real_set() {
        let rooms = Rooms::new(Duration::from_secs(5), 1_000);
        let room = rooms.room(4).expect("room");
        // Before the decode call: a forger fills the unverified slots but one...
        room.put(pending(&rooms, set(4), key(9)))
            .expect("kept unverified");
        room.put(pending(&rooms, set(4), key(8)))
            .expect("kept unverified");
        assert!(matches!(
            room.put(pending(&rooms, set(4), key(7))),
            Err(Refusal::Busy(_))
        ));
        // ...the decode call drops both forgeries and waits; the real set, checked at once, is
        // taken; a later forgery is refused as such.
        let taker = {
            let room = room.clone();
            tokio::spawn(async move { room.take(key(1), far()).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            rooms.pending_bytes(),
            0,
            "forgeries dropped, bytes given back"
        );
        assert_eq!(
            room.put(pending(&rooms, set(4), key(2))),
            Err(Refusal::Forged)
        );
        room.put(pending(&rooms, set(4), key(1)))
            .expect("the real set");
        let (t, forged) = taker.await.expect("join").expect("taken");
        assert_eq!((t.manifest.pair_id, forged), (4, 2));
        assert_eq!(rooms.pending_bytes(), 0);
        assert_eq!(
            room.put(pending(&rooms, set(4), key(1))),
            Err(Refusal::Closed),
            "a replay after the take is refused"
        );
    }

    #[tokio::test]
    async fn a_set_signed_for_another_pair_is_never_taken() {
        let rooms = Rooms::new(Duration::from_secs(5), 1_000);
        let room = rooms.room(4).expect("room");
        // Another pair's genuine set (its own manifest, its own key), replayed here.
        room.put(pending(&rooms, set(5), key(5))).expect("kept");
        let r = tokio::time::timeout(Duration::from_millis(100), room.take(key(4), far())).await;
        assert!(r.is_err(), "still waiting: the replay was dropped");
        assert_eq!(rooms.pending_bytes(), 0);
    }

    #[test]
    fn reservations_are_bounded_and_given_back() {
        let rooms = Rooms::new(Duration::from_secs(5), 250);
        let a = rooms.reserve(100).expect("100");
        let b = rooms.reserve(150).expect("250 in all");
        assert!(matches!(rooms.reserve(1), Err(Refusal::Busy(_))));
        assert!(matches!(rooms.reserve(u64::MAX), Err(Refusal::Busy(_))));
        drop(a);
        assert_eq!(rooms.pending_bytes(), 150);
        let room = rooms.room(1).expect("room");
        room.put(PendingSet {
            set: set(1),
            tag: key(1).sign(&set(1).manifest),
            hold: b,
        })
        .expect("kept");
        rooms.close(1);
        assert_eq!(rooms.pending_bytes(), 0, "an abort gives the bytes back");
        let _c = rooms.room(2).expect("room");
        std::thread::sleep(Duration::from_millis(5));
        let short = Rooms::new(Duration::from_millis(1), 10);
        short.room(3).expect("room");
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(short.sweep(), 1);
    }

    #[tokio::test]
    async fn the_sweep_leaves_a_room_open_while_its_decode_call_may_still_wait() {
        let rooms = Arc::new(Rooms::new(Duration::from_millis(1), 1_000));
        let room = rooms.room(6).expect("room");
        let waiting = tokio::spawn({
            let room = room.clone();
            async move {
                room.take(key(6), Instant::now() + Duration::from_millis(300))
                    .await
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            rooms.sweep(),
            0,
            "past the lease, within the caller's deadline"
        );
        room.put(pending(&rooms, set(6), key(6))).expect("late set");
        assert!(waiting.await.expect("join").is_ok());
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(rooms.sweep(), 1, "then it goes");
    }
}
