//! Automatic reconnection: a [`Subscription`] keeps one durable (or non-durable) subscription
//! alive across lost connections, and [`Backoff`], the I/O-free schedule it waits by.
//!
//! A lost connection is reported as [`ClientEvent::Disconnected`]; the subscription then tries
//! every server it knows (the configured ones and the queue's servers named by earlier
//! welcomes; after a lost primary, the queue's copies first, as [`ClientBuilder::connect`]
//! does) with exponential backoff and jitter, registers the subscription's interest again,
//! says it is ready, and reports [`ClientEvent::Reconnected`] with the new session's queue
//! status. One [`DedupState`] spans the sessions, so an event the application processed is not
//! shown again, and the live marker is shown once. The stream ends only when the application
//! closes it, when reconnecting is refused for good (credentials, permissions, a bad
//! argument), or when the policy's time limit passes.
//!
//! [`Backoff`]'s schedule is exponential, capped, with equal jitter.

use std::collections::VecDeque;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::protocol::{ErrorCode, InitialEntry};
use crate::{
    AckError, AckMode, Acker, Client, ClientBuilder, ClientError, ClientEvent, DedupState,
    EventStream, Interest, Listener, StreamBatch,
};

/// First wait before reconnecting, in milliseconds (doubled after each failed attempt).
pub const RECONNECT_DELAY_INITIAL_MS_DEFAULT: u64 = 100;
/// Longest wait between two reconnection attempts, in milliseconds.
pub const RECONNECT_DELAY_MAX_MS_DEFAULT: u64 = 5_000;
/// How long one reconnection attempt may wait for one server's welcome, in milliseconds.
/// Shorter than a first connection's [`CONNECT_TIMEOUT_MS`](crate::CONNECT_TIMEOUT_MS): a server
/// that is down does not answer at all (QUIC over UDP hears no refusal), and the next attempt
/// should come soon.
pub const RECONNECT_ATTEMPT_TIMEOUT_MS_DEFAULT: u64 = 2_000;
/// How long a subscription keeps reconnecting before it gives up, in seconds.
pub const RECONNECT_GIVE_UP_SECS_DEFAULT: u64 = 600;

/// How a [`Subscription`] reconnects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReconnectPolicy {
    /// Wait before the first attempt; doubled after each failed attempt.
    pub delay_initial: Duration,
    /// Cap of the wait between attempts.
    pub delay_max: Duration,
    /// How long one server may take to welcome one attempt.
    pub attempt_timeout: Duration,
    /// Total time after a loss before the subscription gives up; None: never.
    pub give_up_after: Option<Duration>,
}

impl Default for ReconnectPolicy {
    fn default() -> Self {
        ReconnectPolicy {
            delay_initial: Duration::from_millis(RECONNECT_DELAY_INITIAL_MS_DEFAULT),
            delay_max: Duration::from_millis(RECONNECT_DELAY_MAX_MS_DEFAULT),
            attempt_timeout: Duration::from_millis(RECONNECT_ATTEMPT_TIMEOUT_MS_DEFAULT),
            give_up_after: Some(Duration::from_secs(RECONNECT_GIVE_UP_SECS_DEFAULT)),
        }
    }
}

/// The wait before each reconnection attempt: exponential from `delay_initial`, capped at
/// `delay_max`, with "equal jitter" (half the step fixed, half drawn at random), so that the
/// clients of a restarted server do not all come back in the same instant, and none waits
/// less than half its step. No I/O and no clock: the caller passes the random draw.
#[derive(Clone, Debug)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    attempts: u32,
}

impl Backoff {
    pub fn new(policy: &ReconnectPolicy) -> Self {
        Backoff {
            initial: policy.delay_initial,
            max: policy.delay_max.max(policy.delay_initial),
            attempts: 0,
        }
    }

    /// The wait before the next attempt, given a uniformly random `draw`.
    pub fn next_delay(&mut self, draw: u64) -> Duration {
        let step = self
            .initial
            .saturating_mul(1u32 << self.attempts.min(31))
            .min(self.max);
        self.attempts = self.attempts.saturating_add(1);
        let half = step / 2;
        let half_nanos = u64::try_from(half.as_nanos()).unwrap_or(u64::MAX);
        let jitter = if half_nanos == 0 {
            0
        } else {
            draw % (half_nanos + 1)
        };
        half + Duration::from_nanos(jitter)
    }

    /// Attempts made since the last [`reset`](Self::reset).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// After a success: the next loss starts from `delay_initial` again.
    pub fn reset(&mut self) {
        self.attempts = 0;
    }
}

/// A random draw for the jitter (the standard library's per-process random hash keys; no
/// cryptographic quality needed).
fn random_draw() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    RandomState::new().hash_one(COUNTER.fetch_add(1, Ordering::Relaxed))
}

/// Whether reconnecting after this error can never succeed without a change by a person
/// (credentials, permissions, the request itself): the subscription ends instead of retrying.
fn is_permanent(e: &ClientError) -> bool {
    match e {
        ClientError::Server(w) => matches!(
            w.code,
            ErrorCode::Unauthenticated
                | ErrorCode::Forbidden
                | ErrorCode::InvalidArgument
                | ErrorCode::UnsupportedVersion
                | ErrorCode::ProtocolViolation
        ),
        ClientError::NoServer | ClientError::Tls(_) | ClientError::Usage(_) => true,
        ClientError::Connect(_) | ClientError::Protocol(_) | ClientError::Closed => false,
    }
}

/// Runs `attempt` until it succeeds, waiting by a [`Backoff`] of `policy` between attempts
/// (and before the first, if `wait_first`); gives up on an error no retry can fix
/// ([`is_permanent`]) or when the policy's time limit would pass. Returns the value and the
/// number of attempts made.
pub(crate) async fn retry<T, F: std::future::Future<Output = Result<T, ClientError>>>(
    policy: &ReconnectPolicy,
    wait_first: bool,
    mut attempt: impl FnMut() -> F,
) -> Result<(T, u32), ClientError> {
    let started = Instant::now();
    let mut backoff = Backoff::new(policy);
    let mut attempts = 0;
    loop {
        if attempts > 0 || wait_first {
            let delay = backoff.next_delay(random_draw());
            if let Some(limit) = policy.give_up_after
                && started.elapsed() + delay > limit
            {
                return Err(ClientError::Connect(format!(
                    "gave up reconnecting after {} s and {attempts} attempts",
                    started.elapsed().as_secs(),
                )));
            }
            tokio::time::sleep(delay).await;
        }
        attempts += 1;
        match attempt().await {
            Ok(v) => return Ok((v, attempts)),
            Err(e) if is_permanent(&e) => {
                tracing::warn!(error = %e, "reconnecting refused; giving up");
                return Err(e);
            }
            Err(e) => tracing::debug!(error = %e, attempts, "reconnect failed"),
        }
    }
}

/// A subscription that survives lost connections (see the [module](self) docs). Made by
/// [`ClientBuilder::subscribe`].
pub struct Subscription {
    builder: ClientBuilder,
    interests: Vec<(String, Interest)>,
    policy: ReconnectPolicy,
    dedup: DedupState,
    session: Option<(Client, EventStream)>,
    /// The loss being recovered from: set once `Disconnected` was yielded.
    lost: bool,
    /// Why the subscription ended, when it ended by itself.
    ended: Option<ClientError>,
    initial: Vec<(String, InitialEntry)>,
    queued: VecDeque<ClientEvent>,
    reconnects: u64,
}

impl ClientBuilder {
    /// Connects, registers `interests` (region, interest), says ready (durable clients), and
    /// returns a [`Subscription`] that reconnects by itself by the builder's
    /// [`reconnect`](Self::reconnect) policy. The first connection is not retried: its error
    /// is returned, so a wrong address or credential is reported at once.
    pub async fn subscribe(
        self,
        interests: impl IntoIterator<Item = (String, Interest)>,
    ) -> Result<Subscription, ClientError> {
        let dedup = self.dedup.clone().unwrap_or_default();
        let policy = self.reconnect.clone();
        let mut builder = self.dedup_state(dedup.clone());
        let interests: Vec<(String, Interest)> = interests.into_iter().collect();
        let (client, stream, initial) = open(&builder, &interests).await?;
        learn_servers(&mut builder, &client).await;
        builder.attempt_timeout = policy.attempt_timeout;
        Ok(Subscription {
            builder,
            interests,
            policy,
            dedup,
            session: Some((client, stream)),
            lost: false,
            ended: None,
            initial,
            queued: VecDeque::new(),
            reconnects: 0,
        })
    }
}

/// One session: connect, take the stream, register, ready.
async fn open(
    builder: &ClientBuilder,
    interests: &[(String, Interest)],
) -> Result<(Client, EventStream, Vec<(String, InitialEntry)>), ClientError> {
    let client = builder.clone().connect().await?;
    let result = async {
        let stream = client.events()?;
        let mut initial = Vec::new();
        for (region, interest) in interests {
            let image = client.region(region).register(interest.clone()).await?;
            initial.extend(image.into_iter().map(|e| (region.clone(), e)));
        }
        if client.is_durable() {
            client.ready_for_events().await?;
        }
        Ok((stream, initial))
    }
    .await;
    match result {
        Ok((stream, initial)) => Ok((client, stream, initial)),
        Err(e) => {
            client.abandon(ErrorCode::ClosedByPeer, b"setup failed");
            Err(e)
        }
    }
}

/// Adds the queue's servers named by `client`'s welcome to the servers `builder` tries (a
/// server named by host is verified against that name, unless the application named it).
async fn learn_servers(builder: &mut ClientBuilder, client: &Client) {
    for s in client.queue_servers() {
        let Ok((addr, host)) = crate::resolve_server(&s.addr, Some(client.server_addr())).await
        else {
            continue;
        };
        if let Some(h) = host {
            builder.names.entry(addr).or_insert(h);
        }
        if !builder.servers.contains(&addr) {
            builder.servers.push(addr);
        }
    }
}

impl Subscription {
    /// The next event, [`ClientEvent::Disconnected`] when the connection is lost and
    /// [`ClientEvent::Reconnected`] once it is back. None once the subscription ended
    /// ([`ended`](Self::ended) says why). Asking for the next event marks the previous one
    /// processed, as [`EventStream::next`] does.
    pub async fn next(&mut self) -> Option<ClientEvent> {
        if let Some(item) = self.pending_item().await {
            return item;
        }
        let (_, stream) = self.session.as_mut()?;
        match stream.next().await {
            Some(ev) => Some(ev),
            None => self.lost_connection(),
        }
    }

    /// [`EventStream::next_batch`] across reconnections: the next events read in place, or
    /// one of the items [`Subscription::next`] yields besides events.
    pub async fn next_batch(&mut self) -> Option<StreamBatch> {
        if let Some(item) = self.pending_item().await {
            return item.map(StreamBatch::Other);
        }
        let (_, stream) = self.session.as_mut()?;
        match stream.next_batch().await {
            Some(batch) => Some(batch),
            None => self.lost_connection().map(StreamBatch::Other),
        }
    }

    /// What comes before the stream's next item: a queued notice, the end, or (after
    /// reconnecting if the connection was lost) nothing, and the stream is asked.
    async fn pending_item(&mut self) -> Option<Option<ClientEvent>> {
        loop {
            if let Some(ev) = self.queued.pop_front() {
                return Some(Some(ev));
            }
            if self.ended.is_some() {
                return Some(None);
            }
            if !self.lost {
                return None;
            }
            self.reconnect().await;
        }
    }

    /// The stream ended: the connection is lost. Reconnects at the next call unless the
    /// error is permanent.
    fn lost_connection(&mut self) -> Option<ClientEvent> {
        // The stream marked the last event processed (in the shared DedupState) before it
        // ended: the next session drops its redelivery.
        let (client, _) = self.session.take()?;
        let error = client.closed_error();
        tracing::info!(error = %error, "connection lost; reconnecting");
        client.abandon(ErrorCode::ClosedByPeer, b"lost");
        self.lost = true;
        if is_permanent(&error) {
            self.ended = Some(error);
            return None;
        }
        Some(ClientEvent::Disconnected {
            error: error.to_string(),
        })
    }

    async fn reconnect(&mut self) {
        let (builder, interests) = (&self.builder, &self.interests);
        match retry(&self.policy, true, || open(builder, interests)).await {
            Ok(((client, stream, _initial), attempts)) => {
                // The initial image of a re-registration is not shown: a durable queue
                // replays what happened meanwhile, and non-durable interest misses it
                // by definition (read current values with `Region::get`).
                learn_servers(&mut self.builder, &client).await;
                tracing::info!(
                    server = %client.server_addr(),
                    queue = client.queue_status().as_str(),
                    attempts,
                    "reconnected"
                );
                self.queued.push_back(ClientEvent::Reconnected {
                    queue: client.queue_status(),
                    pending: client.pending(),
                });
                self.session = Some((client, stream));
                self.lost = false;
                self.reconnects += 1;
            }
            Err(e) => self.ended = Some(e),
        }
    }

    /// Registers more interest now and after every reconnect; returns the initial image.
    pub async fn register(
        &mut self,
        region: impl Into<String>,
        interest: Interest,
    ) -> Result<Vec<InitialEntry>, ClientError> {
        let region = region.into();
        let (client, _) = self.session.as_ref().ok_or(ClientError::Closed)?;
        let image = client.region(&region).register(interest.clone()).await?;
        self.interests.push((region, interest));
        Ok(image)
    }

    /// The initial images of the first session's registrations (region, entry), once.
    pub fn take_initial(&mut self) -> Vec<(String, InitialEntry)> {
        std::mem::take(&mut self.initial)
    }

    /// The connected client (to publish, read values or ack), None while reconnecting.
    pub fn client(&self) -> Option<&Client> {
        self.session.as_ref().map(|(c, _)| c)
    }

    /// Why the subscription ended by itself (None while it runs).
    pub fn ended(&self) -> Option<&ClientError> {
        self.ended.as_ref()
    }

    /// Sessions opened after the first.
    pub fn reconnects(&self) -> u64 {
        self.reconnects
    }

    /// What this process processed of the queue (shared by every session).
    pub fn dedup_state(&self) -> DedupState {
        self.dedup.clone()
    }

    /// Acks the event at `offset` ([`AckMode::Manual`]; see [`Acker::ack`]). Acks made while
    /// reconnecting count: they are sent once the next session is sent that offset again.
    pub fn ack(&self, offset: u64) -> Result<u64, ClientError> {
        self.acker()?.ack(offset)
    }

    /// A handle to ack from other tasks ([`AckMode::Manual`]); valid across reconnects.
    pub fn acker(&self) -> Result<Acker, ClientError> {
        match self.builder.ack_mode {
            AckMode::Manual => Ok(Acker {
                dedup: self.dedup.clone(),
            }),
            AckMode::Auto => Err(ClientError::Usage(AckError::NotManual.to_string())),
        }
    }

    /// Marks the last yielded event processed without waiting for the next one.
    pub fn commit(&mut self) {
        if let Some((_, stream)) = self.session.as_mut() {
            stream.commit();
        }
    }

    /// Drives a listener until the subscription ends.
    pub async fn run_listener(mut self, listener: &mut dyn Listener) {
        while let Some(ev) = self.next().await {
            crate::dispatch(listener, &ev);
        }
    }

    /// Ends the subscription: processed events are acked, then the session is closed as
    /// [`Client::close`] does (`keepalive`: the durable queue is kept for its timeout). Fails
    /// with [`ClientError::Closed`] while not connected: a durable queue then stays until
    /// its timeout.
    pub async fn close(self, keepalive: bool) -> Result<(), ClientError> {
        self.close_with(keepalive, false).await
    }

    /// Ends the subscription as [`Subscription::close`] does, but returns once the close is
    /// on the wire, as [`Client::close_promptly`] does: for a process about to exit.
    pub async fn close_promptly(self, keepalive: bool) -> Result<(), ClientError> {
        self.close_with(keepalive, true).await
    }

    async fn close_with(mut self, keepalive: bool, promptly: bool) -> Result<(), ClientError> {
        match self.session.take() {
            Some((client, mut stream)) => {
                stream.commit();
                if promptly {
                    client.close_promptly(keepalive).await
                } else {
                    client.close(keepalive).await
                }
            }
            None => {
                self.dedup.forget_live();
                Err(self.ended.take().unwrap_or(ClientError::Closed))
            }
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if let Some((client, _)) = self.session.take() {
            client.abandon(ErrorCode::ClosedByPeer, b"dropped");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(initial_ms: u64, max_ms: u64) -> ReconnectPolicy {
        ReconnectPolicy {
            delay_initial: Duration::from_millis(initial_ms),
            delay_max: Duration::from_millis(max_ms),
            ..ReconnectPolicy::default()
        }
    }

    #[test]
    fn the_wait_doubles_up_to_the_cap_and_restarts_after_a_success() {
        let mut b = Backoff::new(&policy(100, 1_000));
        // The smallest draw gives half the step, the largest the whole step.
        let low: Vec<u64> = (0..6).map(|_| b.next_delay(0).as_millis() as u64).collect();
        assert_eq!(low, [50, 100, 200, 400, 500, 500]);
        b.reset();
        let max = 50_000_000; // half of the first step, in nanoseconds: the top of the draw
        assert_eq!(b.next_delay(max), Duration::from_millis(100));
        assert_eq!(b.attempts(), 1);
    }

    #[test]
    fn every_wait_lies_between_half_its_step_and_its_step() {
        let mut b = Backoff::new(&policy(100, 5_000));
        for attempt in 0..40u32 {
            let step = Duration::from_millis(100)
                .saturating_mul(1u32 << attempt.min(31))
                .min(Duration::from_millis(5_000));
            let d = b.next_delay(random_draw());
            assert!(
                d >= step / 2 && d <= step,
                "attempt {attempt}: {d:?} vs {step:?}"
            );
        }
    }

    #[test]
    fn a_cap_below_the_first_step_and_a_zero_step_are_harmless() {
        let mut b = Backoff::new(&policy(500, 100));
        assert_eq!(b.next_delay(0), Duration::from_millis(250));
        let mut z = Backoff::new(&policy(0, 0));
        assert_eq!(z.next_delay(u64::MAX), Duration::ZERO);
    }

    #[test]
    fn only_refusals_a_person_must_fix_end_a_subscription() {
        use crate::protocol::WireError;
        let server = |code| ClientError::Server(WireError::new(code, "x"));
        for code in [
            ErrorCode::Unauthenticated,
            ErrorCode::Forbidden,
            ErrorCode::InvalidArgument,
        ] {
            assert!(is_permanent(&server(code)), "{code:?}");
        }
        for code in [
            ErrorCode::Shutdown,
            ErrorCode::Unavailable,
            ErrorCode::DuplicateDurableId,
            ErrorCode::QueueFull,
            ErrorCode::LimitExceeded,
        ] {
            assert!(!is_permanent(&server(code)), "{code:?}");
        }
        assert!(!is_permanent(&ClientError::Connect("timed out".into())));
        assert!(!is_permanent(&ClientError::Closed));
    }
}
