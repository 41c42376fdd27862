//! Registering interest and sending its initial image: the keys (and values) of the region
//! that the new interest selects, read after the interest is registered (a change made in
//! between is both in the image and queued, never in neither).
//!
//! A client that takes the image in parts (`image_in_parts`) gets it as a run of answers of at
//! most [`INITIAL_IMAGE_PART_BYTES_MAX`] each. Each part is a short read of its own, resuming
//! after the last key of the part before, and the next part is read while the last is being
//! written: an image of any size costs the node two parts' memory, and a client that reads
//! slowly holds no thread and no storage iterator. A client that does not take parts gets the
//! image in one answer, and an image that does not fit one frame is refused before anything
//! is registered.

use std::ops::ControlFlow;
use std::sync::Arc;

use regex::Regex;
use tether_storage::{StorageError, Store};
use tether_transport::codec;

use super::{Shared, internal};
use crate::core::SessionId;
use crate::interest::Selector;
use crate::limits::*;
use crate::protocol::*;

/// Registers a `RegisterInterest` request's interest and answers it. Every part of the image
/// but the last is written to `send` here; the last part (or the error) is returned for the
/// caller to write. None: the connection was lost while writing.
pub(super) async fn register(
    shared: &Arc<Shared>,
    session: SessionId,
    id: u64,
    body: RequestBody,
    send: &mut quinn::SendStream,
) -> Option<Result<ResponseBody, WireError>> {
    let RequestBody::RegisterInterest {
        region,
        interest,
        durable,
        policy,
        receive_values,
        image_in_parts,
    } = body
    else {
        return Some(Err(internal("not a registration")));
    };
    let one_answer = !image_in_parts && policy != ResultPolicy::None;
    if one_answer && let Ok(selectors) = Selector::from_spec(&interest) {
        // Refused before it is registered: the client could not take this image.
        let image = Arc::new(Image::new(&region, selectors, policy));
        match in_one_answer(shared, image).await {
            Ok(Some(_)) => {}
            Ok(None) => return Some(Err(too_large_for_one_answer(&region))),
            Err(e) => return Some(Err(e)),
        }
    }
    let registered = async {
        let selectors = shared
            .apply(|core| core.register(session, &region, &interest, durable, receive_values))
            .await?;
        shared.wake(session);
        if durable {
            shared.wait_interest_copied(session).await?;
        }
        Ok(selectors)
    };
    let selectors = match registered.await {
        Ok(s) => s,
        Err(e) => return Some(Err(e)),
    };
    if policy == ResultPolicy::None {
        return Some(Ok(registered_answer(Vec::new(), false)));
    }
    let image = Arc::new(Image::new(&region, selectors, policy));
    if one_answer {
        // Checked above; it can only have grown past one frame in between.
        return Some(match in_one_answer(shared, image).await {
            Ok(Some(entries)) => Ok(registered_answer(entries, false)),
            Ok(None) => Err(too_large_for_one_answer(&region)),
            Err(e) => Err(e),
        });
    }
    let mut reading = read_part(
        shared,
        image.clone(),
        Resume::Start,
        INITIAL_IMAGE_PART_BYTES_MAX,
    );
    loop {
        let part = match reading.await {
            Ok(Ok(part)) => part,
            Ok(Err(e)) => return Some(Err(internal(e))),
            Err(e) => return Some(Err(internal(e))),
        };
        let Some(next) = part.next else {
            return Some(Ok(registered_answer(part.entries, false)));
        };
        reading = read_part(shared, image.clone(), next, INITIAL_IMAGE_PART_BYTES_MAX);
        let answer = ServerMsg::Response {
            id,
            result: Ok(registered_answer(part.entries, true)),
        };
        if codec::write_frame(send, &answer).await.is_err() {
            return None;
        }
    }
}

fn registered_answer(initial: Vec<InitialEntry>, more: bool) -> ResponseBody {
    ResponseBody::Registered { initial, more }
}

fn too_large_for_one_answer(region: &str) -> WireError {
    WireError::new(
        ErrorCode::LimitExceeded,
        format!(
            "the initial image of this interest in region {region:?} exceeds one answer \
             ({INITIAL_IMAGE_ONE_ANSWER_BYTES_MAX} bytes) and this client does not take it in \
             parts: nothing was registered; register with policy none, or with a client that \
             sets image_in_parts"
        ),
    )
}

/// The whole image if it fits one answer; None if it does not (reading stops there).
async fn in_one_answer(
    shared: &Arc<Shared>,
    image: Arc<Image>,
) -> Result<Option<Vec<InitialEntry>>, WireError> {
    let part = read_part(
        shared,
        image,
        Resume::Start,
        INITIAL_IMAGE_ONE_ANSWER_BYTES_MAX,
    )
    .await
    .map_err(internal)?
    .map_err(internal)?;
    Ok(part.next.is_none().then_some(part.entries))
}

/// Reads one part on a blocking thread.
fn read_part(
    shared: &Arc<Shared>,
    image: Arc<Image>,
    from: Resume,
    part_bytes: usize,
) -> tokio::task::JoinHandle<Result<Part, StorageError>> {
    let store = shared.store.clone();
    tokio::task::spawn_blocking(move || image.read_part(&*store, &from, part_bytes))
}

/// What an entry counts for against a part's byte limit.
fn entry_bytes(e: &InitialEntry) -> usize {
    e.key.len() + e.value.as_ref().map_or(0, Vec::len) + INITIAL_IMAGE_ENTRY_OVERHEAD_BYTES
}

/// The image of one registration: a key list (point reads, in the list's order), or one regex
/// or all keys (a scan in key order).
struct Image {
    region: String,
    policy: ResultPolicy,
    /// The keys of a key list; None for a scan.
    keys: Option<Vec<String>>,
    all: bool,
    regexes: Vec<Regex>,
}

/// Where a part starts.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Resume {
    Start,
    /// At this index of the key list.
    ListAt(usize),
    /// After this key of the scan.
    ScanAfter(String),
}

struct Part {
    entries: Vec<InitialEntry>,
    /// Where the next part starts; None: this is the last.
    next: Option<Resume>,
}

impl Image {
    fn new(region: &str, selectors: Vec<Selector>, policy: ResultPolicy) -> Image {
        let is_list = selectors.iter().all(|s| matches!(s, Selector::Key(_)));
        let all = selectors.iter().any(|s| matches!(s, Selector::All));
        let regexes = selectors
            .iter()
            .filter_map(|s| match s {
                Selector::Regex(r) => crate::interest::compile_regex(r).ok(),
                _ => None,
            })
            .collect();
        let keys = is_list.then(|| {
            selectors
                .into_iter()
                .filter_map(|s| match s {
                    Selector::Key(k) => Some(k),
                    _ => None,
                })
                .collect()
        });
        Image {
            region: region.to_string(),
            policy,
            keys,
            all,
            regexes,
        }
    }

    fn entry(&self, key: &str, stored: &[u8]) -> InitialEntry {
        InitialEntry {
            key: key.to_string(),
            value: match self.policy {
                ResultPolicy::KeysValues => super::decode_region_value(stored).map(<[u8]>::to_vec),
                _ => None,
            },
        }
    }

    /// Reads the part starting at `from`: entries of at most `part_bytes` in all (at least
    /// one). Blocking: storage reads.
    fn read_part(
        &self,
        store: &dyn Store,
        from: &Resume,
        part_bytes: usize,
    ) -> Result<Part, StorageError> {
        let mut entries: Vec<InitialEntry> = Vec::new();
        let mut filled = 0;
        // Takes an entry unless the part is full.
        let mut take = |e: InitialEntry| {
            let bytes = entry_bytes(&e);
            if !entries.is_empty() && filled + bytes > part_bytes {
                return false;
            }
            filled += bytes;
            entries.push(e);
            true
        };
        if let Some(keys) = &self.keys {
            let start = match from {
                Resume::ListAt(i) => *i,
                _ => 0,
            };
            for (i, k) in keys.iter().enumerate().skip(start) {
                if let Some(v) = store.region_get(&self.region, k)?
                    && !take(self.entry(k, &v))
                {
                    return Ok(Part {
                        entries,
                        next: Some(Resume::ListAt(i)),
                    });
                }
            }
            return Ok(Part {
                entries,
                next: None,
            });
        }
        let after = match from {
            Resume::ScanAfter(k) => Some(k.as_str()),
            _ => None,
        };
        let mut full = false;
        store.region_scan(&self.region, after, &mut |key, v| {
            if self.all || self.regexes.iter().any(|re| re.is_match(key)) {
                full = !take(self.entry(key, v));
                if full {
                    return ControlFlow::Break(());
                }
            }
            ControlFlow::Continue(())
        })?;
        let next = full
            .then(|| Resume::ScanAfter(entries.last().map(|e| e.key.clone()).unwrap_or_default()));
        Ok(Part { entries, next })
    }
}

#[cfg(test)]
mod tests {
    use tether_storage::Batch;

    use super::*;

    fn store_with(keys: usize, value_bytes: usize) -> Arc<dyn Store> {
        let store: Arc<dyn Store> = Arc::new(tether_storage::MemStore::new());
        let mut b = Batch::new();
        for i in 0..keys {
            b.region_put(
                "R",
                &format!("k{i:05}"),
                crate::core::encode_region_value(Some(&vec![7u8; value_bytes])),
            );
        }
        store.write(&b, true).unwrap();
        store
    }

    /// Every part of an image, read as the connection reads them.
    fn parts_of(
        store: &dyn Store,
        selectors: Vec<Selector>,
        policy: ResultPolicy,
        part_bytes: usize,
    ) -> Vec<Vec<InitialEntry>> {
        let image = Image::new("R", selectors, policy);
        let mut parts = Vec::new();
        let mut from = Resume::Start;
        loop {
            let part = image.read_part(store, &from, part_bytes).unwrap();
            parts.push(part.entries);
            match part.next {
                Some(next) => from = next,
                None => return parts,
            }
        }
    }

    #[test]
    fn an_image_comes_in_parts_within_the_byte_limit_in_key_order() {
        let store = store_with(100, 1000);
        let part_bytes = 10 * 1024;
        let parts = parts_of(
            &*store,
            vec![Selector::All],
            ResultPolicy::KeysValues,
            part_bytes,
        );
        assert!(parts.len() > 1, "{} parts", parts.len());
        for p in &parts {
            assert!(!p.is_empty());
            assert!(p.iter().map(entry_bytes).sum::<usize>() <= part_bytes);
        }
        let keys: Vec<String> = parts.iter().flatten().map(|e| e.key.clone()).collect();
        let want: Vec<String> = (0..100).map(|i| format!("k{i:05}")).collect();
        assert_eq!(keys, want);
        assert!(
            parts
                .iter()
                .flatten()
                .all(|e| e.value.as_deref() == Some(&[7u8; 1000][..]))
        );
        // Keys only: smaller entries, one part, no values.
        let keys_only = parts_of(&*store, vec![Selector::All], ResultPolicy::Keys, part_bytes);
        assert_eq!(keys_only.len(), 1);
        assert!(keys_only[0].iter().all(|e| e.value.is_none()));
        // A regex: only its keys, in parts too.
        let odd = parts_of(
            &*store,
            vec![Selector::Regex("k[0-9]{4}[13579]".into())],
            ResultPolicy::KeysValues,
            part_bytes,
        );
        assert!(odd.len() > 1);
        let keys: Vec<String> = odd.iter().flatten().map(|e| e.key.clone()).collect();
        let want: Vec<String> = (0..100)
            .filter(|i| i % 2 == 1)
            .map(|i| format!("k{i:05}"))
            .collect();
        assert_eq!(keys, want);
    }

    #[test]
    fn a_part_holds_at_least_one_entry_and_an_empty_image_is_one_empty_part() {
        let store = store_with(3, 5000);
        let parts = parts_of(&*store, vec![Selector::All], ResultPolicy::KeysValues, 100);
        assert_eq!(parts.iter().map(Vec::len).collect::<Vec<_>>(), [1, 1, 1]);
        let none = parts_of(
            &*store,
            vec![Selector::Regex("x.*".into())],
            ResultPolicy::KeysValues,
            100,
        );
        assert_eq!(none, vec![Vec::<InitialEntry>::new()]);
    }

    #[test]
    fn a_key_list_comes_in_its_order_in_parts_without_absent_keys() {
        let store = store_with(10, 1000);
        let list: Vec<Selector> = ["k00009", "absent", "k00000", "k00005", "k00001"]
            .into_iter()
            .map(|k| Selector::Key(k.into()))
            .collect();
        let parts = parts_of(&*store, list, ResultPolicy::KeysValues, 2500);
        let keys: Vec<Vec<&str>> = parts
            .iter()
            .map(|p| p.iter().map(|e| e.key.as_str()).collect())
            .collect();
        assert_eq!(keys, [vec!["k00009", "k00000"], vec!["k00005", "k00001"]]);
    }
}
