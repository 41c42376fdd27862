//! The storage writer: one thread that commits write requests in order, grouping whatever is
//! waiting into one RocksDB write batch (group commit) with one fsync under `sync = batch`.
//!
//! Requests are submitted while the caller holds the core lock, so the commit order is the
//! order in which the core assigned offsets. A failed write is fatal: the writer poisons
//! itself, fails every later request and reports the failure (every later refusal names the
//! failure's cause); the node stops rather than continue on storage it cannot trust (the
//! `tether` binary exits non-zero: fail-stop).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, mpsc};
use std::time::Instant;

use tether_storage::{Batch, StorageError, Store};
use tokio::sync::oneshot;

use crate::config::SyncMode;
use crate::metrics as m;

/// Requests merged into one group commit at most.
pub const GROUP_COMMIT_REQUESTS_MAX: usize = 1024;

/// Runs after a request's batch is committed, on the writer thread, before its waiter wakes.
pub type OnCommit = Box<dyn FnOnce() + Send>;

struct Request {
    batch: Batch,
    on_commit: Option<OnCommit>,
    done: Option<oneshot::Sender<Result<(), WriteError>>>,
    submitted: Instant,
}

/// Handle to the writer thread.
#[derive(Clone)]
pub struct Writer {
    tx: mpsc::Sender<Request>,
    poisoned: Arc<AtomicBool>,
    /// The failure that poisoned the writer: every later refusal names it. Set before
    /// `poisoned`, so whoever sees the flag finds the cause.
    cause: Arc<OnceLock<Arc<StorageError>>>,
}

/// Why a write was not made durable.
#[derive(Clone, Debug, thiserror::Error)]
pub enum WriteError {
    /// This write failed in storage: the writer is poisoned and the node stops.
    #[error("{0}")]
    Failed(Arc<StorageError>),
    /// Storage failed on an earlier write; nothing is written any more.
    #[error("storage failed earlier ({0}); the node is stopping")]
    FailedEarlier(Arc<StorageError>),
    /// The writer thread has ended (the node is gone).
    #[error("storage writer stopped")]
    Stopped,
}

/// The refusal of a write after the writer was poisoned by `cause` (set before the flag).
fn refused_after(cause: Option<&Arc<StorageError>>) -> WriteError {
    cause.map_or(WriteError::Stopped, |c| {
        WriteError::FailedEarlier(c.clone())
    })
}

impl Writer {
    /// Starts the writer thread. `on_fatal` is called once if a write fails. The thread ends
    /// (dropping its handle on the store) once every `Writer` clone is dropped.
    pub fn start(
        store: Arc<dyn Store>,
        sync: SyncMode,
        on_fatal: Box<dyn FnOnce(Arc<StorageError>) + Send>,
    ) -> (Self, std::thread::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel::<Request>();
        let poisoned = Arc::new(AtomicBool::new(false));
        let cause = Arc::new(OnceLock::new());
        let (p, c) = (poisoned.clone(), cause.clone());
        let thread = std::thread::Builder::new()
            .name("tether-writer".into())
            .spawn(move || run(store, sync, rx, (p, c), on_fatal))
            .expect("spawn writer thread");
        (
            Writer {
                tx,
                poisoned,
                cause,
            },
            thread,
        )
    }

    /// Queues a batch; `on_commit` runs once it is committed. Returns a receiver that resolves
    /// when the batch is durable per the sync mode. Never blocks.
    pub fn submit(
        &self,
        batch: Batch,
        on_commit: Option<OnCommit>,
    ) -> oneshot::Receiver<Result<(), WriteError>> {
        let (done, rx) = oneshot::channel();
        if self.poisoned.load(Ordering::Acquire) {
            let _ = done.send(Err(refused_after(self.cause.get())));
            return rx;
        }
        if let Err(mpsc::SendError(req)) = self.tx.send(Request {
            batch,
            on_commit,
            done: Some(done),
            submitted: Instant::now(),
        }) && let Some(d) = req.done
        {
            let _ = d.send(Err(WriteError::Stopped));
        }
        rx
    }

    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }
}

fn run(
    store: Arc<dyn Store>,
    sync: SyncMode,
    rx: mpsc::Receiver<Request>,
    (poisoned, cause): (Arc<AtomicBool>, Arc<OnceLock<Arc<StorageError>>>),
    on_fatal: Box<dyn FnOnce(Arc<StorageError>) + Send>,
) {
    let mut on_fatal = Some(on_fatal);
    let mut group: Vec<Request> = Vec::new();
    while let Ok(first) = rx.recv() {
        group.push(first);
        if sync != SyncMode::Always {
            while group.len() < GROUP_COMMIT_REQUESTS_MAX {
                match rx.try_recv() {
                    Ok(r) => group.push(r),
                    Err(_) => break,
                }
            }
        }
        let result = if poisoned.load(Ordering::Acquire) {
            Err(refused_after(cause.get()))
        } else {
            let mut merged = Batch::new();
            for r in &mut group {
                merged.extend(std::mem::take(&mut r.batch));
            }
            metrics::histogram!(m::WRITE_BATCH_OPS).record(merged.len() as f64);
            let fsync = sync != SyncMode::None;
            let t = Instant::now();
            // The first request of the group is its oldest (the channel is FIFO).
            let waited = t.saturating_duration_since(group[0].submitted);
            metrics::histogram!(m::WRITER_WAIT).record(waited.as_secs_f64());
            let r = if merged.is_empty() {
                Ok(())
            } else {
                store.write(&merged, fsync)
            };
            if fsync && !merged.is_empty() {
                metrics::histogram!(m::FSYNC_LATENCY).record(t.elapsed().as_secs_f64());
            }
            r.map_err(|e| WriteError::Failed(Arc::new(e)))
        };
        if let Err(WriteError::Failed(e)) = &result
            && !poisoned.load(Ordering::Acquire)
        {
            // Only this thread writes: the cause first, then the flag.
            let _ = cause.set(e.clone());
            poisoned.store(true, Ordering::Release);
            tracing::error!(error = %e, "storage write failed; stopping the node");
            if let Some(f) = on_fatal.take() {
                f(e.clone());
            }
        }
        for r in group.drain(..) {
            if result.is_ok()
                && let Some(f) = r.on_commit
            {
                f();
            }
            if let Some(d) = r.done {
                let _ = d.send(result.clone());
            }
        }
    }
}

/// Joins the writer thread when dropped. Declared after the [`Writer`] in its owner, so the
/// channel is closed first and the thread finishes its queue, drops its handle on the store and
/// exits: RocksDB is closed by the time the owner is gone, never while the process exits.
pub struct WriterThread(Option<std::thread::JoinHandle<()>>);

impl WriterThread {
    pub fn new(handle: std::thread::JoinHandle<()>) -> Self {
        WriterThread(Some(handle))
    }
}

impl Drop for WriterThread {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            // The last owner may be a commit callback running on the writer thread itself.
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}
