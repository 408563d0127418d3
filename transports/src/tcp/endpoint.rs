//! The long-lived listener and the routing of accepted connections to mesh set-ups.

use super::options::TcpOptions;
use crate::handshake::{self, Hello, HsIoError, Message, Refusal, Verdict};
use crate::links::lock;
use crate::mesh_setup::SharedNotes;
use crate::{Rank, TransportError};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio::time::Instant;

/// How long an accepted connection may take to send its hello.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a connection for a (job, generation) nobody waits for is held before refusal.
pub const PENDING_HOLD: Duration = Duration::from_secs(1);
/// Most connections held for a (job, generation) nobody waits for yet.
pub const MAX_PENDING: usize = 64;
/// Most accepted connections in their hello phase at once; more are closed at once.
pub const MAX_HANDSHAKING: usize = 256;
/// Deadline for sending a refusal to a connection being turned away.
const REFUSE_TIMEOUT: Duration = Duration::from_secs(1);

/// An accepted connection whose hello names a (job, generation) being formed.
pub(crate) struct Incoming {
    pub stream: TcpStream,
    pub hello: Hello,
    pub addr: SocketAddr,
}

struct Waiter {
    tx: mpsc::Sender<Incoming>,
    notes: SharedNotes,
    world: u32,
}

struct Pending {
    id: u64,
    job: String,
    generation: u64,
    claim: oneshot::Sender<mpsc::Sender<Incoming>>,
}

#[derive(Default)]
struct RouterState {
    waiters: HashMap<(String, u64), Waiter>,
    pending: Vec<Pending>,
    next_id: u64,
}

/// State shared between the endpoint, its accept task and the mesh set-ups.
#[derive(Default)]
pub(crate) struct Router {
    state: Mutex<RouterState>,
}

/// Deregisters a mesh set-up from the router when it ends.
pub(crate) struct Registration {
    router: Arc<Router>,
    key: (String, u64),
}

impl Drop for Registration {
    fn drop(&mut self) {
        lock(&self.router.state).waiters.remove(&self.key);
    }
}

impl Router {
    /// Registers a mesh set-up for (job, generation) and hands it any held connections.
    pub(super) fn register(
        self: &Arc<Self>,
        job: &str,
        generation: u64,
        world: u32,
        tx: mpsc::Sender<Incoming>,
        notes: SharedNotes,
    ) -> Result<Registration, TransportError> {
        let mut st = lock(&self.state);
        let key = (job.to_owned(), generation);
        if st.waiters.contains_key(&key) {
            return Err(TransportError::InvalidArgument(format!(
                "a mesh for job {job:?} generation {generation} is already being set up on this endpoint"
            )));
        }
        let held = std::mem::take(&mut st.pending);
        for p in held {
            if p.job == job && p.generation == generation {
                // The holder may have timed out meanwhile; then it refuses by itself.
                let _ = p.claim.send(tx.clone());
            } else {
                st.pending.push(p);
            }
        }
        st.waiters.insert(key.clone(), Waiter { tx, notes, world });
        Ok(Registration { router: Arc::clone(self), key })
    }

    /// Notes a refused connection on every mesh set-up of `job` (or of any job if none).
    fn note(st: &RouterState, job: &str, rank: Rank, note: &str) {
        let same_job = st.waiters.keys().any(|(j, _)| j == job);
        for ((j, _), w) in &st.waiters {
            if !same_job || j == job {
                lock(&w.notes).record(w.world, Some(rank), note.to_owned());
            }
        }
    }

    /// The newest generation being formed for `job`, if any.
    fn newest_for(st: &RouterState, job: &str) -> Option<u64> {
        st.waiters.keys().filter(|(j, _)| j == job).map(|(_, g)| *g).max()
    }
}

/// Binds the listening socket with the buffer sizes set before `listen`, so that accepted
/// sockets inherit them.
pub(crate) fn bind_listener(addr: SocketAddr, options: &TcpOptions) -> Result<TcpListener, TransportError> {
    let io = |what: &str, e: std::io::Error| TransportError::Io(format!("{what} {addr}: {e}"));
    let sock =
        if addr.is_ipv4() { TcpSocket::new_v4() } else { TcpSocket::new_v6() }.map_err(|e| io("socket for", e))?;
    sock.set_reuseaddr(true).map_err(|e| io("SO_REUSEADDR on", e))?;
    options.apply_buffers(&socket2::SockRef::from(&sock))?;
    sock.bind(addr).map_err(|e| io("binding", e))?;
    sock.listen(1024).map_err(|e| io("listening on", e))
}

/// Accepts connections until the task is aborted (when the endpoint is dropped).
pub(crate) async fn accept_loop(listener: TcpListener, router: Arc<Router>, options: TcpOptions) {
    let mut tasks = JoinSet::new();
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, addr)) => {
                    if tasks.len() >= MAX_HANDSHAKING {
                        tracing::warn!(%addr, "too many connections in their handshake; closing a new one");
                        continue;
                    }
                    tasks.spawn(route(stream, addr, Arc::clone(&router), options.clone()));
                }
                Err(e) => {
                    // Out of descriptors or similar: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
}

async fn refuse(stream: &mut TcpStream, refusal: Refusal) {
    // Best effort: the connection is dropped right after either way.
    let _ = handshake::write_all(stream, &refusal.encode(), Instant::now() + REFUSE_TIMEOUT).await;
}

/// Refuses a connection whose first message is not a well-formed hello (final, not retriable).
async fn refuse_malformed(stream: &mut TcpStream, addr: SocketAddr, text: String) {
    tracing::debug!(%addr, "refusing connection: {text}");
    refuse(stream, Refusal { code: Verdict::Malformed, retriable: false, ours: 0, theirs: 0, text }).await;
}

/// Reads an accepted connection's hello and hands it to the mesh set-up it names.
async fn route(mut stream: TcpStream, addr: SocketAddr, router: Arc<Router>, options: TcpOptions) {
    if let Err(e) = options.apply(&socket2::SockRef::from(&stream)) {
        tracing::warn!(%addr, error = %e, "socket options on an accepted connection");
        return;
    }
    let hello = match handshake::read_message(&mut stream, Instant::now() + HELLO_TIMEOUT).await {
        Ok(Message::Hello(h)) => h,
        Ok(other) => {
            refuse_malformed(&mut stream, addr, format!("expected a hello, got {other:?}")).await;
            return;
        }
        Err(HsIoError::Malformed(text)) => {
            refuse_malformed(&mut stream, addr, text).await;
            return;
        }
        Err(e) => {
            tracing::debug!(%addr, "no hello: {e}");
            return;
        }
    };
    match decide(&router, &hello, addr) {
        Decision::Deliver(tx) => deliver(tx, Incoming { stream, hello, addr }).await,
        Decision::Refuse(r) => refuse(&mut stream, r).await,
        Decision::Hold(id, claim) => hold(stream, hello, addr, router, id, claim).await,
    }
}

enum Decision {
    Deliver(mpsc::Sender<Incoming>),
    Refuse(Refusal),
    Hold(u64, oneshot::Receiver<mpsc::Sender<Incoming>>),
}

/// Routes a hello: to the set-up waiting for it, to a refusal, or into the held list.
fn decide(router: &Router, hello: &Hello, addr: SocketAddr) -> Decision {
    let mut st = lock(&router.state);
    let key = (hello.job.clone(), hello.generation);
    if let Some(w) = st.waiters.get(&key) {
        return Decision::Deliver(w.tx.clone());
    }
    if let Some(newest) = Router::newest_for(&st, &hello.job) {
        if newest > hello.generation {
            let note = format!(
                "generation mismatch (ours {newest}, theirs {}): rank {} at {addr} was refused",
                hello.generation, hello.sender
            );
            Router::note(&st, &hello.job, hello.sender, &note);
            let text = format!("this endpoint forms generation {newest} of job {:?}", hello.job);
            return Decision::Refuse(Refusal {
                code: Verdict::StaleGeneration,
                retriable: false,
                ours: newest,
                theirs: hello.generation,
                text,
            });
        }
    }
    if st.pending.len() >= MAX_PENDING {
        let text = "too many connections wait for a mesh set-up on this endpoint".to_owned();
        return Decision::Refuse(Refusal { code: Verdict::Busy, retriable: true, ours: 0, theirs: 0, text });
    }
    let (claim_tx, claim_rx) = oneshot::channel();
    let id = st.next_id;
    st.next_id += 1;
    st.pending.push(Pending { id, job: hello.job.clone(), generation: hello.generation, claim: claim_tx });
    Decision::Hold(id, claim_rx)
}

/// Holds a connection nobody waits for yet, for at most [`PENDING_HOLD`].
async fn hold(
    mut stream: TcpStream,
    hello: Hello,
    addr: SocketAddr,
    router: Arc<Router>,
    id: u64,
    mut claim: oneshot::Receiver<mpsc::Sender<Incoming>>,
) {
    if let Ok(Ok(tx)) = tokio::time::timeout(PENDING_HOLD, &mut claim).await {
        deliver(tx, Incoming { stream, hello, addr }).await;
        return;
    }
    let refusal = match unclaimed(&router, &hello, addr, id, &mut claim) {
        Ok(tx) => {
            deliver(tx, Incoming { stream, hello, addr }).await;
            return;
        }
        Err(r) => r,
    };
    tracing::debug!(%addr, job = %hello.job, generation = hello.generation, "refusing unclaimed connection: {}", refusal.text);
    refuse(&mut stream, refusal).await;
}

async fn deliver(tx: mpsc::Sender<Incoming>, incoming: Incoming) {
    if let Err(e) = tx.try_send(incoming) {
        let mut inc = match e {
            mpsc::error::TrySendError::Full(i) | mpsc::error::TrySendError::Closed(i) => i,
        };
        let text = "the mesh set-up for this job and generation is not taking connections".to_owned();
        refuse(&mut inc.stream, Refusal { code: Verdict::Busy, retriable: true, ours: 0, theirs: 0, text }).await;
    }
}

/// Withdraws a held connection whose hold time ran out: returns the set-up that claimed it
/// meanwhile, or the refusal to send.
fn unclaimed(
    router: &Router,
    hello: &Hello,
    addr: SocketAddr,
    id: u64,
    claim: &mut oneshot::Receiver<mpsc::Sender<Incoming>>,
) -> Result<mpsc::Sender<Incoming>, Refusal> {
    let mut st = lock(&router.state);
    st.pending.retain(|p| p.id != id);
    // Claimed between the timeout and taking the lock.
    if let Ok(tx) = claim.try_recv() {
        return Ok(tx);
    }
    Err(match Router::newest_for(&st, &hello.job) {
        Some(newest) => {
            let note = format!(
                "generation mismatch (ours {newest}, theirs {}): rank {} at {addr} was refused",
                hello.generation, hello.sender
            );
            Router::note(&st, &hello.job, hello.sender, &note);
            let text = format!("this endpoint forms generation {newest} of job {:?}", hello.job);
            Refusal { code: Verdict::GenerationMismatch, retriable: true, ours: newest, theirs: hello.generation, text }
        }
        None if !st.waiters.is_empty() => {
            let jobs: Vec<&str> = st.waiters.keys().map(|(j, _)| j.as_str()).collect();
            let note = format!(
                "rank {} at {addr} asked for job {:?} and was refused: job mismatch (ours {jobs:?})",
                hello.sender, hello.job
            );
            Router::note(&st, &hello.job, hello.sender, &note);
            let text = format!("job mismatch: this endpoint forms meshes for jobs {jobs:?}, not {:?}", hello.job);
            Refusal { code: Verdict::JobMismatch, retriable: true, ours: 0, theirs: 0, text }
        }
        None => {
            let text = format!(
                "no mesh for job {:?} generation {} is being set up on this endpoint",
                hello.job, hello.generation
            );
            Refusal { code: Verdict::NotReady, retriable: true, ours: 0, theirs: 0, text }
        }
    })
}
