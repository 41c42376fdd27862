//! [`Publisher`]: publishing that survives the stopping of its server (a rolling restart).
//!
//! When its server stops, it moves to another server of its list: a request answered
//! `going-away` was not applied, so it is sent again there.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::protocol::{ErrorCode, PublishAck, PublishOp};
use crate::reconnect::retry;
use crate::{Client, ClientBuilder, ClientError, ReconnectPolicy};

/// A publisher that outlives the stopping of its server: a publish a stopping node answers
/// `going-away` (not applied, see [`ErrorCode::GoingAway`]) is sent again through another
/// server, connected by the builder's [`reconnect`](ClientBuilder::reconnect) policy, and so
/// is a publish made while the connection is already closed. A rolling restart of a cluster
/// then costs its application no error and no duplicate. A publish whose connection is lost
/// while it is under way (a crash, a network cut) may or may not have been applied: its error
/// is returned, and the next publish connects again. Its methods take `&self`: tasks sharing
/// one publisher (in an `Arc`) publish over one connection at once. Made by
/// [`ClientBuilder::publisher`].
pub struct Publisher {
    /// The servers tried next: the one left last goes last.
    builder: Mutex<ClientBuilder>,
    policy: ReconnectPolicy,
    /// The builder's acknowledgement mode, for [`Publisher::publish`].
    ack: PublishAck,
    /// The connected client and its generation (one more at each move).
    current: tokio::sync::RwLock<Current>,
    moves: AtomicU64,
}

/// A publisher's connection.
struct Current {
    /// One more at each move to another server.
    generation: u64,
    client: Option<Client>,
    /// Closed by the application: every call fails with [`ClientError::Closed`].
    closed: bool,
}

impl ClientBuilder {
    /// Connects a [`Publisher`] (not durable). The first connection is not retried: its error
    /// is returned, so a wrong address or credential is reported at once.
    pub async fn publisher(self) -> Result<Publisher, ClientError> {
        if self.durable.is_some() {
            return Err(ClientError::Usage(
                "a publisher is not durable: subscribe with a durable builder instead".into(),
            ));
        }
        let policy = self.reconnect.clone();
        let client = self.clone().connect().await?;
        let mut builder = self;
        builder.attempt_timeout = policy.attempt_timeout;
        Ok(Publisher {
            ack: builder.publish_ack,
            builder: Mutex::new(builder),
            policy,
            current: tokio::sync::RwLock::new(Current {
                generation: 0,
                client: Some(client),
                closed: false,
            }),
            moves: AtomicU64::new(0),
        })
    }
}

impl Publisher {
    /// Publishes `ops` with the builder's [`publish_ack`](ClientBuilder::publish_ack), as
    /// [`Client::publish`] does, moving to another server when its own stops.
    pub async fn publish(&self, ops: Vec<PublishOp>) -> Result<u64, ClientError> {
        self.publish_with(ops, self.ack).await
    }

    /// [`Publisher::publish`] with an explicit acknowledgement mode.
    pub async fn publish_with(
        &self,
        ops: Vec<PublishOp>,
        ack: PublishAck,
    ) -> Result<u64, ClientError> {
        loop {
            let generation = {
                let current = self.current.read().await;
                match &current.client {
                    _ if current.closed => return Err(ClientError::Closed),
                    Some(c) if !c.is_closed() => match c.publish_with(ops.clone(), ack).await {
                        // Not applied: sent again through another server.
                        Err(ClientError::Server(e)) if e.code == ErrorCode::GoingAway => {
                            current.generation
                        }
                        other => return other,
                    },
                    _ => current.generation,
                }
            };
            self.move_on(generation).await?;
        }
    }

    /// Runs `f` on the connected client (to read values, or for admin calls), connecting
    /// again first if the connection is closed.
    pub async fn with_client<T>(
        &self,
        f: impl AsyncFnOnce(&Client) -> Result<T, ClientError>,
    ) -> Result<T, ClientError> {
        let mut f = Some(f);
        loop {
            let generation = {
                let current = self.current.read().await;
                match (&current.client, f.take()) {
                    _ if current.closed => return Err(ClientError::Closed),
                    (Some(c), Some(f)) if !c.is_closed() => return f(c).await,
                    (_, back) => {
                        f = back;
                        current.generation
                    }
                }
            };
            self.move_on(generation).await?;
        }
    }

    /// Leaves the client of `generation` (its server is stopping or gone: it goes last among
    /// the servers tried next) and connects again; nothing if another task did so already.
    async fn move_on(&self, generation: u64) -> Result<(), ClientError> {
        let mut current = self.current.write().await;
        if current.generation != generation || current.closed {
            return Ok(());
        }
        if let Some(old) = current.client.take() {
            let addr = old.server_addr();
            let mut builder = self.builder.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(i) = builder.servers.iter().position(|s| *s == addr) {
                let s = builder.servers.remove(i);
                builder.servers.push(s);
            }
            drop(builder);
            old.abandon(ErrorCode::ClosedByPeer, b"moving to another server");
        }
        let builder = self
            .builder
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let (c, _) = retry(&self.policy, false, || builder.clone().connect()).await?;
        tracing::info!(server = %c.server_addr(), "publishing through another server");
        self.moves.fetch_add(1, Ordering::Relaxed);
        current.generation = generation + 1;
        current.client = Some(c);
        Ok(())
    }

    /// The address of the server publishes go to now, if connected.
    pub async fn server_addr(&self) -> Option<std::net::SocketAddr> {
        self.current
            .read()
            .await
            .client
            .as_ref()
            .map(Client::server_addr)
    }

    /// How many times the publisher moved to another server.
    pub fn moves(&self) -> u64 {
        self.moves.load(Ordering::Relaxed)
    }

    /// Closes the connection; later calls fail with [`ClientError::Closed`]. Closing twice
    /// does nothing.
    pub async fn close(&self) -> Result<(), ClientError> {
        let mut current = self.current.write().await;
        current.closed = true;
        match current.client.take() {
            Some(c) => c.close(false).await,
            None => Ok(()),
        }
    }
}
