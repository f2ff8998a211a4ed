//! Warm payload buffers for the engine's saves.
//!
//! A save copies one block out of the executor's arena into a payload buffer (368,640 bytes for
//! the default model). Into a fresh `Vec` that copy is mostly page faults: the allocation is
//! above glibc's mmap threshold, so every block saved is a new mapping faulted in page by page
//! on the engine thread (124 blocks: 23–44 ms, against 2–6 ms into memory already touched;
//! `docs/benchmarks.md` §7). A [`BufferPool`] hands the engine warm buffers instead:
//!
//! * **recycled** — the host LRU gives back the payload of every entry it evicts or replaces,
//!   and the Redis writer gives back each payload once it is encoded into its value; a payload
//!   still shared (a load holds a clone) is dropped as before, never copied;
//! * **pre-touched** — a background thread (`cachet-tiers-buffers`, at the lowest CPU priority)
//!   keeps the free list full by allocating buffers and writing every page once, so the first
//!   saves of an instance, before any eviction, find warm memory too.
//!
//! The free list is bounded by `--kv-tier-spare-bytes` (default 64 MiB). That memory is on top
//! of the host tier's capacity (which counts payload bytes held, exactly). A take from an empty
//! list allocates as before (counted as `fresh`): the pool only ever saves work.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::Payload;

/// Counters of a [`BufferPool`], monotonic.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BufferStats {
    /// Buffers handed out warm (recycled or pre-touched).
    pub warm: u64,
    /// Buffers handed out fresh (the free list was empty, or the size was new).
    pub fresh: u64,
    /// Payloads taken back into the free list.
    pub recycled: u64,
    /// Buffers the background thread allocated and touched.
    pub pretouched: u64,
}

/// The most free buffers kept whatever their size (tiny blocks in tests would otherwise mean
/// hundreds of thousands of them); the byte bound is the one that counts at real block sizes.
pub const MAX_FREE_BUFFERS: usize = 1024;

struct State {
    /// The size of a block's payload; 0 until the first take says it.
    block_bytes: usize,
    free: Vec<Vec<u8>>,
    stop: bool,
}

/// A bounded free list of block-sized payload buffers (see the module docs).
pub struct BufferPool {
    state: Mutex<State>,
    wake: Condvar,
    keep_bytes: u64,
    warm: AtomicU64,
    fresh: AtomicU64,
    recycled: AtomicU64,
    pretouched: AtomicU64,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl BufferPool {
    /// A pool keeping at most `keep_bytes` of free buffers (0: the pool keeps nothing and every
    /// take is a fresh allocation).
    pub fn new(keep_bytes: u64) -> Self {
        BufferPool {
            state: Mutex::new(State {
                block_bytes: 0,
                free: Vec::new(),
                stop: false,
            }),
            wake: Condvar::new(),
            keep_bytes,
            warm: AtomicU64::new(0),
            fresh: AtomicU64::new(0),
            recycled: AtomicU64::new(0),
            pretouched: AtomicU64::new(0),
        }
    }

    /// How many free buffers of `len` bytes the bound allows (at most [`MAX_FREE_BUFFERS`]).
    fn keep(&self, len: usize) -> usize {
        if len == 0 {
            return 0;
        }
        usize::try_from(self.keep_bytes / len as u64)
            .unwrap_or(usize::MAX)
            .min(MAX_FREE_BUFFERS)
    }

    /// An empty buffer with capacity for `len` bytes: a warm one when the free list has one.
    /// The first take (or one of a new size) sets the block size and wakes the filler.
    pub fn take(&self, len: usize) -> Vec<u8> {
        let mut s = lock(&self.state);
        if s.block_bytes != len {
            s.block_bytes = len;
            s.free.clear();
        }
        let got = s.free.pop();
        let below = s.free.len() < self.keep(len);
        drop(s);
        if below {
            self.wake.notify_one();
        }
        match got {
            Some(v) => {
                self.warm.fetch_add(1, Relaxed);
                v
            }
            None => {
                self.fresh.fetch_add(1, Relaxed);
                Vec::with_capacity(len)
            }
        }
    }

    /// Takes `payload`'s buffer back when nothing else holds it and it is block-sized; otherwise
    /// (or with the free list full) it is dropped.
    pub fn give(&self, payload: Payload) {
        if !payload.is_unique() {
            return;
        }
        let mut s = lock(&self.state);
        if s.block_bytes == 0
            || payload.len() != s.block_bytes
            || s.free.len() >= self.keep(s.block_bytes)
        {
            return;
        }
        // Unique, so this reuses the allocation (bytes copies only a shared buffer).
        let mut v = Vec::from(payload);
        if v.capacity() < s.block_bytes {
            return;
        }
        v.clear();
        s.free.push(v);
        drop(s);
        self.recycled.fetch_add(1, Relaxed);
    }

    /// Every payload in `payloads`, as [`BufferPool::give`].
    pub fn give_all(&self, payloads: impl IntoIterator<Item = Payload>) {
        for p in payloads {
            self.give(p);
        }
    }

    /// Free buffers held now.
    pub fn free_buffers(&self) -> usize {
        lock(&self.state).free.len()
    }

    pub fn stats(&self) -> BufferStats {
        BufferStats {
            warm: self.warm.load(Relaxed),
            fresh: self.fresh.load(Relaxed),
            recycled: self.recycled.load(Relaxed),
            pretouched: self.pretouched.load(Relaxed),
        }
    }

    /// Ends the filler thread (the pool itself stays usable).
    pub fn stop(&self) {
        lock(&self.state).stop = true;
        self.wake.notify_all();
    }

    /// Starts the background filler: while the free list is below its bound, allocate a buffer
    /// and write every page of it once. Runs at the lowest CPU priority, so that on a busy
    /// machine it takes the time the compute threads leave. Nothing to start with a zero bound.
    pub fn start_filler(self: &Arc<Self>) -> std::io::Result<()> {
        if self.keep_bytes == 0 {
            return Ok(());
        }
        let pool = Arc::clone(self);
        std::thread::Builder::new()
            .name("cachet-tiers-buffers".into())
            .spawn(move || {
                lower_priority();
                pool.fill_loop();
            })
            .map(|_| ())
    }

    fn fill_loop(&self) {
        loop {
            let len = {
                let mut s = lock(&self.state);
                loop {
                    if s.stop {
                        return;
                    }
                    if s.free.len() < self.keep(s.block_bytes) {
                        break s.block_bytes;
                    }
                    s = match self.wake.wait(s) {
                        Ok(g) => g,
                        Err(p) => p.into_inner(),
                    };
                }
            };
            let mut v: Vec<u8> = Vec::with_capacity(len);
            // Writing every byte faults in every page. Not zeros: `vec![0; len]` would be a
            // zeroed allocation (calloc: fresh mappings, untouched) and `resize(len, 0)` may
            // become one too. The contents do not matter: a save overwrites them.
            v.resize(len, 0x5a);
            v.clear();
            let mut s = lock(&self.state);
            if s.block_bytes == len && s.free.len() < self.keep(len) {
                s.free.push(v);
                drop(s);
                self.pretouched.fetch_add(1, Relaxed);
            }
        }
    }
}

/// The calling thread at nice 19 (Linux: `setpriority` on a thread id affects that thread).
fn lower_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: plain syscalls on the calling thread's own id; failure only leaves the priority.
    unsafe {
        let tid = libc::gettid();
        let _ = libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn a_recycled_buffer_is_handed_out_again_without_a_new_allocation() {
        let pool = BufferPool::new(3 * 100);
        // The first take sets the size; nothing is free yet.
        let mut b = pool.take(100);
        assert_eq!((b.len(), b.capacity()), (0, 100));
        b.extend_from_slice(&[7u8; 100]);
        let addr = b.as_ptr();
        let p = Payload::from(b);
        // A clone held elsewhere (a load in flight): not taken back.
        let clone = p.clone();
        pool.give(p);
        assert_eq!(pool.free_buffers(), 0);
        pool.give(clone);
        assert_eq!(pool.free_buffers(), 1);
        let again = pool.take(100);
        assert_eq!(again.as_ptr(), addr, "the same allocation");
        assert_eq!((again.len(), again.capacity()), (0, 100));
        assert_eq!(
            pool.stats(),
            BufferStats {
                warm: 1,
                fresh: 1,
                recycled: 1,
                pretouched: 0
            }
        );
    }

    #[test]
    fn the_free_list_is_bounded_and_takes_only_block_sized_payloads() {
        // 250 bytes of 100-byte blocks: two buffers at most.
        let pool = BufferPool::new(250);
        drop(pool.take(100));
        pool.give(Payload::from(vec![1u8; 99]));
        assert_eq!(pool.free_buffers(), 0, "wrong size");
        for _ in 0..4 {
            pool.give(Payload::from(vec![1u8; 100]));
        }
        assert_eq!(pool.free_buffers(), 2);
        assert_eq!(pool.stats().recycled, 2);
        // A new size empties the list (its buffers would not fit).
        drop(pool.take(200));
        assert_eq!(pool.free_buffers(), 0);
        // A pool that keeps nothing takes nothing back.
        let none = BufferPool::new(0);
        drop(none.take(100));
        none.give(Payload::from(vec![1u8; 100]));
        assert_eq!(none.free_buffers(), 0);
    }

    #[test]
    fn the_filler_keeps_the_list_full_after_takes() {
        let pool = Arc::new(BufferPool::new(4 * 4096));
        pool.start_filler().unwrap();
        // No size known yet: the filler waits.
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(pool.free_buffers(), 0);
        drop(pool.take(4096));
        let t0 = Instant::now();
        while pool.free_buffers() < 4 && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(pool.free_buffers(), 4);
        assert_eq!(pool.stats().pretouched, 4);
        // Three takes are warm; the filler tops the list up again.
        for _ in 0..3 {
            assert_eq!(pool.take(4096).capacity(), 4096);
        }
        let t0 = Instant::now();
        while pool.free_buffers() < 4 && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let s = pool.stats();
        assert_eq!((s.warm, s.fresh, s.pretouched), (3, 1, 7));
        pool.stop();
    }
}
