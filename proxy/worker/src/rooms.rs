//! Rooms: where a pushed KV set waits for its pair's decode call, and a decode call for its set.
//! A room nobody claims within the lease is dropped ([`Rooms::sweep`]), so a lost peer strands
//! nothing for longer than that.

use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use lockstep_engine::pd::KvRoom;

/// The rooms of one worker, by pair id.
#[derive(Debug)]
pub struct Rooms {
    by_pair: DashMap<u64, Arc<KvRoom>>,
    lease: Duration,
}

impl Rooms {
    /// No rooms; each lives at most `lease` unclaimed.
    pub fn new(lease: Duration) -> Rooms {
        Rooms {
            by_pair: DashMap::new(),
            lease,
        }
    }

    /// How long a set waits for its decode call, and a decode call for its set.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The room of `pair_id`, opened if absent.
    pub fn room(&self, pair_id: u64) -> Arc<KvRoom> {
        self.by_pair.entry(pair_id).or_default().clone()
    }

    /// Forgets the room of `pair_id` (its decode call took what it needed).
    pub fn remove(&self, pair_id: u64) {
        self.by_pair.remove(&pair_id);
    }

    /// Closes and forgets the room of `pair_id` (an abort): a waiting decode call ends, a pushed
    /// set is dropped.
    pub fn close(&self, pair_id: u64) {
        if let Some((_, room)) = self.by_pair.remove(&pair_id) {
            room.close();
        }
    }

    /// Drops rooms older than the lease (their pushed KV, or the wait for it); returns how many.
    pub fn sweep(&self) -> usize {
        let mut n = 0;
        self.by_pair.retain(|_, r| {
            let keep = r.age() < self.lease;
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
