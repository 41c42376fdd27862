//! Ports for nodes that are killed and started again on the same port (shared by the tests and
//! the benchmarks).
//!
//! A port the kernel hands out for `:0` comes from the ephemeral range, which every client
//! socket also draws from: while a node is down, one of the many client sockets of a test or
//! soak may take its port and the restart fails with "address in use". These ports are taken
//! below the ephemeral range instead, at random (tests run in parallel), and checked free.

use std::net::UdpSocket;

/// Lowest port handed out, below the usual ephemeral ranges and above well-known services.
pub const PORT_MIN: u16 = 10_000;

/// `n` distinct free UDP ports on 127.0.0.1 outside the ephemeral range (bound, read and
/// released: the nodes bind them right after). Falls back to ephemeral ports if the range
/// below is too small.
pub fn free_ports(n: usize) -> Vec<u16> {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    let mut ports = Vec::with_capacity(n);
    if ephemeral_low > PORT_MIN + 1_000 {
        let span = u64::from(ephemeral_low - PORT_MIN);
        // A per-call seed: the time and the process id.
        let mut x = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            ^ (u64::from(std::process::id()) << 32);
        for _ in 0..n * 1_000 {
            if ports.len() == n {
                break;
            }
            // xorshift64
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let port = PORT_MIN + (x % span) as u16;
            if !ports.contains(&port) && UdpSocket::bind(("127.0.0.1", port)).is_ok() {
                ports.push(port);
            }
        }
    }
    while ports.len() < n {
        let s = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let port = s.local_addr().expect("addr").port();
        if !ports.contains(&port) {
            ports.push(port);
        }
    }
    ports
}
