//! Interest registrations and the per-region index that matches a published key to the queues
//! that want it. Plain data, no I/O.
//!
//! A registration is identified by `(region, Selector)`; a key list is normalised into one
//! [`Selector::Key`] per key, so registering the same thing twice is idempotent and
//! unregistering one key of a list works. Regexes match the whole key, with the `regex` crate's
//! size limits; a region's distinct regexes are matched together by one `RegexSet`.
//!
//! The set is rebuilt as regexes come and go (once an eighth of the set, or a minimum count,
//! changed); the newest few are matched alone until then. Its compiled form is shared as a
//! [`RegexMatcher`], so a publish matches its keys outside the core lock, with the last matcher
//! it knows of the region ([`Prematch`]; the index checks it is still the region's and matches
//! again itself if not). A new regex is compiled once, when its registration is validated. The
//! index also counts the distinct regexes the queues of each principal hold
//! (`REGEXES_PER_PRINCIPAL_MAX`).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use regex::{Regex, RegexBuilder, RegexSet, RegexSetBuilder};
use serde::{Deserialize, Serialize};

use crate::limits::{
    KEY_BYTES_MAX, REGEX_COMPILED_BYTES_MAX, REGEX_SET_CHANGES_MIN, REGEX_SET_DFA_BYTES_MAX,
    REGEX_SOURCE_BYTES_MAX, REGEXES_PER_PRINCIPAL_MAX,
};
use crate::protocol::{InterestInfo, InterestSpec};
use tether_storage::QueueId;

/// Why an interest (or a key) is refused. Each names the limit it passed.
#[derive(Clone, Debug, thiserror::Error)]
pub enum InterestError {
    #[error("a key list interest needs at least one key")]
    EmptyKeyList,
    #[error("key of {bytes} bytes exceeds the limit of {max} bytes", max = KEY_BYTES_MAX)]
    KeyTooLong { bytes: usize },
    #[error(
        "regex of {bytes} bytes exceeds the limit of {max} bytes",
        max = REGEX_SOURCE_BYTES_MAX
    )]
    RegexTooLong { bytes: usize },
    #[error("invalid regex {pattern:?}: {error}")]
    InvalidRegex {
        pattern: String,
        error: regex::Error,
    },
    #[error(
        "the queues of principal {principal:?} hold {held} distinct interest regexes, and {more} \
         more would pass the most one principal may hold ({max}): unregister some, or register \
         keys",
        max = REGEXES_PER_PRINCIPAL_MAX
    )]
    TooManyRegexes {
        principal: String,
        held: usize,
        more: usize,
    },
}

impl From<InterestError> for crate::protocol::WireError {
    /// A limit on the number of regexes is `limit-exceeded`; anything else is the request's
    /// own fault, `invalid-argument`.
    fn from(e: InterestError) -> Self {
        use crate::protocol::ErrorCode;
        let code = match e {
            InterestError::TooManyRegexes { .. } => ErrorCode::LimitExceeded,
            _ => ErrorCode::InvalidArgument,
        };
        Self::new(code, e.to_string())
    }
}

/// One normalised interest selector within a region.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Selector {
    Key(String),
    Regex(String),
    All,
}

impl Selector {
    /// Expands a wire spec into selectors, validating keys and regex sizes.
    pub fn from_spec(spec: &InterestSpec) -> Result<Vec<Selector>, InterestError> {
        Ok(Selector::from_spec_compiled(spec)?.0)
    }

    /// [`from_spec`](Self::from_spec), with the regex compiled to validate it, so a new one
    /// need not be compiled again for the index ([`InterestIndex::insert_owned`]).
    pub fn from_spec_compiled(
        spec: &InterestSpec,
    ) -> Result<(Vec<Selector>, Option<Regex>), InterestError> {
        let mut compiled = None;
        let selectors = match spec {
            InterestSpec::Key(k) => vec![Selector::Key(k.clone())],
            InterestSpec::Keys(keys) => {
                if keys.is_empty() {
                    return Err(InterestError::EmptyKeyList);
                }
                keys.iter().cloned().map(Selector::Key).collect()
            }
            InterestSpec::Regex(re) => {
                compiled = Some(compile_regex(re)?);
                vec![Selector::Regex(re.clone())]
            }
            InterestSpec::AllKeys => vec![Selector::All],
        };
        for s in &selectors {
            if let Selector::Key(k) = s {
                validate_key(k)?;
            }
        }
        Ok((selectors, compiled))
    }

    /// Whether this selector matches `key`. Regexes are compiled on the fly here; the index
    /// keeps compiled ones for the publish path.
    pub fn matches(&self, key: &str) -> bool {
        match self {
            Selector::Key(k) => k == key,
            Selector::Regex(re) => compile_regex(re).map(|r| r.is_match(key)).unwrap_or(false),
            Selector::All => true,
        }
    }

    /// The `tether queues` description of this selector.
    pub fn info(&self, region: &str, durable: bool) -> InterestInfo {
        let (kind, spec) = match self {
            Selector::Key(k) => ("key", Some(k.clone())),
            Selector::Regex(r) => ("regex", Some(r.clone())),
            Selector::All => ("all", None),
        };
        InterestInfo {
            region: region.to_string(),
            kind: kind.to_string(),
            spec,
            durable,
        }
    }
}

/// Validates a key against the key size limit.
pub fn validate_key(key: &str) -> Result<(), InterestError> {
    if key.len() > KEY_BYTES_MAX {
        return Err(InterestError::KeyTooLong { bytes: key.len() });
    }
    Ok(())
}

/// Compiles an interest regex anchored to the whole key, within the size limits.
pub fn compile_regex(source: &str) -> Result<Regex, InterestError> {
    if source.len() > REGEX_SOURCE_BYTES_MAX {
        return Err(InterestError::RegexTooLong {
            bytes: source.len(),
        });
    }
    RegexBuilder::new(&anchored(source))
        .size_limit(REGEX_COMPILED_BYTES_MAX)
        .dfa_size_limit(REGEX_COMPILED_BYTES_MAX)
        .build()
        .map_err(|error| InterestError::InvalidRegex {
            pattern: source.to_string(),
            error,
        })
}

/// A regex source anchored to match the whole key.
fn anchored(source: &str) -> String {
    format!("^(?:{source})$")
}

/// How one queue registered one selector.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    pub durable: bool,
    pub receive_values: bool,
}

/// One queue's registrations, by (region, selector), kept sorted in a vector: nearly every queue
/// holds one or a few, and a `BTreeMap` would allocate a node of eleven entries for the first
/// one (most of an idle queue's memory). Lookups are binary searches; at
/// [`crate::limits::INTERESTS_PER_QUEUE_MAX`] an insert moves at most that many entries.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Interests(Vec<((String, Selector), Registration)>);

impl Interests {
    pub fn new() -> Self {
        Interests(Vec::new())
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn find(&self, key: &(String, Selector)) -> Result<usize, usize> {
        self.0.binary_search_by(|(k, _)| k.cmp(key))
    }

    pub fn contains_key(&self, key: &(String, Selector)) -> bool {
        self.find(key).is_ok()
    }

    pub fn get(&self, key: &(String, Selector)) -> Option<&Registration> {
        self.find(key).ok().map(|i| &self.0[i].1)
    }

    /// Inserts or replaces; returns the registration replaced.
    pub fn insert(&mut self, key: (String, Selector), reg: Registration) -> Option<Registration> {
        match self.find(&key) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, reg)),
            Err(i) => {
                // Grow by one: the vector stays as small as the registrations.
                self.0.reserve_exact(1);
                self.0.insert(i, (key, reg));
                None
            }
        }
    }

    pub fn remove(&mut self, key: &(String, Selector)) -> Option<Registration> {
        let i = self.find(key).ok()?;
        let (_, reg) = self.0.remove(i);
        if self.0.len() <= self.0.capacity() / 4 {
            self.0.shrink_to_fit();
        }
        Some(reg)
    }

    /// In (region, selector) order.
    pub fn iter(&self) -> impl Iterator<Item = (&(String, Selector), &Registration)> {
        self.0.iter().map(|(k, r)| (k, r))
    }

    pub fn keys(&self) -> impl Iterator<Item = &(String, Selector)> {
        self.0.iter().map(|(k, _)| k)
    }
}

/// A region's distinct interest regexes, each with its queues. Most are matched together by
/// one [`RegexSet`] (one pass of a lazy DFA over the key instead of one per regex: at 1,000
/// regexes with a literal prefix, the publish rate of BENCHMARKS.md's regex phase); the few
/// registered since the set was built are matched one by one. The set is rebuilt when those,
/// plus the removed regexes it still holds, pass [`REGEX_SET_CHANGES_MIN`] or an eighth of the
/// set: rebuilding is paid by the registrations that call for it, a few regex compilations
/// each, and registering and removing the same regex again and again rebuilds nothing.
#[derive(Default)]
struct RegexIndex {
    /// Every source registered, by slot; a slot with no queues is free, dropped at the next
    /// rebuild (or taken again by the same source).
    slots: Vec<RegexSlot>,
    by_source: HashMap<String, usize>,
    /// The compiled patterns of `slots` (pattern i is slot i), shared with publishes that
    /// match keys outside the core lock. Changed in place only while nobody else holds it
    /// (`Arc::make_mut`): a matcher held elsewhere that is still this one (the same
    /// allocation) numbers the slots as they are.
    matcher: Arc<RegexMatcher>,
    /// Free slots below `matcher.set_len`.
    stale: usize,
}

/// The compiled regexes of one region as of one numbering of its slots: a [`RegexSet`] for
/// most, the few registered since it was built one by one. Immutable once shared, so a
/// publish can match its keys with it outside the core lock ([`Prematch`]).
#[derive(Clone, Default)]
pub struct RegexMatcher {
    /// Matches the sources of slots `..set_len` (pattern i is slot i).
    set: Option<RegexSet>,
    set_len: usize,
    /// The slots from `set_len` on, each compiled alone.
    fresh: Vec<Regex>,
}

impl RegexMatcher {
    /// Calls `hit` with each slot whose regex matches `key`.
    fn each_match(&self, key: &str, hit: &mut impl FnMut(usize)) {
        if let Some(set) = &self.set {
            for i in set.matches(key).iter() {
                hit(i);
            }
        }
        for (j, re) in self.fresh.iter().enumerate() {
            if re.is_match(key) {
                hit(self.set_len + j);
            }
        }
    }
}

/// A key's regex matches found with a region's [`RegexMatcher`] outside the core lock. The
/// index uses them if that matcher is still the region's, and matches the key itself if not.
pub struct Prematch {
    matcher: Arc<RegexMatcher>,
    slots: Vec<usize>,
}

impl Prematch {
    pub fn new(matcher: Arc<RegexMatcher>, key: &str) -> Prematch {
        let mut slots = Vec::new();
        matcher.each_match(key, &mut |i| slots.push(i));
        Prematch { matcher, slots }
    }
}

struct RegexSlot {
    source: String,
    queues: BTreeMap<QueueId, bool>,
}

impl RegexIndex {
    /// Distinct regexes with queues.
    fn len(&self) -> usize {
        self.by_source.len() - self.stale
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn contains(&self, source: &str) -> bool {
        self.by_source
            .get(source)
            .is_some_and(|&i| !self.slots[i].queues.is_empty())
    }

    /// Adds or updates `queue`'s registration of `source` (validated by the caller, and
    /// compiled if `compiled`). Returns whether `queue` did not hold it yet.
    fn insert(
        &mut self,
        source: &str,
        queue: QueueId,
        receive_values: bool,
        compiled: Option<Regex>,
    ) -> bool {
        if let Some(&i) = self.by_source.get(source) {
            let slot = &mut self.slots[i];
            if slot.queues.is_empty() {
                // A free slot of the set, taken again.
                self.stale -= 1;
            }
            return slot.queues.insert(queue, receive_values).is_none();
        }
        let Some(re) = compiled.or_else(|| compile_regex(source).ok()) else {
            return false;
        };
        self.by_source.insert(source.to_string(), self.slots.len());
        self.slots.push(RegexSlot {
            source: source.to_string(),
            queues: BTreeMap::from([(queue, receive_values)]),
        });
        Arc::make_mut(&mut self.matcher).fresh.push(re);
        self.rebuild_if_due();
        true
    }

    /// Removes `queue`'s registration of `source`; returns whether it held it.
    fn remove(&mut self, source: &str, queue: QueueId) -> bool {
        let Some(&i) = self.by_source.get(source) else {
            return false;
        };
        let slot = &mut self.slots[i];
        if slot.queues.remove(&queue).is_none() {
            return false;
        }
        if !slot.queues.is_empty() {
            return true;
        }
        let set_len = self.matcher.set_len;
        if i < set_len {
            // Still a pattern of the set: free until the next rebuild.
            self.stale += 1;
        } else {
            // Only fresh slots follow a fresh one: the set's patterns keep their slots.
            self.by_source.remove(source);
            self.slots.remove(i);
            Arc::make_mut(&mut self.matcher).fresh.remove(i - set_len);
            for j in self.by_source.values_mut() {
                if *j > i {
                    *j -= 1;
                }
            }
        }
        if self.is_empty() {
            *self = RegexIndex::default();
        } else {
            self.rebuild_if_due();
        }
        true
    }

    fn rebuild_if_due(&mut self) {
        let m = &self.matcher;
        if m.fresh.len() + self.stale > REGEX_SET_CHANGES_MIN.max(m.set_len / 8) {
            self.rebuild();
        }
    }

    /// One set of every regex with queues.
    fn rebuild(&mut self) {
        self.slots.retain(|s| !s.queues.is_empty());
        let built = RegexSetBuilder::new(self.slots.iter().map(|s| anchored(&s.source)))
            // Each pattern compiled alone within REGEX_COMPILED_BYTES_MAX.
            .size_limit(REGEX_COMPILED_BYTES_MAX.saturating_mul(self.slots.len() + 1))
            .dfa_size_limit(REGEX_SET_DFA_BYTES_MAX)
            .build();
        self.matcher = Arc::new(match built {
            Ok(set) => RegexMatcher {
                set: Some(set),
                set_len: self.slots.len(),
                fresh: Vec::new(),
            },
            Err(e) => {
                // Not expected (each compiled alone): match them one by one.
                tracing::warn!(error = %e, regexes = self.slots.len(), "interest regexes not built into one set");
                let mut fresh = Vec::new();
                self.slots.retain(|s| match compile_regex(&s.source) {
                    Ok(re) => {
                        fresh.push(re);
                        true
                    }
                    Err(_) => false,
                });
                RegexMatcher {
                    set: None,
                    set_len: 0,
                    fresh,
                }
            }
        });
        self.by_source = self
            .slots
            .iter()
            .enumerate()
            .map(|(i, s)| (s.source.clone(), i))
            .collect();
        self.stale = 0;
    }

    /// Hands the queues of every regex matching `key` to `add` (a free slot's are empty),
    /// from `pre` if it was found with this index's matcher. Returns whether `pre` was
    /// missing or out of date (the key was matched here).
    fn matches(
        &self,
        key: &str,
        pre: Option<&Prematch>,
        add: &mut impl FnMut(&BTreeMap<QueueId, bool>),
    ) -> bool {
        match pre {
            Some(p) if Arc::ptr_eq(&p.matcher, &self.matcher) => {
                for &i in &p.slots {
                    add(&self.slots[i].queues);
                }
                false
            }
            _ => {
                self.matcher
                    .each_match(key, &mut |i| add(&self.slots[i].queues));
                true
            }
        }
    }
}

#[derive(Default)]
struct RegionIndex {
    keys: HashMap<String, BTreeMap<QueueId, bool>>,
    regexes: RegexIndex,
    all: BTreeMap<QueueId, bool>,
}

impl RegionIndex {
    fn is_empty(&self) -> bool {
        self.keys.is_empty() && self.regexes.is_empty() && self.all.is_empty()
    }
}

/// Maps `(region, key)` to the queues whose interest matches, with whether they want values.
#[derive(Default)]
pub struct InterestIndex {
    regions: HashMap<String, RegionIndex>,
    /// The regexes held by the queues of each principal (the owner given with each change).
    by_principal: RegexesByPrincipal,
}

impl InterestIndex {
    /// Adds or updates `queue`'s registration of `selector`. The regex must have been validated.
    pub fn insert(
        &mut self,
        region: &str,
        selector: &Selector,
        queue: QueueId,
        receive_values: bool,
    ) {
        self.insert_owned(region, selector, queue, receive_values, None, None);
    }

    /// [`insert`](Self::insert) for a queue owned by `owner` (its regexes count for the owner,
    /// see [`regex_room`](Self::regex_room)), with a regex selector's regex compiled already
    /// (as [`compile_regex`] does), used if the region does not hold it yet.
    pub fn insert_owned(
        &mut self,
        region: &str,
        selector: &Selector,
        queue: QueueId,
        receive_values: bool,
        owner: Option<&str>,
        compiled: Option<Regex>,
    ) {
        let idx = self.regions.entry(region.to_string()).or_default();
        match selector {
            Selector::Key(k) => {
                idx.keys
                    .entry(k.clone())
                    .or_default()
                    .insert(queue, receive_values);
            }
            Selector::Regex(src) => {
                if idx.regexes.insert(src, queue, receive_values, compiled)
                    && let Some(owner) = owner
                {
                    self.by_principal.add(owner, region, src);
                }
            }
            Selector::All => {
                idx.all.insert(queue, receive_values);
            }
        }
    }

    /// Removes `queue`'s registration of `selector`, if any.
    pub fn remove(&mut self, region: &str, selector: &Selector, queue: QueueId) {
        self.remove_owned(region, selector, queue, None);
    }

    /// [`remove`](Self::remove) for a queue owned by `owner`.
    pub fn remove_owned(
        &mut self,
        region: &str,
        selector: &Selector,
        queue: QueueId,
        owner: Option<&str>,
    ) {
        let Some(idx) = self.regions.get_mut(region) else {
            return;
        };
        match selector {
            Selector::Key(k) => {
                if let Some(q) = idx.keys.get_mut(k) {
                    q.remove(&queue);
                    if q.is_empty() {
                        idx.keys.remove(k);
                    }
                }
            }
            Selector::Regex(src) => {
                if idx.regexes.remove(src, queue)
                    && let Some(owner) = owner
                {
                    self.by_principal.remove(owner, region, src);
                }
            }
            Selector::All => {
                idx.all.remove(&queue);
            }
        }
        if idx.is_empty() {
            self.regions.remove(region);
        }
    }

    /// A queue holding `registrations` is `owner`'s from now on (it was created on an open
    /// node): its regexes count for the owner.
    pub fn owner_gained<'a>(
        &mut self,
        owner: &str,
        registrations: impl Iterator<Item = &'a (String, Selector)>,
    ) {
        for (region, selector) in registrations {
            if let Selector::Regex(src) = selector {
                self.by_principal.add(owner, region, src);
            }
        }
    }

    /// Refuses `fresh` regexes in `region` for a queue of `owner` (with the message) when they
    /// would take the owner's queues past [`REGEXES_PER_PRINCIPAL_MAX`] distinct regexes.
    pub fn regex_room<'a>(
        &self,
        owner: &str,
        region: &str,
        fresh: impl Iterator<Item = &'a str>,
    ) -> Result<(), InterestError> {
        self.by_principal.check_room(owner, region, fresh)
    }

    /// Every queue interested in `(region, key)`, ascending by queue id, each with whether any
    /// of its matching registrations wants values. Clears `out` first.
    pub fn matches(&self, region: &str, key: &str, out: &mut BTreeMap<QueueId, bool>) {
        self.matches_with(region, key, None, out);
    }

    /// [`matches`](Self::matches), with the key's regex matches taken from `pre` when it was
    /// found with the region's current matcher. Returns whether the region's regexes were
    /// matched here instead (or `pre` is out of date): its matcher has changed since.
    pub fn matches_with(
        &self,
        region: &str,
        key: &str,
        pre: Option<&Prematch>,
        out: &mut BTreeMap<QueueId, bool>,
    ) -> bool {
        out.clear();
        let Some(idx) = self.regions.get(region) else {
            return pre.is_some();
        };
        let mut add = |queues: &BTreeMap<QueueId, bool>| {
            for (&q, &values) in queues {
                let slot = out.entry(q).or_insert(false);
                *slot |= values;
            }
        };
        add(&idx.all);
        if let Some(q) = idx.keys.get(key) {
            add(q);
        }
        if idx.regexes.is_empty() {
            return pre.is_some();
        }
        idx.regexes.matches(key, pre, &mut add)
    }

    /// The matcher of `region`'s regexes (none when it holds none), to match keys with
    /// outside the core lock ([`Prematch`]).
    pub fn regex_matcher(&self, region: &str) -> Option<Arc<RegexMatcher>> {
        let idx = self.regions.get(region)?;
        (!idx.regexes.is_empty()).then(|| idx.regexes.matcher.clone())
    }

    /// Distinct regexes registered in `region`.
    pub fn regex_count(&self, region: &str) -> usize {
        self.regions.get(region).map_or(0, |idx| idx.regexes.len())
    }

    /// Whether `source` is registered in `region` (by any queue).
    pub fn has_regex(&self, region: &str, source: &str) -> bool {
        self.regions
            .get(region)
            .is_some_and(|idx| idx.regexes.contains(source))
    }
}

/// The distinct interest regexes each principal's queues hold, by `(region, source)`, with
/// how many of its queues hold each: what [`REGEXES_PER_PRINCIPAL_MAX`] bounds.
#[derive(Default)]
struct RegexesByPrincipal(HashMap<String, HashMap<(String, String), u32>>);

impl RegexesByPrincipal {
    /// One more queue of `principal` holds `source` in `region`.
    fn add(&mut self, principal: &str, region: &str, source: &str) {
        *self
            .0
            .entry(principal.to_string())
            .or_default()
            .entry((region.to_string(), source.to_string()))
            .or_default() += 1;
    }

    /// One queue of `principal` holds `source` in `region` no more.
    fn remove(&mut self, principal: &str, region: &str, source: &str) {
        let Some(held) = self.0.get_mut(principal) else {
            return;
        };
        let k = (region.to_string(), source.to_string());
        if let Some(n) = held.get_mut(&k) {
            *n -= 1;
            if *n == 0 {
                held.remove(&k);
                if held.is_empty() {
                    self.0.remove(principal);
                }
            }
        }
    }

    /// Distinct `(region, source)` pairs the queues of `principal` hold.
    fn count(&self, principal: &str) -> usize {
        self.0.get(principal).map_or(0, HashMap::len)
    }

    /// Refuses `fresh` regexes for `principal` in `region` (with its message) when they would
    /// take it past [`REGEXES_PER_PRINCIPAL_MAX`] distinct regexes.
    fn check_room<'a>(
        &self,
        principal: &str,
        region: &str,
        fresh: impl Iterator<Item = &'a str>,
    ) -> Result<(), InterestError> {
        let held = self.0.get(principal);
        let mut new: Vec<&str> = fresh
            .filter(|src| {
                held.is_none_or(|h| !h.contains_key(&(region.to_string(), src.to_string())))
            })
            .collect();
        new.sort_unstable();
        new.dedup();
        let count = self.count(principal);
        if !new.is_empty() && count + new.len() > REGEXES_PER_PRINCIPAL_MAX {
            return Err(InterestError::TooManyRegexes {
                principal: principal.to_string(),
                held: count,
                more: new.len(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn key_list_expands_and_validates() {
        let s = Selector::from_spec(&InterestSpec::Keys(vec!["a".into(), "b".into()])).unwrap();
        assert_eq!(
            s,
            vec![Selector::Key("a".into()), Selector::Key("b".into())]
        );
        assert!(Selector::from_spec(&InterestSpec::Keys(vec![])).is_err());
        assert!(Selector::from_spec(&InterestSpec::Key("k".repeat(KEY_BYTES_MAX + 1))).is_err());
    }

    #[test]
    fn bad_and_oversized_regexes_are_refused() {
        assert!(
            Selector::from_spec(&InterestSpec::Regex("(".into()))
                .unwrap_err()
                .to_string()
                .contains("invalid regex")
        );
        assert!(
            Selector::from_spec(&InterestSpec::Regex("a".repeat(REGEX_SOURCE_BYTES_MAX + 1)))
                .is_err()
        );
        // Compiles past the compiled-size limit.
        assert!(compile_regex("(\\w{100}){100}").is_err());
    }

    #[test]
    fn regex_matches_whole_key() {
        let mut idx = InterestIndex::default();
        idx.insert("R", &Selector::Regex("D-.*".into()), 1, true);
        let mut out = BTreeMap::new();
        idx.matches("R", "D-Key-1", &mut out);
        assert_eq!(out, BTreeMap::from([(1, true)]));
        idx.matches("R", "LD-Key", &mut out);
        assert!(out.is_empty());
        idx.matches("Other", "D-Key-1", &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn receive_values_is_merged_per_queue() {
        let mut idx = InterestIndex::default();
        idx.insert("R", &Selector::All, 1, false);
        idx.insert("R", &Selector::Key("k".into()), 1, true);
        idx.insert("R", &Selector::Key("k".into()), 2, false);
        let mut out = BTreeMap::new();
        idx.matches("R", "k", &mut out);
        assert_eq!(out, BTreeMap::from([(1, true), (2, false)]));
        idx.remove("R", &Selector::Key("k".into()), 1);
        idx.matches("R", "k", &mut out);
        assert_eq!(out, BTreeMap::from([(1, false), (2, false)]));
    }

    fn selector() -> impl Strategy<Value = Selector> {
        prop_oneof![
            "[a-c]{1,2}".prop_map(Selector::Key),
            prop_oneof![Just("a.*"), Just("b+"), Just("[ac]c?")]
                .prop_map(|s| Selector::Regex(s.to_string())),
            Just(Selector::All),
        ]
    }

    /// Many distinct regexes, added and removed in turns: the set is rebuilt, its free slots
    /// taken again, and the index always answers as each regex alone would.
    #[test]
    fn a_regex_set_through_rebuilds_answers_as_each_regex_alone() {
        use std::collections::BTreeSet;
        let mut idx = InterestIndex::default();
        let source = |n: u64| format!("k{n}-.*");
        // Regex n → the queues holding it.
        let mut live: BTreeMap<u64, BTreeSet<QueueId>> = BTreeMap::new();
        let mut out = BTreeMap::new();
        let mut check = |idx: &InterestIndex, live: &BTreeMap<u64, BTreeSet<QueueId>>| {
            for n in 0..300 {
                idx.matches("R", &format!("k{n}-x"), &mut out);
                let want: BTreeMap<QueueId, bool> = live
                    .get(&n)
                    .into_iter()
                    .flatten()
                    .map(|&q| (q, true))
                    .collect();
                assert_eq!(out, want, "key k{n}-x");
            }
        };
        for round in 0..3u64 {
            for n in 0..300 {
                if (n + round) % 3 != 0 {
                    idx.insert("R", &Selector::Regex(source(n)), n + round, true);
                    live.entry(n).or_default().insert(n + round);
                }
            }
            assert_eq!(idx.regex_count("R"), live.len());
            check(&idx, &live);
            for n in 0..300 {
                if n % (round + 2) == 0
                    && let Some(queues) = live.remove(&n)
                {
                    for q in queues {
                        idx.remove("R", &Selector::Regex(source(n)), q);
                    }
                }
            }
            assert_eq!(idx.regex_count("R"), live.len());
            assert!(live.keys().all(|&n| idx.has_regex("R", &source(n))));
            assert!(!idx.has_regex("R", &source(0)));
            check(&idx, &live);
        }
        for (n, queues) in std::mem::take(&mut live) {
            for q in queues {
                idx.remove("R", &Selector::Regex(source(n)), q);
            }
        }
        assert_eq!(idx.regex_count("R"), 0);
        assert!(idx.regions.is_empty(), "an empty region is forgotten");
    }

    /// One region's registrations: (queue, selector) → receive values.
    type Model = BTreeMap<(QueueId, Selector), bool>;

    /// Inserts (or removes) each registration in region "R" of `idx` and in `model`.
    fn apply(
        idx: &mut InterestIndex,
        model: &mut Model,
        (insert, q, sel, values): (bool, QueueId, Selector, bool),
    ) {
        if insert {
            idx.insert("R", &sel, q, values);
            model.insert((q, sel), values);
        } else {
            idx.remove("R", &sel, q);
            model.remove(&(q, sel));
        }
    }

    /// The queues of `model` interested in `key`, by brute force.
    fn brute_force(model: &Model, key: &str) -> BTreeMap<QueueId, bool> {
        let mut expect: BTreeMap<QueueId, bool> = BTreeMap::new();
        for ((q, sel), values) in model {
            if sel.matches(key) {
                *expect.entry(*q).or_insert(false) |= *values;
            }
        }
        expect
    }

    fn many_regexes() -> impl Strategy<Value = Selector> {
        (0u8..80).prop_map(|n| Selector::Regex(format!("[ab]{{0,2}}{}?(?:x{{{}}})?", n % 3, n)))
    }

    proptest! {
        /// With many distinct regexes (set rebuilds, fresh and free slots), the index answers
        /// exactly what a brute-force scan answers.
        #[test]
        fn many_regexes_agree_with_brute_force(
            ops in proptest::collection::vec((any::<bool>(), 0u64..6, many_regexes(), any::<bool>()), 0..300),
            keys in proptest::collection::vec("[ab]{0,2}[0-2]?", 1..10),
        ) {
            let mut idx = InterestIndex::default();
            let mut model = Model::new();
            for op in ops {
                apply(&mut idx, &mut model, op);
            }
            let mut out = BTreeMap::new();
            for key in &keys {
                idx.matches("R", key, &mut out);
                prop_assert_eq!(&out, &brute_force(&model, key));
            }
        }
    }

    proptest! {
        /// A key matched outside the core lock with the matcher of any earlier moment gives
        /// the queues a brute-force scan gives: a matcher out of date is noticed (it is
        /// another allocation than the region's) and the key matched again by the index.
        #[test]
        fn prematches_from_any_earlier_matcher_agree_with_brute_force(
            ops in proptest::collection::vec((any::<bool>(), 0u64..6, many_regexes(), any::<bool>()), 0..300),
            taken_at in 0usize..320,
            keys in proptest::collection::vec("[ab]{0,2}[0-2]?", 1..10),
        ) {
            let mut idx = InterestIndex::default();
            let mut model = Model::new();
            let mut taken = None;
            for (n, op) in ops.into_iter().enumerate() {
                if n == taken_at {
                    taken = idx.regex_matcher("R");
                }
                apply(&mut idx, &mut model, op);
            }
            if taken_at >= 300 {
                taken = idx.regex_matcher("R");
            }
            let now = idx.regex_matcher("R");
            let current = matches!((&taken, &now), (Some(a), Some(b)) if Arc::ptr_eq(a, b));
            let mut out = BTreeMap::new();
            for key in &keys {
                let pre = taken.clone().map(|m| Prematch::new(m, key));
                let here = idx.matches_with("R", key, pre.as_ref(), &mut out);
                prop_assert_eq!(&out, &brute_force(&model, key));
                prop_assert_eq!(here, !current && (taken.is_some() || now.is_some()));
            }
        }
    }

    proptest! {
        /// A queue's registrations behave as the ordered map they replace.
        #[test]
        fn interests_behave_as_an_ordered_map(
            ops in proptest::collection::vec((any::<bool>(), 0usize..3, selector(), any::<bool>()), 0..80),
        ) {
            let mut model = BTreeMap::new();
            let mut interests = Interests::new();
            for (insert, region, sel, durable) in ops {
                let key = (format!("r{region}"), sel);
                let reg = Registration { durable, receive_values: !durable };
                if insert {
                    prop_assert_eq!(interests.insert(key.clone(), reg), model.insert(key, reg));
                } else {
                    prop_assert_eq!(interests.remove(&key), model.remove(&key));
                }
                prop_assert_eq!(interests.len(), model.len());
                prop_assert!(interests.iter().eq(model.iter()));
            }
            for k in model.keys() {
                prop_assert!(interests.contains_key(k));
                prop_assert_eq!(interests.get(k), model.get(k));
            }
        }

        /// The index answers exactly what a brute-force scan of the registrations answers,
        /// after any sequence of inserts and removes.
        #[test]
        fn index_agrees_with_brute_force(
            ops in proptest::collection::vec((any::<bool>(), 0u64..4, 0usize..2, selector(), any::<bool>()), 0..60),
            keys in proptest::collection::vec("[a-c]{1,2}", 1..10),
        ) {
            let regions = ["R", "S"];
            let mut idx = InterestIndex::default();
            let mut model: BTreeMap<(QueueId, &str, Selector), bool> = BTreeMap::new();
            for (insert, q, r, sel, values) in ops {
                if insert {
                    idx.insert(regions[r], &sel, q, values);
                    model.insert((q, regions[r], sel), values);
                } else {
                    idx.remove(regions[r], &sel, q);
                    model.remove(&(q, regions[r], sel));
                }
            }
            let mut out = BTreeMap::new();
            for region in regions {
                for key in &keys {
                    idx.matches(region, key, &mut out);
                    let mut expect: BTreeMap<QueueId, bool> = BTreeMap::new();
                    for ((q, r, sel), values) in &model {
                        if *r == region && sel.matches(key) {
                            *expect.entry(*q).or_insert(false) |= *values;
                        }
                    }
                    prop_assert_eq!(&out, &expect);
                }
            }
        }
    }
}
