//! Pacing of a replay at the rate its client asked for (`RequestBody::ReplayRate`): a token
//! bucket in events, with the time passed in. Plain data, no I/O.

use tether_storage::Offset;

/// How far ahead of its rate a paced replay may run after a pause, in microseconds of the
/// rate (the bucket's depth); also the span of events one paced read asks for.
pub const REPLAY_BURST_US: u64 = 100_000;

/// The replay pacing of one session's delivery driver.
#[derive(Clone, Debug, Default)]
pub struct ReplayPacer {
    /// Events per second; 0: unlimited.
    rate: u64,
    /// The instant, in microseconds of the driver's clock, until which the events sent so far
    /// are paid for.
    paid_until_us: u64,
}

impl ReplayPacer {
    /// Sets the rate (events per second; 0: unlimited), with a full bucket. Applies from the
    /// next frame on.
    pub fn set_rate(&mut self, events_per_s: u64) {
        *self = ReplayPacer {
            rate: events_per_s,
            paid_until_us: 0,
        };
    }

    /// The rate in force (0: unlimited).
    pub fn rate(&self) -> u64 {
        self.rate
    }

    /// The last offset a paced read starting at `from` should ask for (at most `to`): the
    /// events of one burst, so that a slow rate sends small frames, not large ones far apart.
    pub fn read_end(&self, from: Offset, to: Offset) -> Offset {
        if self.rate == 0 {
            return to;
        }
        let burst = (self.rate.saturating_mul(REPLAY_BURST_US) / 1_000_000).max(1);
        to.min(from.saturating_add(burst - 1))
    }

    /// `n` replayed events went to the wire at `now_us`: how long to wait, in microseconds,
    /// before the next replayed frame.
    pub fn sent(&mut self, n: u64, now_us: u64) -> u64 {
        if self.rate == 0 {
            return 0;
        }
        let cost_us = n.saturating_mul(1_000_000).div_ceil(self.rate);
        // Time spent idle earns credit, up to one burst.
        let start = self
            .paid_until_us
            .max(now_us.saturating_sub(REPLAY_BURST_US));
        self.paid_until_us = start.saturating_add(cost_us);
        self.wait_us(now_us)
    }

    /// How long, in microseconds from `now_us`, the next replayed frame must wait.
    pub fn wait_us(&self, now_us: u64) -> u64 {
        if self.rate == 0 {
            return 0;
        }
        self.paid_until_us.saturating_sub(now_us)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn unlimited_never_waits_nor_splits() {
        let mut p = ReplayPacer::default();
        assert_eq!(p.read_end(1, 1_000_000), 1_000_000);
        assert_eq!(p.sent(1_000_000, 5), 0);
    }

    #[test]
    fn a_burst_goes_at_once_then_the_rate_holds() {
        let mut p = ReplayPacer::default();
        p.set_rate(1_000);
        // One burst: 100 events.
        assert_eq!(p.read_end(1, 10_000), 100);
        assert_eq!(p.read_end(9_950, 10_000), 10_000);
        // The first 100 events are credit from the idle start.
        let now = 1_000_000;
        assert_eq!(p.sent(100, now), 0);
        // The next 100 cost 100 ms.
        assert_eq!(p.sent(100, now), 100_000);
        // Sent on time: the next 100 cost another 100 ms.
        assert_eq!(p.sent(100, now + 100_000), 100_000);
    }

    #[test]
    fn a_pause_earns_at_most_one_burst() {
        let mut p = ReplayPacer::default();
        p.set_rate(1_000);
        let _ = p.sent(100, 1_000_000);
        let _ = p.sent(100, 1_000_000);
        // Ten seconds later: one burst of credit, not ten seconds' worth.
        assert_eq!(p.sent(100, 11_000_000), 0);
        assert_eq!(p.sent(100, 11_000_000), 100_000);
    }

    proptest! {
        /// Over any schedule of sends that waits as told, the events sent by time t never
        /// exceed rate × t plus one burst and one frame.
        #[test]
        fn the_average_rate_holds(
            rate in 1u64..1_000_000,
            frames in proptest::collection::vec((1u64..5_000, 0u64..200_000), 1..200),
        ) {
            let mut p = ReplayPacer::default();
            p.set_rate(rate);
            let start = 10_000_000u64;
            let mut now = start;
            let mut sent = 0u64;
            let mut largest = 0u64;
            for (n, extra) in frames {
                let wait = p.sent(n, now);
                sent += n;
                largest = largest.max(n);
                // Checked when the frame goes, before the wait it is told.
                let allowed = (rate as u128 * (now - start + REPLAY_BURST_US) as u128)
                    .div_ceil(1_000_000) as u64;
                prop_assert!(sent <= allowed + largest, "{sent} events by {}", now - start);
                now += wait + extra;
            }
        }
    }
}
