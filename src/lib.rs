//! # Tether
//!
//! Durable client messaging: clients register interest in keys of named regions and receive
//! entry events (creates, updates, destroys, invalidates). A *durable* client's subscription
//! queue outlives its connection for its timeout, in an append-only RocksDB log; on reconnect it
//! learns whether the queue survived and how many events wait, registers, says it is ready,
//! receives the stored events flagged `replayed`, and is told once per region when it is live.
//!
//! - [`client`]: the client library ([`client::ClientBuilder`], [`client::Listener`], an async
//!   stream of [`client::ClientEvent`]s).
//! - [`server`]: the node ([`server::Node`]), also embeddable in a host process that feeds it
//!   events without the network ([`server::Node::publisher`]).
//! - [`core`]: the sans-IO state machine both are built around.
//!
//! ```no_run
//! use tether::client::{ClientBuilder, ClientEvent, Interest};
//! # async fn demo() -> Result<(), tether::client::ClientError> {
//! let client = ClientBuilder::new()
//!     .server("127.0.0.1:7400".parse().unwrap())
//!     .ca_file("data/tls/ca.pem")
//!     .durable("dashboard-1", 300)
//!     .connect()
//!     .await?;
//! println!("queue {:?}, {:?} pending", client.queue_status(), client.pending());
//! let prices = client.region("prices");
//! prices.register(Interest::regex("EUR.*")).await?;
//! let mut events = client.events()?;
//! client.ready_for_events().await?;
//! while let Some(ev) = events.next().await {
//!     match ev {
//!         ClientEvent::Event(e) => println!("{} {} replayed={}", e.key, e.op.as_str(), e.replayed),
//!         ClientEvent::Live { regions } => println!("live: {regions:?}"),
//!         _ => {} // Disconnected and Reconnected come only from a `Subscription`.
//!     }
//! }
//! client.close(true).await?;
//! # Ok(()) }
//! ```

pub mod admin;
pub mod auth;
pub mod bug;
pub mod cluster;
pub mod config;
pub mod control;
pub mod core;
pub mod heap;
pub mod ids;
pub mod interest;
pub mod limits;
pub mod metrics;
pub mod replication;
pub mod server;

/// The client library (the `tether-client` crate, which applications that only subscribe or
/// publish depend on alone).
pub use tether_client as client;
/// Messages and types of the wire protocol (from the `tether-client` crate).
pub use tether_client::protocol;
pub use tether_storage as storage;
pub use tether_transport as transport;

/// The README's Rust examples, compiled as doc tests so they stay true to the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme_examples {}
