//! `tether._native`: the Rust half of Tether's Python client (the public API is the pure-Python
//! package `tether`, `python/tether/__init__.py`, which validates arguments and calls this).
//!
//! A module-wide tokio runtime (two worker threads, made on first use) drives the
//! `tether-client` futures; every call that waits releases the GIL (`Python::detach`) and blocks
//! on the runtime.
//!
//! A subscription is a [`Subscription`] owned by a pump task, which reads events ahead into a
//! bounded channel of batches; the Python iterator takes one batch per wait and hands out its
//! events one at a time without crossing back into Rust's async side. The pump never abandons
//! `Subscription::next` midway (reconnecting is not cancel-safe) except to close it.
//!
//! Reading ahead must not count an event as processed before the application had it, so the
//! subscription always runs in `AckMode::Manual`; the `auto` mode of the Python API acks each
//! event's offset when the application asks for the next one (as `AckMode::Auto` marks it), or
//! when it commits or closes.

use std::collections::VecDeque;
use std::future::Future;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::pin::pin;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};
use tether_client::protocol::{
    InitialEntry, InterestSpec, PublishAck, PublishOp, QueueStatus, ResultPolicy,
};
use tether_client::{
    AckMode, Acker, Client, ClientBuilder, ClientError, ClientEvent, Interest, ReconnectPolicy,
    Subscription,
};
use tokio::sync::{mpsc, oneshot};

create_exception!(
    tether,
    TetherError,
    PyException,
    "An error of the Tether client; the message is the client library's."
);
create_exception!(
    tether,
    ConnectError,
    TetherError,
    "No server could be reached (or none was configured)."
);
create_exception!(
    tether,
    ServerError,
    TetherError,
    "A server refused a request; `code` is the wire error code's name."
);
create_exception!(
    tether,
    TlsError,
    TetherError,
    "The CA certificate or client identity could not be loaded."
);
create_exception!(
    tether,
    ProtocolError,
    TetherError,
    "The server sent something the client did not expect."
);
create_exception!(
    tether,
    ClosedError,
    TetherError,
    "The connection is closed (or was lost, for a subscriber without reconnect)."
);
create_exception!(
    tether,
    UsageError,
    TetherError,
    "The request is not valid in this state (an ack in auto mode, a bad checkpoint, ...)."
);

/// Events the pump reads ahead per batch, at most (the Python side may ask for fewer).
const BATCH_MAX_DEFAULT: usize = 1024;
/// Batches read ahead of the application.
const BATCHES_AHEAD: usize = 2;
/// The longest one wait for a batch holds the GIL released, so signals (Ctrl-C) are seen.
const WAIT_SLICE: Duration = Duration::from_millis(200);

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("tether-io")
            .enable_all()
            .build()
            .expect("cannot start the tokio runtime")
    })
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// ---------------------------------------------------------------------------------------------
// Errors

#[derive(Clone, Copy, Debug)]
enum Kind {
    Connect,
    Server,
    Tls,
    Protocol,
    Closed,
    Usage,
    Value,
    Other,
}

/// A [`ClientError`] (or an argument error) in a form that can be kept, sent between tasks, and
/// raised later.
#[derive(Clone, Debug)]
struct ErrInfo {
    kind: Kind,
    message: String,
    code: Option<&'static str>,
}

impl ErrInfo {
    fn new(kind: Kind, message: impl Into<String>) -> Self {
        ErrInfo {
            kind,
            message: message.into(),
            code: None,
        }
    }

    fn to_py(&self, py: Python<'_>) -> PyErr {
        let m = self.message.clone();
        match self.kind {
            Kind::Connect => ConnectError::new_err(m),
            Kind::Server => {
                let e = ServerError::new_err(m);
                let _ = e.value(py).setattr("code", self.code);
                e
            }
            Kind::Tls => TlsError::new_err(m),
            Kind::Protocol => ProtocolError::new_err(m),
            Kind::Closed => ClosedError::new_err(m),
            Kind::Usage => UsageError::new_err(m),
            Kind::Value => PyValueError::new_err(m),
            Kind::Other => TetherError::new_err(m),
        }
    }
}

impl From<&ClientError> for ErrInfo {
    fn from(e: &ClientError) -> Self {
        let message = e.to_string();
        #[allow(unreachable_patterns)]
        let (kind, code) = match e {
            ClientError::NoServer | ClientError::Connect(_) => (Kind::Connect, None),
            ClientError::Server(w) => (Kind::Server, Some(w.code.name())),
            ClientError::Tls(_) => (Kind::Tls, None),
            ClientError::Protocol(_) => (Kind::Protocol, None),
            ClientError::Closed => (Kind::Closed, None),
            ClientError::Usage(_) => (Kind::Usage, None),
            _ => (Kind::Other, None),
        };
        ErrInfo {
            kind,
            message,
            code,
        }
    }
}

impl From<ClientError> for ErrInfo {
    fn from(e: ClientError) -> Self {
        ErrInfo::from(&e)
    }
}

// ---------------------------------------------------------------------------------------------
// Event objects

/// An entry event: a create, update, destroy or invalidate of a key.
#[pyclass(module = "tether", name = "Event", frozen)]
struct PyEvent(tether_client::Event);

#[pymethods]
impl PyEvent {
    #[getter]
    fn region(&self) -> &str {
        &self.0.region
    }
    #[getter]
    fn key(&self) -> &str {
        &self.0.key
    }
    /// `"create"`, `"update"`, `"destroy"` or `"invalidate"`.
    #[getter]
    fn op(&self) -> &'static str {
        self.0.op.as_str()
    }
    /// The new value; None for a destroy or an invalidate.
    #[getter]
    fn value<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.0.value.as_deref().map(|v| PyBytes::new(py, v))
    }
    /// The event's offset in this client's queue (what `ack` and `checkpoint` take).
    #[getter]
    fn offset(&self) -> u64 {
        self.0.offset
    }
    /// The cluster-unique event id, `node-session-seq`.
    #[getter]
    fn event_id(&self) -> String {
        self.0.event_id.to_string()
    }
    /// Queued before the client said it was ready.
    #[getter]
    fn replayed(&self) -> bool {
        self.0.replayed
    }
    /// Sent to this durable id before and not acknowledged.
    #[getter]
    fn possible_duplicate(&self) -> bool {
        self.0.possible_duplicate
    }
    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.cast::<PyEvent>().is_ok_and(|o| o.get().0 == self.0)
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let e = &self.0;
        let value = match &e.value {
            None => "None".to_string(),
            Some(v) if v.len() > 40 => format!("{}...", PyBytes::new(py, &v[..40]).repr()?),
            Some(v) => PyBytes::new(py, v).repr()?.to_string(),
        };
        let s = |t: &str| PyString::new(py, t).repr().map(|r| r.to_string());
        Ok(format!(
            "Event(region={}, key={}, op={}, value={value}, offset={}, event_id={}, \
             replayed={}, possible_duplicate={})",
            s(&e.region)?,
            s(&e.key)?,
            s(e.op.as_str())?,
            e.offset,
            s(&e.event_id.to_string())?,
            py_bool(e.replayed),
            py_bool(e.possible_duplicate)
        ))
    }
}

fn py_bool(b: bool) -> &'static str {
    if b { "True" } else { "False" }
}

/// The live marker: everything queued before ready was delivered (for these regions).
#[pyclass(module = "tether", name = "Live", frozen, eq)]
#[derive(PartialEq)]
struct PyLive {
    #[pyo3(get)]
    regions: Vec<String>,
}

#[pymethods]
impl PyLive {
    #[new]
    fn new(regions: Vec<String>) -> Self {
        PyLive { regions }
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "Live(regions={})",
            self.regions.clone().into_pyobject(py)?.repr()?
        ))
    }
}

/// The connection was lost; the subscriber is reconnecting.
#[pyclass(module = "tether", name = "Disconnected", frozen, eq)]
#[derive(PartialEq)]
struct PyDisconnected {
    #[pyo3(get)]
    error: String,
}

#[pymethods]
impl PyDisconnected {
    #[new]
    fn new(error: String) -> Self {
        PyDisconnected { error }
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "Disconnected(error={})",
            PyString::new(py, &self.error).repr()?
        ))
    }
}

/// Connected again, with the new session's queue status and pending count.
#[pyclass(module = "tether", name = "Reconnected", frozen, eq)]
#[derive(PartialEq)]
struct PyReconnected {
    /// `"resumed"`, `"expired"`, `"new"` or `"none"`.
    #[pyo3(get)]
    queue: String,
    #[pyo3(get)]
    pending: Option<u64>,
}

#[pymethods]
impl PyReconnected {
    #[new]
    #[pyo3(signature = (queue, pending=None))]
    fn new(queue: String, pending: Option<u64>) -> Self {
        PyReconnected { queue, pending }
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let pending = self.pending.map_or("None".into(), |p| p.to_string());
        let queue = PyString::new(py, &self.queue).repr()?;
        Ok(format!("Reconnected(queue={queue}, pending={pending})"))
    }
}

fn to_py_event(py: Python<'_>, ev: ClientEvent) -> PyResult<Py<PyAny>> {
    Ok(match ev {
        ClientEvent::Event(e) => Py::new(py, PyEvent(e))?.into_any(),
        ClientEvent::Live { regions } => Py::new(py, PyLive { regions })?.into_any(),
        ClientEvent::Disconnected { error } => Py::new(py, PyDisconnected { error })?.into_any(),
        ClientEvent::Reconnected { queue, pending } => Py::new(
            py,
            PyReconnected {
                queue: queue.as_str().to_string(),
                pending,
            },
        )?
        .into_any(),
    })
}

// ---------------------------------------------------------------------------------------------
// Connection options shared by subscribers and publishers

struct Conn {
    servers: Vec<String>,
    ca_file: Option<PathBuf>,
    ca_pem: Option<Vec<u8>>,
    server_name: Option<String>,
    token: Option<String>,
    cert_file: Option<PathBuf>,
    key_file: Option<PathBuf>,
    failure_timeout_ms: Option<u64>,
    name: String,
}

/// `HOST:PORT` (an IP address, `[v6]:port`, or a name resolved now: its first address).
fn resolve(server: &str) -> Result<SocketAddr, ErrInfo> {
    if let Ok(a) = server.parse() {
        return Ok(a);
    }
    let Some((host, port)) = server.rsplit_once(':') else {
        return Err(ErrInfo::new(
            Kind::Value,
            format!("servers: {server:?} is not HOST:PORT"),
        ));
    };
    if host.is_empty() || port.parse::<u16>().is_err() {
        return Err(ErrInfo::new(
            Kind::Value,
            format!("servers: {server:?} is not HOST:PORT"),
        ));
    }
    match server.to_socket_addrs() {
        Ok(mut addrs) => addrs.next().ok_or_else(|| {
            ErrInfo::new(
                Kind::Connect,
                format!("cannot resolve server {server:?}: no address"),
            )
        }),
        Err(e) => Err(ErrInfo::new(
            Kind::Connect,
            format!("cannot resolve server {server:?}: {e}"),
        )),
    }
}

impl Conn {
    /// The builder for these options (resolves host names: call without the GIL).
    fn builder(&self) -> Result<ClientBuilder, ErrInfo> {
        if self.servers.is_empty() {
            return Err(ErrInfo::new(Kind::Value, "servers: the list is empty"));
        }
        let mut b = ClientBuilder::new().name(self.name.clone());
        for s in &self.servers {
            b = b.server(resolve(s)?);
        }
        // As the command line: certificates are checked against --server-name, else the host
        // of the first server when it is a name, else `localhost` (the dev certificates').
        let name = self.server_name.clone().or_else(|| {
            let first = &self.servers[0];
            let host = first.rsplit_once(':').map_or(first.as_str(), |(h, _)| h);
            let host = host.trim_start_matches('[').trim_end_matches(']');
            (host.parse::<IpAddr>().is_err()).then(|| host.to_string())
        });
        if let Some(n) = name {
            b = b.server_name(n);
        }
        if let Some(f) = &self.ca_file {
            b = b.ca_file(f.clone());
        }
        if let Some(p) = &self.ca_pem {
            b = b.ca_pem(p.clone());
        }
        if let Some(t) = &self.token {
            b = b.token(t.clone());
        }
        match (&self.cert_file, &self.key_file) {
            (Some(c), k) => b = b.identity(c.clone(), k.clone().unwrap_or_else(|| c.clone())),
            (None, Some(_)) => {
                return Err(ErrInfo::new(
                    Kind::Value,
                    "key_file: given without cert_file",
                ));
            }
            (None, None) => {}
        }
        if let Some(ms) = self.failure_timeout_ms {
            if !(300..=600_000).contains(&ms) {
                return Err(ErrInfo::new(
                    Kind::Value,
                    format!("failure_timeout_ms: {ms} is outside 300 to 600000"),
                ));
            }
            b = b.failure_timeout(Duration::from_millis(ms));
        }
        Ok(b)
    }
}

// ---------------------------------------------------------------------------------------------
// Subscriptions

enum Msg {
    Batch(Vec<ClientEvent>),
    /// The subscription ended by itself (with why), or ended quietly (None).
    End(Option<ErrInfo>),
}

struct CloseCmd {
    keepalive: bool,
    reply: oneshot::Sender<Result<(), ErrInfo>>,
}

/// Polls a future once; None if it is not ready (it is then dropped).
fn poll_once<F: Future>(f: F) -> Option<F::Output> {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => Some(v),
        Poll::Pending => None,
    }
}

/// Reads the subscription ahead, one batch at a time, until it ends or is closed.
async fn pump(
    mut sub: Subscription,
    tx: mpsc::Sender<Msg>,
    mut ctl: mpsc::Receiver<CloseCmd>,
    batch_max: usize,
    reconnect: bool,
) {
    loop {
        // Waiting for the first event of a batch is the one place a close interrupts (also a
        // reconnection in progress: the subscription is closed anyway).
        let first = tokio::select! {
            biased;
            cmd = ctl.recv() => return finish(sub, cmd).await,
            ev = sub.next() => ev,
        };
        let mut batch = Vec::new();
        let mut end = None;
        match first {
            None => end = Some(sub.ended().map(ErrInfo::from)),
            Some(ev) => batch.push(ev),
        }
        // Whatever else is ready now, without waiting. Not past a Disconnected: the next call
        // reconnects, which must run to its end.
        while end.is_none()
            && batch.len() < batch_max
            && !matches!(batch.last(), Some(ClientEvent::Disconnected { .. }))
        {
            match poll_once(sub.next()) {
                None => break,
                Some(None) => end = Some(sub.ended().map(ErrInfo::from)),
                Some(Some(ev)) => batch.push(ev),
            }
        }
        if !reconnect && let Some(ClientEvent::Disconnected { error }) = batch.last().cloned() {
            // Without reconnect, a lost connection ends the subscription (as the command line's
            // subscriber exits).
            batch.pop();
            end = Some(Some(ErrInfo::new(
                Kind::Closed,
                format!("the connection was lost: {error}"),
            )));
        }
        for msg in [
            (!batch.is_empty()).then_some(Msg::Batch(batch)),
            end.map(Msg::End),
        ]
        .into_iter()
        .flatten()
        {
            let ended = matches!(msg, Msg::End(_));
            tokio::select! {
                biased;
                cmd = ctl.recv() => return finish(sub, cmd).await,
                sent = tx.send(msg) => if sent.is_err() {
                    return; // The Python object is gone: dropping `sub` abandons the session.
                },
            }
            if ended {
                let cmd = ctl.recv().await;
                return finish(sub, cmd).await;
            }
        }
    }
}

async fn finish(sub: Subscription, cmd: Option<CloseCmd>) {
    match cmd {
        // The Python object was dropped without a close: abandon the session, as dropping a
        // Subscription does.
        None => drop(sub),
        Some(CloseCmd { keepalive, reply }) => {
            let r = sub.close(keepalive).await.map_err(ErrInfo::from);
            let _ = reply.send(r);
        }
    }
}

struct SubState {
    buf: VecDeque<ClientEvent>,
    /// Auto acks: the offsets of the events handed out last (one event, or one batch),
    /// processed once the application asks for more.
    last: Vec<u64>,
    /// The pump is done: Some(why) once it said so (or its channel closed).
    end: Option<Option<ErrInfo>>,
    /// The end was shown to the application (raised or StopIteration).
    end_reported: bool,
    closed: bool,
    queue: QueueStatus,
    pending: Option<u64>,
    reconnects: u64,
    initial: Option<Vec<(String, InitialEntry)>>,
}

/// A running subscription (see `tether.Subscriber`). Iterating it blocks, with the GIL
/// released, until an event comes.
#[pyclass(module = "tether._native", name = "Subscription", frozen)]
struct PySubscription {
    state: Mutex<SubState>,
    rx: tokio::sync::Mutex<mpsc::Receiver<Msg>>,
    ctl: Mutex<Option<mpsc::Sender<CloseCmd>>>,
    acker: Acker,
    auto_ack: bool,
    durable: bool,
}

/// What one look at the buffer found.
enum Step {
    Event(ClientEvent),
    Empty,
    /// The end, with the error to raise if it was not raised before.
    End(Option<ErrInfo>),
}

impl PySubscription {
    /// Hands out the next buffered event (acking those handed out before it in auto mode).
    fn step(&self) -> Step {
        let mut st = lock(&self.state);
        self.ack_handed_out(&mut st);
        self.step_locked(&mut st)
    }

    /// Auto mode: the events handed out before are processed (the application asked for more).
    fn ack_handed_out(&self, st: &mut SubState) {
        if self.auto_ack {
            for o in st.last.drain(..) {
                // An offset the queue no longer knows (it expired meanwhile) is simply dropped.
                let _ = self.acker.ack(o);
            }
        }
    }

    /// [`Self::step`] without the acks, under the caller's lock.
    fn step_locked(&self, st: &mut SubState) -> Step {
        if st.closed {
            st.end_reported = true;
            return Step::End(None);
        }
        match st.buf.pop_front() {
            Some(ev) => {
                match &ev {
                    ClientEvent::Event(e) if self.auto_ack => st.last.push(e.offset),
                    ClientEvent::Reconnected { queue, pending } => {
                        st.queue = *queue;
                        st.pending = *pending;
                        st.reconnects += 1;
                    }
                    _ => {}
                }
                Step::Event(ev)
            }
            None => match st.end.clone() {
                None => Step::Empty,
                Some(e) => {
                    let first = !st.end_reported;
                    st.end_reported = true;
                    Step::End(e.filter(|_| first))
                }
            },
        }
    }

    /// Waits (without the GIL) up to `timeout` for the pump's next batch; true if one came
    /// or the subscription ended.
    fn wait_batch(&self, timeout: Duration) -> bool {
        {
            let st = lock(&self.state);
            if !st.buf.is_empty() || st.end.is_some() || st.closed {
                return true;
            }
        }
        runtime().block_on(async {
            let deadline = tokio::time::Instant::now() + timeout;
            let Ok(mut rx) = tokio::time::timeout_at(deadline, self.rx.lock()).await else {
                return false;
            };
            // Another thread may have taken a batch while this one waited for the receiver.
            {
                let st = lock(&self.state);
                if !st.buf.is_empty() || st.end.is_some() {
                    return true;
                }
            }
            let msg = match tokio::time::timeout_at(deadline, rx.recv()).await {
                Err(_) => return false,
                Ok(m) => m,
            };
            let mut st = lock(&self.state);
            match msg {
                Some(Msg::Batch(b)) => st.buf.extend(b),
                Some(Msg::End(e)) => st.end = Some(e),
                None => {
                    st.end.get_or_insert(None);
                }
            }
            true
        })
    }

    /// The next event, waiting up to `timeout` (None: for ever); Ok(None) on a timeout or at
    /// a quiet end (`finished` tells which).
    fn next_event(&self, py: Python<'_>, timeout: Option<Duration>) -> PyResult<Option<Py<PyAny>>> {
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        loop {
            match self.step() {
                Step::Event(ev) => return to_py_event(py, ev).map(Some),
                Step::End(Some(e)) => return Err(e.to_py(py)),
                Step::End(None) => return Ok(None),
                Step::Empty => {}
            }
            let slice = match deadline {
                None => WAIT_SLICE,
                Some(d) => {
                    let left = d.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() {
                        return Ok(None);
                    }
                    left.min(WAIT_SLICE)
                }
            };
            py.detach(|| self.wait_batch(slice));
            py.check_signals()?;
        }
    }
}

#[pymethods]
impl PySubscription {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// The next event; blocks until there is one. Stops when the subscription was closed;
    /// raises TetherError when it ended by itself.
    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        self.next_event(py, None)
    }

    /// Up to `max_events` events at once (a list; at least one unless `timeout` seconds passed
    /// or the subscription is finished): the first waited for as `poll` does, then those
    /// already received, without waiting (an end after some events is left for the next
    /// call). Raises TetherError if the subscription ended by itself before any. Auto acks
    /// cover the whole batch once more is asked for.
    #[pyo3(signature = (max_events=256, timeout=None))]
    fn poll_batch(
        &self,
        py: Python<'_>,
        max_events: usize,
        timeout: Option<f64>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        if max_events == 0 {
            return Err(PyValueError::new_err("max_events must be at least 1"));
        }
        let timeout = timeout.map(secs).transpose()?;
        let Some(first) = self.next_event(py, timeout)? else {
            return Ok(Vec::new());
        };
        // Taken under the lock, made Python objects after it: creating them may run Python
        // code (a collection's finalizers) that calls back into this subscription.
        let rest = {
            let mut st = lock(&self.state);
            let mut rest = Vec::with_capacity(max_events.saturating_sub(1).min(st.buf.len()));
            while rest.len() + 1 < max_events && !st.buf.is_empty() {
                match self.step_locked(&mut st) {
                    Step::Event(ev) => rest.push(ev),
                    Step::Empty | Step::End(_) => break,
                }
            }
            rest
        };
        let mut out = Vec::with_capacity(rest.len() + 1);
        out.push(first);
        for ev in rest {
            out.push(to_py_event(py, ev)?);
        }
        Ok(out)
    }

    /// The next event, waiting at most `timeout` seconds (None: as long as it takes); None on
    /// a timeout, and once the subscription is finished.
    #[pyo3(signature = (timeout=None))]
    fn poll(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Py<PyAny>>> {
        let timeout = timeout.map(secs).transpose()?;
        self.next_event(py, timeout)
    }

    /// Waits (releasing the GIL) up to `timeout` seconds for events; true if some are ready
    /// (or the subscription ended). For asyncio: run it in a worker thread.
    fn wait(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let t = secs(timeout)?;
        Ok(py.detach(|| self.wait_batch(t)))
    }

    /// True once nothing more will come (ended or closed, and the buffer is empty).
    #[getter]
    fn finished(&self) -> bool {
        let st = lock(&self.state);
        st.closed || (st.buf.is_empty() && st.end.is_some())
    }

    #[getter]
    fn queue_status(&self) -> &'static str {
        lock(&self.state).queue.as_str()
    }

    #[getter]
    fn pending(&self) -> Option<u64> {
        lock(&self.state).pending
    }

    #[getter]
    fn reconnects(&self) -> u64 {
        lock(&self.state).reconnects
    }

    #[getter]
    fn durable(&self) -> bool {
        self.durable
    }

    /// The initial images of the first session's registrations, as (region, key, value)
    /// tuples, once (later calls return an empty list).
    fn take_initial<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let initial = lock(&self.state).initial.take().unwrap_or_default();
        let items = initial
            .into_iter()
            .map(|(region, e)| {
                let value = e.value.as_deref().map(|v| PyBytes::new(py, v));
                (region, e.key, value).into_pyobject(py)
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }

    /// Manual acks: the application processed the event at `offset`; returns the offset
    /// everything is processed through.
    fn ack(&self, py: Python<'_>, offset: u64) -> PyResult<u64> {
        if self.auto_ack {
            return Err(UsageError::new_err(
                "acks are automatic in this subscriber's ack mode (use ack_mode=\"manual\")",
            ));
        }
        self.acker
            .ack(offset)
            .map_err(|e| ErrInfo::from(e).to_py(py))
    }

    /// Auto acks: the events handed out last (one, or a batch) count as processed now.
    fn commit(&self) {
        self.ack_handed_out(&mut lock(&self.state));
    }

    /// Ends the subscription (see `tether.Subscriber.close`). Closing twice does nothing.
    #[pyo3(signature = (keepalive=true))]
    fn close(&self, py: Python<'_>, keepalive: bool) -> PyResult<()> {
        self.commit();
        let Some(ctl) = lock(&self.ctl).take() else {
            return Ok(());
        };
        let reported = {
            let mut st = lock(&self.state);
            st.closed = true;
            st.buf.clear();
            st.end_reported
        };
        let result = py.detach(|| {
            runtime().block_on(async move {
                let (reply, rx) = oneshot::channel();
                if ctl.send(CloseCmd { keepalive, reply }).await.is_err() {
                    return Ok(()); // The pump is gone already.
                }
                rx.await.unwrap_or(Ok(()))
            })
        });
        match result {
            // An end already raised to the application is not raised again.
            Err(_) if reported => Ok(()),
            Err(e) => Err(e.to_py(py)),
            Ok(()) => Ok(()),
        }
    }
}

fn secs(s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| PyValueError::new_err(format!("timeout: {s} is not a number of seconds ≥ 0")))
}

/// An interest as the Python side passes it: (region, kind, specs, durable, policy,
/// receive_values).
type WireInterest = (String, String, Vec<String>, Option<bool>, String, bool);

fn parse_interest(
    (region, kind, specs, durable, policy, receive_values): WireInterest,
) -> Result<(String, Interest), ErrInfo> {
    let one = |what: &str| -> Result<String, ErrInfo> {
        match specs.as_slice() {
            [s] => Ok(s.clone()),
            _ => Err(ErrInfo::new(
                Kind::Value,
                format!("interests: a {what} interest takes exactly one {what}"),
            )),
        }
    };
    let spec = match kind.as_str() {
        "key" => InterestSpec::Key(one("key")?),
        "keys" => InterestSpec::Keys(specs.clone()),
        "regex" => InterestSpec::Regex(one("regex")?),
        "all-keys" => InterestSpec::AllKeys,
        other => {
            return Err(ErrInfo::new(
                Kind::Value,
                format!("interests: unknown interest kind {other:?}"),
            ));
        }
    };
    let policy: ResultPolicy =
        policy
            .parse()
            .map_err(|e: tether_client::protocol::UnknownResultPolicy| {
                ErrInfo::new(Kind::Value, format!("policy: {e}"))
            })?;
    let mut interest = Interest::key("")
        .policy(policy)
        .receive_values(receive_values);
    interest.spec = spec;
    if let Some(d) = durable {
        interest = interest.durable(d);
    }
    Ok((region, interest))
}

/// Connects, registers `interests`, says ready and starts reading (see `tether.Subscriber`).
#[pyfunction]
#[pyo3(signature = (
    servers, *, interests, ca_file=None, ca_pem=None, durable_id=None, timeout_secs=300,
    redundancy=0, reconnect=true, reconnect_max_secs=600.0, reconnect_delay_initial_ms=100,
    reconnect_delay_max_ms=5000, reconnect_attempt_timeout_ms=2000, ack_mode="auto",
    checkpoint=None, server_name=None, token=None, cert_file=None, key_file=None,
    failure_timeout_ms=None, ack_interval_ms=100, name=String::from("tether-python"), batch_size=BATCH_MAX_DEFAULT,
    replay_rate=0
))]
#[allow(clippy::too_many_arguments)]
fn subscribe(
    py: Python<'_>,
    servers: Vec<String>,
    interests: Vec<WireInterest>,
    ca_file: Option<PathBuf>,
    ca_pem: Option<&[u8]>,
    durable_id: Option<String>,
    timeout_secs: u64,
    redundancy: u8,
    reconnect: bool,
    reconnect_max_secs: f64,
    reconnect_delay_initial_ms: u64,
    reconnect_delay_max_ms: u64,
    reconnect_attempt_timeout_ms: u64,
    ack_mode: &str,
    checkpoint: Option<u64>,
    server_name: Option<String>,
    token: Option<String>,
    cert_file: Option<PathBuf>,
    key_file: Option<PathBuf>,
    failure_timeout_ms: Option<u64>,
    ack_interval_ms: u64,
    name: String,
    batch_size: usize,
    replay_rate: u64,
) -> PyResult<PySubscription> {
    let auto_ack = match ack_mode {
        "auto" => true,
        "manual" => false,
        other => {
            return Err(PyValueError::new_err(format!(
                "ack_mode: expected \"auto\" or \"manual\", got {other:?}"
            )));
        }
    };
    if batch_size == 0 {
        return Err(PyValueError::new_err("batch_size: must be at least 1"));
    }
    if reconnect_max_secs < 0.0 || !reconnect_max_secs.is_finite() {
        return Err(PyValueError::new_err(format!(
            "reconnect_max_secs: {reconnect_max_secs} is not a number of seconds ≥ 0"
        )));
    }
    let conn = Conn {
        servers,
        ca_file,
        ca_pem: ca_pem.map(<[u8]>::to_vec),
        server_name,
        token,
        cert_file,
        key_file,
        failure_timeout_ms,
        name,
    };
    let durable = durable_id.is_some();
    let result = py.detach(move || -> Result<_, ErrInfo> {
        let interests = interests
            .into_iter()
            .map(parse_interest)
            .collect::<Result<Vec<_>, _>>()?;
        let mut b = conn
            .builder()?
            .redundancy(redundancy)
            .ack_interval(Duration::from_millis(ack_interval_ms))
            .replay_rate(replay_rate)
            // Always manual underneath: the pump reads ahead (see the module docs).
            .ack_mode(AckMode::Manual)
            .reconnect(ReconnectPolicy {
                delay_initial: Duration::from_millis(reconnect_delay_initial_ms),
                delay_max: Duration::from_millis(reconnect_delay_max_ms),
                attempt_timeout: Duration::from_millis(reconnect_attempt_timeout_ms),
                give_up_after: (reconnect_max_secs > 0.0)
                    .then(|| Duration::from_secs_f64(reconnect_max_secs)),
            });
        if let Some(id) = durable_id {
            b = b.durable(id, timeout_secs);
        }
        if let Some(c) = checkpoint {
            b = b.checkpoint(c);
        }
        runtime().block_on(async move {
            let mut sub = b.subscribe(interests).await?;
            let (queue, pending) = sub
                .client()
                .map(|c| (c.queue_status(), c.pending()))
                .unwrap_or((QueueStatus::None, None));
            let initial = sub.take_initial();
            let acker = sub.acker()?;
            let (tx, rx) = mpsc::channel(BATCHES_AHEAD);
            let (ctl_tx, ctl_rx) = mpsc::channel(1);
            tokio::spawn(pump(sub, tx, ctl_rx, batch_size, reconnect));
            Ok(PySubscription {
                state: Mutex::new(SubState {
                    buf: VecDeque::new(),
                    last: Vec::new(),
                    end: None,
                    end_reported: false,
                    closed: false,
                    queue,
                    pending,
                    reconnects: 0,
                    initial: Some(initial),
                }),
                rx: tokio::sync::Mutex::new(rx),
                ctl: Mutex::new(Some(ctl_tx)),
                acker,
                auto_ack,
                durable,
            })
        })
    });
    result.map_err(|e| e.to_py(py))
}

// ---------------------------------------------------------------------------------------------
// Publisher

/// A plain (non-durable) client for publishing and reading values (see `tether.Publisher`).
/// It moves to another of its servers when its own stops (the Rust `Publisher`).
#[pyclass(module = "tether._native", name = "Publisher", frozen)]
struct PyPublisher {
    publisher: tether_client::Publisher,
}

impl PyPublisher {
    /// Runs `f` without the GIL.
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        f: impl AsyncFnOnce(&tether_client::Publisher) -> Result<T, ClientError> + Send,
    ) -> PyResult<T> {
        let r = py.detach(|| {
            runtime().block_on(async {
                f(&self.publisher).await.map_err(|e| match e {
                    ClientError::Closed => ErrInfo::new(Kind::Closed, "the publisher is closed"),
                    e => ErrInfo::from(e),
                })
            })
        });
        r.map_err(|e| e.to_py(py))
    }

    /// Runs `f` on the connected client without the GIL.
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl AsyncFnOnce(&Client) -> Result<T, ClientError> + Send,
    ) -> PyResult<T> {
        self.run(py, async move |p| p.with_client(f).await)
    }
}

fn value_bytes(value: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    match value.cast::<PyBytes>() {
        Ok(b) => Ok(b.as_bytes().to_vec()),
        Err(_) => Err(PyTypeError::new_err(format!(
            "value: expected bytes, got {}",
            value.get_type().name()?
        ))),
    }
}

#[pymethods]
impl PyPublisher {
    /// Publishes a batch of operations, each a tuple (op, region, key[, value]) with op
    /// `"put"` (value: bytes), `"destroy"` or `"invalidate"`; returns how many the server
    /// committed.
    #[pyo3(signature = (ops, ack="local"))]
    fn publish(&self, py: Python<'_>, ops: &Bound<'_, PyAny>, ack: &str) -> PyResult<u64> {
        let ack = match ack {
            "local" => PublishAck::Local,
            "replicated" => PublishAck::Replicated,
            other => {
                return Err(PyValueError::new_err(format!(
                    "ack: expected \"local\" or \"replicated\", got {other:?}"
                )));
            }
        };
        let mut list = Vec::new();
        for (i, op) in ops.try_iter()?.enumerate() {
            let op = op?;
            let t = op.cast::<PyTuple>().map_err(|_| {
                PyTypeError::new_err(format!(
                    "ops[{i}]: expected a tuple (op, region, key[, value])"
                ))
            })?;
            let kind: String = t.get_item(0)?.extract()?;
            let region: String = t.get_item(1)?.extract()?;
            let key: String = t.get_item(2)?.extract()?;
            list.push(match (kind.as_str(), t.len()) {
                ("put", 4) => PublishOp::Put {
                    region,
                    key,
                    value: value_bytes(&t.get_item(3)?)?,
                },
                ("destroy", 3) => PublishOp::Destroy { region, key },
                ("invalidate", 3) => PublishOp::Invalidate { region, key },
                _ => {
                    return Err(PyValueError::new_err(format!(
                        "ops[{i}]: expected (\"put\", region, key, value), (\"destroy\", region, \
                         key) or (\"invalidate\", region, key)"
                    )));
                }
            });
        }
        self.run(py, async move |p| p.publish_with(list, ack).await)
    }

    /// The current value of a key; None when absent or invalidated.
    fn get<'py>(
        &self,
        py: Python<'py>,
        region: String,
        key: String,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let v = self.with(py, async move |c| c.region(region).get(key).await)?;
        Ok(v.map(|v| PyBytes::new(py, &v)))
    }

    /// Admin: destroys an away durable client's queue.
    fn close_durable(&self, py: Python<'_>, durable_id: String) -> PyResult<()> {
        self.with(py, async move |c| c.close_durable(&durable_id).await)
    }

    #[getter]
    fn server(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, async |c| Ok(c.server_addr().to_string()))
    }

    /// How many times the publisher moved to another server.
    #[getter]
    fn moves(&self) -> u64 {
        self.publisher.moves()
    }

    /// Closes the connection. Closing twice does nothing.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, async |p| p.close().await)
    }
}

/// Connects a publisher (see `tether.Publisher`).
#[pyfunction]
#[pyo3(signature = (
    servers, *, ca_file=None, ca_pem=None, server_name=None, token=None, cert_file=None,
    key_file=None, failure_timeout_ms=None, name=String::from("tether-python")
))]
#[allow(clippy::too_many_arguments)]
fn connect_publisher(
    py: Python<'_>,
    servers: Vec<String>,
    ca_file: Option<PathBuf>,
    ca_pem: Option<&[u8]>,
    server_name: Option<String>,
    token: Option<String>,
    cert_file: Option<PathBuf>,
    key_file: Option<PathBuf>,
    failure_timeout_ms: Option<u64>,
    name: String,
) -> PyResult<PyPublisher> {
    let conn = Conn {
        servers,
        ca_file,
        ca_pem: ca_pem.map(<[u8]>::to_vec),
        server_name,
        token,
        cert_file,
        key_file,
        failure_timeout_ms,
        name,
    };
    let r = py.detach(move || -> Result<_, ErrInfo> {
        let b = conn.builder()?;
        let publisher = runtime().block_on(b.publisher())?;
        Ok(PyPublisher { publisher })
    });
    r.map_err(|e| e.to_py(py))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_function(wrap_pyfunction!(subscribe, m)?)?;
    m.add_function(wrap_pyfunction!(connect_publisher, m)?)?;
    m.add_class::<PySubscription>()?;
    m.add_class::<PyPublisher>()?;
    m.add_class::<PyEvent>()?;
    m.add_class::<PyLive>()?;
    m.add_class::<PyDisconnected>()?;
    m.add_class::<PyReconnected>()?;
    m.add("TetherError", py.get_type::<TetherError>())?;
    m.add("ConnectError", py.get_type::<ConnectError>())?;
    m.add("ServerError", py.get_type::<ServerError>())?;
    m.add("TlsError", py.get_type::<TlsError>())?;
    m.add("ProtocolError", py.get_type::<ProtocolError>())?;
    m.add("ClosedError", py.get_type::<ClosedError>())?;
    m.add("UsageError", py.get_type::<UsageError>())?;
    Ok(())
}
