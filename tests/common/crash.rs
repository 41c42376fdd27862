//! What the kill -9 crash tests (`crash_safety`, one node; `cluster_crash_safety`, a cluster)
//! share: their seeded generator and settings, the numbered publishes (each value unique, so
//! a delivery names its publish), the durable subscribers' interests, and the round's stop.

use tether::client::Interest;
use tokio::sync::watch;

/// Publishers of the workload.
pub const PUBLISHERS: u64 = 2;
/// Keys per publisher (values are overwritten, so `get` checks the latest one).
pub const KEYS_PER_PUBLISHER: u64 = 30;

/// A number from the environment, decimal or `0x` hex.
pub fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => v.parse().ok(),
    }
}

/// xorshift64*: seeded, no extra dependencies.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.max(1))
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// In `0..n` (`n` at least 1).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    /// In `lo..=hi`.
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

/// The key of publish `n` of `publisher`.
pub fn key_of(publisher: u64, n: u64) -> String {
    let j = n % KEYS_PER_PUBLISHER;
    format!("k{}-p{publisher}-{j}", j % 10)
}

/// The value of publish `n` of `publisher` (unique).
pub fn value_of(publisher: u64, n: u64) -> String {
    format!("p{publisher}:{n}")
}

/// The next publish of publisher `p`: one to three puts of its next numbered keys in region
/// `region`, with their numbers; `next` counts the publisher's numbers.
pub fn next_publish(
    next: &mut [u64; PUBLISHERS as usize],
    p: u64,
    rng: &mut Rng,
    region: &str,
) -> (Vec<tether::protocol::PublishOp>, Vec<u64>) {
    let ops_n = 1 + rng.below(3);
    let mut ops = Vec::new();
    let mut ns = Vec::new();
    for _ in 0..ops_n {
        let n = next[p as usize];
        next[p as usize] += 1;
        ops.push(tether::protocol::PublishOp::Put {
            region: region.into(),
            key: key_of(p, n),
            value: value_of(p, n).into_bytes(),
        });
        ns.push(n);
    }
    (ops, ns)
}
/// The (publisher, number) a value names.
pub fn parse_value(v: &str) -> Option<(u64, u64)> {
    let (p, n) = v.strip_prefix('p')?.split_once(':')?;
    Some((p.parse().ok()?, n.parse().ok()?))
}

/// One durable subscriber: its id, its durable interest and which keys that matches, and (on a
/// cluster) the node it is first placed on.
pub struct SubSpec {
    pub id: &'static str,
    pub interest: fn() -> Interest,
    pub matches: fn(&str) -> bool,
    pub home: usize,
}

/// The subscribers: all keys, a regex over a half of them, a key list of a tenth.
pub fn subs() -> Vec<SubSpec> {
    vec![
        SubSpec {
            id: "all",
            interest: Interest::all_keys,
            matches: |_| true,
            home: 0,
        },
        SubSpec {
            id: "regex",
            interest: || Interest::regex("k[0-4]-.*"),
            matches: |k| matches!(k.as_bytes()[1], b'0'..=b'4'),
            home: 1,
        },
        SubSpec {
            id: "keys",
            interest: || {
                Interest::keys((0..PUBLISHERS).flat_map(|p| {
                    (0..KEYS_PER_PUBLISHER)
                        .filter(|j| j % 10 == 7)
                        .map(move |j| key_of(p, j))
                }))
            },
            matches: |k| k.as_bytes()[1] == b'7',
            home: 2,
        },
    ]
}

/// Runs `f` unless the round is stopped (a kill) first.
pub async fn or_stop<F: std::future::Future>(
    stop: &mut watch::Receiver<bool>,
    f: F,
) -> Option<F::Output> {
    tokio::select! {
        out = f => Some(out),
        _ = stop.wait_for(|s| *s) => None,
    }
}

/// Records a failed check in `$world` (which has `fn fail(&self, String)`) and goes on.
#[allow(unused_macros)] // Test crates that do not use it compile this module too.
macro_rules! check {
    ($world:expr, $cond:expr, $($fmt:tt)*) => {
        if !$cond {
            $world.fail(format!($($fmt)*));
        }
    };
}
#[allow(unused_imports)]
pub(crate) use check;
