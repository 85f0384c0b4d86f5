//! Where the tokenizer pool's helpers wake up. The pool's threads run under `SCHED_IDLE`, and
//! Linux's wake-up placement counts a CPU that runs only idle-policy tasks as idle: a helper
//! woken to take a chunk of a long prompt is put on the CPU of the thread that is already
//! tokenizing it, and waits behind it, while another CPU idles (2026-12-02, 2 vCPUs: of 120
//! chunks of 128 KiB prompts, 89 ran on the thread that took the job). Pinning the threads one
//! per CPU would fix the placement but strand a job whenever the pinned CPU is busy with
//! another process (an idle-policy thread there never runs, and rayon wakes no other thread
//! for it). So the placement is steered for one chunked encode only: before it, the caller
//! keeps its siblings off its own CPU ([`spread_helpers`]); a helper gives itself the whole set
//! back as soon as it runs a chunk ([`joined`]), and the caller gives it back to those that
//! never ran when the encode ends (the guard's drop). Where the CPU set cannot be read or holds
//! one CPU, nothing is changed.

use std::cell::OnceCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

/// One pool's threads: their kernel thread ids and whether each is kept off a CPU now.
pub struct Siblings {
    /// Kernel thread ids by pool index (0 until the thread has started).
    tids: Box<[AtomicI32]>,
    /// Whether the thread's CPU set is narrowed now.
    narrowed: Box<[AtomicBool]>,
}

impl Siblings {
    /// Room for a pool of `threads` threads.
    pub fn new(threads: usize) -> Arc<Siblings> {
        Arc::new(Siblings {
            tids: (0..threads).map(|_| AtomicI32::new(0)).collect(),
            narrowed: (0..threads).map(|_| AtomicBool::new(false)).collect(),
        })
    }
}

/// The calling pool thread's place: its pool, its index, and the CPU set it started with.
struct Me {
    siblings: Arc<Siblings>,
    index: usize,
    cpus: Cpus,
}

thread_local! {
    static ME: OnceCell<Me> = const { OnceCell::new() };
}

/// Registers the calling thread as thread `index` of `siblings` (from the pool's start handler).
pub fn register(siblings: &Arc<Siblings>, index: usize) {
    let Some(cpus) = Cpus::of(0) else {
        return;
    };
    if index >= siblings.tids.len() {
        return;
    }
    siblings.tids[index].store(gettid(), Ordering::Release);
    ME.with(|me| {
        let _ = me.set(Me {
            siblings: siblings.clone(),
            index,
            cpus,
        });
    });
}

/// Until dropped, the calling pool thread's siblings are kept off the CPU it runs on (see the
/// module's comment). Nothing on a thread of no registered pool, or with one CPU.
pub fn spread_helpers() -> Spread {
    joined();
    let narrowed = ME.with(|me| {
        let me = me.get()?;
        let here = current_cpu()?;
        let others = me.cpus.without(here)?;
        for (i, tid) in me.siblings.tids.iter().enumerate() {
            let tid = tid.load(Ordering::Acquire);
            if i == me.index || tid == 0 {
                continue;
            }
            // Marked after the change: whoever clears a mark restores the set, so every
            // narrowing is followed by a restore (a helper that joined between the two is
            // restored by this guard's drop instead), and no thread stays narrowed.
            if others.apply(tid) {
                me.siblings.narrowed[i].store(true, Ordering::Release);
            }
        }
        Some(())
    });
    Spread {
        active: narrowed.is_some(),
    }
}

/// A pool thread taking a chunk: its whole CPU set back if a caller narrowed it.
pub fn joined() {
    ME.with(|me| {
        if let Some(me) = me.get()
            && me.siblings.narrowed[me.index].swap(false, Ordering::AcqRel)
        {
            me.cpus.apply(0);
        }
    });
}

/// What [`spread_helpers`] changed, undone when dropped.
pub struct Spread {
    active: bool,
}

impl Drop for Spread {
    fn drop(&mut self) {
        if !self.active {
            return;
        }
        ME.with(|me| {
            let Some(me) = me.get() else {
                return;
            };
            for (i, tid) in me.siblings.tids.iter().enumerate() {
                if me.siblings.narrowed[i].swap(false, Ordering::AcqRel) {
                    me.cpus.apply(tid.load(Ordering::Acquire));
                }
            }
        });
    }
}

/// A CPU set (Linux); elsewhere nothing is ever read, so nothing is changed.
#[derive(Clone, Copy)]
struct Cpus {
    #[cfg(target_os = "linux")]
    set: libc::cpu_set_t,
}

#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
impl Cpus {
    /// The CPU set of thread `tid` (0: the calling thread).
    fn of(tid: i32) -> Option<Cpus> {
        // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity writes at most
        // `size_of::<cpu_set_t>()` bytes into it.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            (libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0)
                .then_some(Cpus { set })
        }
    }

    /// This set less `cpu`, if that leaves any CPU.
    fn without(&self, cpu: usize) -> Option<Cpus> {
        let mut rest = *self;
        // SAFETY: CPU_ISSET, CPU_CLR and CPU_COUNT read and write the set they are given, with
        // `cpu` checked against CPU_SETSIZE first.
        unsafe {
            if cpu >= libc::CPU_SETSIZE as usize || !libc::CPU_ISSET(cpu, &self.set) {
                return None;
            }
            libc::CPU_CLR(cpu, &mut rest.set);
            (libc::CPU_COUNT(&rest.set) > 0).then_some(rest)
        }
    }

    /// Gives thread `tid` (0: the calling thread) this set.
    fn apply(&self, tid: i32) -> bool {
        // SAFETY: sched_setaffinity reads `size_of::<cpu_set_t>()` bytes of the set.
        unsafe {
            libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &self.set) == 0
        }
    }

    #[cfg(test)]
    fn has(&self, cpu: usize) -> bool {
        // SAFETY: CPU_ISSET reads the set, `cpu` checked against CPU_SETSIZE.
        cpu < libc::CPU_SETSIZE as usize && unsafe { libc::CPU_ISSET(cpu, &self.set) }
    }

    #[cfg(test)]
    fn count(&self) -> usize {
        // SAFETY: CPU_COUNT reads the set.
        unsafe { libc::CPU_COUNT(&self.set) as usize }
    }
}

#[cfg(not(target_os = "linux"))]
impl Cpus {
    fn of(_tid: i32) -> Option<Cpus> {
        None
    }
    fn without(&self, _cpu: usize) -> Option<Cpus> {
        None
    }
    fn apply(&self, _tid: i32) -> bool {
        false
    }
}

#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn gettid() -> i32 {
    // SAFETY: gettid takes nothing and cannot fail.
    unsafe { libc::gettid() }
}

#[cfg(not(target_os = "linux"))]
fn gettid() -> i32 {
    0
}

#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn current_cpu() -> Option<usize> {
    // SAFETY: sched_getcpu takes nothing; -1 is its failure.
    usize::try_from(unsafe { libc::sched_getcpu() }).ok()
}

#[cfg(not(target_os = "linux"))]
fn current_cpu() -> Option<usize> {
    None
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use std::sync::atomic::Ordering;

    use super::{Cpus, Siblings};

    /// The whole cycle on a real two-thread pool: the caller's sibling is kept off the caller's
    /// CPU, a sibling that runs a chunk takes its set back itself, and the guard gives it back
    /// to one that never ran.
    #[test]
    fn a_helper_is_kept_off_the_callers_cpu_for_one_encode_only() {
        let Some(all) = Cpus::of(0) else {
            panic!("sched_getaffinity failed");
        };
        if all.count() < 2 {
            eprintln!("skipped: one CPU in this process's set");
            return;
        }
        let siblings = Siblings::new(2);
        let pool = {
            let s = siblings.clone();
            rayon::ThreadPoolBuilder::new()
                .num_threads(2)
                .start_handler(move |i| super::register(&s, i))
                .build()
                .expect("pool")
        };
        // Both threads have started and registered.
        pool.broadcast(|_| ());
        let tids: Vec<i32> = siblings
            .tids
            .iter()
            .map(|t| t.load(Ordering::Acquire))
            .collect();
        assert!(tids.iter().all(|&t| t != 0), "{tids:?}");
        let (me, other) = pool.install(|| {
            let me = rayon::current_thread_index().expect("a pool thread");
            (me, 1 - me)
        });
        // On the caller's thread: narrowed while the guard lives, whole after.
        let (cpu, during, after) = pool.broadcast(|ctx| {
            if ctx.index() != me {
                return None;
            }
            let cpu = super::current_cpu().expect("cpu");
            let guard = super::spread_helpers();
            let during = Cpus::of(tids[other]).expect("read");
            drop(guard);
            let after = Cpus::of(tids[other]).expect("read");
            Some((cpu, during, after))
        })[me]
            .expect("ran on the caller");
        assert!(
            !during.has(cpu),
            "the sibling may still wake on the caller's CPU {cpu}"
        );
        assert_eq!(during.count(), all.count() - 1);
        assert_eq!(after.count(), all.count());
        assert!(!siblings.narrowed[other].load(Ordering::Acquire));
        // A sibling that takes a chunk while narrowed gives itself its set back.
        let narrowed = pool.broadcast(|ctx| {
            if ctx.index() == me {
                let guard = super::spread_helpers();
                std::mem::forget(guard); // as if the encode were still running
            }
        });
        drop(narrowed);
        assert!(siblings.narrowed[other].load(Ordering::Acquire));
        assert_eq!(
            Cpus::of(tids[other]).expect("read").count(),
            all.count() - 1
        );
        let back = pool.broadcast(|ctx| {
            if ctx.index() == other {
                super::joined();
                Some(Cpus::of(0).expect("read").count())
            } else {
                None
            }
        })[other];
        assert_eq!(back, Some(all.count()));
        assert!(!siblings.narrowed[other].load(Ordering::Acquire));
    }

    /// On a thread of no registered pool nothing changes and nothing fails.
    #[test]
    fn outside_a_pool_nothing_changes() {
        let before = Cpus::of(0).expect("read").count();
        let guard = super::spread_helpers();
        assert!(!guard.active);
        drop(guard);
        super::joined();
        assert_eq!(Cpus::of(0).expect("read").count(), before);
    }
}
