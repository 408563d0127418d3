//! Where a host's relays live: the seam between the relays' logic (`relay.rs`,
//! `event_relay.rs`) and the sockets they bind and connect to.
//!
//! Production's [`AbstractUnix`] binds abstract Unix sockets in the process's network
//! namespace and checks the peer's user on both ends (`SO_PEERCRED`). [`SocketDir`] binds
//! them as files in a directory instead, so that processes in different network namespaces
//! share them: on Kubernetes, the pods of one node, through a directory of the node mounted
//! into each (`--relay-dir`). The deterministic
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

use std::fs::File;
use std::future::Future;
use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::SocketAddr as UnixAddr;
use std::path::{Path, PathBuf};
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

/// The relays' sockets as files in one directory (a [`RelayNet`]): processes that share the
/// directory share the relays, whatever network namespace each runs in. On Kubernetes that is
/// a node-local directory mounted into every pod of the node (`hostPath`), so that pods of one
/// rank each still send their node's beats in shared calls and hear its events through one
/// watch stream (deploy/overlays/node-relays).
///
/// A socket file outlives a process that dies, so the name is held by a lock instead: `bind`
/// takes an exclusive `flock` on `NAME.lock` beside the socket for the listener's life, and
/// the kernel drops it with the process. A bind that finds the lock free removes any socket
/// file a dead server left and binds afresh; one that finds it held fails with
/// [`io::ErrorKind::AddrInUse`]. A connect to a file nobody listens on, or to no file, is
/// [`io::ErrorKind::ConnectionRefused`]. Peers are checked as with [`AbstractUnix`]: a socket
/// served by another user is refused, and a relay answers only its own user. The directory
/// must be node-local (a lock on a network file system is not the node's) and writable by
/// the workers' user; files are made `0600`.
#[derive(Clone, Debug)]
pub struct SocketDir {
    dir: PathBuf,
}

/// The longest socket path Linux binds (`sun_path` holds 108 bytes with the terminating NUL).
const SUN_PATH_MAX: usize = 107;

/// The longest file name [`SocketDir`] makes: `cohort-heartbeat-relay-` and a 24-digit
/// digest (relay.rs's `socket_name`), then `.lock`, with room to spare.
const LONGEST_FILE_NAME: usize = 64;

impl SocketDir {
    /// Relays' sockets in `dir`, which must be an absolute path short enough for every
    /// socket name under it ([`io::ErrorKind::InvalidInput`] otherwise, naming the limit).
    /// The directory is not touched here: one that is missing or not writable fails each
    /// bind, and the workers then send their own beats, as without a relay.
    pub fn new(dir: impl Into<PathBuf>) -> io::Result<Self> {
        let dir = dir.into();
        if !dir.is_absolute() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("relay directory {} is not an absolute path", dir.display()),
            ));
        }
        let room = SUN_PATH_MAX - LONGEST_FILE_NAME - 1;
        if dir.as_os_str().len() > room {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "relay directory {} is {} bytes long; at most {room} leave room for a socket's name \
                     within Linux's {SUN_PATH_MAX}-byte socket path",
                    dir.display(),
                    dir.as_os_str().len()
                ),
            ));
        }
        Ok(Self { dir })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The socket's file for relay name `name` (`kind/digest`: the slash becomes a dash).
    fn file(&self, name: &str, suffix: &str) -> io::Result<PathBuf> {
        let file = format!("{}{suffix}", name.replace('/', "-"));
        if file.len() > LONGEST_FILE_NAME || file.starts_with('.') {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("relay name {name:?} makes no file name")));
        }
        Ok(self.dir.join(file))
    }
}

impl RelayNet for SocketDir {
    fn connect(&self, name: &str) -> io::Result<RelayStream> {
        match connect(&UnixAddr::from_pathname(self.file(name, ".sock")?)?) {
            Ok(stream) => Ok(Box::new(stream)),
            // No socket yet: as a name nobody serves.
            Err(e) if e.kind() == io::ErrorKind::NotFound => Err(io::Error::new(
                io::ErrorKind::ConnectionRefused,
                format!("no relay socket {name} in {}", self.dir.display()),
            )),
            Err(e) => Err(e),
        }
    }

    fn bind(&self, name: &str) -> io::Result<Box<dyn RelayListener>> {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        // Errors name the file, so that an operator sees which directory to fix (the kind,
        // AddrInUse above all, is kept).
        let at =
            |what: &str, path: &Path, e: io::Error| io::Error::new(e.kind(), format!("{what} {}: {e}", path.display()));
        let socket = self.file(name, ".sock")?;
        let lock_path = self.file(name, ".lock")?;
        let lock = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&lock_path)
            .map_err(|e| at("opening the relay's lock", &lock_path, e))?;
        lock_exclusive(&lock)?;
        // The lock is ours: a socket file here is a dead server's.
        match std::fs::remove_file(&socket) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(at("removing a dead relay's socket", &socket, e))
            }
            _ => {}
        }
        let listener = std::os::unix::net::UnixListener::bind(&socket)
            .map_err(|e| at("binding the relay's socket", &socket, e))?;
        let bound = SocketFile { path: socket, _lock: lock };
        std::fs::set_permissions(&bound.path, std::fs::Permissions::from_mode(0o600))?;
        listener.set_nonblocking(true)?;
        Ok(Box::new(FileListener { listener: OwnUserListener::new(UnixListener::from_std(listener)?), _file: bound }))
    }
}

/// Takes an exclusive `flock` on `file` without waiting: [`io::ErrorKind::AddrInUse`] when
/// another open file holds it (a live relay).
fn lock_exclusive(file: &File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: the descriptor is open for the call's duration; flock takes no pointers.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        return Err(io::Error::new(io::ErrorKind::AddrInUse, "another process serves this relay"));
    }
    Err(e)
}

/// A bound socket's file and the lock that holds its name: the file is removed when the
/// listener is dropped, before the lock is let go (so no new server's file is removed).
struct SocketFile {
    path: PathBuf,
    _lock: File,
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// [`SocketDir`]'s listener: the socket, then its file and lock (dropped after the socket).
struct FileListener {
    listener: OwnUserListener,
    _file: SocketFile,
}

impl RelayListener for FileListener {
    fn accept(&mut self) -> Pin<Box<dyn Future<Output = RelayStream> + Send + '_>> {
        Box::pin(self.listener.next())
    }
}

/// Connects to a relay's socket (abstract or a file), refusing a server of another user
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
