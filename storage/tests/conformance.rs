//! Runs the conformance suite on both stores, plus RocksStore reopen and a
//! MemStore-vs-RocksStore model-based proptest.

use std::sync::Arc;

use proptest::prelude::*;
use tempfile::TempDir;
use tether_storage::conformance::{self, read_all};
use tether_storage::{Batch, Entry, MemStore, RocksStore, Store};

#[test]
fn conformance_mem() {
    conformance::run_all(&mut || Box::new(MemStore::new()));
}

#[test]
fn conformance_rocks() {
    let mut dirs: Vec<TempDir> = Vec::new();
    conformance::run_all(&mut || {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = RocksStore::open(dir.path()).expect("open");
        dirs.push(dir);
        Box::new(store)
    });
}

#[test]
fn rocks_reopen_restores_everything() {
    let dir = tempfile::tempdir().unwrap();
    let (queues_before, entries_before) = {
        let s = RocksStore::open(dir.path()).unwrap();
        let mut b = Batch::new();
        for q in [1u64, 2, 3] {
            b.put_queue_info(q, 10 + q, format!("info{q}").into_bytes());
            for off in 1..=20u64 {
                b.append(
                    q,
                    off,
                    Entry::new(off as u8, format!("q{q}o{off}").into_bytes()),
                );
            }
        }
        b.region_put("subs", "alice", b"1".to_vec());
        b.region_put("subs", "bob", b"2".to_vec());
        b.region_put("sub", "x", b"3".to_vec());
        b.state_put("node", b"n1".to_vec());
        s.write(&b, true).unwrap();
        let mut b = Batch::new();
        b.set_acked(1, 5);
        b.set_delivered(1, 8);
        b.set_acked(3, 20);
        b.drop_queue(2);
        b.region_delete("subs", "bob");
        s.write(&b, true).unwrap();
        // Half the data only in the WAL, half flushed to SSTs.
        s.flush().unwrap();
        let mut b = Batch::new();
        b.append(1, 21, Entry::new(0, b"late".to_vec()));
        s.write(&b, true).unwrap();
        let q = s.queues().unwrap();
        let e: Vec<_> = [1u64, 2, 3]
            .iter()
            .map(|&q| read_all(&s, q, 0, u64::MAX))
            .collect();
        (q, e)
    };
    let s = RocksStore::open(dir.path()).unwrap();
    assert_eq!(s.queues().unwrap(), queues_before);
    let ids: Vec<u64> = queues_before.iter().map(|e| e.0).collect();
    assert_eq!(ids, vec![1, 3]);
    let m1 = s.queue_meta(1).unwrap().unwrap();
    assert_eq!((m1.acked, m1.delivered, m1.epoch, m1.end), (5, 8, 11, 21));
    assert_eq!(m1.info, b"info1".to_vec());
    let m3 = s.queue_meta(3).unwrap().unwrap();
    assert_eq!((m3.acked, m3.end), (20, 20));
    let entries: Vec<_> = [1u64, 2, 3]
        .iter()
        .map(|&q| read_all(&s, q, 0, u64::MAX))
        .collect();
    assert_eq!(entries, entries_before);
    assert_eq!(entries[0].len(), 16);
    assert_eq!(entries[0][0], (6, 6, b"q1o6".to_vec()));
    assert!(entries[1].is_empty() && entries[2].is_empty());
    assert_eq!(s.region_get("subs", "alice").unwrap(), Some(b"1".to_vec()));
    assert_eq!(s.region_get("subs", "bob").unwrap(), None);
    assert_eq!(s.region_get("sub", "x").unwrap(), Some(b"3".to_vec()));
    assert_eq!(s.state_get("node").unwrap(), Some(b"n1".to_vec()));
}

#[test]
fn stores_are_shareable_trait_objects() {
    fn assert_send_sync<T: Send + Sync + 'static>() {}
    assert_send_sync::<RocksStore>();
    assert_send_sync::<MemStore>();
    let s: Arc<dyn Store> = Arc::new(MemStore::new());
    let t = {
        let s = s.clone();
        std::thread::spawn(move || {
            let mut b = Batch::new();
            b.state_put("k", vec![1]);
            s.write(&b, false).unwrap();
        })
    };
    t.join().unwrap();
    assert_eq!(s.state_get("k").unwrap(), Some(vec![1]));
}

#[derive(Debug, Clone)]
enum ModelOp {
    Append {
        q: u64,
        off: u64,
        flags: u8,
        len: usize,
    },
    Ack {
        q: u64,
        off: u64,
    },
    Deliver {
        q: u64,
        off: u64,
    },
    Info {
        q: u64,
        epoch: u64,
    },
    Drop {
        q: u64,
    },
}

fn model_op() -> impl Strategy<Value = ModelOp> {
    let q = 0u64..4;
    prop_oneof![
        6 => (q.clone(), 1u64..30, any::<u8>(), 0usize..64)
            .prop_map(|(q, off, flags, len)| ModelOp::Append { q, off, flags, len }),
        2 => (q.clone(), 0u64..35).prop_map(|(q, off)| ModelOp::Ack { q, off }),
        1 => (q.clone(), 0u64..35).prop_map(|(q, off)| ModelOp::Deliver { q, off }),
        1 => (q.clone(), 0u64..5).prop_map(|(q, epoch)| ModelOp::Info { q, epoch }),
        1 => q.prop_map(|q| ModelOp::Drop { q }),
    ]
}

fn to_batch(ops: &[ModelOp]) -> Batch {
    let mut b = Batch::new();
    for op in ops {
        match *op {
            ModelOp::Append { q, off, flags, len } => {
                let body: Vec<u8> = (0..len).map(|i| (i as u8) ^ (off as u8)).collect();
                b.append(q, off, Entry::new(flags, body));
            }
            ModelOp::Ack { q, off } => b.set_acked(q, off),
            ModelOp::Deliver { q, off } => b.set_delivered(q, off),
            ModelOp::Info { q, epoch } => {
                b.put_queue_info(q, epoch, vec![epoch as u8; epoch as usize])
            }
            ModelOp::Drop { q } => b.drop_queue(q),
        }
    }
    b
}

fn limited_read(s: &dyn Store, q: u64, from: u64, max: usize) -> (usize, Vec<(u64, u8, Vec<u8>)>) {
    let mut v = Vec::new();
    let n = s
        .read_entries(q, from, u64::MAX, max, &mut |o, f, b| {
            v.push((o, f, b.to_vec()))
        })
        .unwrap();
    (n, v)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]
    #[test]
    fn mem_and_rocks_agree(batches in prop::collection::vec(prop::collection::vec(model_op(), 1..6), 1..25)) {
        let dir = tempfile::tempdir().unwrap();
        let rocks = RocksStore::open(dir.path()).unwrap();
        let mem = MemStore::new();
        for ops in &batches {
            let b = to_batch(ops);
            rocks.write(&b, false).unwrap();
            mem.write(&b, false).unwrap();
            prop_assert_eq!(rocks.queues().unwrap(), mem.queues().unwrap());
        }
        for q in 0u64..5 {
            prop_assert_eq!(rocks.queue_meta(q).unwrap(), mem.queue_meta(q).unwrap());
            prop_assert_eq!(read_all(&rocks, q, 0, u64::MAX), read_all(&mem, q, 0, u64::MAX));
            for (from, max) in [(0u64, 0usize), (3, 40), (10, 100), (1, 1000)] {
                prop_assert_eq!(limited_read(&rocks, q, from, max), limited_read(&mem, q, from, max));
            }
        }
    }
}
