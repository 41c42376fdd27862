//! Helpers shared by the benchmarks.

#[path = "../../tests/common/ports.rs"]
pub mod ports;
pub mod server;

/// The process's resident memory, in KiB (0 where /proc is missing).
pub fn rss_kb() -> u64 {
    rss_kb_of("self")
}

/// Resident memory of process `pid` ("self" for this one), in KiB (0 where /proc is missing).
pub fn rss_kb_of(pid: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}
