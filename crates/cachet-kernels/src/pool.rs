//! Persistent thread pool for the kernels.
//!
//! Workers are spawned once and wait for work; [`ThreadPool::parallel_for`] publishes a job,
//! runs tasks on the calling thread too, and returns once every task has finished. Waiting
//! spins briefly (kernel calls arrive back to back during a forward pass) and then sleeps on
//! a condition variable, so an idle pool costs no CPU.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Number of spin iterations before a waiting thread goes to sleep.
const SPIN_ITERS: u32 = 1 << 14;

type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// Bumped (under `lock`) each time a job is published.
    epoch: AtomicUsize,
    /// The current job; written only by the publisher while no worker can read it.
    job: UnsafeCell<Option<Job>>,
    next_task: AtomicUsize,
    n_tasks: AtomicUsize,
    /// Workers that have not yet finished the current job.
    pending: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
    done_lock: Mutex<()>,
    done: Condvar,
}

// SAFETY: `job` is only written by the thread holding `ThreadPool::call_lock` while no worker
// is running a job (all workers have decremented `pending` for the previous epoch), and only
// read by workers after observing the new epoch with Acquire ordering. The pointee is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: see above; the raw job pointer is only dereferenced while the publisher keeps the
// closure alive (it blocks until `pending` reaches zero).
unsafe impl Send for Shared {}

impl Shared {
    fn run_tasks(&self, f: &(dyn Fn(usize) + Sync)) {
        let n = self.n_tasks.load(Ordering::Relaxed);
        loop {
            let i = self.next_task.fetch_add(1, Ordering::Relaxed);
            if i >= n {
                break;
            }
            f(i);
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
    let mut seen = 0usize;
    loop {
        // Wait for a new epoch: spin first, then sleep.
        let mut spins = 0u32;
        loop {
            if shared.shutdown.load(Ordering::Acquire) {
                return;
            }
            let e = shared.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
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
            if shared.epoch.load(Ordering::Acquire) == seen
                && !shared.shutdown.load(Ordering::Acquire)
            {
                drop(shared.wake.wait(guard));
            }
        }
        // SAFETY: the publisher wrote `job` before bumping `epoch` (Release), we read it after
        // observing the bump (Acquire); it stays valid until we decrement `pending`.
        let job = unsafe { *shared.job.get() };
        if let Some(job) = job {
            // SAFETY: the closure outlives this job (the publisher waits for `pending == 0`).
            let f: &(dyn Fn(usize) + Sync) = unsafe { &*job };
            if catch_unwind(AssertUnwindSafe(|| shared.run_tasks(f))).is_err() {
                shared.panicked.store(true, Ordering::Relaxed);
                // Drain remaining tasks so the publisher does not wait on them forever.
                shared.next_task.store(usize::MAX / 2, Ordering::Relaxed);
            }
        }
        if shared.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _g = shared.done_lock.lock();
            shared.done.notify_all();
        }
    }
}

impl ThreadPool {
    /// A pool using `n_threads` threads in total, the caller of `parallel_for` included
    /// (so `n_threads - 1` workers are spawned). `0` is treated as `1`.
    pub fn new(n_threads: usize) -> ThreadPool {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            epoch: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            next_task: AtomicUsize::new(0),
            n_tasks: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            done_lock: Mutex::new(()),
            done: Condvar::new(),
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
    /// thread participating; returns when all are done. Tasks are handed out dynamically.
    ///
    /// If the pool is already busy (a nested call from inside a task, or a concurrent call
    /// from another thread) the tasks run serially on the calling thread instead.
    /// A panic in a task is re-raised on the calling thread after all workers are idle.
    pub fn parallel_for(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_tasks == 0 {
            return;
        }
        let guard = match self.call_lock.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        if self.workers.is_empty() || n_tasks == 1 || guard.is_none() {
            for i in 0..n_tasks {
                f(i);
            }
            return;
        }
        let sh = &*self.shared;
        // SAFETY: erase the borrow's lifetime; we do not return before every worker has
        // finished with the job (`pending == 0`), so the pointer never dangles while used.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
        // SAFETY: no worker reads `job` now: all finished the previous epoch (pending == 0).
        unsafe { *sh.job.get() = Some(job) };
        sh.next_task.store(0, Ordering::Relaxed);
        sh.n_tasks.store(n_tasks, Ordering::Relaxed);
        sh.panicked.store(false, Ordering::Relaxed);
        sh.pending.store(self.workers.len(), Ordering::Relaxed);
        {
            let _g = sh.lock.lock();
            sh.epoch.fetch_add(1, Ordering::Release);
            sh.wake.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| sh.run_tasks(f)));
        if mine.is_err() {
            sh.next_task.store(usize::MAX / 2, Ordering::Relaxed);
        }
        // Wait for the workers.
        let mut spins = 0u32;
        while sh.pending.load(Ordering::Acquire) != 0 {
            if spins < SPIN_ITERS * 4 {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            let g = match sh.done_lock.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            if sh.pending.load(Ordering::Acquire) != 0 {
                let _ = sh.done.wait_timeout(g, std::time::Duration::from_millis(1));
            }
        }
        // SAFETY: all workers are done with the job; clear the dangling-to-be pointer.
        unsafe { *sh.job.get() = None };
        drop(guard);
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if sh.panicked.load(Ordering::Relaxed) {
            panic!("a ThreadPool task panicked");
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        {
            let _g = self.shared.lock.lock();
            self.shared.shutdown.store(true, Ordering::Release);
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
