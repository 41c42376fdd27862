//! Publish throughput with many distinct interest regexes in the published region: a fresh
//! node with [`REGEX_QUEUES`] durable clients away, which together registered `regexes`
//! distinct regexes (none matching the bench keys, so the figure is the cost of matching
//! alone, not of fan-out), and a publisher putting events over the network as in the
//! fan-out phase. Run with 0 regexes too, on its own fresh node, for the baseline of the
//! ratio. Then the same publishes again beside a second publisher putting as many events
//! into a region no queue is interested in: how much the regexes slow publishes that do not
//! use them (their matching runs outside the core lock).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tether::client::{ClientBuilder, Interest};
use tether::config::ServerConfig;
use tether::protocol::{PublishAck, ResultPolicy};
use tether::server::Node;

use crate::{publish_all, publish_all_in};

/// Durable clients holding the regexes.
const REGEX_QUEUES: u64 = 10;

/// The regexes' form.
#[derive(Clone, Copy, Debug)]
pub enum Shape {
    /// `cust-<n>-order-[0-9]+`: a literal prefix, as most subscribers write them.
    Prefix,
    /// `.*-<n>-.*`: a match anywhere, the hardest form for one automaton over many regexes.
    Contains,
}

impl Shape {
    pub fn parse(s: &str) -> Option<Shape> {
        match s {
            "prefix" => Some(Shape::Prefix),
            "contains" => Some(Shape::Contains),
            _ => None,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Shape::Prefix => "prefix",
            Shape::Contains => "contains",
        }
    }

    fn source(self, n: u64) -> String {
        match self {
            Shape::Prefix => format!("cust-{n}-order-[0-9]+"),
            Shape::Contains => format!(".*-{n}-.*"),
        }
    }
}

pub struct Regexes {
    pub shape: Shape,
    pub regexes: u64,
    pub events: u64,
    /// Registering every regex (one request each, the queues in turn).
    pub register: Duration,
    pub publish: Duration,
    /// The second publisher's time, into a region without interest, while the first
    /// publishes again.
    pub beside: Duration,
}

impl Regexes {
    pub fn events_per_s(&self) -> f64 {
        self.events as f64 / self.publish.as_secs_f64()
    }

    pub fn beside_events_per_s(&self) -> f64 {
        self.events as f64 / self.beside.as_secs_f64()
    }
}

pub async fn run(dir: &Path, shape: Shape, regexes: u64, events: u64, size: usize) -> Regexes {
    let data = dir.join(format!("regexes-{}-{regexes}", shape.label()));
    let node = Node::start(ServerConfig::ephemeral(&data)).await.unwrap();
    let builder = ClientBuilder::new()
        .server(node.addr())
        .ca_file(node.ca_file());
    let mut register = Duration::ZERO;
    for q in 0..REGEX_QUEUES {
        let c = builder
            .clone()
            .durable(format!("regexes-{q}"), 3600)
            .connect()
            .await
            .unwrap();
        let region = c.region("bench");
        // Every queue has interest in the region, regexes or not, so the baseline pays for
        // the same queues.
        region
            .register(Interest::key("not-a-bench-key").policy(ResultPolicy::None))
            .await
            .unwrap();
        let t = Instant::now();
        for n in (q..regexes).step_by(REGEX_QUEUES as usize) {
            region
                .register(Interest::regex(shape.source(n)).policy(ResultPolicy::None))
                .await
                .unwrap();
        }
        register += t.elapsed();
        c.ready_for_events().await.unwrap();
        c.close(true).await.unwrap();
    }
    let publisher = Arc::new(builder.clone().connect().await.unwrap());
    let publish = publish_all(&publisher, 0..events, size, PublishAck::Local).await;
    let neighbour = Arc::new(builder.clone().connect().await.unwrap());
    let (_, beside) = tokio::join!(
        publish_all(&publisher, events..2 * events, size, PublishAck::Local),
        publish_all_in("beside", &neighbour, 0..events, size, PublishAck::Local),
    );
    assert!(
        node.queues().iter().all(|q| q.pending == 0),
        "no regex matches a bench key"
    );
    drop((publisher, neighbour));
    node.shutdown().await;
    let _ = std::fs::remove_dir_all(&data);
    Regexes {
        shape,
        regexes,
        events,
        register,
        publish,
        beside,
    }
}
