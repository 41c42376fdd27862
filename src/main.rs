//! The `tether` command line: server, publishers, subscribers and admin.
//! Its names, flags and JSON fields are a public contract (`docs/cli.md`); the commands live
//! in `cli/`.
//!
//! This file sets up the process before handing over to `cli/`: a panic stops it
//! (`tether::bug::stop_on_panic`), and the allocators: mimalloc, counted
//! (`tether::heap::Counting`), without transparent huge pages (for the whole process:
//! `PR_SET_THP_DISABLE`) and purging freed memory at once; glibc's mmap threshold
//! (`docs/operations.md`, "Memory").

mod cli;

/// The server is allocation-heavy on its hot paths (one record per event on the client side,
/// frames on the server side); mimalloc roughly halves allocator time there.
/// Counted (`tether_heap_live_bytes{allocator="rust"}`, src/heap.rs).
#[cfg(not(feature = "system-alloc"))]
#[global_allocator]
static GLOBAL: tether::heap::Counting<mimalloc::MiMalloc> =
    tether::heap::Counting(mimalloc::MiMalloc);
#[cfg(feature = "system-alloc")]
#[global_allocator]
static GLOBAL: tether::heap::Counting<std::alloc::System> =
    tether::heap::Counting(std::alloc::System);

/// mimalloc's settings for a server that runs for long (`tune`, first thing in `main`). By
/// default mimalloc v3 gives memory back to the OS in 2 MiB units where transparent huge pages
/// may be used, and a second after it was freed: a node's resident memory then rose to 300-400
/// MB holding 50-100 MB of live data, and kept rising (BENCHMARKS.md, soak run Y). Without
/// huge pages (64 KiB units) and purging at once, it stayed at 120-190 MB (run Z2).
///
/// mimalloc reads its options and reserves its first arena before `main` runs, advising huge
/// pages for it when they are allowed then: turning `allow_thp` off afterwards only affects
/// later mappings. So `tune` also does what mimalloc itself does when `MIMALLOC_ALLOW_THP=0`
/// is set at start: it disables transparent huge pages for the process (`PR_SET_THP_DISABLE`),
/// which also covers the arena already reserved (run AC: without it, a node's first arena held
/// 240 MB of huge pages).
#[cfg(not(feature = "system-alloc"))]
mod mimalloc_options {
    use std::ffi::{c_int, c_long};

    // Indices in `mi_option_t` of the mimalloc (v3) the `mimalloc` crate builds, from its
    // include/mimalloc.h (its Rust bindings list v2's): the test checks them by their defaults.
    pub const PURGE_DELAY: c_int = 16;
    pub const ALLOW_THP: c_int = 44;
    /// Milliseconds between a free and giving the memory back (mimalloc's default: 1000).
    pub const PURGE_DELAY_MS: c_long = 0;

    unsafe extern "C" {
        fn mi_option_set(option: c_int, value: c_long);
        #[cfg(test)]
        fn mi_option_get(option: c_int) -> c_long;
    }

    /// Huge pages off (the option and the process) and purging at once, each unless the
    /// environment sets it (`MIMALLOC_ALLOW_THP`, `MIMALLOC_PURGE_DELAY`: the operator's
    /// choice, which mimalloc reads itself).
    pub fn tune() {
        // SAFETY (both): a plain option setter of the linked mimalloc, called before any
        // thread starts.
        if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
            unsafe { mi_option_set(ALLOW_THP, 0) };
            disable_thp();
        }
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            unsafe { mi_option_set(PURGE_DELAY, PURGE_DELAY_MS) };
        }
    }

    /// Disables transparent huge pages for this process (Linux with glibc; a no-op elsewhere).
    fn disable_thp() {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            // SAFETY: prctl with PR_SET_THP_DISABLE takes integer arguments only and changes
            // nothing but this process's huge page policy.
            let rc = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
            if rc != 0 {
                eprintln!(
                    "warning: cannot disable transparent huge pages: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn the_option_indices_are_those_of_the_linked_mimalloc() {
            // Read before any test sets them: mimalloc v3's defaults (allow_thp 1, purge_delay
            // 1000 ms) are what these indices hold; another index or version fails here.
            // SAFETY: plain option getters.
            let (thp, delay) = unsafe { (mi_option_get(ALLOW_THP), mi_option_get(PURGE_DELAY)) };
            assert!(
                (thp, delay) == (1, 1000) || (thp, delay) == (0, PURGE_DELAY_MS),
                "allow_thp={thp} purge_delay={delay}"
            );
            tune();
            // SAFETY: as above.
            let after = unsafe { (mi_option_get(ALLOW_THP), mi_option_get(PURGE_DELAY)) };
            if std::env::var_os("MIMALLOC_ALLOW_THP").is_none()
                && std::env::var_os("MIMALLOC_PURGE_DELAY").is_none()
            {
                assert_eq!(after, (0, PURGE_DELAY_MS));
            }
            #[cfg(all(target_os = "linux", target_env = "gnu"))]
            if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
                // SAFETY: PR_GET_THP_DISABLE only reads the process's flag.
                let disabled = unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) };
                assert_eq!(disabled, 1, "transparent huge pages still allowed");
            }
        }
    }
}

fn main() {
    // A bug stops the process, on whichever thread it shows (see `tether::bug`).
    tether::bug::stop_on_panic();
    // Allocator settings first, before threads and the first large allocations.
    #[cfg(not(feature = "system-alloc"))]
    mimalloc_options::tune();
    tether::heap::tune_native_heap();
    cli::main()
}
