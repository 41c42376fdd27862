//! One behavioural suite run against every [`Store`] implementation.
//!
//! Each `pub fn` takes a factory returning a fresh, empty store and panics (assert) on a
//! deviation. [`run_all`] runs them all.

use std::ops::ControlFlow;

use crate::{Batch, Entry, Offset, QueueId, QueueMeta, Store};

/// Factory of fresh, empty stores.
pub type MakeStore<'a> = &'a mut dyn FnMut() -> Box<dyn Store>;

/// Runs every conformance check, each on a fresh store.
pub fn run_all(make: &mut dyn FnMut() -> Box<dyn Store>) {
    append_and_read_order(make);
    read_bounds(make);
    max_bytes_early_stop(make);
    set_acked_deletes_and_end(make);
    delivered_round_trip(make);
    info_epoch_round_trip(make);
    drop_queue_isolated(make);
    truncate_queue_keeps_prefix_and_meta(make);
    byte_marks_follow_the_entries(make);
    regions_isolated(make);
    state_round_trip(make);
    batch_mixed_ops_atomic(make);
    invalid_batch_applies_nothing(make);
    queues_ordering(make);
    empty_batch_and_flush(make);
}

/// An entry with the given flags and body.
pub fn entry(flags: u8, body: &[u8]) -> Entry {
    Entry::new(flags, body)
}

/// Every entry of `queue` in `from..=to` as `(offset, flags, body)`.
pub fn read_all(
    store: &dyn Store,
    queue: QueueId,
    from: Offset,
    to: Offset,
) -> Vec<(Offset, u8, Vec<u8>)> {
    let mut out = Vec::new();
    let n = store
        .read_entries(queue, from, to, usize::MAX, &mut |o, f, b| {
            out.push((o, f, b.to_vec()))
        })
        .expect("read_entries");
    assert_eq!(n, out.len(), "returned count matches visits");
    out
}

fn write(store: &dyn Store, b: &Batch) {
    store.write(b, false).expect("write");
}

fn meta(store: &dyn Store, q: QueueId) -> QueueMeta {
    store
        .queue_meta(q)
        .expect("queue_meta")
        .expect("queue has metadata")
}

/// Entries come back in offset order whatever the append order, with flags and bodies.
pub fn append_and_read_order(make: MakeStore<'_>) {
    let s = make();
    let mut b = Batch::new();
    b.put_queue_info(7, 1, b"i".to_vec());
    for off in [3u64, 1, 2, 5, 4] {
        b.append(7, off, entry(off as u8, format!("body{off}").as_bytes()));
    }
    assert_eq!(b.len(), 6);
    write(&*s, &b);
    let got = read_all(&*s, 7, 1, 100);
    let want: Vec<_> = (1..=5u64)
        .map(|o| (o, o as u8, format!("body{o}").into_bytes()))
        .collect();
    assert_eq!(got, want);
    assert_eq!(meta(&*s, 7).end, 5);
    // Empty body round-trips.
    let mut b = Batch::new();
    b.append(7, 6, entry(9, b""));
    write(&*s, &b);
    assert_eq!(read_all(&*s, 7, 6, 6), vec![(6, 9, vec![])]);
}

/// `from`/`to` are inclusive, out-of-range and inverted ranges visit nothing, and
/// neighbouring queues are never visited.
pub fn read_bounds(make: MakeStore<'_>) {
    let s = make();
    let mut b = Batch::new();
    for q in [1u64, 2, 3] {
        for off in 1..=10u64 {
            b.append(q, off, entry(0, &[q as u8, off as u8]));
        }
    }
    b.append(u64::MAX, u64::MAX, entry(1, b"max"));
    write(&*s, &b);
    let offs = |v: Vec<(Offset, u8, Vec<u8>)>| v.into_iter().map(|e| e.0).collect::<Vec<_>>();
    assert_eq!(offs(read_all(&*s, 2, 3, 6)), vec![3, 4, 5, 6]);
    assert_eq!(
        offs(read_all(&*s, 2, 0, u64::MAX)),
        (1..=10).collect::<Vec<_>>()
    );
    assert_eq!(offs(read_all(&*s, 2, 10, 10)), vec![10]);
    assert!(read_all(&*s, 2, 11, 20).is_empty());
    assert!(read_all(&*s, 2, 6, 3).is_empty());
    assert!(read_all(&*s, 4, 0, u64::MAX).is_empty());
    assert!(read_all(&*s, 2, 1, 10).iter().all(|e| e.2[0] == 2));
    assert_eq!(
        read_all(&*s, u64::MAX, 0, u64::MAX),
        vec![(u64::MAX, 1, b"max".to_vec())]
    );
}

/// Reading stops once the visited bodies total `>= max_bytes`, visiting at least one entry.
pub fn max_bytes_early_stop(make: MakeStore<'_>) {
    let s = make();
    let mut b = Batch::new();
    for off in 1..=10u64 {
        b.append(1, off, entry(0, &[0u8; 100]));
    }
    write(&*s, &b);
    let count = |max: usize| {
        let mut seen = Vec::new();
        let n = s
            .read_entries(1, 1, 10, max, &mut |o, _, _| seen.push(o))
            .unwrap();
        assert_eq!(n, seen.len());
        assert_eq!(seen, (1..=n as u64).collect::<Vec<_>>());
        n
    };
    assert_eq!(count(0), 1);
    assert_eq!(count(1), 1);
    assert_eq!(count(100), 1);
    assert_eq!(count(101), 2);
    assert_eq!(count(250), 3);
    assert_eq!(count(1000), 10);
    assert_eq!(count(usize::MAX), 10);
    assert_eq!(
        s.read_entries(2, 1, 10, 0, &mut |_, _, _| panic!("no entry"))
            .unwrap(),
        0
    );
}

/// `set_acked` deletes every entry `<= acked`, records `acked`, and `end` stays right
/// (equal to `acked` once everything is acked, never below it).
pub fn set_acked_deletes_and_end(make: MakeStore<'_>) {
    let s = make();
    let mut b = Batch::new();
    b.put_queue_info(5, 0, vec![]);
    for off in 1..=10u64 {
        b.append(5, off, entry(0, b"x"));
        b.append(6, off, entry(0, b"y"));
    }
    write(&*s, &b);
    let mut b = Batch::new();
    b.set_acked(5, 4);
    write(&*s, &b);
    let m = meta(&*s, 5);
    assert_eq!((m.acked, m.end), (4, 10));
    assert_eq!(read_all(&*s, 5, 0, u64::MAX).first().map(|e| e.0), Some(5));
    assert_eq!(
        read_all(&*s, 6, 0, u64::MAX).len(),
        10,
        "other queue untouched"
    );

    let mut b = Batch::new();
    b.set_acked(5, 10);
    write(&*s, &b);
    let m = meta(&*s, 5);
    assert_eq!((m.acked, m.end), (10, 10));
    assert!(read_all(&*s, 5, 0, u64::MAX).is_empty());

    // Acking beyond the last entry: end follows acked.
    let mut b = Batch::new();
    b.set_acked(5, 15);
    write(&*s, &b);
    assert_eq!(meta(&*s, 5).end, 15);
    // Appending after an ack.
    let mut b = Batch::new();
    b.append(5, 16, entry(0, b"z"));
    write(&*s, &b);
    let m = meta(&*s, 5);
    assert_eq!((m.acked, m.end), (15, 16));

    // set_acked alone creates metadata; append-then-ack in one batch deletes.
    let mut b = Batch::new();
    b.append(9, 1, entry(0, b"a"));
    b.append(9, 2, entry(0, b"b"));
    b.set_acked(9, 1);
    write(&*s, &b);
    let m = meta(&*s, 9);
    assert_eq!((m.acked, m.delivered, m.epoch, m.end), (1, 0, 0, 2));
    assert!(m.info.is_empty());
    assert_eq!(read_all(&*s, 9, 0, u64::MAX).len(), 1);
    // Ack then re-append in one batch: the later append survives.
    let mut b = Batch::new();
    b.set_acked(9, 2);
    b.append(9, 2, entry(3, b"again"));
    write(&*s, &b);
    assert_eq!(
        read_all(&*s, 9, 0, u64::MAX),
        vec![(2, 3, b"again".to_vec())]
    );
    // Ack at u64::MAX removes everything of that queue only.
    let mut b = Batch::new();
    b.append(u64::MAX, u64::MAX, entry(0, b"m"));
    b.set_acked(u64::MAX - 1, u64::MAX);
    write(&*s, &b);
    assert_eq!(read_all(&*s, u64::MAX, 0, u64::MAX).len(), 1);
    let mut b = Batch::new();
    b.set_acked(u64::MAX, u64::MAX);
    write(&*s, &b);
    assert!(read_all(&*s, u64::MAX, 0, u64::MAX).is_empty());
    assert_eq!(meta(&*s, u64::MAX).end, u64::MAX);
}

/// `set_delivered` is recorded independently of `acked` and creates metadata.
pub fn delivered_round_trip(make: MakeStore<'_>) {
    let s = make();
    let mut b = Batch::new();
    b.set_delivered(3, 42);
    write(&*s, &b);
    let m = meta(&*s, 3);
    assert_eq!((m.acked, m.delivered, m.end), (0, 42, 0));
    let mut b = Batch::new();
    b.set_delivered(3, 7);
    b.set_acked(3, 5);
    write(&*s, &b);
    let m = meta(&*s, 3);
    assert_eq!((m.acked, m.delivered, m.end), (5, 7, 5));
    assert!(s.queue_meta(4).unwrap().is_none());
}

/// Info and epoch round-trip and overwrite without touching acked/delivered.
pub fn info_epoch_round_trip(make: MakeStore<'_>) {
    let s = make();
    assert!(s.queue_meta(1).unwrap().is_none());
    let mut b = Batch::new();
    b.put_queue_info(1, 3, b"durable-id\x00\xff".to_vec());
    write(&*s, &b);
    assert_eq!(
        meta(&*s, 1),
        QueueMeta {
            acked: 0,
            delivered: 0,
            epoch: 3,
            info: b"durable-id\x00\xff".to_vec(),
            end: 0,
            byte_marks: vec![]
        }
    );
    let mut b = Batch::new();
    b.set_acked(1, 2);
    b.set_delivered(1, 4);
    b.put_queue_info(1, 4, vec![]);
    write(&*s, &b);
    assert_eq!(
        meta(&*s, 1),
        QueueMeta {
            acked: 2,
            delivered: 4,
            epoch: 4,
            info: vec![],
            end: 2,
            byte_marks: vec![]
        }
    );
    let big = vec![7u8; 100_000];
    let mut b = Batch::new();
    b.put_queue_info(1, u64::MAX, big.clone());
    write(&*s, &b);
    let m = meta(&*s, 1);
    assert_eq!((m.epoch, m.info), (u64::MAX, big));
}

/// `drop_queue` removes one queue's entries and metadata, leaving adjacent ids intact;
/// the id can then be reused from scratch.
pub fn truncate_queue_keeps_prefix_and_meta(make: MakeStore<'_>) {
    let s = make();
    let mut b = Batch::new();
    for q in [1u64, 2] {
        b.put_queue_info(q, 7, vec![9]);
        for off in 1..=6u64 {
            b.append(q, off, entry(0, &[off as u8]));
        }
        b.set_acked(q, 1);
    }
    write(&*s, &b);
    let mut b = Batch::new();
    b.truncate_queue(1, 4);
    write(&*s, &b);
    let kept: Vec<u64> = read_all(&*s, 1, 0, u64::MAX).iter().map(|e| e.0).collect();
    assert_eq!(kept, vec![2, 3]);
    let m = meta(&*s, 1);
    assert_eq!((m.acked, m.epoch, m.end, m.info), (1, 7, 3, vec![9]));
    // The other queue is untouched; truncating at its end or beyond is a no-op.
    assert_eq!(read_all(&*s, 2, 0, u64::MAX).len(), 5);
    let mut b = Batch::new();
    b.truncate_queue(2, 7);
    b.truncate_queue(2, u64::MAX);
    write(&*s, &b);
    assert_eq!(meta(&*s, 2).end, 6);
    // Appending again after a truncation.
    let mut b = Batch::new();
    b.append(1, 4, entry(1, b"new"));
    write(&*s, &b);
    assert_eq!(read_all(&*s, 1, 4, 4), vec![(4, 1, b"new".to_vec())]);
}

/// Byte marks come back above `acked` only, and go with acks, truncations and drops.
pub fn byte_marks_follow_the_entries(make: MakeStore<'_>) {
    let s = make();
    let mut b = Batch::new();
    for q in [1u64, 2] {
        b.put_queue_info(q, 1, vec![]);
        for off in 1..=10u64 {
            b.append(q, off, entry(0, &[0; 10]));
            if off % 3 == 0 {
                b.put_byte_mark(q, off, off * 10 + q);
            }
        }
    }
    write(&*s, &b);
    let marks = |q| meta(&*s, q).byte_marks;
    assert_eq!(marks(1), vec![(3, 31), (6, 61), (9, 91)]);
    let listed: Vec<Vec<(u64, u64)>> = s
        .queues()
        .unwrap()
        .into_iter()
        .map(|(_, m)| m.byte_marks)
        .collect();
    assert_eq!(listed, vec![marks(1), marks(2)]);
    // An ack removes the marks at and below it; a truncation those at and above its start.
    let mut b = Batch::new();
    b.set_acked(1, 6);
    b.truncate_queue(2, 6);
    write(&*s, &b);
    assert_eq!(marks(1), vec![(9, 91)]);
    assert_eq!(marks(2), vec![(3, 32)]);
    // A mark put at or below `acked` (a late write) is not reported; an overwrite is.
    let mut b = Batch::new();
    b.put_byte_mark(1, 5, 1);
    b.put_byte_mark(1, 9, 99);
    write(&*s, &b);
    assert_eq!(marks(1), vec![(9, 99)]);
    // A queue whose entries are all acked reports none; a dropped queue keeps none.
    let mut b = Batch::new();
    b.set_acked(1, 10);
    b.drop_queue(2);
    write(&*s, &b);
    assert_eq!(marks(1), vec![]);
    let mut b = Batch::new();
    b.put_queue_info(2, 1, vec![]);
    b.append(2, 1, entry(0, b"x"));
    write(&*s, &b);
    assert_eq!(marks(2), vec![]);
}

pub fn drop_queue_isolated(make: MakeStore<'_>) {
    let s = make();
    let mut b = Batch::new();
    for q in [1u64, 2, 3] {
        b.put_queue_info(q, q, vec![q as u8]);
        b.set_delivered(q, 2);
        for off in 1..=5u64 {
            b.append(q, off, entry(0, &[q as u8]));
        }
        b.set_acked(q, 1);
    }
    write(&*s, &b);
    let mut b = Batch::new();
    b.drop_queue(2);
    write(&*s, &b);
    assert!(s.queue_meta(2).unwrap().is_none());
    assert!(read_all(&*s, 2, 0, u64::MAX).is_empty());
    for q in [1u64, 3] {
        let m = meta(&*s, q);
        assert_eq!(
            (m.acked, m.delivered, m.epoch, m.end, m.info),
            (1, 2, q, 5, vec![q as u8])
        );
        assert_eq!(read_all(&*s, q, 0, u64::MAX).len(), 4);
    }
    assert_eq!(
        s.queues().unwrap().iter().map(|e| e.0).collect::<Vec<_>>(),
        vec![1, 3]
    );
    // Reuse the id: fresh metadata.
    let mut b = Batch::new();
    b.put_queue_info(2, 9, vec![]);
    write(&*s, &b);
    assert_eq!(
        meta(&*s, 2),
        QueueMeta {
            epoch: 9,
            ..QueueMeta::default()
        }
    );
    // Dropping an unknown queue is harmless.
    let mut b = Batch::new();
    b.drop_queue(77);
    b.drop_queue(u64::MAX);
    write(&*s, &b);
    assert_eq!(s.queues().unwrap().len(), 3);
}

/// Region put/get/delete/scan, with prefix-like region names kept apart.
pub fn regions_isolated(make: MakeStore<'_>) {
    let s = make();
    let mut b = Batch::new();
    b.region_put("a", "k2", b"a2".to_vec());
    b.region_put("a", "k1", b"a1".to_vec());
    b.region_put("a", "bk", b"abk".to_vec());
    b.region_put("ab", "k", b"ab".to_vec());
    b.region_put("", "k", b"empty".to_vec());
    b.region_put("b", "", b"b-empty-key".to_vec());
    write(&*s, &b);
    assert_eq!(s.region_get("a", "k1").unwrap(), Some(b"a1".to_vec()));
    assert_eq!(s.region_get("ab", "k").unwrap(), Some(b"ab".to_vec()));
    assert_eq!(s.region_get("a", "bk").unwrap(), Some(b"abk".to_vec()));
    assert_eq!(s.region_get("a", "k").unwrap(), None);
    assert_eq!(s.region_get("", "k").unwrap(), Some(b"empty".to_vec()));
    assert_eq!(
        s.region_get("b", "").unwrap(),
        Some(b"b-empty-key".to_vec())
    );
    for (region, key, held) in [("a", "k1", true), ("ab", "k", true), ("a", "k", false)] {
        assert_eq!(
            s.region_contains(region, key).unwrap(),
            held,
            "{region}/{key}"
        );
    }
    let scan = |r: &str| {
        let mut v = Vec::new();
        s.region_scan(r, None, &mut |k, val| {
            v.push((k.to_owned(), val.to_vec()));
            ControlFlow::Continue(())
        })
        .unwrap();
        v
    };
    assert_eq!(
        scan("a"),
        vec![
            ("bk".to_owned(), b"abk".to_vec()),
            ("k1".to_owned(), b"a1".to_vec()),
            ("k2".to_owned(), b"a2".to_vec())
        ]
    );
    assert_eq!(scan("ab"), vec![("k".to_owned(), b"ab".to_vec())]);
    // A visit that breaks ends the scan there.
    let mut seen = Vec::new();
    s.region_scan("a", None, &mut |k, _| {
        seen.push(k.to_owned());
        if seen.len() == 2 {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })
    .unwrap();
    assert_eq!(seen, ["bk", "k1"]);
    // A scan resumes after a key, present or not, and stays in its region.
    let after = |r: &str, key: &str| {
        let mut v = Vec::new();
        s.region_scan(r, Some(key), &mut |k, _| {
            v.push(k.to_owned());
            ControlFlow::Continue(())
        })
        .unwrap();
        v
    };
    assert_eq!(after("a", "bk"), ["k1", "k2"]);
    assert_eq!(after("a", "c"), ["k1", "k2"]);
    assert_eq!(after("a", "k1"), ["k2"]);
    assert!(after("a", "k2").is_empty());
    assert_eq!(after("", ""), ["k"]);
    assert!(after("ab", "k").is_empty());
    assert_eq!(scan(""), vec![("k".to_owned(), b"empty".to_vec())]);
    assert!(scan("c").is_empty());
    let mut b = Batch::new();
    b.region_delete("a", "k1");
    b.region_delete("a", "missing");
    b.region_put("a", "k2", b"new".to_vec());
    write(&*s, &b);
    assert_eq!(s.region_get("a", "k1").unwrap(), None);
    assert!(!s.region_contains("a", "k1").unwrap(), "a deleted key");
    assert_eq!(scan("a").len(), 2);
    assert_eq!(s.region_get("a", "k2").unwrap(), Some(b"new".to_vec()));
    assert_eq!(scan("ab").len(), 1);
    // Over-long region names are an error, not a panic.
    let long = "r".repeat(crate::MAX_REGION_NAME_BYTES + 1);
    assert!(s.region_get(&long, "k").is_err());
    assert!(s.region_contains(&long, "k").is_err());
    assert!(
        s.region_scan(&long, None, &mut |_, _| ControlFlow::Continue(()))
            .is_err()
    );
    let max = "r".repeat(crate::MAX_REGION_NAME_BYTES);
    let mut b = Batch::new();
    b.region_put(&max, "k", b"v".to_vec());
    write(&*s, &b);
    assert_eq!(s.region_get(&max, "k").unwrap(), Some(b"v".to_vec()));
    // Every key of every region, in pages that resume after the last key seen: each key once,
    // with its value, whatever the page size.
    let mut want: Vec<(String, String, Vec<u8>)> = Vec::new();
    for r in ["", "a", "ab", "b", max.as_str()] {
        s.region_scan(r, None, &mut |k, v| {
            want.push((r.to_owned(), k.to_owned(), v.to_vec()));
            ControlFlow::Continue(())
        })
        .unwrap();
    }
    for page in [1, 2, 3, 100] {
        let mut got: Vec<(String, String, Vec<u8>)> = Vec::new();
        loop {
            let last = got.last().map(|(r, k, _)| (r.clone(), k.clone()));
            let mut n = 0;
            s.regions_scan(
                last.as_ref().map(|(r, k)| (r.as_str(), k.as_str())),
                &mut |r, k, v| {
                    got.push((r.to_owned(), k.to_owned(), v.to_vec()));
                    n += 1;
                    if n == page {
                        ControlFlow::Break(())
                    } else {
                        ControlFlow::Continue(())
                    }
                },
            )
            .unwrap();
            if n < page {
                break;
            }
        }
        let mut sorted = got.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), got.len(), "a key seen twice, pages of {page}");
        let mut w = want.clone();
        w.sort();
        assert_eq!(sorted, w, "pages of {page}");
    }
}

/// Node-state put/get/overwrite.
pub fn state_round_trip(make: MakeStore<'_>) {
    let s = make();
    assert_eq!(s.state_get("node-id").unwrap(), None);
    let mut b = Batch::new();
    b.state_put("node-id", b"n1".to_vec());
    b.state_put("epoch", 5u64.to_be_bytes().to_vec());
    write(&*s, &b);
    assert_eq!(s.state_get("node-id").unwrap(), Some(b"n1".to_vec()));
    let mut b = Batch::new();
    b.state_put("node-id", b"n2".to_vec());
    s.write(&b, true).unwrap();
    assert_eq!(s.state_get("node-id").unwrap(), Some(b"n2".to_vec()));
    assert_eq!(
        s.state_get("epoch").unwrap(),
        Some(5u64.to_be_bytes().to_vec())
    );
    // State and regions are separate namespaces.
    assert_eq!(s.region_get("", "epoch").unwrap(), None);
}

/// A batch mixing every op kind applies in order, and `extend` concatenates.
pub fn batch_mixed_ops_atomic(make: MakeStore<'_>) {
    let s = make();
    let mut b1 = Batch::new();
    b1.put_queue_info(1, 1, b"q1".to_vec());
    b1.append(1, 1, entry(0, b"e1"));
    b1.append(1, 2, entry(0, b"e2"));
    b1.region_put("r", "k", b"v".to_vec());
    let mut b2 = Batch::new();
    b2.set_acked(1, 1);
    b2.set_delivered(1, 2);
    b2.put_queue_info(2, 1, vec![]);
    b2.append(2, 1, entry(0, b"x"));
    b2.drop_queue(2);
    b2.region_delete("r", "k");
    b2.region_put("r", "k2", b"v2".to_vec());
    b2.state_put("s", b"1".to_vec());
    b1.extend(b2);
    assert_eq!(b1.len(), 12);
    write(&*s, &b1);
    let m = meta(&*s, 1);
    assert_eq!(
        (m.acked, m.delivered, m.end, m.info),
        (1, 2, 2, b"q1".to_vec())
    );
    assert_eq!(read_all(&*s, 1, 0, u64::MAX), vec![(2, 0, b"e2".to_vec())]);
    assert!(s.queue_meta(2).unwrap().is_none());
    assert!(read_all(&*s, 2, 0, u64::MAX).is_empty());
    assert_eq!(s.region_get("r", "k").unwrap(), None);
    assert_eq!(s.region_get("r", "k2").unwrap(), Some(b"v2".to_vec()));
    assert_eq!(s.state_get("s").unwrap(), Some(b"1".to_vec()));
    // Drop then recreate in the same batch.
    let mut b = Batch::new();
    b.drop_queue(1);
    b.put_queue_info(1, 2, vec![]);
    b.append(1, 3, entry(0, b"e3"));
    write(&*s, &b);
    assert_eq!(
        meta(&*s, 1),
        QueueMeta {
            epoch: 2,
            end: 3,
            ..QueueMeta::default()
        }
    );
    assert_eq!(read_all(&*s, 1, 0, u64::MAX).len(), 1);
}

/// A batch with one invalid op is rejected whole: nothing of it is visible.
pub fn invalid_batch_applies_nothing(make: MakeStore<'_>) {
    let s = make();
    let mut b = Batch::new();
    b.put_queue_info(1, 1, vec![]);
    b.append(1, 1, entry(0, b"e"));
    b.state_put("s", b"v".to_vec());
    b.region_put(&"r".repeat(crate::MAX_REGION_NAME_BYTES + 1), "k", vec![]);
    assert!(s.write(&b, true).is_err());
    assert!(s.queue_meta(1).unwrap().is_none());
    assert!(read_all(&*s, 1, 0, u64::MAX).is_empty());
    assert_eq!(s.state_get("s").unwrap(), None);
    assert!(s.queues().unwrap().is_empty());
}

/// `queues()` lists queues with metadata in ascending id order with `end` derived, and
/// ignores entries of queues without metadata.
pub fn queues_ordering(make: MakeStore<'_>) {
    let s = make();
    assert!(s.queues().unwrap().is_empty());
    let ids = [300u64, 1, u64::MAX, 256, 2, 0];
    let mut b = Batch::new();
    for &q in &ids {
        b.put_queue_info(q, q ^ 1, q.to_le_bytes().to_vec());
        b.append(q, 1, entry(0, b"a"));
        b.append(q, 2, entry(0, b"b"));
    }
    b.append(1000, 1, entry(0, b"orphan"));
    b.set_delivered(500, 1);
    write(&*s, &b);
    let got = s.queues().unwrap();
    let mut want_ids: Vec<u64> = ids.to_vec();
    want_ids.push(500);
    want_ids.sort_unstable();
    assert_eq!(got.iter().map(|e| e.0).collect::<Vec<_>>(), want_ids);
    for (q, m) in &got {
        assert_eq!(Some(m), s.queue_meta(*q).unwrap().as_ref());
        if *q == 500 {
            assert_eq!(
                m,
                &QueueMeta {
                    delivered: 1,
                    ..QueueMeta::default()
                }
            );
        } else {
            assert_eq!(
                (m.epoch, &m.info, m.end),
                (q ^ 1, &q.to_le_bytes().to_vec(), 2)
            );
        }
    }
}

/// An empty batch is a no-op (also with `sync`), and `flush` succeeds.
pub fn empty_batch_and_flush(make: MakeStore<'_>) {
    let s = make();
    let b = Batch::new();
    assert!(b.is_empty());
    s.write(&b, true).unwrap();
    s.write(&b, false).unwrap();
    let mut b = Batch::new();
    b.append(1, 1, entry(0, b"x"));
    b.put_queue_info(1, 0, vec![]);
    s.write(&b, true).unwrap();
    s.flush().unwrap();
    assert_eq!(meta(&*s, 1).end, 1);
    assert!(s.queues().unwrap().len() == 1);
}
