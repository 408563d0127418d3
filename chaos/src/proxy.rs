//! A fault-injecting TCP proxy for the workers' data-plane links (netem is not available).
//!
//! # Design
//!
//! Every worker gets a harness-chosen data-plane listen port and advertises a proxy
//! listener instead (`--listen 127.0.0.1:P --advertise 127.0.0.1:Q`): one listener per
//! *destination* worker, forwarding to its real port. Peers dial the advertised address, so
//! every data-plane connection of the job passes through this proxy.
//!
//! Faults are per *directed* pair of workers (`from → to`), so the proxy must know which
//! worker a connection comes from, with only one advertised address per worker. Reading the
//! handshake's HELLO would give (generation, sender rank), but mapping a rank to a worker
//! needs the generation's member list, which the harness only learns (from the workers'
//! `event=generation` lines) *after* the mesh is connected. Instead the proxy identifies the
//! dialing process directly, from the kernel: an accepted connection's peer address is the
//! dialer's local address; `/proc/net/tcp` maps that (local, remote) pair to a socket
//! inode, and the worker whose `/proc/PID/fd/` holds `socket:[inode]` is the source. The
//! dialer's socket exists for as long as the connection does, so the lookup cannot race
//! (a source that vanished before the lookup is recorded as unidentified, and no pair rule
//! applies to it). Tests, which dial from one process, register the client's local port
//! instead ([`Proxy::register_port`]). The transports crate is untouched.
//!
//! A connection is pumped in both directions; the rule for each direction is read for every
//! chunk, so a fault applies to connections already open:
//!
//! - blackhole: chunks are held (not forwarded, not dropped: like a TCP path that loses
//!   every packet, the sender's window fills and it blocks; no FIN, no RST) until healed;
//!   a one-way partition is a blackhole of one direction;
//! - latency: every chunk is forwarded `latency` after it was read (order kept, throughput
//!   not serialised);
//! - bandwidth: a pacing clock spaces the writes at `bandwidth` bytes per second;
//! - reset: every open connection of the pair is closed with RST (SO_LINGER 0) on both sides.
//!
//! EOF and errors are forwarded as they come (FIN as FIN; a read error resets both sides),
//! so a SIGKILLed worker looks to its peers as it would without the proxy.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// Name of a source the proxy could not identify.
pub const UNKNOWN: &str = "?";

/// What happens to the bytes of one direction of one pair of workers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkRule {
    /// Hold every byte until healed (no FIN, no RST).
    pub blackhole: bool,
    /// Delay added to every chunk.
    pub latency: Duration,
    /// Cap in bytes per second.
    pub bandwidth: Option<u64>,
}

impl LinkRule {
    fn is_clear(&self) -> bool {
        *self == LinkRule::default()
    }
}

/// Errors of the proxy.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// Binding a listener failed.
    #[error("proxy: binding 127.0.0.1:0: {0}")]
    Bind(std::io::Error),
}

/// Counters of the proxy (for reports and tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ProxyStats {
    /// Connections accepted.
    pub accepted: u64,
    /// Connections whose source could not be identified.
    pub unidentified: u64,
    /// Connections reset by a fault.
    pub reset: u64,
    /// Bytes forwarded (both directions).
    pub bytes: u64,
}

struct Conn {
    from: String,
    to: String,
    abort: watch::Sender<bool>,
}

#[derive(Default)]
struct Inner {
    rules: Mutex<BTreeMap<(String, String), LinkRule>>,
    version: Option<watch::Sender<u64>>,
    pids: Mutex<BTreeMap<u32, String>>,
    ports: Mutex<BTreeMap<u16, String>>,
    conns: Mutex<Vec<Conn>>,
    accepted: AtomicU64,
    unidentified: AtomicU64,
    reset: AtomicU64,
    bytes: AtomicU64,
}

impl Inner {
    fn rule(&self, from: &str, to: &str) -> LinkRule {
        self.rules
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(from.to_string(), to.to_string()))
            .copied()
            .unwrap_or_default()
    }

    fn bump(&self) {
        if let Some(v) = &self.version {
            v.send_modify(|n| *n += 1);
        }
    }

    fn subscribe(&self) -> watch::Receiver<u64> {
        match &self.version {
            Some(v) => v.subscribe(),
            None => watch::channel(0).1,
        }
    }
}

/// How long a connection accepted for a worker whose real address is not known yet waits
/// for it (see [`Proxy::listen_for_later`]).
pub const UPSTREAM_WAIT: Duration = Duration::from_secs(10);

/// Sets the real address behind a listener made by [`Proxy::listen_for_later`].
#[derive(Debug)]
pub struct UpstreamSetter(watch::Sender<Option<SocketAddr>>);

impl UpstreamSetter {
    /// Sets (or changes) the address new connections are forwarded to.
    pub fn set(&self, upstream: SocketAddr) {
        self.0.send_replace(Some(upstream));
    }
}

/// The proxy: listeners per destination worker plus a table of rules per directed pair.
/// Cheap to clone; tasks end when the runtime does (or when [`Proxy::shutdown`] is called).
#[derive(Clone)]
pub struct Proxy {
    inner: Arc<Inner>,
    tasks: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Default for Proxy {
    fn default() -> Self {
        Self::new()
    }
}

impl Proxy {
    /// A proxy with no listeners and no rules.
    pub fn new() -> Self {
        let (tx, _) = watch::channel(0u64);
        let inner = Inner { version: Some(tx), ..Default::default() };
        Self { inner: Arc::new(inner), tasks: Arc::new(Mutex::new(Vec::new())) }
    }

    /// Binds a listener on 127.0.0.1 (free port) that forwards to `upstream`, the real
    /// data-plane address of worker `to`; returns the address to advertise for it.
    ///
    /// # Cancel safety
    /// Cancel safe (binding is the only await; a dropped call leaves no listener).
    pub async fn listen_for(&self, to: &str, upstream: SocketAddr) -> Result<SocketAddr, ProxyError> {
        let (advertised, set_upstream) = self.listen_for_later(to).await?;
        set_upstream.set(upstream);
        Ok(advertised)
    }

    /// Binds a listener on 127.0.0.1 (free port) for worker `to` whose real data-plane
    /// address is not known yet (the worker binds port 0 and prints what it got); returns
    /// the address to advertise and the handle that sets the upstream once known.
    /// Connections accepted before then wait for it (at most [`UPSTREAM_WAIT`], then they are
    /// reset, as a dead host's would be).
    ///
    /// Why not pick the worker's port beforehand: a port found free and released can be
    /// taken by any outgoing connection before the worker binds it.
    ///
    /// # Cancel safety
    /// Cancel safe (binding is the only await; a dropped call leaves no listener).
    pub async fn listen_for_later(&self, to: &str) -> Result<(SocketAddr, UpstreamSetter), ProxyError> {
        let listener = TcpListener::bind("127.0.0.1:0").await.map_err(ProxyError::Bind)?;
        let local = listener.local_addr().map_err(ProxyError::Bind)?;
        let (set_tx, upstream) = watch::channel(None::<SocketAddr>);
        let inner = self.inner.clone();
        let to = to.to_string();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, peer)) = listener.accept().await else { continue };
                inner.accepted.fetch_add(1, Ordering::Relaxed);
                let from = identify(&inner, peer, local);
                if from == UNKNOWN {
                    inner.unidentified.fetch_add(1, Ordering::Relaxed);
                }
                tracing::debug!(%from, to = %to, %peer, "proxy accepted a connection");
                tokio::spawn(serve(inner.clone(), client, from, to.clone(), upstream.clone()));
            }
        });
        self.tasks.lock().unwrap_or_else(PoisonError::into_inner).push(task);
        Ok((local, UpstreamSetter(set_tx)))
    }

    /// Tells the proxy that process `pid` is worker `name` (for source identification).
    pub fn register_pid(&self, pid: u32, name: &str) {
        self.inner.pids.lock().unwrap_or_else(PoisonError::into_inner).insert(pid, name.to_string());
    }

    /// Tells the proxy that connections from local port `port` come from `name` (checked
    /// before the `/proc` lookup; used by tests that dial from one process).
    pub fn register_port(&self, port: u16, name: &str) {
        self.inner.ports.lock().unwrap_or_else(PoisonError::into_inner).insert(port, name.to_string());
    }

    /// Sets the rule for bytes from `from` to `to` (a clear rule removes it).
    pub fn set_rule(&self, from: &str, to: &str, rule: LinkRule) {
        {
            let mut rules = self.inner.rules.lock().unwrap_or_else(PoisonError::into_inner);
            let key = (from.to_string(), to.to_string());
            if rule.is_clear() {
                rules.remove(&key);
            } else {
                rules.insert(key, rule);
            }
        }
        tracing::info!(from, to, ?rule, "proxy rule");
        self.inner.bump();
    }

    /// The rule for bytes from `from` to `to`.
    pub fn rule(&self, from: &str, to: &str) -> LinkRule {
        self.inner.rule(from, to)
    }

    /// Removes every rule.
    pub fn heal_all(&self) {
        self.inner.rules.lock().unwrap_or_else(PoisonError::into_inner).clear();
        self.inner.bump();
    }

    /// Resets (RST) every open connection between `a` and `b` (either direction); returns
    /// how many.
    pub fn reset_pair(&self, a: &str, b: &str) -> usize {
        let mut conns = self.inner.conns.lock().unwrap_or_else(PoisonError::into_inner);
        conns.retain(|c| !c.abort.is_closed());
        let mut n = 0;
        for c in conns.iter() {
            if (c.from == a && c.to == b) || (c.from == b && c.to == a) {
                let _ = c.abort.send(true);
                n += 1;
            }
        }
        self.inner.reset.fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// Counters so far.
    pub fn stats(&self) -> ProxyStats {
        ProxyStats {
            accepted: self.inner.accepted.load(Ordering::Relaxed),
            unidentified: self.inner.unidentified.load(Ordering::Relaxed),
            reset: self.inner.reset.load(Ordering::Relaxed),
            bytes: self.inner.bytes.load(Ordering::Relaxed),
        }
    }

    /// Stops every listener (open connections end when their endpoints close them).
    pub fn shutdown(&self) {
        for t in self.tasks.lock().unwrap_or_else(PoisonError::into_inner).drain(..) {
            t.abort();
        }
    }
}

/// Who dialed: a registered port, else the registered process owning the dialer's socket.
fn identify(inner: &Inner, peer: SocketAddr, local: SocketAddr) -> String {
    if let Some(name) = inner.ports.lock().unwrap_or_else(PoisonError::into_inner).get(&peer.port()) {
        return name.clone();
    }
    let pids: Vec<(u32, String)> =
        inner.pids.lock().unwrap_or_else(PoisonError::into_inner).iter().map(|(p, n)| (*p, n.clone())).collect();
    if pids.is_empty() {
        return UNKNOWN.to_string();
    }
    let Some(inode) = socket_inode(peer, local) else { return UNKNOWN.to_string() };
    owner_of(inode, pids.iter().map(|(p, _)| *p))
        .and_then(|pid| pids.iter().find(|(p, _)| *p == pid).map(|(_, n)| n.clone()))
        .unwrap_or_else(|| UNKNOWN.to_string())
}

/// The inode of the socket whose local address is `local` and remote address `remote`
/// (from `/proc/net/tcp`; IPv4 only).
pub fn socket_inode(local: SocketAddr, remote: SocketAddr) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/net/tcp").ok()?;
    find_inode(&text, local, remote)
}

/// [`socket_inode`] on given `/proc/net/tcp` text.
pub fn find_inode(table: &str, local: SocketAddr, remote: SocketAddr) -> Option<u64> {
    for line in table.lines().skip(1) {
        let cols: Vec<&str> = line.split_whitespace().collect();
        if cols.len() < 10 {
            continue;
        }
        if parse_proc_addr(cols[1]) == Some(local) && parse_proc_addr(cols[2]) == Some(remote) {
            return cols[9].parse().ok().filter(|&i| i != 0);
        }
    }
    None
}

/// Parses `0100007F:1F90` (address as the kernel's native-endian u32 of the network bytes).
fn parse_proc_addr(text: &str) -> Option<SocketAddr> {
    let (ip, port) = text.split_once(':')?;
    let ip = u32::from_str_radix(ip, 16).ok()?;
    let port = u16::from_str_radix(port, 16).ok()?;
    Some(SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(ip.to_ne_bytes()), port)))
}

/// Which of `pids` has `socket:[inode]` open.
pub fn owner_of(inode: u64, pids: impl IntoIterator<Item = u32>) -> Option<u32> {
    let want = format!("socket:[{inode}]");
    for pid in pids {
        let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { continue };
        for entry in dir.flatten() {
            if std::fs::read_link(entry.path()).is_ok_and(|l| l.as_os_str() == want.as_str()) {
                return Some(pid);
            }
        }
    }
    None
}

fn set_linger_zero(fd: RawFd) {
    let l = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: setsockopt on a socket fd owned by a live TcpStream half (the caller keeps the
    // halves alive across this call); the option value is a valid `linger`.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

async fn serve(
    inner: Arc<Inner>,
    client: TcpStream,
    from: String,
    to: String,
    mut upstream: watch::Receiver<Option<SocketAddr>>,
) {
    let known = match tokio::time::timeout(UPSTREAM_WAIT, upstream.wait_for(Option::is_some)).await {
        Ok(Ok(addr)) => *addr,
        _ => None,
    };
    let connected = match known {
        Some(addr) => {
            tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr)).await.ok().and_then(Result::ok)
        }
        None => None,
    };
    let server = match connected {
        Some(s) => s,
        None => {
            // The destination is gone: refuse the way a dead host's kernel would.
            set_linger_zero(client.as_raw_fd());
            return;
        }
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (cfd, sfd) = (client.as_raw_fd(), server.as_raw_fd());
    let (abort_tx, mut abort_rx) = watch::channel(false);
    inner.conns.lock().unwrap_or_else(PoisonError::into_inner).push(Conn {
        from: from.clone(),
        to: to.clone(),
        abort: abort_tx.clone(),
    });
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let failed = abort_tx.clone();
    let aborted = {
        let up = pump(inner.clone(), &mut cr, &mut sw, from.clone(), to.clone(), failed.clone());
        let down = pump(inner.clone(), &mut sr, &mut cw, to.clone(), from.clone(), failed);
        let mut both = std::pin::pin!(async { tokio::join!(up, down) });
        tokio::select! {
            _ = &mut both => false,
            _ = abort_rx.wait_for(|a| *a) => true,
        }
    };
    if aborted {
        // RST, not FIN: linger 0, and the write halves must not shut down on drop.
        set_linger_zero(cfd);
        set_linger_zero(sfd);
        cw.forget();
        sw.forget();
    }
    drop((cr, sr));
    tracing::debug!(%from, %to, "proxy connection closed");
}

/// Forwards `rd` to `wr` under the `from → to` rule until EOF (then FIN) or an error (then
/// `failed` resets the whole connection).
async fn pump(
    inner: Arc<Inner>,
    rd: &mut OwnedReadHalf,
    wr: &mut OwnedWriteHalf,
    from: String,
    to: String,
    failed: watch::Sender<bool>,
) {
    let (tx, mut rx) = mpsc::channel::<(Instant, Vec<u8>)>(32);
    let failed_r = failed.clone();
    // Owns the sender: when it ends, the writer sees the end of the stream.
    let reader = async move {
        loop {
            let mut buf = vec![0u8; 64 * 1024];
            match rd.read(&mut buf).await {
                Ok(0) => return,
                Ok(n) => {
                    buf.truncate(n);
                    if tx.send((Instant::now(), buf)).await.is_err() {
                        return;
                    }
                }
                Err(_) => {
                    let _ = failed_r.send(true);
                    return;
                }
            }
        }
    };
    let writer = async {
        let mut version = inner.subscribe();
        let mut next_free = Instant::now();
        while let Some((read_at, chunk)) = rx.recv().await {
            let rule = loop {
                let rule = inner.rule(&from, &to);
                if !rule.blackhole {
                    break rule;
                }
                if version.changed().await.is_err() {
                    return;
                }
            };
            if !rule.latency.is_zero() {
                tokio::time::sleep_until(read_at + rule.latency).await;
            }
            if let Some(bw) = rule.bandwidth.filter(|b| *b > 0) {
                let now = Instant::now();
                next_free = next_free.max(now) + Duration::from_secs_f64(chunk.len() as f64 / bw as f64);
                tokio::time::sleep_until(next_free).await;
            }
            if wr.write_all(&chunk).await.is_err() {
                let _ = failed.send(true);
                return;
            }
            inner.bytes.fetch_add(chunk.len() as u64, Ordering::Relaxed);
        }
        let _ = wr.shutdown().await;
    };
    tokio::join!(reader, writer);
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpSocket;

    const BOUND: Duration = Duration::from_secs(10);

    /// An echo server; returns its address.
    async fn echo() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = s.into_split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        a
    }

    /// Dials `addr` from a fresh local port registered as `name`.
    async fn dial(proxy: &Proxy, addr: SocketAddr, name: &str) -> TcpStream {
        let sock = TcpSocket::new_v4().unwrap();
        sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        proxy.register_port(sock.local_addr().unwrap().port(), name);
        sock.connect(addr).await.unwrap()
    }

    async fn roundtrip(s: &mut TcpStream, n: usize) -> std::io::Result<Duration> {
        let t = Instant::now();
        let data = vec![7u8; n];
        s.write_all(&data).await?;
        let mut back = vec![0u8; n];
        s.read_exact(&mut back).await?;
        assert_eq!(back, data);
        Ok(t.elapsed())
    }

    #[tokio::test]
    async fn forwards_and_identifies_the_source() {
        tokio::time::timeout(BOUND, async {
            let proxy = Proxy::new();
            let addr = proxy.listen_for("b", echo().await).await.unwrap();
            let mut s = dial(&proxy, addr, "a").await;
            roundtrip(&mut s, 100_000).await.unwrap();
            let st = proxy.stats();
            assert_eq!(st.accepted, 1);
            assert_eq!(st.unidentified, 0);
            assert!(st.bytes >= 200_000);
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn a_connection_waits_for_an_upstream_set_later() {
        tokio::time::timeout(BOUND, async {
            let proxy = Proxy::new();
            let (addr, upstream) = proxy.listen_for_later("b").await.unwrap();
            // The client connects and writes before the proxy knows where "b" is.
            let mut s = dial(&proxy, addr, "a").await;
            s.write_all(b"early").await.unwrap();
            upstream.set(echo().await);
            let mut buf = [0u8; 5];
            s.read_exact(&mut buf).await.unwrap();
            assert_eq!(&buf, b"early");
            roundtrip(&mut s, 10_000).await.unwrap();
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn blackhole_holds_bytes_without_closing_and_heals() {
        tokio::time::timeout(BOUND, async {
            let proxy = Proxy::new();
            let addr = proxy.listen_for("b", echo().await).await.unwrap();
            let mut s = dial(&proxy, addr, "a").await;
            roundtrip(&mut s, 10).await.unwrap();
            proxy.set_rule("a", "b", LinkRule { blackhole: true, ..Default::default() });
            s.write_all(b"hello").await.unwrap();
            let mut buf = [0u8; 5];
            // Nothing comes back, and the connection is not closed either.
            assert!(tokio::time::timeout(Duration::from_millis(300), s.read(&mut buf)).await.is_err());
            proxy.set_rule("a", "b", LinkRule::default());
            s.read_exact(&mut buf).await.unwrap();
            assert_eq!(&buf, b"hello");
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn one_way_partition_only_drops_one_direction() {
        tokio::time::timeout(BOUND, async {
            let proxy = Proxy::new();
            let addr = proxy.listen_for("b", echo().await).await.unwrap();
            let mut s = dial(&proxy, addr, "a").await;
            // b → a is cut: the request reaches the echo server, the reply is held.
            proxy.set_rule("b", "a", LinkRule { blackhole: true, ..Default::default() });
            assert_eq!(proxy.rule("a", "b"), LinkRule::default());
            s.write_all(b"ping").await.unwrap();
            let mut buf = [0u8; 4];
            assert!(tokio::time::timeout(Duration::from_millis(300), s.read(&mut buf)).await.is_err());
            proxy.heal_all();
            s.read_exact(&mut buf).await.unwrap();
            assert_eq!(&buf, b"ping");
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn reset_closes_with_rst_and_other_pairs_survive() {
        tokio::time::timeout(BOUND, async {
            let proxy = Proxy::new();
            let addr = proxy.listen_for("b", echo().await).await.unwrap();
            let mut ab = dial(&proxy, addr, "a").await;
            let mut cb = dial(&proxy, addr, "c").await;
            roundtrip(&mut ab, 10).await.unwrap();
            roundtrip(&mut cb, 10).await.unwrap();
            assert_eq!(proxy.reset_pair("b", "a"), 1);
            let mut buf = [0u8; 1];
            let r = ab.read(&mut buf).await;
            assert!(matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset), "{r:?}");
            roundtrip(&mut cb, 10).await.unwrap();
            assert_eq!(proxy.stats().reset, 1);
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn latency_and_bandwidth_slow_the_link() {
        tokio::time::timeout(BOUND, async {
            let proxy = Proxy::new();
            let addr = proxy.listen_for("b", echo().await).await.unwrap();
            let mut s = dial(&proxy, addr, "a").await;
            proxy.set_rule("a", "b", LinkRule { latency: Duration::from_millis(100), ..Default::default() });
            let t = roundtrip(&mut s, 10).await.unwrap();
            assert!(t >= Duration::from_millis(100), "{t:?}");
            proxy.set_rule("a", "b", LinkRule { bandwidth: Some(1 << 20), ..Default::default() });
            // 256 KiB at 1 MiB/s: about 250 ms.
            let t = roundtrip(&mut s, 256 << 10).await.unwrap();
            assert!(t >= Duration::from_millis(200), "{t:?}");
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn eof_is_forwarded_as_eof() {
        tokio::time::timeout(BOUND, async {
            let proxy = Proxy::new();
            let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = proxy.listen_for("b", upstream.local_addr().unwrap()).await.unwrap();
            let mut s = dial(&proxy, addr, "a").await;
            let (server, _) = upstream.accept().await.unwrap();
            drop(server);
            let mut buf = [0u8; 1];
            assert_eq!(s.read(&mut buf).await.unwrap(), 0);
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn proc_lookup_finds_this_process() {
        tokio::time::timeout(BOUND, async {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            let c = TcpStream::connect(addr).await.unwrap();
            let (_s, peer) = l.accept().await.unwrap();
            assert_eq!(peer, c.local_addr().unwrap());
            let inode = socket_inode(peer, addr).expect("inode");
            assert_eq!(owner_of(inode, [std::process::id()]), Some(std::process::id()));
            // And through the proxy, with the pid registered.
            let proxy = Proxy::new();
            proxy.register_pid(std::process::id(), "me");
            let paddr = proxy.listen_for("b", echo().await).await.unwrap();
            let mut s = TcpStream::connect(paddr).await.unwrap();
            roundtrip(&mut s, 10).await.unwrap();
            assert_eq!(proxy.stats().unidentified, 0);
        })
        .await
        .unwrap();
    }

    #[test]
    fn parses_proc_net_tcp() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 0100007F:9C40 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 12345 1 0000000000000000 20 4 30 10 -1\n";
        let local: SocketAddr = "127.0.0.1:40000".parse().unwrap();
        let remote: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        assert_eq!(find_inode(table, local, remote), Some(12345));
        assert_eq!(find_inode(table, remote, local), None);
        assert_eq!(find_inode("garbage\nmore garbage", local, remote), None);
    }
}
