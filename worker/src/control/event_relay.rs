//! The host's event relay: the ranks of one host hear the job's events through one watch
//! stream to the coordinator, not one each.
//!
//! A revocation must reach every rank of the job at once. With a stream per rank, the
//! coordinator writes it to N streams; with the relay, to one stream per host, and each host
//! hands it to its ranks over a Unix socket. The first worker of a job on a host to subscribe
//! and find no relay becomes it: it binds an abstract socket named after the job, the host,
//! the coordinator endpoints and the user (the heartbeat relay's name, another prefix), opens
//! one compact watch of the job (incarnation 0: the coordinator records no control stream for
//! it) and forwards every event to every subscriber. A subscriber first gets the state as the
//! relay last heard it (the newest generation formed and revoked, a pending re-formation, the
//! job's end), then each new event.
//!
//! Each worker still holds a watch stream of its own, *quiet* (`WatchRequest.quiet`): it
//! carries no events, but while it is open the coordinator counts the process as alive (a
//! rendezvous stops waiting for a member whose stream closed), so liveness stays per
//! process. Nothing depends on the relay: a subscriber whose relay closes subscribes again at
//! once (becoming the relay if no one is), and one that cannot subscribe, loses the relay
//! three times within [`RESUBSCRIBE_WINDOW`] or finds it hung, watches with a full stream of its own
//! for [`FULL_AFTER_FAILURE`] (longer after failures in a row). The relay stops when its
//! process's group is dropped.
//!
//! The wire: the relay writes frames (a u32 little-endian length, then a prost `JobEvent`;
//! an empty event is a keepalive, written after a [`KEEPALIVE_EVERY`] without a frame); a
//! subscriber writes nothing. A subscription that hears nothing for [`SILENCE_LIMIT`] has a
//! hung relay (a stopped process, or a forked child holding the socket): its worker watches
//! alone, for longer after each such failure. The relay serves only processes of its own user
//! (`SO_PEERCRED`), a subscriber refuses a relay of another user (as one it cannot reach), at most [`MAX_SUBSCRIBERS`] at once, and drops a subscriber that falls
//! [`QUEUED_EVENTS`] events behind (it subscribes again and gets the state afresh).

use super::relay::{read_frame, socket_name};
use super::relay_net::{RelayListener, RelayNet, RelayStream};
use super::ControlClient;
use cohort_proto::ids::{JobId, WorkerId};
use cohort_proto::v1::{self as pb, job_event::Event, JobEvent};
use prost::Message;
use std::io;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;
use tokio::io::AsyncReadExt;
use tokio::sync::{broadcast, mpsc};
use tokio::task::JoinHandle;
use tracing::{debug, info, Instrument};

/// A subscriber that loses its relay three times within this window stops using it for a
/// while.
pub const RESUBSCRIBE_WINDOW: Duration = Duration::from_secs(1);

/// How long a worker watches with a full stream of its own after the relay failed it (twice
/// as long after each failure in a row, up to five minutes).
pub const FULL_AFTER_FAILURE: Duration = Duration::from_secs(10);

/// Most subscribers one relay serves at once; more are closed at once (they watch alone).
pub const MAX_SUBSCRIBERS: usize = cohort_proto::MAX_BEATS_PER_CALL;

/// Events queued for a subscriber before it is dropped as too slow.
pub const QUEUED_EVENTS: usize = 256;

/// How often the relay writes a keepalive (an empty event) to a subscriber that has had no
/// frame for that long: ten small writes a second per subscriber.
pub const KEEPALIVE_EVERY: Duration = Duration::from_millis(100);

/// A subscription with no frame for this long has a relay that hangs (a stopped process, or
/// a forked child that inherited the socket and never serves it): it ends with
/// [`io::ErrorKind::TimedOut`]. This is how late a hung relay's host can hear a revocation
/// (the relay's own process is often the rank that hung): short, so that a SIGSTOPped rank
/// still costs the others well under a second.
pub const SILENCE_LIMIT: Duration = Duration::from_millis(400);

/// First and longest wait before the relay reopens its watch of the coordinator.
const REOPEN_FIRST: Duration = Duration::from_millis(50);
const REOPEN_MAX: Duration = Duration::from_secs(1);

/// One worker's access to its host's event relay (serving it when no one does). Cheap to
/// clone; the relay this process serves, if any, stops when the last clone is dropped.
#[derive(Clone)]
pub struct EventRelay {
    inner: Arc<Inner>,
}

struct Inner {
    client: ControlClient,
    job: JobId,
    worker_id: WorkerId,
    /// Where the relay's socket is bound and connected to.
    net: Arc<dyn RelayNet>,
    /// The socket's name.
    name: String,
    /// The relay this process serves.
    serving: StdMutex<Option<JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(task) = self.serving.lock().unwrap_or_else(|e| e.into_inner()).take() {
            task.abort();
        }
    }
}

/// A subscription: the job's events as the host's relay forwards them. A task of its own
/// reads the socket, so that waiting for the next event can be cancelled freely; dropping
/// the subscription stops it and closes the connection.
pub struct RelayEvents {
    events: mpsc::Receiver<io::Result<JobEvent>>,
    _reader: AbortOnDrop,
}

impl RelayEvents {
    fn reading(mut conn: RelayStream) -> Self {
        let (tx, events) = mpsc::channel(QUEUED_EVENTS);
        let reader = tokio::spawn(async move {
            loop {
                let event = match tokio::time::timeout(SILENCE_LIMIT, read_frame(&mut conn)).await {
                    Err(_) => Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("no frame from the event relay within {SILENCE_LIMIT:?}: it hangs"),
                    )),
                    Ok(Ok(None)) => return,
                    Ok(Ok(Some(frame))) => match JobEvent::decode(frame.as_slice()) {
                        // A keepalive.
                        Ok(JobEvent { event: None }) => continue,
                        Ok(event) => Ok(event),
                        Err(e) => Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!("malformed event from the relay: {e}"),
                        )),
                    },
                    Ok(Err(e)) => Err(e),
                };
                let failed = event.is_err();
                if tx.send(event).await.is_err() || failed {
                    return;
                }
            }
        });
        Self { events, _reader: AbortOnDrop(reader) }
    }

    /// The next event, or `None` when the relay closed the subscription (its process ended,
    /// or this subscriber fell behind); [`io::ErrorKind::TimedOut`] when the relay wrote
    /// nothing, not even a keepalive, for [`SILENCE_LIMIT`].
    ///
    /// # Cancel safety
    /// Cancel safe: an event not yet returned stays queued.
    pub async fn next(&mut self) -> io::Result<Option<JobEvent>> {
        self.events.recv().await.transpose()
    }
}

impl EventRelay {
    /// The event relay of `job`'s worker `worker_id` on `host` (the relay's scope,
    /// [`crate::elastic::ElasticConfig::relay_scope`]), reached through `client`'s
    /// coordinators, its socket bound and connected in `net` ([`super::AbstractUnix`] in
    /// production). Nothing is bound or connected until [`EventRelay::subscribe`].
    pub fn new(client: ControlClient, job: &JobId, worker_id: &WorkerId, host: &str, net: Arc<dyn RelayNet>) -> Self {
        let name = socket_name("cohort-event-relay", 1, &client.config().endpoints, job, host);
        Self {
            inner: Arc::new(Inner {
                client,
                job: job.clone(),
                worker_id: worker_id.clone(),
                net,
                name,
                serving: StdMutex::new(None),
            }),
        }
    }

    /// The relay's socket name (in production, an abstract name without the leading NUL).
    pub fn socket_name(&self) -> &str {
        &self.inner.name
    }

    /// Whether this process serves the host's event relay.
    pub fn is_serving(&self) -> bool {
        self.inner.serving.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Subscribes to the host's relay, binding its name and serving it when no one does.
    /// A Unix socket connects at once, so this does not wait. Call it within a tokio runtime.
    pub fn subscribe(&self) -> io::Result<RelayEvents> {
        let inner = &self.inner;
        match inner.net.connect(&inner.name) {
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {}
            Ok(conn) => return Ok(RelayEvents::reading(conn)),
            Err(e) => return Err(e),
        }
        match inner.net.bind(&inner.name) {
            Ok(listener) => {
                info!(job = %inner.job, relay = %inner.name, "serving the host's event relay");
                let span = tracing::info_span!("event_relay", job = %inner.job, worker = %inner.worker_id);
                let upstream = Upstream {
                    client: inner.client.clone(),
                    job: inner.job.clone(),
                    worker_id: inner.worker_id.clone(),
                    net: inner.net.clone(),
                };
                let task = tokio::spawn(serve(listener, upstream).instrument(span));
                if let Some(old) = inner.serving.lock().unwrap_or_else(|e| e.into_inner()).replace(task) {
                    old.abort();
                }
            }
            // Another worker bound it first: use theirs.
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => {}
            Err(e) => return Err(e),
        }
        inner.net.connect(&inner.name).map(RelayEvents::reading)
    }
}

/// The job's state as the relay last heard it, and which events are new.
#[derive(Default)]
struct Latest {
    formed: Option<(u64, JobEvent)>,
    revoked: Option<(u64, JobEvent)>,
    /// A pending re-formation of the newest generation formed: (generation, joiners).
    pending: Option<((u64, u32), JobEvent)>,
    ended: Option<JobEvent>,
}

impl Latest {
    /// Takes `e` in; whether it is news (to be forwarded). A stream reopened on another
    /// replica starts with the state again: what the relay already has is not news.
    fn admit(&mut self, e: &JobEvent) -> bool {
        match &e.event {
            Some(Event::GenerationFormed(g)) => {
                if self.formed.as_ref().is_some_and(|(n, _)| *n >= g.number) {
                    return false;
                }
                self.formed = Some((g.number, e.clone()));
                self.pending = None;
                true
            }
            Some(Event::GenerationRevoked(r)) => {
                if self.revoked.as_ref().is_some_and(|(n, _)| *n >= r.generation) {
                    return false;
                }
                self.revoked = Some((r.generation, e.clone()));
                true
            }
            Some(Event::ReformationPending(p)) => {
                let key = (p.generation, p.joiners);
                if self.pending.as_ref().is_some_and(|(k, _)| *k == key) {
                    return false;
                }
                self.pending = Some((key, e.clone()));
                true
            }
            Some(Event::JobEnded(_)) => {
                if self.ended.is_some() {
                    return false;
                }
                self.ended = Some(e.clone());
                true
            }
            // A straggler's naming is news once; it is not state.
            Some(Event::StragglerNamed(_)) => true,
            None => false,
        }
    }

    /// The state for a new subscriber, oldest first.
    fn state(&self) -> Vec<JobEvent> {
        let formed = self.formed.iter().map(|(_, e)| e);
        let revoked = self.revoked.iter().map(|(_, e)| e);
        let pending = self.pending.iter().map(|(_, e)| e);
        formed.chain(revoked).chain(pending).chain(self.ended.iter()).cloned().collect()
    }
}

/// An event as the relay writes it: the frame (length and body), encoded once for every
/// subscriber.
fn frame(e: &JobEvent) -> Arc<Vec<u8>> {
    let body = e.encode_to_vec();
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    Arc::new(out)
}

/// What the relay's watch of the coordinator needs.
struct Upstream {
    client: ControlClient,
    job: JobId,
    /// The serving worker's id (the watch's, for the coordinator's logs).
    worker_id: WorkerId,
    /// The random source of the reopen jitter.
    net: Arc<dyn RelayNet>,
}

/// Aborts a task when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Serves the relay: follows the job's events in one watch and accepts the host's
/// subscribers.
///
/// # Cancel safety
/// Aborting it closes the socket and the watch; the subscribers then subscribe again, and
/// one of them serves the relay next.
async fn serve(mut listener: Box<dyn RelayListener>, upstream: Upstream) {
    let latest = Arc::new(StdMutex::new(Latest::default()));
    let (events, _) = broadcast::channel::<Arc<Vec<u8>>>(QUEUED_EVENTS);
    let _upstream = AbortOnDrop(tokio::spawn(follow(upstream, latest.clone(), events.clone()).in_current_span()));
    let mut subscribers = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            stream = listener.accept() => {
                if subscribers.len() >= MAX_SUBSCRIBERS {
                    debug!("event relay full; the worker watches alone");
                    continue;
                }
                // The state and the subscription are taken together, under the lock the
                // follower publishes under: no event falls between them.
                let (state, rx) = {
                    let latest = latest.lock().unwrap_or_else(|e| e.into_inner());
                    (latest.state().iter().map(frame).collect::<Vec<_>>(), events.subscribe())
                };
                subscribers.spawn(serve_subscriber(stream, state, rx).in_current_span());
            }
            Some(_) = subscribers.join_next() => {}
        }
    }
}

/// How long the relay waits for a subscriber to take one event before dropping it.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// One subscriber: the state, then every event (and a keepalive whenever a
/// [`KEEPALIVE_EVERY`] passes without one), until it closes, falls behind or stops reading.
/// What a subscriber writes is ignored.
async fn serve_subscriber(
    stream: RelayStream,
    state: Vec<Arc<Vec<u8>>>,
    mut events: broadcast::Receiver<Arc<Vec<u8>>>,
) {
    use tokio::io::AsyncWriteExt;
    let (mut rd, mut wr) = tokio::io::split(stream);
    for f in state {
        if !matches!(tokio::time::timeout(WRITE_TIMEOUT, wr.write_all(&f)).await, Ok(Ok(()))) {
            return;
        }
    }
    let keepalive = frame(&JobEvent { event: None });
    let mut idle = tokio::time::interval(KEEPALIVE_EVERY);
    let mut scratch = [0u8; 64];
    loop {
        tokio::select! {
            // The first tick is at once: a keepalive right after the state tells a new
            // subscriber that this relay serves.
            _ = idle.tick() => {
                if !matches!(tokio::time::timeout(WRITE_TIMEOUT, wr.write_all(&keepalive)).await, Ok(Ok(()))) {
                    return;
                }
            }
            next = events.recv() => match next {
                Ok(f) => {
                    if !matches!(tokio::time::timeout(WRITE_TIMEOUT, wr.write_all(&f)).await, Ok(Ok(()))) {
                        debug!("event relay: a subscriber stopped reading; dropping it");
                        return;
                    }
                    idle.reset();
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    debug!(skipped = n, "event relay: a subscriber fell behind; dropping it (it subscribes again)");
                    return;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            },
            read = rd.read(&mut scratch) => match read {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            },
        }
    }
}

/// Follows the job's events in one compact watch (incarnation 0: no control stream is
/// recorded for it), reopening it when it breaks, and publishes what is news to the
/// subscribers. Ends once the job has ended.
///
/// # Cancel safety
/// Cancel safe: an event is taken in and published under one lock.
async fn follow(upstream: Upstream, latest: Arc<StdMutex<Latest>>, events: broadcast::Sender<Arc<Vec<u8>>>) {
    let Upstream { client, job, worker_id, net } = upstream;
    let mut wait = REOPEN_FIRST;
    loop {
        let request = pb::WatchRequest {
            job: job.to_string(),
            worker_id: worker_id.to_string(),
            incarnation: 0,
            compact: true,
            quiet: false,
        };
        match client.watch(request).await {
            Ok(mut stream) => loop {
                match stream.message().await {
                    Ok(Some(e)) => {
                        wait = REOPEN_FIRST;
                        let ended = matches!(e.event, Some(Event::JobEnded(_)));
                        {
                            let mut latest = latest.lock().unwrap_or_else(|e| e.into_inner());
                            if latest.admit(&e) {
                                let _ = events.send(frame(&e));
                            }
                        }
                        if ended {
                            return;
                        }
                    }
                    Ok(None) => break,
                    Err(status) => {
                        debug!(%status, "event relay: the watch broke; reopening");
                        break;
                    }
                }
            },
            Err(e) => debug!(error = %e, "event relay: could not open the watch; retrying"),
        }
        let jitter = Duration::from_millis(net.entropy() % (wait.as_millis() as u64 + 1));
        tokio::time::sleep(wait / 2 + jitter / 2).await;
        wait = (wait * 2).min(REOPEN_MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::Latest;
    use cohort_proto::v1::{self as pb, job_event::Event, JobEvent};

    fn formed(n: u64) -> JobEvent {
        JobEvent { event: Some(Event::GenerationFormed(pb::Generation { number: n, ..Default::default() })) }
    }
    fn revoked(n: u64) -> JobEvent {
        JobEvent {
            event: Some(Event::GenerationRevoked(pb::GenerationRevoked { generation: n, ..Default::default() })),
        }
    }
    fn pending(n: u64, joiners: u32) -> JobEvent {
        JobEvent { event: Some(Event::ReformationPending(pb::ReformationPending { generation: n, joiners })) }
    }

    /// What the relay forwards and what a new subscriber is told: news once, repeats from a
    /// reopened watch dropped, a pending re-formation forgotten once the next generation forms.
    #[test]
    fn the_relay_forwards_news_once_and_keeps_the_newest_state() {
        let mut l = Latest::default();
        assert!(l.admit(&formed(1)));
        assert!(!l.admit(&formed(1)), "a reopened watch repeats the state");
        assert!(l.admit(&pending(1, 2)));
        assert!(!l.admit(&pending(1, 2)));
        assert!(l.admit(&pending(1, 3)), "more joiners is news");
        assert_eq!(l.state(), vec![formed(1), pending(1, 3)]);
        assert!(l.admit(&revoked(1)));
        assert!(!l.admit(&revoked(1)));
        assert!(l.admit(&formed(2)));
        assert_eq!(l.state(), vec![formed(2), revoked(1)], "the pending re-formation is over");
        assert!(!l.admit(&revoked(0)), "older than the newest revoked");
        assert!(!l.admit(&formed(1)), "older than the newest formed");
        let ended = JobEvent { event: Some(Event::JobEnded(pb::JobEnded::default())) };
        assert!(l.admit(&ended));
        assert!(!l.admit(&ended));
        assert_eq!(l.state().last(), Some(&ended));
        assert!(!l.admit(&JobEvent { event: None }));
    }
}
