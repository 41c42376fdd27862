//! Publish throughput with fan-out: a fresh node with `queues` durable clients away (all-keys
//! interest in the bench region), a publisher putting events over the network (requests of
//! [`crate::PUBLISH_BATCH_OPS`], [`crate::PUBLISH_CONCURRENCY`] in flight, each acknowledged
//! after its group commit): every event is appended to every queue.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tether::client::ClientBuilder;
use tether::config::ServerConfig;
use tether::protocol::PublishAck;
use tether::server::Node;

use crate::{park_durable, publish_all};

/// Durable clients registering at once while the queues are set up.
const PARK_CONCURRENCY: usize = 16;

pub struct Fanout {
    pub queues: u64,
    pub events: u64,
    pub publish: Duration,
}

impl Fanout {
    pub fn events_per_s(&self) -> f64 {
        self.events as f64 / self.publish.as_secs_f64()
    }
    pub fn entries_per_s(&self) -> f64 {
        (self.events * self.queues) as f64 / self.publish.as_secs_f64()
    }
}

pub async fn run(dir: &Path, queues: u64, events: u64, value_bytes: usize) -> Fanout {
    let data = dir.join(format!("fanout-{queues}"));
    let node = Node::start(ServerConfig::ephemeral(&data)).await.unwrap();
    let builder = ClientBuilder::new()
        .server(node.addr())
        .ca_file(node.ca_file());
    let mut parking = tokio::task::JoinSet::new();
    for q in 0..queues {
        if parking.len() >= PARK_CONCURRENCY {
            parking.join_next().await.unwrap().unwrap();
        }
        parking.spawn(park_durable(
            builder.clone().durable(format!("fan-{q}"), 3600),
        ));
    }
    parking.join_all().await;
    let publisher = Arc::new(builder.clone().connect().await.unwrap());
    let publish = publish_all(&publisher, 0..events, value_bytes, PublishAck::Local).await;
    let reports = node.queues();
    assert_eq!(reports.len() as u64, queues);
    assert!(
        reports.iter().all(|q| q.pending == events),
        "every event in every queue"
    );
    drop(publisher);
    node.shutdown().await;
    let _ = std::fs::remove_dir_all(&data);
    Fanout {
        queues,
        events,
        publish,
    }
}
