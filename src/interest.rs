//! Interest registrations and the per-region index that matches a published key to the queues
//! that want it. Plain data, no I/O.
//!
//! A registration is identified by `(region, Selector)`; a key list is normalised into one
//! [`Selector::Key`] per key, so registering the same thing twice is idempotent and
//! unregistering one key of a list works. Regexes match the whole key and are compiled once
//! per distinct source per region, with the `regex` crate's size limits.

use std::collections::{BTreeMap, HashMap};

use regex::{Regex, RegexBuilder};
use serde::{Deserialize, Serialize};

use crate::limits::{KEY_BYTES_MAX, REGEX_COMPILED_BYTES_MAX, REGEX_SOURCE_BYTES_MAX};
use crate::protocol::{InterestInfo, InterestSpec};
use tether_storage::QueueId;

/// One normalised interest selector within a region.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Selector {
    Key(String),
    Regex(String),
    All,
}

impl Selector {
    /// Expands a wire spec into selectors, validating keys and regex sizes.
    pub fn from_spec(spec: &InterestSpec) -> Result<Vec<Selector>, String> {
        let selectors = match spec {
            InterestSpec::Key(k) => vec![Selector::Key(k.clone())],
            InterestSpec::Keys(keys) => {
                if keys.is_empty() {
                    return Err("a key list interest needs at least one key".into());
                }
                keys.iter().cloned().map(Selector::Key).collect()
            }
            InterestSpec::Regex(re) => {
                compile_regex(re)?;
                vec![Selector::Regex(re.clone())]
            }
            InterestSpec::AllKeys => vec![Selector::All],
        };
        for s in &selectors {
            if let Selector::Key(k) = s {
                validate_key(k)?;
            }
        }
        Ok(selectors)
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
pub fn validate_key(key: &str) -> Result<(), String> {
    if key.len() > KEY_BYTES_MAX {
        return Err(format!(
            "key of {} bytes exceeds the limit of {KEY_BYTES_MAX} bytes",
            key.len()
        ));
    }
    Ok(())
}

/// Compiles an interest regex anchored to the whole key, within the size limits.
pub fn compile_regex(source: &str) -> Result<Regex, String> {
    if source.len() > REGEX_SOURCE_BYTES_MAX {
        return Err(format!(
            "regex of {} bytes exceeds the limit of {REGEX_SOURCE_BYTES_MAX} bytes",
            source.len()
        ));
    }
    RegexBuilder::new(&format!("^(?:{source})$"))
        .size_limit(REGEX_COMPILED_BYTES_MAX)
        .dfa_size_limit(REGEX_COMPILED_BYTES_MAX)
        .build()
        .map_err(|e| format!("invalid regex {source:?}: {e}"))
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

#[derive(Default)]
struct RegionIndex {
    keys: HashMap<String, BTreeMap<QueueId, bool>>,
    regexes: HashMap<String, (Regex, BTreeMap<QueueId, bool>)>,
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
        let idx = self.regions.entry(region.to_string()).or_default();
        match selector {
            Selector::Key(k) => {
                idx.keys
                    .entry(k.clone())
                    .or_default()
                    .insert(queue, receive_values);
            }
            Selector::Regex(src) => {
                if let Some((_, queues)) = idx.regexes.get_mut(src) {
                    queues.insert(queue, receive_values);
                } else if let Ok(re) = compile_regex(src) {
                    idx.regexes
                        .insert(src.clone(), (re, BTreeMap::from([(queue, receive_values)])));
                }
            }
            Selector::All => {
                idx.all.insert(queue, receive_values);
            }
        }
    }

    /// Removes `queue`'s registration of `selector`, if any.
    pub fn remove(&mut self, region: &str, selector: &Selector, queue: QueueId) {
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
                if let Some((_, q)) = idx.regexes.get_mut(src) {
                    q.remove(&queue);
                    if q.is_empty() {
                        idx.regexes.remove(src);
                    }
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

    /// Every queue interested in `(region, key)`, ascending by queue id, each with whether any
    /// of its matching registrations wants values. Clears `out` first.
    pub fn matches(&self, region: &str, key: &str, out: &mut BTreeMap<QueueId, bool>) {
        out.clear();
        let Some(idx) = self.regions.get(region) else {
            return;
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
        for (re, q) in idx.regexes.values() {
            if re.is_match(key) {
                add(q);
            }
        }
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
