//! The Rust client library's replay rate, the baseline of `bench_replay.py`: resumes durable
//! queue ID on SERVER (trusting CA) with a `Subscription`, as `tether.Subscriber` does, reads
//! every event until the live marker (each value's length summed), closes with keepalive, and
//! prints `{"events":N,"bytes":B,"live_secs":L,"close_secs":C}`: connect to live marker, and
//! the close (without process start).
//!
//! `cargo run --release -p tether-replay-baseline -- SERVER CA ID` (in clients/python)

use std::time::Instant;

use tether_client::{ClientBuilder, ClientEvent, Interest, ReconnectPolicy};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [server, ca, id] = args.as_slice() else {
        eprintln!("error: usage: replay_baseline SERVER CA DURABLE_ID");
        std::process::exit(2);
    };
    let t0 = Instant::now();
    let mut sub = ClientBuilder::new()
        .server(server.parse().expect("SERVER is IP:PORT"))
        .ca_file(ca)
        .durable(id.clone(), 300)
        .reconnect(ReconnectPolicy::default())
        .subscribe(std::iter::empty::<(String, Interest)>())
        .await
        .unwrap_or_else(|e| {
            eprintln!("error: {e}");
            std::process::exit(1);
        });
    let (mut events, mut bytes) = (0u64, 0u64);
    while let Some(ev) = sub.next().await {
        match ev {
            ClientEvent::Event(e) => {
                events += 1;
                bytes += e.value.map_or(0, |v| v.len() as u64);
            }
            ClientEvent::Live { .. } => break,
            _ => {}
        }
    }
    let live = t0.elapsed();
    let t1 = Instant::now();
    if let Err(e) = sub.close(true).await {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
    println!(
        "{{\"events\":{events},\"bytes\":{bytes},\"live_secs\":{},\"close_secs\":{}}}",
        live.as_secs_f64(),
        t1.elapsed().as_secs_f64()
    );
}
