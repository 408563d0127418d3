//! Where a host's relays live: the seam between the relays' logic (`relay.rs`,
//! `event_relay.rs`) and the sockets they bind and connect to.
//!
//! Production's [`AbstractUnix`] binds abstract Unix sockets in the process's network
//! namespace and checks the peer's user on both ends (`SO_PEERCRED`). The deterministic
//! simulation puts its own [`RelayNet`] here (in-memory pipes between the simulated processes
//! of one host, which stop moving while the process that serves them is stopped), so the
//! relays' failover, bypass and re-serve paths run under its seeds with the code production
//! runs.
//!
//! The contract every implementation keeps, which the relays depend on:
//! - [`RelayNet::connect`] to a name no live listener holds fails at once with
//!   [`io::ErrorKind::ConnectionRefused`] (the caller then binds the name and serves it);
//! - [`RelayNet::bind`] of a name a live listener holds fails with
//!   [`io::ErrorKind::AddrInUse`] (another process serves it: the caller connects);
//! - a listener's name is free again once the listener is dropped (its process ended), and
//!   the connections it accepted then read end-of-stream at the other end once their own
//!   ends are dropped.

use std::future::Future;
use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::SocketAddr as UnixAddr;
use std::pin::Pin;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{UnixListener, UnixStream};
use tokio::time::Instant;
use tracing::{debug, warn};

/// One connection between a relay and one of its host's workers: a byte stream each way.
pub trait RelayConnection: AsyncRead + AsyncWrite + Send + Unpin + 'static {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> RelayConnection for T {}

/// A connection, whatever carries it.
pub type RelayStream = Box<dyn RelayConnection>;

/// A relay's bound name, handing out its host's workers' connections.
pub trait RelayListener: Send + 'static {
    /// The next connection a worker made. Implementations retry or skip failed and refused
    /// accepts themselves; this never fails.
    ///
    /// # Cancel safety
    /// Implementations must be cancel safe: a connection accepted is returned in the same poll.
    fn accept(&mut self) -> Pin<Box<dyn Future<Output = RelayStream> + Send + '_>>;
}

/// The sockets of a host's relays, and the random source of their retries (the module's
/// doc lists the contract).
pub trait RelayNet: Send + Sync + 'static {
    /// Connects to the relay serving `name`; [`io::ErrorKind::ConnectionRefused`] when none
    /// does. Does not wait.
    fn connect(&self, name: &str) -> io::Result<RelayStream>;

    /// Binds `name` for a relay to serve; [`io::ErrorKind::AddrInUse`] when a live relay
    /// holds it. Call it within a tokio runtime.
    fn bind(&self, name: &str) -> io::Result<Box<dyn RelayListener>>;

    /// 64 random bits (the event relay's reopen jitter).
    fn entropy(&self) -> u64 {
        rand::random()
    }
}

/// Production's relay sockets: abstract Unix sockets in this process's network namespace.
///
/// Abstract sockets have no permissions: anyone on the host can compute a relay's name and
/// bind it first. So a worker uses only a relay served by its own user, and a relay answers
/// only its own user's processes (both from `SO_PEERCRED`, taken by the kernel at bind and
/// connect). A relay that dies frees its name with its process (there is no file to clean up).
#[derive(Clone, Copy, Debug, Default)]
pub struct AbstractUnix;

impl RelayNet for AbstractUnix {
    fn connect(&self, name: &str) -> io::Result<RelayStream> {
        connect(&UnixAddr::from_abstract_name(name.as_bytes())?).map(|s| Box::new(s) as RelayStream)
    }

    fn bind(&self, name: &str) -> io::Result<Box<dyn RelayListener>> {
        let listener = std::os::unix::net::UnixListener::bind_addr(&UnixAddr::from_abstract_name(name.as_bytes())?)?;
        listener.set_nonblocking(true)?;
        Ok(Box::new(OwnUserListener::new(UnixListener::from_std(listener)?)))
    }
}

/// Connects to a relay's abstract socket, refusing a server of another user
/// ([`io::ErrorKind::PermissionDenied`], naming its uid and pid): a squatter of another user
/// would otherwise hear every beat, answer them, and forge the job's events. The caller then
/// does without the relay, as when it cannot connect at all.
fn connect(address: &UnixAddr) -> io::Result<UnixStream> {
    // A Unix socket's connect completes at once (or fails): no need to wait on it.
    let stream = std::os::unix::net::UnixStream::connect_addr(address)?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    check_server(peer_credentials(&stream)?, unsafe { libc::geteuid() })?;
    stream.set_nonblocking(true)?;
    UnixStream::from_std(stream)
}

/// The credentials (`SO_PEERCRED`) of a Unix socket's peer: for a connected client socket,
/// those of the process that bound and listened on the server's side.
fn peer_credentials(stream: &std::os::unix::net::UnixStream) -> io::Result<libc::ucred> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: the descriptor is open for the call's duration, and `cred`/`len` are valid for
    // writes of the size given.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred)
}

/// Whether a relay server with credentials `server` may serve a worker of user `own_uid`:
/// only a process of the same user.
fn check_server(server: libc::ucred, own_uid: u32) -> io::Result<()> {
    if server.uid == own_uid {
        return Ok(());
    }
    Err(io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!(
            "the relay's socket is served by process {} of uid {}, not by this user (uid {own_uid}): another \
             user holds the name; refusing it",
            server.pid, server.uid
        ),
    ))
}

/// How long a relay stops accepting after a failed accept.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// A relay's listening socket, handing out only the connections of the relay's own user
/// (`SO_PEERCRED`). After a failed accept (out of descriptors, say) it pauses accepting
/// briefly instead of spinning on the error.
struct OwnUserListener {
    listener: UnixListener,
    uid: u32,
    /// Until when accepting pauses (after a failed accept).
    paused_until: Option<Instant>,
}

impl OwnUserListener {
    fn new(listener: UnixListener) -> Self {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let uid = unsafe { libc::geteuid() };
        Self { listener, uid, paused_until: None }
    }

    /// The next connection of the relay's own user; other users' connections are closed.
    ///
    /// # Cancel safety
    /// Cancel safe: a connection accepted is returned in the same poll, and a pause cut
    /// short goes on at the next call.
    async fn next(&mut self) -> RelayStream {
        loop {
            if let Some(until) = self.paused_until {
                tokio::time::sleep_until(until).await;
                self.paused_until = None;
            }
            let stream = match self.listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    debug!(error = %e, "relay: accept failed; pausing accepts");
                    self.paused_until = Some(Instant::now() + ACCEPT_PAUSE);
                    continue;
                }
            };
            match stream.peer_cred() {
                Ok(cred) if cred.uid() == self.uid => return Box::new(stream),
                other => warn!(peer = ?other, "relay: refused a connection of another user"),
            }
        }
    }
}

impl RelayListener for OwnUserListener {
    fn accept(&mut self) -> Pin<Box<dyn Future<Output = RelayStream> + Send + '_>> {
        Box::pin(self.next())
    }
}

#[cfg(test)]
mod tests {
    use super::check_server;

    #[test]
    fn a_relay_of_another_user_is_refused() {
        let cred = |uid| libc::ucred { pid: 4242, uid, gid: uid };
        assert!(check_server(cred(1000), 1000).is_ok());
        for (server, own) in [(65534, 0), (0, 1000), (1001, 1000)] {
            let e = check_server(cred(server), own).expect_err("another user");
            assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied);
            let text = e.to_string();
            assert!(
                text.contains(&format!("process 4242 of uid {server}")) && text.contains(&format!("(uid {own})")),
                "{text}"
            );
        }
    }
}
