//! Persistent thread pool for the kernels.
//!
//! Workers are spawned once and wait for work; [`ThreadPool::parallel_for`] publishes a job,
//! runs tasks on the calling thread too, and returns once every task has finished. Waiting
//! spins briefly (kernel calls arrive back to back during a forward pass) and then sleeps on
//! a condition variable, so an idle pool costs no CPU.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Spin iterations of an idle worker before it sleeps on the condition variable.
const SPIN_ITERS: u32 = 1 << 15;

type Job = *const (dyn Fn(usize) + Sync);

/// Synchronisation design: `ticket` packs `(epoch << 32) | next_task_index`. A worker may
/// only run a task (and only then read `job`) after claiming an index with a CAS on the
/// ticket of the current epoch; the publisher does not return before `done == n_tasks`.
/// So a late worker never touches a finished job, and the publisher never waits for a
/// worker that is not running (it simply does all tasks itself).
struct Shared {
    ticket: AtomicU64,
    n_tasks: AtomicUsize,
    done: AtomicUsize,
    job: UnsafeCell<Option<Job>>,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the publisher (holding `call_lock`) while no task of any
// epoch is claimed or running (all previous tasks are done and the new epoch is not yet
// published), and read only by a thread that claimed a task of the current epoch, which
// the publisher keeps alive until `done == n_tasks`. The pointee is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: see above.
unsafe impl Send for Shared {}

impl Shared {
    /// Claim and run tasks of `epoch` until none are left. Returns true if any ran.
    fn work(&self, epoch: u64) -> bool {
        let mut ran = false;
        loop {
            let t = self.ticket.load(Ordering::Acquire);
            if t >> 32 != epoch {
                return ran;
            }
            let n = self.n_tasks.load(Ordering::Acquire);
            let idx = (t & 0xffff_ffff) as usize;
            if idx >= n {
                return ran;
            }
            if self
                .ticket
                .compare_exchange_weak(t, t + 1, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            // SAFETY: we hold a claimed task of the current epoch, so the publisher is still
            // waiting and `job` is this epoch's closure.
            if let Some(job) = unsafe { *self.job.get() } {
                // SAFETY: as above, the closure outlives this task.
                let f: &(dyn Fn(usize) + Sync) = unsafe { &*job };
                if catch_unwind(AssertUnwindSafe(|| f(idx))).is_err() {
                    self.panicked.store(true, Ordering::Relaxed);
                }
            }
            self.done.fetch_add(1, Ordering::AcqRel);
            ran = true;
        }
    }
}

/// A persistent pool of `n_threads - 1` worker threads plus the calling thread.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    call_lock: Mutex<()>,
    n_threads: usize,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("n_threads", &self.n_threads)
            .finish()
    }
}

fn worker_loop(shared: Arc<Shared>) {
    let mut seen = shared.ticket.load(Ordering::Acquire) >> 32;
    let mut spins = 0u32;
    loop {
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        let e = shared.ticket.load(Ordering::Acquire) >> 32;
        if e != seen {
            seen = e;
            shared.work(e);
            spins = 0;
            continue;
        }
        if spins < SPIN_ITERS {
            spins += 1;
            std::hint::spin_loop();
            continue;
        }
        let guard = match shared.lock.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        shared.sleepers.fetch_add(1, Ordering::SeqCst);
        if shared.ticket.load(Ordering::SeqCst) >> 32 == seen
            && !shared.shutdown.load(Ordering::SeqCst)
        {
            drop(shared.wake.wait(guard));
        }
        shared.sleepers.fetch_sub(1, Ordering::SeqCst);
        spins = 0;
    }
}

impl ThreadPool {
    /// A pool using `n_threads` threads in total, the caller of `parallel_for` included
    /// (so `n_threads - 1` workers are spawned). `0` is treated as `1`.
    pub fn new(n_threads: usize) -> ThreadPool {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            ticket: AtomicU64::new(0),
            n_tasks: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut workers = Vec::with_capacity(n_threads - 1);
        for i in 1..n_threads {
            let s = Arc::clone(&shared);
            let spawned = std::thread::Builder::new()
                .name(format!("cachet-kernel-{i}"))
                .spawn(move || worker_loop(s));
            match spawned {
                Ok(h) => workers.push(h),
                Err(_) => break, // run with fewer threads rather than fail
            }
        }
        let n_threads = workers.len() + 1;
        ThreadPool {
            shared,
            workers,
            call_lock: Mutex::new(()),
            n_threads,
        }
    }

    /// A pool with one thread per available CPU.
    pub fn with_available_parallelism() -> ThreadPool {
        ThreadPool::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }

    /// Threads used by `parallel_for`, the caller included.
    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Run `f(task)` for `task in 0..n_tasks`, spread over the pool's threads, the calling
    /// thread participating; returns when all are done. Tasks are handed out dynamically,
    /// so a descheduled worker never delays the call beyond the task it is running.
    ///
    /// If the pool is already busy (a nested call from inside a task, or a concurrent call
    /// from another thread) the tasks run serially on the calling thread instead.
    /// A panic in a task is re-raised on the calling thread once all tasks have finished.
    pub fn parallel_for(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_tasks == 0 {
            return;
        }
        let guard = match self.call_lock.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        if self.workers.is_empty() || n_tasks == 1 || guard.is_none() || n_tasks > u32::MAX as usize
        {
            for i in 0..n_tasks {
                f(i);
            }
            return;
        }
        let sh = &*self.shared;
        // Close the finished epoch first: a worker may have loaded its ticket just before and
        // could otherwise pair that stale ticket with the new `n_tasks` below, claim an index
        // of the old epoch and run it with the new job (a task run twice, and `done` counting
        // a task that is still running). After this store any such CAS fails: the worker's
        // acquire load of the new `n_tasks` orders this store before its CAS.
        let epoch = (sh.ticket.load(Ordering::Relaxed) >> 32) + 1;
        sh.ticket
            .store(((epoch - 1) << 32) | 0xffff_ffff, Ordering::SeqCst);
        // SAFETY: erase the borrow's lifetime; tasks can only be claimed until `done`
        // reaches `n_tasks`, and we do not return before that.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
        // SAFETY: no task is claimable now (the previous epoch is exhausted and finished).
        unsafe { *sh.job.get() = Some(job) };
        sh.n_tasks.store(n_tasks, Ordering::Release);
        sh.done.store(0, Ordering::Release);
        sh.panicked.store(false, Ordering::Relaxed);
        sh.ticket.store(epoch << 32, Ordering::SeqCst);
        if sh.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = sh.lock.lock();
            sh.wake.notify_all();
        }
        sh.work(epoch);
        let mut spins = 0u32;
        while sh.done.load(Ordering::Acquire) < n_tasks {
            spins += 1;
            if spins < 1 << 12 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        drop(guard);
        if sh.panicked.load(Ordering::Relaxed) {
            panic!("a ThreadPool task panicked");
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        {
            let _g = self.shared.lock.lock();
            self.shared.shutdown.store(true, Ordering::SeqCst);
            self.shared.wake.notify_all();
        }
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn runs_every_task_once() {
        for n in [1, 2, 3, 4] {
            let pool = ThreadPool::new(n);
            assert_eq!(pool.n_threads(), n);
            for round in 0..200 {
                let n_tasks = round % 37;
                let hits: Vec<AtomicU64> = (0..n_tasks).map(|_| AtomicU64::new(0)).collect();
                pool.parallel_for(n_tasks, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    /// Back-to-back calls with few, tiny tasks: the window in which a worker that loaded the
    /// previous call's ticket races the next publication is hit thousands of times.
    #[test]
    fn back_to_back_calls_run_each_task_exactly_once() {
        let pool = ThreadPool::new(2);
        for round in 0..50_000u64 {
            let n_tasks = 2 + (round % 3) as usize;
            let hits: Vec<AtomicU64> = (0..n_tasks).map(|_| AtomicU64::new(0)).collect();
            pool.parallel_for(n_tasks, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            for (i, h) in hits.iter().enumerate() {
                assert_eq!(h.load(Ordering::Relaxed), 1, "round {round} task {i}");
            }
        }
    }

    #[test]
    fn nested_calls_run_serially() {
        let pool = ThreadPool::new(2);
        let total = AtomicU64::new(0);
        pool.parallel_for(4, &|_| {
            pool.parallel_for(3, &|_| {
                total.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(total.load(Ordering::Relaxed), 12);
    }

    #[test]
    fn panics_propagate_and_pool_survives() {
        let pool = ThreadPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.parallel_for(8, &|i| {
                if i == 5 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        let c = AtomicU64::new(0);
        pool.parallel_for(8, &|_| {
            c.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(c.load(Ordering::Relaxed), 8);
    }
}
