//! Heap accounting for the memory metrics: how much of a node's resident memory is live
//! allocations and how much is freed memory its allocators keep.
//!
//! Two heaps: Rust's (the global allocator; counted when the host installs [`Counting`] around
//! it, as the `tether` binary does) and the C allocator's, which RocksDB's C++ uses whatever
//! the Rust allocator is (glibc's figures, read at scrape time from `mallinfo2`). Resident
//! memory well above the two live figures is memory freed but kept by an allocator, not data
//! the node holds (`docs/operations.md`, "Memory").
//!
//! Also glibc's mmap threshold (`tune_native_heap`) and mimalloc's options (`mimalloc_options`:
//! no transparent huge pages, freed memory purged at once), which the `tether` binary sets.

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::sync::atomic::{AtomicIsize, Ordering};

/// Net bytes a thread allocates or frees before it adds them to the shared count: the count
/// is off by at most this per thread (and per exited thread), and the hot path touches the
/// shared counter only once per this many bytes.
pub const HEAP_COUNT_FLUSH_BYTES: isize = 64 << 10;

/// Live bytes of the Rust heap, as far as the threads flushed them.
static RUST_LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);

thread_local! {
    /// This thread's net bytes not yet added to [`RUST_LIVE_BYTES`] (no destructor: the
    /// allocator may run during thread teardown).
    static UNFLUSHED_BYTES: Cell<isize> = const { Cell::new(0) };
}

fn note(delta: isize) {
    let flushed = UNFLUSHED_BYTES.try_with(|c| {
        let v = c.get() + delta;
        if v.abs() >= HEAP_COUNT_FLUSH_BYTES {
            RUST_LIVE_BYTES.fetch_add(v, Ordering::Relaxed);
            c.set(0);
        } else {
            c.set(v);
        }
    });
    if flushed.is_err() {
        RUST_LIVE_BYTES.fetch_add(delta, Ordering::Relaxed);
    }
}

/// A global allocator that counts the live bytes of `A` (see [`rust_heap_bytes`]):
/// `#[global_allocator] static A: Counting<mimalloc::MiMalloc> = Counting(mimalloc::MiMalloc);`
pub struct Counting<A>(pub A);

// SAFETY: every call is passed to `A` unchanged; only the byte count is noted beside it.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Counting<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is `A`'s.
        let p = unsafe { self.0.alloc(layout) };
        if !p.is_null() {
            note(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is `A`'s.
        let p = unsafe { self.0.alloc_zeroed(layout) };
        if !p.is_null() {
            note(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is `A`'s.
        unsafe { self.0.dealloc(ptr, layout) };
        note(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract is `A`'s.
        let p = unsafe { self.0.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            note(new_size as isize - layout.size() as isize);
        }
        p
    }
}

/// Live bytes of the Rust heap (within [`HEAP_COUNT_FLUSH_BYTES`] per thread), or None when
/// the process's global allocator is not [`Counting`].
pub fn rust_heap_bytes() -> Option<u64> {
    match RUST_LIVE_BYTES.load(Ordering::Relaxed) {
        0 => None,
        n => Some(n.max(0) as u64),
    }
}

/// The C allocator's heap: bytes in live allocations, and bytes freed but kept by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NativeHeap {
    pub live_bytes: u64,
    pub retained_bytes: u64,
}

/// The C allocator's heap (glibc only; None elsewhere). Walks every arena under its lock:
/// for a scrape, not a hot path.
pub fn native_heap() -> Option<NativeHeap> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 has no preconditions (glibc 2.33 and later).
        let m = unsafe { libc::mallinfo2() };
        Some(NativeHeap {
            live_bytes: (m.uordblks + m.hblkhd) as u64,
            retained_bytes: m.fordblks as u64,
        })
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        None
    }
}

/// Allocations of at least this size get pages of their own from glibc (mmap) and give them
/// back when freed, in bytes. glibc's own threshold starts at 128 KiB and rises to the largest
/// such block freed so far (up to 32 MiB); past that, RocksDB's memtable blocks come from the
/// arenas and stay there, free, once their memtable is flushed (BENCHMARKS.md, soak runs Y
/// and Z: glibc kept 74-103 MB free per node, 20-23 MB with this threshold).
pub const NATIVE_MMAP_THRESHOLD_BYTES: i32 = 64 << 10;

/// The `tether` binary's allocator settings, first thing in `main` before any thread starts:
/// mimalloc's ([`mimalloc_options::tune`], unless built with the system allocator) and glibc's
/// heap, which RocksDB allocates from ([`tune_native_heap`]). The replay benchmark calls it
/// too, so its in-process nodes run as a server process does.
pub fn tune_process() {
    #[cfg(not(feature = "system-alloc"))]
    mimalloc_options::tune();
    tune_native_heap();
}

/// Fixes glibc's mmap threshold at [`NATIVE_MMAP_THRESHOLD_BYTES`], unless the environment
/// sets one (`MALLOC_MMAP_THRESHOLD_`, or `mmap_threshold` in `GLIBC_TUNABLES`: the operator's
/// choice); false where it did not (not glibc, set by the environment, or refused). The
/// `tether` binary calls it first thing; a host embedding the library keeps its own allocator
/// settings unless it calls it too.
pub fn tune_native_heap() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let tunables = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
        if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some()
            || tunables.contains("mmap_threshold")
        {
            return false;
        }
        // SAFETY: mallopt only changes glibc's allocation policy; 1 is success.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, NATIVE_MMAP_THRESHOLD_BYTES) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_native_heap_counts_a_live_c_allocation() {
        let Some(before) = native_heap() else {
            return; // Not glibc: nothing to read.
        };
        const BYTES: usize = 8 << 20;
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            // SAFETY: a plain malloc/free pair; the block is touched so it is really used.
            // black_box: the compiler may otherwise drop a malloc/free pair nothing else sees.
            let p = std::hint::black_box(unsafe { libc::malloc(BYTES) } as *mut u8);
            assert!(!p.is_null());
            unsafe { std::ptr::write_bytes(p, 1, BYTES) };
            let during = native_heap().unwrap();
            std::hint::black_box(p);
            unsafe { libc::free(p as *mut libc::c_void) };
            // Other test threads allocate too: allow them half the block.
            assert!(
                during.live_bytes + (BYTES as u64 / 2) > before.live_bytes + BYTES as u64,
                "{before:?} -> {during:?}"
            );
        }
    }

    #[test]
    fn counting_notes_allocations_and_frees_per_thread_in_batches() {
        // The test binary's allocator is not Counting: drive the counter directly on a thread
        // of its own, so the shared count moves only by what this thread flushes.
        std::thread::spawn(|| {
            let start = RUST_LIVE_BYTES.load(Ordering::Relaxed);
            note(HEAP_COUNT_FLUSH_BYTES - 1);
            assert_eq!(
                RUST_LIVE_BYTES.load(Ordering::Relaxed),
                start,
                "not flushed yet"
            );
            note(1);
            assert_eq!(
                RUST_LIVE_BYTES.load(Ordering::Relaxed),
                start + HEAP_COUNT_FLUSH_BYTES
            );
            note(-HEAP_COUNT_FLUSH_BYTES);
            assert_eq!(RUST_LIVE_BYTES.load(Ordering::Relaxed), start);
            assert_eq!(UNFLUSHED_BYTES.with(Cell::get), 0);
        })
        .join()
        .unwrap();
    }
}

/// mimalloc's settings for a server that runs for long (`tune`, first thing in the `tether`
/// binary's `main` and in the benchmarks', which run nodes in their process). By
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
pub mod mimalloc_options {
    use std::ffi::{c_int, c_long};
    // The library this module sets the options of, linked here whichever binary uses it.
    use mimalloc as _;

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
