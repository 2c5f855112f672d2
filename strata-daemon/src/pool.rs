//! A fork-join worker pool with short spinning, for the many small parallel
//! regions of a decode step (~250 matrix products per token on a small
//! model, each a few tens of microseconds). Waking sleeping threads for each
//! would cost more than the work; the workers spin on a generation counter
//! for a while after each region and then sleep on a condition variable.
//!
//! `run(n, f)` calls `f(0..n)` spread over the caller and the workers and
//! returns when all calls have finished.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before sleeping.
const SPIN: Duration = Duration::from_millis(3);

type TaskFn = dyn Fn(usize) + Sync + 'static;

struct Shared {
    /// The current region's closure (lifetime erased) and task count; written
    /// by the caller before `generation` is bumped, read by workers after.
    job: UnsafeCell<(*const TaskFn, usize)>,
    generation: AtomicUsize,
    next: AtomicUsize,
    active: AtomicUsize,
    sleeping: AtomicUsize,
    shutdown: AtomicBool,
    mutex: Mutex<()>,
    cv: Condvar,
}

// SAFETY: `job` is written only by the caller of `run` (serialised by `run_lock`)
// while no worker reads it (all workers are idle: `active == 0`), and read by workers
// only between the generation bump and their `active` decrement, during which the
// caller keeps the closure alive and does not write `job`.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

/// A pool of `threads - 1` worker threads plus the calling thread.
pub struct WorkerPool {
    shared: Arc<Shared>,
    threads: usize,
    handles: Vec<JoinHandle<()>>,
    run_lock: Mutex<()>,
}

impl WorkerPool {
    /// Creates a pool that runs regions on `threads` threads (the caller
    /// included; `threads` ≥ 1). Errors: a thread could not be spawned.
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let threads = threads.max(1);
        let noop: &TaskFn = &|_| {};
        let shared = Arc::new(Shared {
            job: UnsafeCell::new((noop as *const TaskFn, 0)),
            generation: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            sleeping: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            mutex: Mutex::new(()),
            cv: Condvar::new(),
        });
        let mut handles = Vec::new();
        for i in 1..threads {
            let s = shared.clone();
            handles.push(std::thread::Builder::new().name(format!("strata-cpu-{i}")).spawn(move || worker(s))?);
        }
        Ok(WorkerPool { shared, threads, handles, run_lock: Mutex::new(()) })
    }

    /// Threads that run a region (workers + caller).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Calls `f(i)` for every `i` in `0..n`, spread over the pool; returns
    /// when all calls are done. Calls from several threads are serialised.
    pub fn run<F: Fn(usize) + Sync>(&self, n: usize, f: F) {
        self.run_with(n, f, || {})
    }

    /// [`WorkerPool::run`], with `side` run once on the calling thread while the workers start on the tasks
    /// (the caller joins them when `side` returns). For work that must stay on the caller — e.g. GPU calls on
    /// a thread with the device context bound — to overlap a region instead of delaying it. With no workers
    /// (one thread, or `n` ≤ 1) `side` runs first, then the tasks. `side` must not start a region on this
    /// same pool (the pool is busy with this one: it would wait forever). A panic in `side` or in the caller's
    /// tasks stops the region (no further tasks start), waits for the workers' running tasks, then unwinds.
    pub fn run_with<F: Fn(usize) + Sync, G: FnOnce()>(&self, n: usize, f: F, side: G) {
        if self.threads == 1 || n <= 1 {
            side();
            (0..n).for_each(f);
            return;
        }
        let _g = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        let fref: &(dyn Fn(usize) + Sync + '_) = &f;
        // SAFETY: erase the closure's lifetime; it outlives every use because `join` below (declared after `f`,
        // so dropped before it, on return and on unwind alike) waits until all workers are done (active == 0).
        let fptr: *const TaskFn = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), &'static TaskFn>(fref) };
        // SAFETY: all workers are idle (the previous run waited for active == 0), so no one reads `job`.
        unsafe { *s.job.get() = (fptr, n) };
        s.next.store(0, Ordering::SeqCst);
        s.active.store(self.threads - 1, Ordering::SeqCst);
        s.generation.fetch_add(1, Ordering::SeqCst);
        let join = Join { s, n };
        if s.sleeping.load(Ordering::SeqCst) > 0 {
            let _m = s.mutex.lock().unwrap_or_else(|e| e.into_inner());
            s.cv.notify_all();
        }
        side();
        loop {
            let i = s.next.fetch_add(1, Ordering::AcqRel);
            if i >= n {
                break;
            }
            f(i);
        }
        drop(join);
    }
}

/// The end of a region: waits until every worker has left it. On unwind (a panic in the caller's side work or
/// tasks) it first stops the hand-out of tasks, so the wait covers only tasks already running.
struct Join<'a> {
    s: &'a Shared,
    n: usize,
}

impl Drop for Join<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // every index at or past n means "no task left"
            self.s.next.store(self.n, Ordering::SeqCst);
        }
        let mut spins = 0u32;
        while self.s.active.load(Ordering::Acquire) != 0 {
            spins = spins.wrapping_add(1);
            // When the machine is oversubscribed a worker may be descheduled: let it run.
            if spins.is_multiple_of(4096) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

fn worker(s: Arc<Shared>) {
    let mut seen = 0usize;
    loop {
        let t0 = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            let g = s.generation.load(Ordering::SeqCst);
            if g != seen {
                seen = g;
                break;
            }
            spins += 1;
            if spins.is_multiple_of(1024) && t0.elapsed() > SPIN {
                let mut m = s.mutex.lock().unwrap_or_else(|e| e.into_inner());
                s.sleeping.fetch_add(1, Ordering::SeqCst);
                while s.generation.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::SeqCst) {
                    m = s.cv.wait(m).unwrap_or_else(|e| e.into_inner());
                }
                s.sleeping.fetch_sub(1, Ordering::SeqCst);
                drop(m);
                continue;
            }
            if spins.is_multiple_of(4096) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        // SAFETY: read after observing the generation bump (SeqCst), which the caller
        // did after writing `job`; the closure lives until we decrement `active`.
        let (fptr, n) = unsafe { *s.job.get() };
        // SAFETY: see above; the pointer refers to the caller's live closure.
        let f = unsafe { &*fptr };
        loop {
            let i = s.next.fetch_add(1, Ordering::AcqRel);
            if i >= n {
                break;
            }
            f(i);
        }
        s.active.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _m = self.shared.mutex.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.cv.notify_all();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn side_work_runs_once_on_the_caller_beside_the_tasks() {
        for threads in [1, 3] {
            let p = WorkerPool::new(threads).unwrap();
            for n in [0usize, 1, 5, 64] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                let mut side_thread = None;
                p.run_with(
                    n,
                    |i| {
                        hits[i].fetch_add(1, Ordering::SeqCst);
                    },
                    || side_thread = Some(std::thread::current().id()),
                );
                assert_eq!(side_thread, Some(std::thread::current().id()), "threads {threads}, n {n}");
                assert!(hits.iter().all(|h| h.load(Ordering::SeqCst) == 1), "threads {threads}, n {n}");
            }
        }
    }

    #[test]
    fn a_panic_in_the_side_work_waits_for_the_running_tasks_and_leaves_the_pool_usable() {
        let p = WorkerPool::new(3).unwrap();
        let done = AtomicUsize::new(0);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let local = vec![1usize; 64]; // borrowed by the tasks, freed by the unwind
            p.run_with(
                64,
                |i| {
                    std::thread::sleep(Duration::from_micros(200));
                    done.fetch_add(local[i], Ordering::SeqCst);
                },
                || panic!("side work failed"),
            );
        }));
        assert!(r.is_err());
        // every task that started has finished (none runs on after the unwind), and the pool still works
        let after = done.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(done.load(Ordering::SeqCst), after);
        let sum = AtomicUsize::new(0);
        p.run(10, |i| {
            sum.fetch_add(i, Ordering::SeqCst);
        });
        assert_eq!(sum.load(Ordering::SeqCst), 45);
    }

    #[test]
    fn runs_every_task_once() {
        let p = WorkerPool::new(3).unwrap();
        for n in [0usize, 1, 2, 7, 100] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            p.run(n, |i| {
                hits[i].fetch_add(1, Ordering::SeqCst);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::SeqCst) == 1));
        }
        // After sleeping, the workers wake up again.
        std::thread::sleep(SPIN * 3);
        let sum = AtomicUsize::new(0);
        p.run(50, |i| {
            sum.fetch_add(i, Ordering::SeqCst);
        });
        assert_eq!(sum.load(Ordering::SeqCst), 49 * 50 / 2);
    }
}
