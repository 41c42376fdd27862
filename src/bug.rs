//! A bug stops the node.
//!
//! A panic means the code did something it was written never to do, and the state it was
//! changing (the core's queues and offsets, a replication cursor) may be half-changed. Going on
//! with that state risks exactly what the node exists to prevent: an offset reused for another
//! event, an event lost. Stopping loses nothing that is durable, and the cluster is built for a
//! node that dies: its queues fail over to their copies and its clients reconnect.
//!
//! - [`stop_on_panic`] makes any panic, on any thread, abort the process once the panic is
//!   reported (the `tether` binary installs it first thing; a host that embeds the node may
//!   install it too). This is the effect of `panic = "abort"` without a second build of every
//!   crate: the test harness needs unwinding, so the test binaries and the server binary
//!   would no longer share their compiled dependencies.
//! - A poisoned lock (a thread panicked while holding it, in a host that lets panics unwind)
//!   is never taken as is: [`LockExt::lock_or_stop`] and its `RwLock` forms panic in turn, so
//!   no task goes on with the half-changed state behind it.

use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// The line a panic adds before the process aborts.
pub const STOPPING_LINE: &str =
    "error: a bug stopped this process (a panic, reported above); nothing durable is lost";

/// Installs a panic hook that reports the panic as the default hook does, then aborts the
/// process. Once per process; later calls add nothing.
pub fn stop_on_panic() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let report = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            report(info);
            tracing::error!(panic = %info, "a bug stopped the process");
            eprintln!("{STOPPING_LINE}");
            std::process::abort();
        }));
    });
}

#[cold]
#[track_caller]
fn poisoned(what: &str) -> ! {
    panic!(
        "{what} is poisoned: a thread panicked while holding it, so the state it guards may be half-changed; stopping"
    )
}

/// Locking that treats a poisoned lock as the bug it is.
pub(crate) trait LockExt<T> {
    /// Locks; panics if the lock is poisoned.
    fn lock_or_stop(&self) -> MutexGuard<'_, T>;
}

impl<T> LockExt<T> for Mutex<T> {
    #[track_caller]
    fn lock_or_stop(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(|_| poisoned("a mutex"))
    }
}

/// [`LockExt`] for `RwLock`s.
pub(crate) trait RwLockExt<T> {
    fn read_or_stop(&self) -> RwLockReadGuard<'_, T>;
    fn write_or_stop(&self) -> RwLockWriteGuard<'_, T>;
}

impl<T> RwLockExt<T> for RwLock<T> {
    #[track_caller]
    fn read_or_stop(&self) -> RwLockReadGuard<'_, T> {
        self.read()
            .unwrap_or_else(|_| poisoned("a read-write lock"))
    }

    #[track_caller]
    fn write_or_stop(&self) -> RwLockWriteGuard<'_, T> {
        self.write()
            .unwrap_or_else(|_| poisoned("a read-write lock"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::panic::{AssertUnwindSafe, catch_unwind};
    use std::sync::Arc;

    fn poison<L: Send + Sync + 'static>(lock: Arc<L>, hold: fn(&L)) {
        let held = lock.clone();
        let _ = std::thread::spawn(move || hold(&held)).join();
    }

    fn panic_text(r: std::thread::Result<()>) -> String {
        let e = r.expect_err("a panic");
        e.downcast_ref::<String>().cloned().unwrap_or_default()
    }

    #[test]
    fn a_poisoned_mutex_is_not_taken() {
        let m = Arc::new(Mutex::new(1));
        assert_eq!(*m.lock_or_stop(), 1, "a healthy lock is taken");
        poison(m.clone(), |m| {
            let _g = m.lock().unwrap();
            panic!("a bug while holding the lock");
        });
        assert!(m.is_poisoned());
        let text = panic_text(catch_unwind(AssertUnwindSafe(|| {
            drop(m.lock_or_stop());
        })));
        assert!(text.contains("poisoned"), "{text}");
    }

    #[test]
    fn a_poisoned_rwlock_is_not_taken_for_reading_or_writing() {
        let l = Arc::new(RwLock::new(1));
        assert_eq!(*l.read_or_stop(), 1);
        *l.write_or_stop() = 2;
        poison(l.clone(), |l| {
            let _g = l.write().unwrap();
            panic!("a bug while holding the lock");
        });
        for r in [
            catch_unwind(AssertUnwindSafe(|| {
                drop(l.read_or_stop());
            })),
            catch_unwind(AssertUnwindSafe(|| {
                drop(l.write_or_stop());
            })),
        ] {
            assert!(panic_text(r).contains("poisoned"));
        }
    }
}
