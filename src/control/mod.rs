//! The cluster's decisions, without I/O.
//!
//! Each module here is a pure state machine or a pure function: inputs are what the node
//! observed (metadata applied here, peer answers, what its core and copies hold) and the time,
//! passed in as milliseconds of the caller's clock; outputs are decisions the server executes
//! (declare a member failed, promote, depose, ship, repair, hand over, drop a copy). Nothing
//! here reads a clock, touches storage or the network, spawns or awaits: the drivers in
//! `server/` do, and tests drive these deterministically. State is held in ordered maps only
//! (deterministic order), and logging is left to the drivers. `tests/tidy.rs` checks the rule
//! (no tokio, storage, transport, clocks, locks, hash maps or logging here).
//!
//! - [`forward`]: the pipeline of publish-log runs an origin ships to one peer;
//! - [`lease`]: when a primary may deliver (every secondary acknowledged recently, and a
//!   promoted or restarted primary waits out its predecessor's lease);
//! - [`liveness`]: which members answer, and which the metadata leader declares failed;
//! - [`reconcile`]: per queue and per copy, what the node does next (ship and repair, depose,
//!   drop, promote), and the fencing checks on copies;
//! - [`rebalance`]: how many queues each member hands over, and which;
//! - [`round`]: one round composed of those steps (a primary's repair as a metadata write,
//!   the takers of a rebalancing round), executed by the server and the cluster simulation;
//! - [`watermark`]: how far a copy holds the publishes its primary applied.

pub mod forward;
pub mod lease;
pub mod liveness;
pub mod rebalance;
pub mod reconcile;
pub mod round;
pub mod watermark;
