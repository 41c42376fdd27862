mod nats_peer;

use nats_peer::{AckMode, DrainTuning, NatsPeer};
use std::time::Duration;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().replace('_', "").parse().ok())
        .unwrap_or(default)
}

#[tokio::main]
async fn main() {
    let events = env_u64("EVENTS", 100_000);
    let value_bytes = env_u64("VALUE_BYTES", 128) as usize;
    let sync_always = env_u64("SYNC_ALWAYS", 0) != 0;
    // Tuning overrides (for sweeps); defaults are the module's.
    let d = DrainTuning::default();
    let tuning = DrainTuning {
        batch: env_u64("NATS_BATCH", d.batch as u64) as usize,
        max_bytes: env_u64("NATS_MAX_BYTES", d.max_bytes as u64) as usize,
        expires: Duration::from_millis(env_u64("NATS_EXPIRES_MS", d.expires.as_millis() as u64)),
        ack_every: env_u64("NATS_ACK_EVERY", d.ack_every),
    };
    let tuned = ["NATS_BATCH", "NATS_MAX_BYTES", "NATS_EXPIRES_MS", "NATS_ACK_EVERY"]
        .iter()
        .any(|k| std::env::var_os(k).is_some());
    let repeat = env_u64("REPEAT", 1).max(1);

    // After the drains at the default sync interval, the server restarts with
    // `sync_interval: always` and drains again: Tether's acks are fsynced (group commit), so
    // this is the setting matched to Tether's. SYNC_MATCHED=0 skips it.
    let sync_matched = env_u64("SYNC_MATCHED", 1) != 0 && !sync_always;
    let mut peer = match NatsPeer::start(sync_always) {
        Ok(p) => p,
        Err(e) => {
            println!("NATS peer skipped: {e}");
            return;
        }
    };
    println!(
        "nats-server {} ({}) at {}; events={events} value_bytes={value_bytes} sync_always={sync_always} {tuning:?}",
        peer.version(),
        peer.binary().display(),
        peer.url()
    );

    let fill = match peer.fill("replay", events, value_bytes).await {
        Ok(d) => d,
        Err(e) => {
            eprintln!("fill failed: {e}");
            std::process::exit(1);
        }
    };
    let fill_rate = events as f64 / fill.as_secs_f64();

    let mut all = Vec::new();
    let mut each = Vec::new();
    for _ in 0..repeat {
        for (mode, out) in [(AckMode::All, &mut all), (AckMode::Each, &mut each)] {
            let r = if tuned {
                peer.drain_tuned("replay", events, mode, tuning).await
            } else {
                peer.drain("replay", events, mode).await
            };
            match r {
                Ok(d) => out.push(d),
                Err(e) => {
                    eprintln!("drain {mode:?} failed: {e}");
                    std::process::exit(1);
                }
            }
        }
    }
    // Best of the repeats.
    let best = |v: &[nats_peer::Drain]| {
        *v.iter()
            .max_by(|a, b| a.events_per_s.total_cmp(&b.events_per_s))
            .expect("at least one drain")
    };
    let (a, e) = (best(&all), best(&each));
    let synced = if sync_matched {
        if let Err(e) = peer.restart(true) {
            eprintln!("restart with sync_interval always failed: {e}");
            std::process::exit(1);
        }
        let mut out = Vec::new();
        for mode in [AckMode::All, AckMode::Each] {
            match peer.drain("replay", events, mode).await {
                Ok(d) => out.push(d),
                Err(e) => {
                    eprintln!("drain {mode:?} with sync_interval always failed: {e}");
                    std::process::exit(1);
                }
            }
        }
        Some((out[0], out[1]))
    } else {
        None
    };

    println!("{:<28} {:>14} {:>10} {:>10}", "phase", "events/s", "total s", "first ms");
    println!("{:<28} {:>14.0} {:>10.3} {:>10}", "fill (pub acks)", fill_rate, fill.as_secs_f64(), "-");
    for (name, d) in [("drain AckAll", a), ("drain AckEach", e)] {
        println!("{:<28} {:>14.0} {:>10.3} {:>10.1}", name, d.events_per_s, d.total_s, d.first_ms);
    }
    if let Some((sa, se)) = synced {
        for (name, d) in [("drain AckAll, sync always", sa), ("drain AckEach, sync always", se)] {
            println!("{:<28} {:>14.0} {:>10.3} {:>10.1}", name, d.events_per_s, d.total_s, d.first_ms);
        }
    }
    if repeat > 1 {
        for (name, v) in [("ackall", &all), ("ackeach", &each)] {
            let r: Vec<String> = v.iter().map(|d| format!("{:.0}", d.events_per_s)).collect();
            println!("runs_{name}={}", r.join(","));
        }
    }
    println!("nats_fill_events_per_s={fill_rate:.0}");
    println!("nats_drain_ackall_events_per_s={:.0}", a.events_per_s);
    println!("nats_drain_ackeach_events_per_s={:.0}", e.events_per_s);
    println!("nats_first_ms_ackall={:.1}", a.first_ms);
    if let Some((sa, se)) = synced {
        println!("nats_synced_drain_ackall_events_per_s={:.0}", sa.events_per_s);
        println!("nats_synced_drain_ackeach_events_per_s={:.0}", se.events_per_s);
        println!("nats_synced_first_ms_ackall={:.1}", sa.first_ms);
    }
}
