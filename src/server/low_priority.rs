//! Threads at a lower CPU priority for bulk work that must not take the processor from live
//! traffic: the frames of a replay. On Linux each thread raises its own nice value, so when the
//! cores are busy the scheduler runs the async workers and the storage writer (which carry live
//! events) first; on an idle machine the pool runs at full speed all the same.

use crate::bug::LockExt;
use std::sync::{Arc, Mutex, mpsc};

use tokio::sync::oneshot;

/// Nice value of the pool's threads (0 is the default, 19 the lowest priority). 10 gives a
/// runnable pool thread about a tenth of a core a normal thread competes for.
pub const LOW_PRIORITY_NICE: i32 = 10;

type Job = Box<dyn FnOnce() + Send>;

/// A fixed set of low-priority threads taking jobs in submission order. The threads end once
/// the pool is dropped and their queue is empty.
pub struct LowPriorityPool {
    tx: Mutex<mpsc::Sender<Job>>,
}

/// The job's answer never came: it panicked, or the pool's threads are gone.
#[derive(Debug)]
pub struct PoolClosed;

impl LowPriorityPool {
    /// Starts `threads` threads named `name`.
    pub fn start(name: &str, threads: usize) -> Self {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    lower_this_threads_priority();
                    loop {
                        // The lock is held only while waiting for the next job.
                        let job = {
                            let rx = rx.lock_or_stop();
                            rx.recv()
                        };
                        let Ok(job) = job else { return };
                        // A panicking job is a bug: its caller sees `PoolClosed` (its answer is
                        // dropped) and the thread goes on serving the others.
                        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                            tracing::error!("a low-priority job panicked");
                        }
                    }
                })
                .expect("spawn a low-priority pool thread");
        }
        LowPriorityPool { tx: Mutex::new(tx) }
    }

    /// Runs `f` on one of the pool's threads and returns what it returns.
    pub async fn run<T, F>(&self, f: F) -> Result<T, PoolClosed>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let (done, result) = oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = done.send(f());
        });
        self.tx.lock_or_stop().send(job).map_err(|_| PoolClosed)?;
        result.await.map_err(|_| PoolClosed)
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn lower_this_threads_priority() {
    // SAFETY: gettid has no preconditions; setpriority with PRIO_PROCESS and a thread id
    // changes that thread's nice value only (Linux), and raising it needs no privilege.
    let failed = unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, LOW_PRIORITY_NICE) != 0
    };
    if failed {
        tracing::debug!("could not lower a pool thread's priority; it runs at the default");
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn lower_this_threads_priority() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn jobs_run_and_return_their_results() {
        let pool = LowPriorityPool::start("test-pool", 2);
        let mut got = Vec::new();
        for i in 0..10u32 {
            got.push(pool.run(move || i * 2).await.unwrap());
        }
        assert_eq!(got, (0..10).map(|i| i * 2).collect::<Vec<_>>());
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[tokio::test]
    async fn its_threads_run_at_the_lower_priority() {
        let pool = LowPriorityPool::start("test-pool", 1);
        // SAFETY: getpriority of the calling thread; errno is not consulted (nice 10 is not -1).
        let nice = pool
            .run(|| unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) })
            .await
            .unwrap();
        assert_eq!(nice, LOW_PRIORITY_NICE);
    }
}
