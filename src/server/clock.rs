//! The node's clock for durable timeouts, enqueue times and reports: milliseconds since the
//! Unix epoch, read from the wall clock once when the node starts and advanced by a monotonic
//! clock after that. A step of the system clock while the node runs (an NTP correction, an
//! operator's `date -s`) moves no deadline; a restart reads the wall clock again. Members
//! never compare their clocks: a copy turns the away time it receives into its own clock
//! (`copies.rs`), measured against the primary's clock reading in the same message
//! (`sent_ms`). Every timestamp the core keeps comes from this clock. A test may shift it
//! (`ServerConfig::clock_offset_ms`).

use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch on the system's wall clock (0 before 1970).
pub(crate) fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// See the module docs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Clock {
    /// The clock's reading at `anchor`.
    anchor_ms: u64,
    anchor: Instant,
}

impl Clock {
    /// A clock reading the wall clock now, shifted by `offset_ms`
    /// ([`ServerConfig::clock_offset_ms`](crate::config::ServerConfig::clock_offset_ms)).
    pub(crate) fn start(offset_ms: i64) -> Clock {
        Clock::anchored(wall_ms().saturating_add_signed(offset_ms), Instant::now())
    }

    /// A clock that reads `anchor_ms` at `anchor`.
    pub(crate) fn anchored(anchor_ms: u64, anchor: Instant) -> Clock {
        Clock { anchor_ms, anchor }
    }

    /// When the node started (its monotonic anchor).
    pub(crate) fn started(&self) -> Instant {
        self.anchor
    }

    /// Milliseconds since the node started, on the monotonic clock.
    pub(crate) fn since_start_ms(&self) -> u64 {
        self.anchor.elapsed().as_millis() as u64
    }

    /// Milliseconds since the Unix epoch, as this node counts them.
    pub(crate) fn now_ms(&self) -> u64 {
        self.anchor_ms
            .saturating_add(self.anchor.elapsed().as_millis() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_clock_counts_monotonic_time_from_its_anchor() {
        let anchor = Instant::now() - Duration::from_millis(250);
        let clock = Clock::anchored(1_000, anchor);
        let first = clock.now_ms();
        assert!(first >= 1_250, "{first}");
        std::thread::sleep(Duration::from_millis(20));
        let second = clock.now_ms();
        assert!(second >= first + 20, "{first} then {second}");
    }

    #[test]
    fn an_offset_shifts_the_wall_clock_reading() {
        let ahead = Clock::start(3_600_000).now_ms();
        let wall = wall_ms();
        assert!(ahead >= wall + 3_600_000 - 1_000, "{ahead} vs {wall}");
        let behind = Clock::start(-3_600_000).now_ms();
        assert!(
            behind <= wall_ms() - 3_600_000 + 1_000,
            "{behind} vs {wall}"
        );
        assert_eq!(
            Clock::start(i64::MIN).anchor_ms,
            0,
            "saturates at the epoch"
        );
    }
}
