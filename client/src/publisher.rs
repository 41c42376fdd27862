//! [`Publisher`]: publishing that survives the stopping of its server (a rolling restart).

use crate::protocol::{ErrorCode, PublishAck, PublishOp};
use crate::reconnect::retry;
use crate::{Client, ClientBuilder, ClientError, ReconnectPolicy};

/// A publisher that outlives the stopping of its server: a publish a stopping node answers
/// `going-away` (not applied, see [`ErrorCode::GoingAway`]) is sent again through another
/// server, connected by the builder's [`reconnect`](ClientBuilder::reconnect) policy, and so
/// is a publish made while the connection is already closed. A rolling restart of a cluster
/// then costs its application no error and no duplicate. A publish whose connection is lost
/// while it is under way (a crash, a network cut) may or may not have been applied: its error
/// is returned, and the next publish connects again. Made by [`ClientBuilder::publisher`].
pub struct Publisher {
    builder: ClientBuilder,
    policy: ReconnectPolicy,
    client: Option<Client>,
    moves: u64,
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
            builder,
            policy,
            client: Some(client),
            moves: 0,
        })
    }
}

impl Publisher {
    /// Publishes `ops` with the builder's [`publish_ack`](ClientBuilder::publish_ack), as
    /// [`Client::publish`] does, moving to another server when its own stops.
    pub async fn publish(&mut self, ops: Vec<PublishOp>) -> Result<u64, ClientError> {
        let ack = self.builder.publish_ack;
        self.publish_with(ops, ack).await
    }

    /// [`Publisher::publish`] with an explicit acknowledgement mode.
    pub async fn publish_with(
        &mut self,
        ops: Vec<PublishOp>,
        ack: PublishAck,
    ) -> Result<u64, ClientError> {
        loop {
            let client = match self.client.take() {
                Some(c) if !c.is_closed() => self.client.insert(c),
                old => {
                    if let Some(c) = old {
                        self.leave(c);
                    }
                    let builder = &self.builder;
                    let (c, _) = retry(&self.policy, false, || builder.clone().connect()).await?;
                    self.moves += 1;
                    tracing::info!(server = %c.server_addr(), "publishing through another server");
                    self.client.insert(c)
                }
            };
            match client.publish_with(ops.clone(), ack).await {
                Err(ClientError::Server(e)) if e.code == ErrorCode::GoingAway => {
                    // Not applied: the next round sends it through another server.
                    if let Some(c) = self.client.take() {
                        self.leave(c);
                    }
                }
                other => return other,
            }
        }
    }

    /// Leaves `client`'s server, which is stopping or gone: it goes last among the servers
    /// tried next (a stopped server answers nothing, and each try waits out its timeout).
    fn leave(&mut self, client: Client) {
        let addr = client.server_addr();
        if let Some(i) = self.builder.servers.iter().position(|s| *s == addr) {
            let s = self.builder.servers.remove(i);
            self.builder.servers.push(s);
        }
        client.abandon(ErrorCode::ClosedByPeer, b"moving to another server");
    }

    /// The connected client (to read values), None between servers.
    pub fn client(&self) -> Option<&Client> {
        self.client.as_ref()
    }

    /// How many times the publisher moved to another server.
    pub fn moves(&self) -> u64 {
        self.moves
    }

    /// Closes the connection.
    pub async fn close(mut self) -> Result<(), ClientError> {
        match self.client.take() {
            Some(c) => c.close(false).await,
            None => Ok(()),
        }
    }
}
