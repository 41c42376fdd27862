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

fn main() {
    // A bug stops the process, on whichever thread it shows (see `tether::bug`).
    tether::bug::stop_on_panic();
    // Allocator settings first, before threads and the first large allocations.
    tether::heap::tune_process();
    cli::main()
}
