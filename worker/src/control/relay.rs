//! The host's heartbeat relay: the ranks of one host send the coordinator one heartbeat call
//! per interval between them, not one each.
//!
//! The first worker of a job on a host to find no relay becomes it: it binds an abstract Unix
//! socket named after the job, the host, the coordinator endpoints and the user, and serves it
//! for as long as its group lives. Every worker of the job on the host, the relay's own
//! included, sends each heartbeat over that socket and waits for its answer. Twice per
//! heartbeat interval ([`FLUSHES_PER_INTERVAL`]) the relay sends the beats it holds in one
//! `HostHeartbeat` call and hands each worker the coordinator's answer to its own beat: a host
//! of eight ranks makes two calls where it made eight, and the coordinator's per-call cost
//! (gRPC, HTTP/2, the kernel's TCP) is paid once per call, not per rank. (One flush per interval
//! would halve the calls again, but a beat could then wait a whole interval in the relay, and
//! a member's silence as the coordinator sees it must stay under two intervals: that is how
//! it tells a live member from a lost one.)
//!
//! Nothing depends on the relay being there, and a worker judges the relay by whether it is
//! alive, not by how fast the coordinator answers. The relay acknowledges each beat as it reads
//! it (an empty frame), then writes the coordinator's answer after the flush. A worker sends a
//! beat itself when the relay does not acknowledge it within three quarters of an interval
//! (the relay died or hung), does not answer it within [`relay_answer_budget`] of the
//! acknowledgement (it stopped since), or answers with its own failure to reach the
//! coordinator; it then sends its own beats for [`DIRECT_AFTER_FAILURE`] intervals, tries the
//! socket again, and becomes the relay when no one serves it. A coordinator that answers
//! slowly, but within an interval and the heartbeat timeout, is waited for: a worker that left
//! its relay for a slow answer would multiply the slow coordinator's calls by the ranks of a
//! host just when it is slowest. A relay that dies frees the name with its process (an
//! abstract socket has no file to clean up). A coordinator without `HostHeartbeat` makes every
//! worker send its own beats for good.
//!
//! Abstract sockets live in the network namespace: on Kubernetes the ranks of one pod share a
//! relay, pods do not. The relay answers only processes of its own user (`SO_PEERCRED`), a
//! worker uses only a relay run by its own user (anyone can bind the name first), and the relay
//! forwards only its job's beats: the coordinator judges each beat as if the member had sent
//! it, against the member's incarnation.
//!
//! The sockets are behind [`RelayNet`] (`relay_net.rs`): production's abstract sockets, or
//! the simulation's in-memory ones, under which the same failover and bypass paths run.
//!
//! The frames on the socket are [`RELAY_PROTOCOL`]'s, and the socket's name carries that version:
//! workers of a build that speaks another version (during a rolling upgrade) serve and use a
//! relay of their own rather than misreading each other's frames.

use super::relay_net::{RelayListener, RelayNet, RelayStream};
use super::{ControlClient, ControlError};
use cohort_proto::ids::JobId;
use cohort_proto::v1::{self as pb, HeartbeatRequest, HeartbeatResponse};
use prost::Message;
use sha2::{Digest, Sha256};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, info, warn};

/// Intervals a worker sends its own beats after the relay failed it, before it tries the
/// relay again.
pub const DIRECT_AFTER_FAILURE: u32 = 10;

/// How many times per heartbeat interval the relay sends the beats it holds.
pub const FLUSHES_PER_INTERVAL: u32 = 2;

/// The shortest lease, in heartbeat intervals, that a relay is used with.
pub const MIN_LEASE_INTERVALS: u32 = 4;

/// The version of the frames on the relay's socket, digested into its name:
/// 1 answered each beat once; 2 acknowledges each beat with an empty frame first.
pub const RELAY_PROTOCOL: u32 = 2;

/// Largest frame either side accepts: a beat with every peer's wait is far smaller.
const MAX_FRAME: usize = 1 << 20;

/// Most workers one relay serves at once; more connections are closed at once (those workers
/// send their own beats).
const MAX_CONNECTIONS: usize = cohort_proto::MAX_BEATS_PER_CALL;

/// One worker's way to the coordinator for its heartbeats: through the host's relay when there
/// is one (becoming it when there is none), else directly. Cheap to clone; the relay this
/// process serves, if any, stops when the last clone is dropped.
#[derive(Clone)]
pub struct HostRelay {
    inner: Arc<Inner>,
}

struct Inner {
    client: ControlClient,
    job: JobId,
    interval: Duration,
    /// How long a beat waits for the relay to acknowledge it.
    ack_wait: Duration,
    /// How long an acknowledged beat waits for its answer ([`relay_answer_budget`]).
    answer_wait: Duration,
    /// Where the relay's socket is bound and connected to.
    net: Arc<dyn RelayNet>,
    /// The socket's name.
    name: String,
    path: tokio::sync::Mutex<Path>,
    /// The relay this process serves.
    serving: StdMutex<Option<JoinHandle<()>>>,
    /// Times this worker gave the relay up and sent its beats directly.
    bypasses: AtomicU64,
}

/// The state of one worker's path through the relay.
#[derive(Default)]
struct Path {
    conn: Option<RelayStream>,
    /// Until when beats go directly (after a relay failure).
    direct_until: Option<Instant>,
    /// A beat was written and its answer not read (a call was cancelled): the connection's
    /// next frame would be that answer, so it is not used again.
    in_flight: bool,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(task) = self.serving.lock().unwrap_or_else(|e| e.into_inner()).take() {
            task.abort();
        }
    }
}

/// Why a beat did not go through the relay.
#[derive(Debug, thiserror::Error)]
enum RelayFailure {
    #[error("the relay closed the connection")]
    Closed,
    #[error("relay socket: {0}")]
    Io(#[from] io::Error),
    #[error("the relay did not acknowledge the beat within {0:?}")]
    Unacknowledged(Duration),
    #[error("the relay acknowledged the beat but did not answer it within {0:?}")]
    Unanswered(Duration),
    #[error("the relay's answer is malformed: {0}")]
    Malformed(String),
    #[error("the relay could not reach the coordinator: {0}")]
    Upstream(String),
    #[error("the coordinator has no HostHeartbeat")]
    Unsupported,
}

impl HostRelay {
    /// The relay path of `job`'s worker on `host` (the relay's scope: the workers that share
    /// it, [`crate::elastic::ElasticConfig::relay_scope`]), heartbeating every `interval` through
    /// `client`, its socket bound and connected in `net` ([`super::AbstractUnix`] in
    /// production), or `None` when the lease is too short for a relay's delay: a beat through the
    /// relay waits for its next flush (up to half an interval), and one the relay does not
    /// acknowledge waits three quarters of an interval before it goes directly, so the relay is used only
    /// when the lease lasts [`MIN_LEASE_INTERVALS`] intervals or more (the default 3 s lease and
    /// 500 ms interval give six). Nothing is bound or connected until the first beat.
    pub fn new(
        client: ControlClient,
        job: &JobId,
        host: &str,
        interval: Duration,
        lease_ttl: Duration,
        net: Arc<dyn RelayNet>,
    ) -> Option<Self> {
        if lease_ttl < interval * MIN_LEASE_INTERVALS {
            debug!(%job, ?interval, ?lease_ttl, "lease too short for the heartbeat relay; heartbeats go directly");
            return None;
        }
        let name = socket_name("cohort-heartbeat-relay", RELAY_PROTOCOL, &client.config().endpoints, job, host);
        // A beat goes directly when the relay has not acknowledged it within half an interval
        // and a quarter more (or the heartbeat timeout, if shorter): a live relay acknowledges
        // at once, and a dead or stopped one then costs what it cost before acknowledgements,
        // beats 1.75 intervals and a direct call apart at worst, under the two intervals of
        // silence after which the coordinator takes a member for lost.
        let flush = interval / FLUSHES_PER_INTERVAL;
        let ack_wait = flush + client.config().heartbeat_timeout.min(interval / 4);
        let answer_wait = relay_answer_budget(interval, client.config());
        Some(Self {
            inner: Arc::new(Inner {
                client,
                job: job.clone(),
                interval,
                ack_wait,
                answer_wait,
                net,
                name,
                path: tokio::sync::Mutex::new(Path::default()),
                serving: StdMutex::new(None),
                bypasses: AtomicU64::new(0),
            }),
        })
    }

    /// The relay's socket name (in production, an abstract name without the leading NUL).
    pub fn socket_name(&self) -> &str {
        &self.inner.name
    }

    /// The heartbeat interval the relay flushes at.
    pub fn interval(&self) -> Duration {
        self.inner.interval
    }

    /// Whether this process serves the host's relay.
    pub fn is_serving(&self) -> bool {
        self.inner.serving.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|t| !t.is_finished())
    }

    /// How many times this worker gave the relay up (it did not acknowledge or answer a beat,
    /// or could not reach the coordinator) and sent its beats directly for a while.
    pub fn bypasses(&self) -> u64 {
        self.inner.bypasses.load(Ordering::Relaxed)
    }

    /// Sends one heartbeat, through the relay when it answers in time, else directly, and
    /// returns the coordinator's answer to it.
    ///
    /// # Cancel safety
    /// Cancel safe: a heartbeat is idempotent, and a beat cut short leaves its connection
    /// unused again (the next beat opens another).
    pub async fn heartbeat(&self, request: HeartbeatRequest) -> Result<HeartbeatResponse, ControlError> {
        let inner = &self.inner;
        let mut path = inner.path.lock().await;
        if path.in_flight {
            path.conn = None;
            path.in_flight = false;
        }
        if path.direct_until.is_some_and(|until| Instant::now() < until) {
            drop(path);
            return inner.client.heartbeat(request).await;
        }
        let mut outcome = self.through_relay(&mut path, &request).await;
        if matches!(&outcome, Err(RelayFailure::Closed)) {
            // The relay's process ended (or dropped its group): the name is free, so this
            // worker finds the next relay or becomes it at once.
            path.conn = None;
            path.in_flight = false;
            outcome = self.through_relay(&mut path, &request).await;
        }
        match outcome {
            Ok(answer) => return answer,
            Err(failure) => {
                path.conn = None;
                path.in_flight = false;
                let retry_in = match failure {
                    // An old coordinator: never again in this process's life (an hour).
                    RelayFailure::Unsupported => Duration::from_secs(3600),
                    _ => inner.interval * DIRECT_AFTER_FAILURE,
                };
                warn!(job = %inner.job, relay = %inner.name, error = %failure, ?retry_in,
                      "heartbeat relay failed; sending heartbeats directly");
                path.direct_until = Some(Instant::now() + retry_in);
                inner.bypasses.fetch_add(1, Ordering::Relaxed);
            }
        }
        drop(path);
        inner.client.heartbeat(request).await
    }

    async fn through_relay(
        &self,
        path: &mut Path,
        request: &HeartbeatRequest,
    ) -> Result<Result<HeartbeatResponse, ControlError>, RelayFailure> {
        let inner = &self.inner;
        if path.conn.is_none() {
            path.conn = Some(self.connect_or_serve()?);
        }
        let conn = path.conn.as_mut().expect("connected above");
        #[cfg(feature = "test-support")]
        let (ack_wait, answer_wait) = if planted::never_bypassed() {
            (Duration::from_secs(3600), Duration::from_secs(3600))
        } else {
            (inner.ack_wait, inner.answer_wait)
        };
        #[cfg(not(feature = "test-support"))]
        let (ack_wait, answer_wait) = (inner.ack_wait, inner.answer_wait);
        let closed = |e: io::Error| match e.kind() {
            io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset => RelayFailure::Closed,
            _ => RelayFailure::Io(e),
        };
        path.in_flight = true;
        let first = tokio::time::timeout(ack_wait, async {
            write_frame(conn, &request.encode_to_vec()).await?;
            read_frame(conn).await
        })
        .await
        .map_err(|_| RelayFailure::Unacknowledged(ack_wait))?
        .map_err(closed)?
        .ok_or(RelayFailure::Closed)?;
        // The acknowledgement (an empty frame; an answer never is): the relay is alive and
        // holds the beat, so its answer is waited for as long as its own call may take. A
        // refusal of a frame the relay would not forward comes without one.
        let answer = if first.is_empty() {
            tokio::time::timeout(answer_wait, read_frame(conn))
                .await
                .map_err(|_| RelayFailure::Unanswered(answer_wait))?
                .map_err(closed)?
                .ok_or(RelayFailure::Closed)?
        } else {
            first
        };
        path.in_flight = false;
        let answer =
            pb::HeartbeatAnswer::decode(answer.as_slice()).map_err(|e| RelayFailure::Malformed(e.to_string()))?;
        match answer.outcome {
            Some(pb::heartbeat_answer::Outcome::Ok(response)) => Ok(Ok(response)),
            Some(pb::heartbeat_answer::Outcome::Refused(r)) => match tonic::Code::from(r.code) {
                tonic::Code::Unimplemented => Err(RelayFailure::Unsupported),
                // The relay's own trouble reaching the coordinator: this worker tries itself.
                tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Internal => {
                    Err(RelayFailure::Upstream(r.message))
                }
                code => Ok(Err(ControlError::Rejected { rpc: "Heartbeat", code, message: r.message })),
            },
            None => Err(RelayFailure::Malformed("an answer with no outcome".into())),
        }
    }

    /// Connects to the host's relay, or binds its name and serves it when no one does.
    fn connect_or_serve(&self) -> io::Result<RelayStream> {
        let inner = &self.inner;
        match inner.net.connect(&inner.name) {
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {}
            other => return other,
        }
        match inner.net.bind(&inner.name) {
            Ok(listener) => {
                info!(job = %inner.job, relay = %inner.name, "serving the host's heartbeat relay");
                let task = tokio::spawn(serve(listener, inner.client.clone(), inner.job.clone(), inner.interval));
                if let Some(old) = inner.serving.lock().unwrap_or_else(|e| e.into_inner()).replace(task) {
                    old.abort();
                }
            }
            // Another worker bound it first: use theirs.
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => {}
            Err(e) => return Err(e),
        }
        inner.net.connect(&inner.name)
    }
}

/// A host relay's socket name, `kind/<digest>`: one per kind, job, scope (the failure domain,
/// else the host), coordinator deployment (its endpoints in any order) and user.
/// The name digests the relay's frame `version` too, so that builds speaking different frames
/// never share a relay.
pub(super) fn socket_name(kind: &str, version: u32, endpoints: &[String], job: &JobId, host: &str) -> String {
    let mut endpoints: Vec<&str> = endpoints.iter().map(String::as_str).collect();
    endpoints.sort_unstable();
    endpoints.dedup();
    let mut digest = Sha256::new();
    // Version 1's names digested no version: they stay as they were.
    if version > 1 {
        digest.update(b"version");
        digest.update(version.to_le_bytes());
    }
    for part in endpoints.into_iter().chain([job.as_str(), host]) {
        digest.update((part.len() as u64).to_le_bytes());
        digest.update(part.as_bytes());
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    digest.update(unsafe { libc::geteuid() }.to_le_bytes());
    let hex: String = digest.finalize()[..12].iter().map(|b| format!("{b:02x}")).collect();
    format!("{kind}/{hex}")
}

/// Writes one frame: the body's length (u32, little-endian), then the body.
async fn write_frame(conn: &mut (impl AsyncWrite + Unpin), body: &[u8]) -> io::Result<()> {
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    conn.write_all(&frame).await
}

/// One frame, or `None` at a clean end of stream between frames.
pub(super) async fn read_frame(conn: &mut (impl AsyncRead + Unpin)) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    match conn.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a {len}-byte frame (at most {MAX_FRAME})")));
    }
    let mut body = vec![0u8; len];
    conn.read_exact(&mut body).await?;
    Ok(Some(body))
}

/// How long a worker waits for the answer to a beat its relay acknowledged: the wait for the
/// relay's next flush, the relay's bound on its `HostHeartbeat` call (the heartbeat timeout, at
/// most the request timeout and one interval), and a
/// quarter of an interval for the answer to come back. The relay answers its own failure to
/// reach the coordinator within this, so the worker hears why; the bound itself covers a relay
/// that stops after acknowledging.
pub fn relay_answer_budget(interval: Duration, config: &super::ControlConfig) -> Duration {
    interval / FLUSHES_PER_INTERVAL + upstream_bound(interval, config) + interval / 4
}

/// The relay's bound on one flush's `HostHeartbeat` call, retries included: the bound on one
/// direct heartbeat call (the heartbeat timeout, at most the request timeout), and at most one
/// interval, so that a relay that stops after acknowledging a beat costs its worker less than
/// its lease. A coordinator slower than that is answered as DEADLINE_EXCEEDED, and the relay's
/// workers go directly.
fn upstream_bound(interval: Duration, config: &super::ControlConfig) -> Duration {
    config.heartbeat_timeout.min(config.request_timeout).min(interval)
}

/// A beat waiting for the next flush, and where its answer goes.
type Pending = (HeartbeatRequest, oneshot::Sender<pb::HeartbeatAnswer>);

/// Serves the relay: accepts the host's workers, gathers their beats, and
/// [`FLUSHES_PER_INTERVAL`] times per `interval` sends the gathered beats in `HostHeartbeat`
/// calls.
///
/// # Cancel safety
/// Aborting it closes the socket; the workers then send their own beats, and one of them
/// serves the relay next.
async fn serve(mut listener: Box<dyn RelayListener>, client: ControlClient, job: JobId, interval: Duration) {
    let (beats_tx, mut beats_rx) = mpsc::channel::<Pending>(MAX_CONNECTIONS);
    let mut connections = tokio::task::JoinSet::new();
    let mut flushes = tokio::task::JoinSet::new();
    let mut pending: Vec<Pending> = Vec::new();
    let mut ticker = tokio::time::interval(interval / FLUSHES_PER_INTERVAL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            stream = listener.accept() => {
                if connections.len() >= MAX_CONNECTIONS {
                    debug!(job = %job, "heartbeat relay full; the worker sends its own beats");
                    continue;
                }
                connections.spawn(serve_connection(stream, beats_tx.clone(), job.clone()));
            }
            Some(beat) = beats_rx.recv() => pending.push(beat),
            _ = ticker.tick() => {
                if !pending.is_empty() {
                    flushes.spawn(flush(client.clone(), job.clone(), interval, std::mem::take(&mut pending)));
                }
            }
            Some(_) = connections.join_next() => {}
            Some(_) = flushes.join_next() => {}
        }
    }
}

/// One worker's connection: reads its beats, acknowledges each (an empty frame) and queues it
/// for the next flush, writes back its answer. A malformed beat is answered with
/// INVALID_ARGUMENT, without an acknowledgement, and the connection goes on.
async fn serve_connection(mut stream: RelayStream, beats: mpsc::Sender<Pending>, job: JobId) {
    while let Ok(Some(frame)) = read_frame(&mut stream).await {
        let refuse = |message: String| pb::HeartbeatAnswer {
            outcome: Some(pb::heartbeat_answer::Outcome::Refused(pb::HeartbeatRefusal {
                code: tonic::Code::InvalidArgument as i32,
                message,
            })),
        };
        let answer = match HeartbeatRequest::decode(frame.as_slice()) {
            Err(e) => refuse(format!("malformed heartbeat: {e}")),
            Ok(beat) if beat.job != job.as_str() => {
                refuse(format!("this host's heartbeat relay serves job {:?}, not {:?}", job.as_str(), beat.job))
            }
            Ok(beat) => {
                if write_frame(&mut stream, &[]).await.is_err() {
                    return;
                }
                let (tx, rx) = oneshot::channel();
                if beats.send((beat, tx)).await.is_err() {
                    return;
                }
                match rx.await {
                    Ok(answer) => answer,
                    Err(_) => return,
                }
            }
        };
        if write_frame(&mut stream, &answer.encode_to_vec()).await.is_err() {
            return;
        }
    }
}

/// Sends the gathered beats (in calls of at most `MAX_BEATS_PER_CALL`, each within
/// [`upstream_bound`]) and hands out the answers; a failed call answers each of its beats with
/// the failure (a call out of time: DEADLINE_EXCEEDED).
async fn flush(client: ControlClient, job: JobId, interval: Duration, pending: Vec<Pending>) {
    let bound = upstream_bound(interval, client.config());
    let mut pending = pending.into_iter().peekable();
    while pending.peek().is_some() {
        let (beats, waiting): (Vec<_>, Vec<_>) = pending.by_ref().take(cohort_proto::MAX_BEATS_PER_CALL).unzip();
        let count = beats.len();
        let call = client.host_heartbeat(pb::HostHeartbeatRequest { job: job.to_string(), beats });
        let answers = match tokio::time::timeout(bound, call).await {
            Ok(Ok(r)) if r.answers.len() == count => r.answers,
            Ok(Ok(r)) => {
                vec![refusal(tonic::Code::Internal, format!("{} answers to {count} beats", r.answers.len())); count]
            }
            Ok(Err(e)) => vec![refusal(e.code().unwrap_or(tonic::Code::Unavailable), e.to_string()); count],
            Err(_) => {
                let message = format!("the coordinator did not answer the host's beats within {bound:?}");
                vec![refusal(tonic::Code::DeadlineExceeded, message); count]
            }
        };
        for (answer, to) in answers.into_iter().zip(waiting) {
            let _ = to.send(answer);
        }
    }
}

fn refusal(code: tonic::Code, message: String) -> pb::HeartbeatAnswer {
    pb::HeartbeatAnswer {
        outcome: Some(pb::heartbeat_answer::Outcome::Refused(pb::HeartbeatRefusal { code: code as i32, message })),
    }
}

/// Bugs a test plants on purpose, to show that the deterministic simulation catches them
/// (`test-support` only). Per thread: the simulation runs every worker on one.
#[cfg(feature = "test-support")]
pub mod planted {
    use std::cell::Cell;

    thread_local! {
        static NEVER_BYPASSED: Cell<bool> = const { Cell::new(false) };
    }

    /// Plants (or removes) a bug in the heartbeat relay's path on this thread: a beat waits
    /// for the relay's answer for an hour, not the next flush and a quarter of an interval,
    /// so a worker whose relay hangs never sends its beats itself.
    pub fn set_never_bypassed(on: bool) {
        NEVER_BYPASSED.with(|w| w.set(on));
    }

    /// Whether the never-bypassed bug is planted on this thread.
    pub(super) fn never_bypassed() -> bool {
        NEVER_BYPASSED.with(Cell::get)
    }
}

#[cfg(test)]
mod tests {
    use super::socket_name;
    use cohort_proto::ids::JobId;

    #[test]
    fn the_name_depends_on_the_deployment_not_the_order_of_its_endpoints() {
        let e = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let name = |endpoints: &[&str], job: &str, host| {
            socket_name("cohort-heartbeat-relay", 1, &e(endpoints), &JobId::new(job).unwrap(), host)
        };
        let a = name(&["http://c0:7000", "http://c1:7000"], "job", "host");
        assert_eq!(a, name(&["http://c1:7000", "http://c0:7000"], "job", "host"));
        assert_ne!(a, name(&["http://c0:7000"], "job", "host"));
        assert_ne!(a, name(&["http://c0:7000", "http://c1:7000"], "job2", "host"));
        assert_ne!(a, name(&["http://c0:7000", "http://c1:7000"], "job", "host2"));
        // Length-prefixed parts: moving a boundary changes the name.
        assert_ne!(name(&["ab"], "c", "h"), name(&["a"], "bc", "h"));
        assert!(a.starts_with("cohort-heartbeat-relay/") && a.len() < 108, "{a}");
        let job = JobId::new("job").unwrap();
        let endpoints = e(&["http://c0:7000", "http://c1:7000"]);
        let events = socket_name("cohort-event-relay", 1, &endpoints, &job, "host");
        assert!(events.starts_with("cohort-event-relay/") && events[19..] == a[23..], "{events} {a}");
        // Another version of the frames, another relay.
        let v2 = socket_name("cohort-heartbeat-relay", 2, &endpoints, &job, "host");
        assert!(v2.starts_with("cohort-heartbeat-relay/") && v2.len() == a.len() && v2 != a, "{v2} {a}");
    }
}
