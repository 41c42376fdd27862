//! Timed guards for the node's shared mutexes.
//!
//! The node's state lives behind `std::sync::Mutex`es taken on tokio worker threads; a lock
//! held long stalls every task queued behind it (client sessions, replication, the metadata
//! group's RPCs) on a node with few workers. A [`Timed`] guard measures how long it was held
//! and, past [`LOCK_HELD_SLOW_MS`], counts it in `tether_lock_held_slow_total` and logs the
//! caller's source location, so the hold that stalled a node can be named. A wait that long is
//! counted the same way (`tether_lock_wait_slow_total`).
//!
//! The rule this enforces: no long work under the core lock. A long hold stalls every task of
//! the node; on two cores, long enough for the node to be declared failed. Every hold of the
//! core and of the recent-publish log (`failover.rs`) is timed.

use crate::bug::LockExt;
use std::ops::{Deref, DerefMut};
use std::panic::Location;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

/// A lock held at least this long is counted and logged, in milliseconds.
pub const LOCK_HELD_SLOW_MS: u128 = 100;
/// A lock waited for at least this long is counted and logged, in milliseconds.
pub const LOCK_WAIT_SLOW_MS: u128 = 100;

/// A `MutexGuard` that reports a long hold when dropped.
pub(crate) struct Timed<'a, T> {
    guard: MutexGuard<'a, T>,
    name: &'static str,
    at: &'static Location<'static>,
    since: Instant,
}

/// Locks `m` (a poisoned lock is a bug and stops the caller: see [`crate::bug`]), timing the
/// wait and, on drop, the hold.
#[track_caller]
pub(crate) fn lock<'a, T>(m: &'a Mutex<T>, name: &'static str) -> Timed<'a, T> {
    lock_at(m, name, Location::caller())
}

/// [`lock`] on behalf of the caller at `at`.
pub(crate) fn lock_at<'a, T>(
    m: &'a Mutex<T>,
    name: &'static str,
    at: &'static Location<'static>,
) -> Timed<'a, T> {
    let asked = Instant::now();
    let guard = m.lock_or_stop();
    let since = Instant::now();
    let waited = since.duration_since(asked).as_millis();
    if waited >= LOCK_WAIT_SLOW_MS {
        metrics::counter!(crate::metrics::LOCK_WAIT_SLOW, "lock" => name).increment(1);
        tracing::debug!(lock = name, waited_ms = waited as u64, at = %at, "lock waited for long");
    }
    Timed {
        guard,
        name,
        at,
        since,
    }
}

impl<T> Deref for Timed<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> DerefMut for Timed<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

impl<T> Drop for Timed<'_, T> {
    fn drop(&mut self) {
        let held = self.since.elapsed().as_millis();
        if held >= LOCK_HELD_SLOW_MS {
            metrics::counter!(crate::metrics::LOCK_HELD_SLOW, "lock" => self.name).increment(1);
            tracing::warn!(lock = self.name, held_ms = held as u64, at = %self.at, "lock held long");
        }
    }
}
