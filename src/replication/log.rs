//! The shape of a queue log as replication sees it: offsets and the epoch of every entry.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::{Epoch, Offset};

/// A [`LogState`] as read from storage or a peer, before validation.
#[derive(Deserialize)]
struct RawLogState {
    start: Offset,
    end: Offset,
    epochs: Vec<EpochStart>,
}

impl TryFrom<RawLogState> for LogState {
    type Error = InvalidLog;

    fn try_from(raw: RawLogState) -> Result<Self, InvalidLog> {
        LogState::new(raw.start, raw.end, raw.epochs)
    }
}

/// The first offset of a run of entries appended under one epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochStart {
    pub epoch: Epoch,
    pub first: Offset,
}

/// A queue log without payloads: entries live at `[start, end)` and the epoch of each is given by
/// runs ([`EpochStart`]), sorted by offset with strictly rising epochs.
///
/// The runs also cover the entry just below `start` (if `start > 0`), so that the epoch of the
/// last trimmed entry stays known: a primary needs it as `prev_epoch` when it ships from its
/// `start`. Persist it with the entries (it changes only at a new epoch's first append, at a
/// truncation and at a trim); a restarted node rebuilds its [`Shipper`](super::Shipper) or
/// [`Replica`](super::Replica) from it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawLogState")]
pub struct LogState {
    start: Offset,
    end: Offset,
    epochs: Vec<EpochStart>,
}

/// Why a [`LogState`] read from storage or from a peer was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InvalidLog {
    /// The epoch runs do not cover `[start - 1, end)` exactly once.
    EpochRunsNotCovering,
    /// An epoch run has epoch 0, or the epochs do not rise strictly.
    EpochsNotRising,
    /// `start > end`.
    StartAfterEnd,
}

impl fmt::Display for InvalidLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self {
            InvalidLog::EpochRunsNotCovering => "epoch runs do not cover the log",
            InvalidLog::EpochsNotRising => "epoch runs are not strictly rising",
            InvalidLog::StartAfterEnd => "log start is after its end",
        };
        f.write_str(what)
    }
}

impl std::error::Error for InvalidLog {}

impl LogState {
    /// The empty log `[0, 0)`.
    pub fn empty() -> Self {
        Self::default()
    }

    /// Validates a log shape read from storage or received in a snapshot. Runs that end before
    /// `start - 1` are dropped.
    pub fn new(start: Offset, end: Offset, epochs: Vec<EpochStart>) -> Result<Self, InvalidLog> {
        if start > end {
            return Err(InvalidLog::StartAfterEnd);
        }
        if epochs.iter().any(|r| r.epoch == 0)
            || epochs.windows(2).any(|w| w[0].epoch >= w[1].epoch)
        {
            return Err(InvalidLog::EpochsNotRising);
        }
        if epochs.windows(2).any(|w| w[0].first >= w[1].first) {
            return Err(InvalidLog::EpochRunsNotCovering);
        }
        let mut log = LogState { start, end, epochs };
        if end == 0 {
            if !log.epochs.is_empty() {
                return Err(InvalidLog::EpochRunsNotCovering);
            }
            return Ok(log);
        }
        let lowest = log.covered_from();
        match (log.epochs.first(), log.epochs.last()) {
            (Some(first), Some(last)) if first.first <= lowest && last.first < end => {}
            _ => return Err(InvalidLog::EpochRunsNotCovering),
        }
        log.prune();
        Ok(log)
    }

    /// First offset held.
    pub fn start(&self) -> Offset {
        self.start
    }

    /// End of the log (exclusive): the offset the next entry gets.
    pub fn end(&self) -> Offset {
        self.end
    }

    /// Entries held.
    pub fn len(&self) -> u64 {
        self.end - self.start
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// The epoch runs, covering `[start - 1, end)`.
    pub fn epochs(&self) -> &[EpochStart] {
        &self.epochs
    }

    /// Epoch of the last entry ever appended (trimmed or not), or `None` for a log that never
    /// held one.
    pub fn last_epoch(&self) -> Option<Epoch> {
        self.epochs.last().map(|r| r.epoch)
    }

    /// Epoch of the entry at `offset`, for `start - 1 <= offset < end`.
    pub fn epoch_at(&self, offset: Offset) -> Option<Epoch> {
        if offset >= self.end || offset < self.covered_from() {
            return None;
        }
        self.run_index(offset).map(|i| self.epochs[i].epoch)
    }

    /// First offset of the run holding `offset` (possibly below `start`).
    pub fn run_first(&self, offset: Offset) -> Option<Offset> {
        self.run_index(offset).map(|i| self.epochs[i].first)
    }

    /// End (exclusive) of the run holding `offset`: the next run's first offset, or `end`.
    pub fn run_end(&self, offset: Offset) -> Option<Offset> {
        let i = self.run_index(offset)?;
        Some(self.epochs.get(i + 1).map_or(self.end, |r| r.first))
    }

    /// Extends the log to `new_end` with entries of `epoch`.
    ///
    /// # Panics
    /// If `new_end < end` or `epoch` is below the last entry's epoch (a caller bug).
    pub fn append(&mut self, epoch: Epoch, new_end: Offset) {
        assert!(new_end >= self.end, "log append moves end backwards");
        if new_end == self.end {
            return;
        }
        match self.last_epoch() {
            Some(last) if last == epoch => {}
            last => {
                assert!(epoch > last.unwrap_or(0), "log append with a falling epoch");
                self.epochs.push(EpochStart {
                    epoch,
                    first: self.end,
                });
            }
        }
        self.end = new_end;
    }

    /// Removes the entries at and above `to`.
    ///
    /// # Panics
    /// Unless `start <= to <= end` (a caller bug).
    pub fn truncate(&mut self, to: Offset) {
        assert!(
            self.start <= to && to <= self.end,
            "log truncate out of range"
        );
        self.end = to;
        while self.epochs.last().is_some_and(|r| r.first >= to) {
            self.epochs.pop();
        }
    }

    /// Removes the entries below `new_start` (no-op if it is not above `start`).
    ///
    /// # Panics
    /// If `new_start > end` (a caller bug).
    pub fn trim(&mut self, new_start: Offset) {
        assert!(new_start <= self.end, "log trim beyond end");
        if new_start > self.start {
            self.start = new_start;
            self.prune();
        }
    }

    fn covered_from(&self) -> Offset {
        self.start.saturating_sub(1)
    }

    fn run_index(&self, offset: Offset) -> Option<usize> {
        if offset >= self.end {
            return None;
        }
        self.epochs
            .partition_point(|r| r.first <= offset)
            .checked_sub(1)
    }

    /// Drops runs wholly below `start - 1`.
    fn prune(&mut self) {
        let lowest = self.covered_from();
        let keep_from = self
            .epochs
            .partition_point(|r| r.first <= lowest)
            .saturating_sub(1);
        self.epochs.drain(..keep_from);
    }
}
