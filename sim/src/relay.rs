//! The host relays' sockets in the simulation: the shipped heartbeat and event relays
//! (`cohort::control::{HostRelay, EventRelay}`) run behind [`RelayNet`] over in-memory pipes.
//!
//! Each simulated host has one socket namespace ([`HostSockets`]), as a network namespace
//! holds abstract Unix sockets: a name is bound by one live listener at a time, a connection
//! to a name nobody serves is refused at once, and a listener dropped with its process (a
//! crash, or a worker whose group ended) frees the name and ends its connections. So the
//! relays' own paths run under the seeds: the first worker of a host serves, its host-mates
//! connect, a mate serves next when the server dies, and beats go directly while a relay
//! fails them.
//!
//! A stopped process (SIGSTOP, [`crate::ledger::Ledger::paused`]) stops serving: its listener
//! accepts nothing and the connections it accepted move no byte until it runs again, as a
//! stopped relay's kernel buffers fill and nobody reads them. Its host-mates then find it
//! hung (the heartbeat relay's answer does not come; the event relay goes silent) and go
//! around it, which is what production's relays must do.

use crate::ledger::Shared;
use cohort::control::{RelayListener, RelayNet, RelayStream};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, DuplexStream, ReadBuf};
use tokio::sync::mpsc;

/// Bytes each direction of a relay connection buffers (a Unix socket's default is larger;
/// a relay's frames are far smaller).
const PIPE_BYTES: usize = 64 * 1024;

/// How often a stopped process's connections look whether it runs again (simulated time, as
/// [`crate::worker`]'s own look).
const STOPPED_POLL: Duration = Duration::from_millis(10);

/// One host's socket namespace: the names bound, each to the way into its listener.
#[derive(Clone, Default)]
pub(crate) struct HostSockets(Arc<Mutex<BTreeMap<String, mpsc::UnboundedSender<DuplexStream>>>>);

/// One simulated process's relay sockets: its host's namespace, and whether it runs.
pub(crate) struct SimRelayNet {
    sockets: HostSockets,
    shared: Shared,
    /// The process's worker index (whether it is stopped) and name (the trace).
    index: usize,
    name: String,
    rng: Mutex<StdRng>,
}

impl SimRelayNet {
    /// The relay sockets of worker `index` (named `name` in the trace) on the host whose
    /// namespace is `sockets`, its randomness drawn from `seed`.
    pub(crate) fn new(sockets: HostSockets, shared: Shared, index: usize, name: String, seed: u64) -> Self {
        Self { sockets, shared, index, name, rng: Mutex::new(StdRng::seed_from_u64(seed)) }
    }
}

impl RelayNet for SimRelayNet {
    fn connect(&self, name: &str) -> io::Result<RelayStream> {
        let sockets = self.sockets.0.lock().unwrap_or_else(PoisonError::into_inner);
        let refused = || io::Error::new(io::ErrorKind::ConnectionRefused, format!("no relay serves {name}"));
        let listener = sockets.get(name).ok_or_else(refused)?;
        let (ours, theirs) = tokio::io::duplex(PIPE_BYTES);
        listener.send(theirs).map_err(|_| refused())?;
        Ok(Box::new(ours))
    }

    fn bind(&self, name: &str) -> io::Result<Box<dyn RelayListener>> {
        let mut sockets = self.sockets.0.lock().unwrap_or_else(PoisonError::into_inner);
        if sockets.get(name).is_some_and(|live| !live.is_closed()) {
            return Err(io::Error::new(io::ErrorKind::AddrInUse, format!("{name} is served")));
        }
        let (tx, incoming) = mpsc::unbounded_channel();
        sockets.insert(name.to_string(), tx);
        drop(sockets);
        let kind = name.split('/').next().unwrap_or(name);
        self.shared.log(&self.name, format!("serves {kind}"));
        Ok(Box::new(SimListener { incoming, owner: Owner { shared: self.shared.clone(), index: self.index } }))
    }

    fn entropy(&self) -> u64 {
        self.rng.lock().unwrap_or_else(PoisonError::into_inner).random()
    }
}

/// The process that serves a listener: its sockets move only while it runs.
#[derive(Clone)]
struct Owner {
    shared: Shared,
    index: usize,
}

impl Owner {
    fn stopped(&self) -> bool {
        self.shared.lock().paused.contains(&self.index)
    }

    async fn runs(&self) {
        crate::worker::stopped_while_paused(&self.shared, self.index).await;
    }
}

struct SimListener {
    incoming: mpsc::UnboundedReceiver<DuplexStream>,
    owner: Owner,
}

impl RelayListener for SimListener {
    fn accept(&mut self) -> Pin<Box<dyn Future<Output = RelayStream> + Send + '_>> {
        Box::pin(async move {
            loop {
                self.owner.runs().await;
                match self.incoming.recv().await {
                    Some(pipe) => {
                        return Box::new(Served { pipe, owner: self.owner.clone(), nap: None }) as RelayStream
                    }
                    // The namespace dropped the name (never while this listener lives): no
                    // connection will come.
                    None => std::future::pending::<()>().await,
                }
            }
        })
    }
}

/// A connection as the serving process holds it: it moves no byte while that process is
/// stopped.
struct Served {
    pipe: DuplexStream,
    owner: Owner,
    nap: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Served {
    /// Ready when the owner runs; else pending, woken to look again after a short nap.
    fn poll_runs(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            if !self.owner.stopped() {
                self.nap = None;
                return Poll::Ready(());
            }
            let nap = self.nap.get_or_insert_with(|| Box::pin(tokio::time::sleep(STOPPED_POLL)));
            match nap.as_mut().poll(cx) {
                Poll::Ready(()) => self.nap = None,
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl AsyncRead for Served {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        std::task::ready!(self.poll_runs(cx));
        Pin::new(&mut self.pipe).poll_read(cx, buf)
    }
}

impl AsyncWrite for Served {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        std::task::ready!(self.poll_runs(cx));
        Pin::new(&mut self.pipe).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        std::task::ready!(self.poll_runs(cx));
        Pin::new(&mut self.pipe).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.pipe).poll_shutdown(cx)
    }
}
