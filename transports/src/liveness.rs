//! Is the peer's process alive? A UDP echo beside every TCP endpoint and the probe that asks
//! it, and the look at a same-host peer's process in `/proc` that the shared-memory links
//! take instead.
//!
//! A stalled link has two very different causes: the peer's process does not run (SIGSTOP,
//! a frozen host, a cut path), or it runs but is not sending yet (it computes a longer step,
//! saves a checkpoint, waits on another rank that is itself late). TCP cannot tell them
//! apart (the peer's kernel acknowledges bytes either way), so when a link's learned deadline
//! passes (see [`crate::deadline`]), the waiting side asks the peer's *process*: a 16-byte
//! datagram to the UDP port with the same number as the peer's TCP listener, answered by a
//! thread of the peer's [`crate::tcp::TcpEndpoint`] (or, over RDMA, of its `RdmaEndpoint`, on
//! the port of its bootstrap listener). No answer within [`PROBE_WITHIN`]
//! fails the operation; an answer means "alive, keep waiting" (up to the configured ceiling).
//!
//! The answer proves nothing but that the process runs and the path carries packets; it
//! carries no data and needs no authentication (a reply is exactly as large as the request,
//! so it amplifies nothing). A probe refused by the peer's host (no socket on that port) is
//! not taken as a death: the link then waits up to the ceiling, as with learning off. Nor is a
//! local failure to send the probe at all (no socket to bind: out of file descriptors; a
//! refused connect; no randomness for the nonce): that says nothing about the peer, so it is
//! no verdict either, and the link keeps waiting and asks again later. A
//! link's target is only probed for a failure once it has answered once, right after the
//! link came up (`verify`), so a foreign socket on that port never makes a live peer look
//! dead.

use crate::activity::{Activity, Presence};
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long a probe waits for the answer (it is sent again every quarter of it).
pub const PROBE_WITHIN: Duration = Duration::from_millis(200);

const REQUEST: &[u8; 4] = b"CHLQ";
const ANSWER: &[u8; 4] = b"CHLA";
const LEN: usize = 16;
/// A status probe: "do you run, and where are you for operation `seq` of this mesh?"
/// (magic, nonce, job digest, generation, rank, seq, zero padding).
const STATUS_REQUEST: &[u8; 4] = b"CHLS";
/// Its answer (magic, nonce, flags, entered seq, calls in progress, late waits, process
/// CPU time in ms, the root of its late waits plus one or zero): exactly as long as the
/// request, so it amplifies nothing.
const STATUS_ANSWER: &[u8; 4] = b"CHLB";
const STATUS_LEN: usize = 40;
/// Flag bits of a status answer.
const HAS_BOARD: u32 = 1;
const HAS_ENTERED: u32 = 2;
/// How often the responder thread looks at its stop flag.
const RESPONDER_POLL: Duration = Duration::from_millis(200);

/// What a probe found out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    /// The peer's process answered (with what it says of where it is, when asked and known).
    Alive(Option<Status>),
    /// Nothing came back in time (or the path refused to carry the probe).
    Silent,
    /// The peer's host said nobody listens on that port: no verdict.
    NoResponder,
    /// The peer's process, on this host, is stopped (SIGSTOP, a debugger).
    Stopped,
    /// The peer's process, on this host, is gone (exited, a zombie).
    Gone,
    /// The probe could not be sent from here (bind, connect or the nonce failed locally,
    /// e.g. this process is out of file descriptors): no verdict about the peer.
    LocalFailure,
}

/// The echo thread of one endpoint; stops (within [`RESPONDER_POLL`]) when dropped.
#[derive(Debug)]
pub(crate) struct Responder {
    stop: Arc<AtomicBool>,
}

impl Drop for Responder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl Responder {
    /// Binds UDP `local` (the endpoint's TCP address) and answers probes on a thread of its
    /// own, so that a busy async runtime never delays an answer. `None` (logged) if the port
    /// is taken: peers then wait up to the ceiling on this endpoint's links.
    pub(crate) fn start(local: SocketAddr) -> Option<Self> {
        let sock = match UdpSocket::bind(local).and_then(|s| s.set_read_timeout(Some(RESPONDER_POLL)).map(|()| s)) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(%local, error = %e, "no liveness responder (peers will wait up to the no-progress ceiling)");
                return None;
            }
        };
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let spawned =
            std::thread::Builder::new().name("cohort-liveness".into()).spawn(move || answer_loop(&sock, &flag));
        match spawned {
            Ok(_) => Some(Self { stop }),
            Err(e) => {
                tracing::warn!(%local, error = %e, "no liveness responder thread");
                None
            }
        }
    }
}

fn answer_loop(sock: &UdpSocket, stop: &AtomicBool) {
    let mut buf = [0u8; 64];
    while !stop.load(Ordering::Relaxed) {
        match sock.recv_from(&mut buf) {
            Ok((n, from)) if n == LEN && &buf[..4] == REQUEST => {
                buf[..4].copy_from_slice(ANSWER);
                // Best effort: a lost answer is a retried probe.
                let _ = sock.send_to(&buf[..LEN], from);
            }
            Ok((n, from)) if n == STATUS_LEN && &buf[..4] == STATUS_REQUEST => {
                let answer = status_answer(&buf[..STATUS_LEN]);
                let _ = sock.send_to(&answer, from);
            }
            // Anything else (wrong size, wrong magic, timeouts, ICMP errors) is ignored.
            _ => {}
        }
    }
}

/// The answer to a status request (checked for size and magic): this process's board for
/// the mesh it names, if that mesh is here, and its CPU time.
fn status_answer(req: &[u8]) -> [u8; STATUS_LEN] {
    let job = u64_at(req, 12);
    let generation = u64_at(req, 20);
    let rank = crate::wire::u32_at(req, 28);
    let seq = crate::wire::u32_at(req, 32);
    let mut out = [0u8; STATUS_LEN];
    out[..4].copy_from_slice(STATUS_ANSWER);
    out[4..12].copy_from_slice(&req[4..12]);
    let mut flags = 0;
    if let Some(p) = Activity::lookup(job, generation, rank).and_then(|board| board.presence(seq)) {
        flags |= HAS_BOARD;
        if let Some(e) = p.entered {
            flags |= HAS_ENTERED;
            out[16..20].copy_from_slice(&e.to_le_bytes());
        }
        out[20..24].copy_from_slice(&p.pending.to_le_bytes());
        out[24..28].copy_from_slice(&p.late_waits.to_le_bytes());
        let root = p.late_root.map_or(0, |r| r.saturating_add(1));
        out[36..40].copy_from_slice(&root.to_le_bytes());
    }
    out[12..16].copy_from_slice(&flags.to_le_bytes());
    let cpu_ms = own_cpu_time().map_or(u64::MAX, |c| c.as_millis() as u64);
    out[28..36].copy_from_slice(&cpu_ms.to_le_bytes());
    out
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// This process's CPU time (user and system), if the kernel says.
fn own_cpu_time() -> Option<Duration> {
    // SAFETY: an all-zero rusage is a valid value to be overwritten.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: ru is a valid out pointer.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return None;
    }
    let tv = |t: libc::timeval| Duration::new(t.tv_sec.max(0) as u64, (t.tv_usec.clamp(0, 999_999) as u32) * 1000);
    Some(tv(ru.ru_utime) + tv(ru.ru_stime))
}

/// What a running peer said of itself in a status answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Status {
    /// Its board for the mesh asked about (`None`: that mesh is not in the process, or
    /// the peer could not say).
    pub(crate) presence: Option<Presence>,
    /// Its process CPU time, if known.
    pub(crate) cpu: Option<Duration>,
}

/// The mesh and operation a status probe asks about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Query {
    /// [`crate::activity::job_digest`] of the job.
    pub(crate) job: u64,
    /// The generation.
    pub(crate) generation: u64,
    /// The peer's rank in it.
    pub(crate) rank: crate::Rank,
    /// The operation the waiter waits for.
    pub(crate) seq: u32,
}

fn decode_status(b: &[u8]) -> Status {
    let flags = crate::wire::u32_at(b, 12);
    let presence = (flags & HAS_BOARD != 0).then(|| Presence {
        entered: (flags & HAS_ENTERED != 0).then(|| crate::wire::u32_at(b, 16)),
        pending: crate::wire::u32_at(b, 20),
        late_waits: crate::wire::u32_at(b, 24),
        // Zero from a peer that predates roots: no root named.
        late_root: crate::wire::u32_at(b, 36).checked_sub(1),
    });
    let cpu = match u64_at(b, 28) {
        u64::MAX => None,
        ms => Some(Duration::from_millis(ms)),
    };
    Status { presence, cpu }
}

/// Asks the process behind `target` whether it runs, and where it is for `query`, within
/// `within`: `Alive(Some(status))` if it answered.
///
/// # Cancel safety
/// Cancel safe: it holds nothing but its own socket.
pub(crate) async fn probe(target: SocketAddr, within: Duration, query: Query) -> Answer {
    let unspecified: SocketAddr = if target.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    // A failure here is this process's, not the peer's: never read it as the peer's death.
    let sock = match tokio::net::UdpSocket::bind(unspecified).await {
        Ok(s) => s,
        Err(e) => return local_failure(target, "bind", &e),
    };
    if let Err(e) = sock.connect(target).await {
        // A route that cuts the path (a blackhole route answers a connect with EINVAL, an
        // unreachable one with ENETUNREACH or EHOSTUNREACH) says that the peer cannot be
        // reached from here: no answer, as a probe sent into the cut would get. Any other
        // error (out of descriptors or buffers, a refused broadcast) is this process's own.
        use std::io::ErrorKind::{HostUnreachable, InvalidInput, NetworkUnreachable};
        if matches!(e.kind(), InvalidInput | NetworkUnreachable | HostUnreachable) {
            tracing::debug!(%target, error = %e, "liveness probe: no route to the peer");
            return Answer::Silent;
        }
        return local_failure(target, "connect", &e);
    }
    let mut nonce = [0u8; 8];
    if let Err(e) = getrandom::fill(&mut nonce) {
        return local_failure(target, "draw a nonce", &e);
    }
    let mut request = [0u8; STATUS_LEN];
    request[..4].copy_from_slice(STATUS_REQUEST);
    request[4..12].copy_from_slice(&nonce);
    request[12..20].copy_from_slice(&query.job.to_le_bytes());
    request[20..28].copy_from_slice(&query.generation.to_le_bytes());
    request[28..32].copy_from_slice(&query.rank.to_le_bytes());
    request[32..36].copy_from_slice(&query.seq.to_le_bytes());
    let until = tokio::time::Instant::now() + within;
    let mut buf = [0u8; 64];
    loop {
        let now = tokio::time::Instant::now();
        if now >= until {
            return Answer::Silent;
        }
        match sock.send(&request).await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return Answer::NoResponder,
            // No route (a blackhole route), unreachable: the path is cut; keep trying.
            Err(_) | Ok(_) => {}
        }
        let resend = (now + within / 4).min(until);
        loop {
            match tokio::time::timeout_at(resend, sock.recv(&mut buf)).await {
                Ok(Ok(n)) if n == STATUS_LEN && &buf[..4] == STATUS_ANSWER && buf[4..12] == nonce => {
                    return Answer::Alive(Some(decode_status(&buf[..STATUS_LEN])))
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => return Answer::NoResponder,
                Ok(Err(_)) => {
                    tokio::time::sleep_until(resend).await;
                    break;
                }
                Err(_) => break,
            }
        }
    }
}

/// Whether the process behind the endpoint `target` (a member's data-plane address) runs,
/// asked from outside any link: code that watches a data plane cohort does not drive (a torch
/// backend beneath a process group whose membership is cohort's) names a dead member this way.
/// `Some(true)` if it answered within `within`; `Some(false)` if nothing came back, or if its
/// host refused the probe (nothing listens on that port any more: the endpoint is gone; a link
/// takes a refusal as no verdict, but the caller here asks about members that formed a
/// generation with it moments ago); `None` if the probe could not be sent from here.
///
/// # Cancel safety
/// Cancel safe: it sends one datagram and waits for the answer.
pub async fn endpoint_runs(target: SocketAddr, within: Duration) -> Option<bool> {
    match probe(target, within, NO_MESH).await {
        Answer::Alive(_) => Some(true),
        Answer::Silent | Answer::NoResponder | Answer::Gone | Answer::Stopped => Some(false),
        Answer::LocalFailure => None,
    }
}

fn local_failure(target: SocketAddr, what: &str, error: &dyn std::fmt::Display) -> Answer {
    tracing::warn!(%target, error = %error, "could not {what} for a liveness probe; no verdict about the peer");
    Answer::LocalFailure
}

impl Answer {
    /// What a failing link reports about the peer (see [`crate::Silence`]), or `None` when
    /// the answer is no reason to give up (alive, or no verdict).
    pub(crate) fn silence(self) -> Option<crate::Silence> {
        match self {
            Self::Silent => Some(crate::Silence::NoAnswer),
            Self::Stopped => Some(crate::Silence::ProcessStopped),
            Self::Gone => Some(crate::Silence::ProcessGone),
            Self::Alive(_) | Self::NoResponder | Self::LocalFailure => None,
        }
    }
}

/// Whether the process `pid` on this host runs: it is looked up in `/proc` every few
/// milliseconds for up to `within`; `Alive` (with its CPU time) as soon as it is seen in any
/// state but stopped (`T`, SIGSTOP) or traced-stopped (`t`, a debugger); else, at the end,
/// `Stopped` if it was stopped at the last look, `Gone` if it was gone or a zombie, and
/// `LocalFailure` if this process could not look (out of file descriptors or memory: no
/// verdict about the peer). For peers on the same host (shared memory), where no datagram is
/// needed.
///
/// # Cancel safety
/// Cancel safe: it holds nothing.
pub(crate) async fn probe_local_process(pid: u32, within: Duration) -> Answer {
    let until = tokio::time::Instant::now() + within;
    loop {
        let state = process_state(pid);
        if matches!(state, Answer::Alive(_)) || tokio::time::Instant::now() >= until {
            return state;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// One look at `/proc/PID/stat`: `Alive` (with the process's CPU time), `Stopped` (stopped
/// or traced), `Gone` (a zombie, or no such process), or `LocalFailure` when the file could
/// not be read for a reason of this process's own (EMFILE, ENFILE, ENOMEM, ...): only "no
/// such process" says that the peer is gone.
fn process_state(pid: u32) -> Answer {
    let stat = match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH) => {
            return Answer::Gone
        }
        Err(e) => {
            tracing::warn!(pid, error = %e, "could not read the peer's /proc entry; no verdict about the peer");
            return Answer::LocalFailure;
        }
    };
    // "PID (COMM) STATE ...": COMM may hold spaces and parentheses; the state follows the last ')'.
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else { return Answer::Gone };
    let mut fields = rest.split_ascii_whitespace();
    match fields.next().and_then(|f| f.chars().next()) {
        Some('T' | 't') => Answer::Stopped,
        Some('Z' | 'X' | 'x') | None => Answer::Gone,
        Some(_) => {
            // utime and stime are the 12th and 13th fields after the state, in clock ticks.
            let ticks = |f: Option<&str>| f.and_then(|v| v.parse::<u64>().ok());
            let mut after = fields.skip(10);
            let cpu = match (ticks(after.next()), ticks(after.next())) {
                (Some(u), Some(s)) => Some(Duration::from_millis((u + s).saturating_mul(1000) / clock_ticks())),
                _ => None,
            };
            Answer::Alive(Some(Status { presence: None, cpu }))
        }
    }
}

/// Clock ticks per second (`_SC_CLK_TCK`), 100 where the kernel does not say.
fn clock_ticks() -> u64 {
    // SAFETY: sysconf has no preconditions.
    match unsafe { libc::sysconf(libc::_SC_CLK_TCK) } {
        t if t > 0 => t as u64,
        _ => 100,
    }
}

#[cfg(test)]
fn process_runs(pid: u32) -> bool {
    matches!(process_state(pid), Answer::Alive(_))
}

/// [`verify`]s `target` in the background (a task on the current runtime): the flag is set
/// once its responder answered, so that a link asks about a stall only a peer it has heard.
pub(crate) fn verify_in_background(target: SocketAddr) -> Arc<AtomicBool> {
    let verified = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&verified);
    tokio::spawn(async move {
        if verify(target).await {
            flag.store(true, Ordering::Relaxed);
        }
    });
    verified
}

/// Probes `target` once, with a generous bound, right after its link came up: true if the
/// peer's responder answered a status probe (then a later silence means something, and its
/// answers say where it is).
///
/// # Cancel safety
/// Cancel safe, as [`probe`].
pub(crate) async fn verify(target: SocketAddr) -> bool {
    matches!(probe(target, Duration::from_secs(2), NO_MESH).await, Answer::Alive(_))
}

/// A query about no mesh (what [`verify`] asks).
const NO_MESH: Query = Query { job: 0, generation: 0, rank: 0, seq: 0 };

#[cfg(test)]
mod tests {
    use super::*;

    fn free_udp() -> SocketAddr {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        s.local_addr().unwrap()
    }

    #[tokio::test]
    async fn a_running_responder_answers_and_a_dropped_one_does_not() {
        // A port free a moment ago may be taken by another test's endpoint before the
        // responder binds it (endpoints bind UDP on their TCP port number): try a few.
        let (addr, r) = (0..20)
            .find_map(|_| {
                let addr = free_udp();
                Responder::start(addr).map(|r| (addr, r))
            })
            .expect("a responder on one of 20 free ports");
        assert!(matches!(
            probe(addr, Duration::from_secs(2), NO_MESH).await,
            Answer::Alive(Some(Status { presence: None, .. }))
        ));
        assert!(verify(addr).await);
        drop(r);
        // Its thread stops within RESPONDER_POLL; then the port is closed and the host
        // refuses: no verdict. Until then it still answers.
        let until = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            match probe(addr, Duration::from_millis(100), NO_MESH).await {
                Answer::NoResponder => break,
                other => {
                    assert!(tokio::time::Instant::now() < until, "still {other:?} 5 s after the responder was dropped")
                }
            }
        }
    }

    #[tokio::test]
    async fn a_socket_that_never_answers_is_silent() {
        let mute = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = mute.local_addr().unwrap();
        let t0 = std::time::Instant::now();
        assert_eq!(probe(addr, Duration::from_millis(120), NO_MESH).await, Answer::Silent);
        assert!(t0.elapsed() >= Duration::from_millis(120));
        // Garbage, wrong nonces and answers of the old size are no answer.
        let held = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr2 = held.local_addr().unwrap();
        let liar = held.try_clone().unwrap();
        let echo = std::thread::spawn(move || {
            let mut b = [0u8; 64];
            if let Ok((n, from)) = liar.recv_from(&mut b) {
                b[..4].copy_from_slice(ANSWER);
                b[4] ^= 0xff;
                let _ = liar.send_to(&b[..n], from);
            }
        });
        assert_eq!(probe(addr2, Duration::from_millis(120), NO_MESH).await, Answer::Silent);
        echo.join().unwrap();
        drop(held);
        assert!(!verify_within(addr, Duration::from_millis(50)).await);
    }

    #[tokio::test]
    async fn a_local_process_is_running_until_stopped() {
        assert!(matches!(probe_local_process(std::process::id(), PROBE_WITHIN).await, Answer::Alive(_)));
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("sleep");
        let pid = child.id();
        assert!(matches!(probe_local_process(pid, PROBE_WITHIN).await, Answer::Alive(_)));
        // SAFETY: signalling our own child, which has not been reaped.
        unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        // Stopping is asynchronous: the state turns T shortly.
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while process_runs(pid) {
            assert!(std::time::Instant::now() < until, "the child never showed as stopped");
            std::thread::yield_now();
        }
        let t0 = std::time::Instant::now();
        assert_eq!(probe_local_process(pid, Duration::from_millis(100)).await, Answer::Stopped);
        assert!(t0.elapsed() >= Duration::from_millis(100));
        // SAFETY: as above.
        unsafe { libc::kill(pid as i32, libc::SIGCONT) };
        assert!(matches!(probe_local_process(pid, Duration::from_secs(5)).await, Answer::Alive(_)));
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(probe_local_process(pid, Duration::from_millis(20)).await, Answer::Gone, "a reaped process");
        assert_eq!(Answer::Stopped.silence(), Some(crate::Silence::ProcessStopped));
        assert_eq!(Answer::Silent.silence(), Some(crate::Silence::NoAnswer));
        assert_eq!(Answer::LocalFailure.silence(), None);
    }

    /// A probe this process cannot even send (here: a UDP connect to the broadcast address
    /// without SO_BROADCAST, which the local kernel refuses with EACCES, as it would refuse a
    /// bind with EMFILE when out of file descriptors) is no verdict, not a silent peer.
    #[tokio::test]
    async fn a_local_failure_to_probe_is_no_verdict() {
        let broadcast: SocketAddr = "255.255.255.255:9".parse().unwrap();
        assert_eq!(probe(broadcast, Duration::from_millis(100), NO_MESH).await, Answer::LocalFailure);
        assert!(!verify(broadcast).await);
    }

    async fn verify_within(target: SocketAddr, within: Duration) -> bool {
        matches!(probe(target, within, NO_MESH).await, Answer::Alive(_))
    }

    /// A status probe is answered from the board of the mesh it names, with the process's
    /// CPU time: where the peer is, not only that it runs.
    #[tokio::test]
    async fn a_status_probe_says_where_the_peer_is() {
        let (addr, _r) = (0..20)
            .find_map(|_| {
                let addr = free_udp();
                Responder::start(addr).map(|r| (addr, r))
            })
            .expect("a responder on one of 20 free ports");
        let board = Activity::for_mesh("liveness-status-test", 7, 2);
        let q = Query { job: crate::activity::job_digest("liveness-status-test"), generation: 7, rank: 2, seq: 12 };
        let Answer::Alive(Some(st)) = probe(addr, Duration::from_secs(2), q).await else { panic!("no answer") };
        assert_eq!(st.presence, Some(Presence { entered: None, pending: 0, late_waits: 0, late_root: None }));
        assert!(st.cpu.is_some(), "the CPU time comes with the answer");
        let _call = board.enter(12);
        let Answer::Alive(Some(st)) = probe(addr, Duration::from_secs(2), q).await else { panic!("no answer") };
        assert_eq!(st.presence, Some(Presence { entered: Some(12), pending: 1, late_waits: 0, late_root: None }));
        {
            // Waiting behind late rank 5: the root travels with the answer.
            let _late = board.late_wait(5);
            let Answer::Alive(Some(st)) = probe(addr, Duration::from_secs(2), q).await else { panic!("no answer") };
            assert_eq!(
                st.presence,
                Some(Presence { entered: Some(12), pending: 1, late_waits: 1, late_root: Some(5) })
            );
        }
        // Another mesh (rank) of the same job: not here.
        let other = Query { rank: 3, ..q };
        let Answer::Alive(Some(st)) = probe(addr, Duration::from_secs(2), other).await else { panic!("no answer") };
        assert_eq!(st.presence, None);
    }

    /// A look into /proc that fails for a reason of this process's own (here: out of file
    /// descriptors under RLIMIT_NOFILE) is no verdict, never "gone". Run in a child process
    /// (the limit would starve the other tests of this one).
    #[test]
    fn a_local_failure_to_read_proc_is_no_verdict() {
        const CHILD: &str = "COHORT_LIVENESS_RLIMIT_CHILD";
        if std::env::var_os(CHILD).is_some() {
            let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            // SAFETY: reading and setting this (child) process's own limit.
            assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
            lim.rlim_cur = 0;
            // SAFETY: as above.
            assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
            let answer = process_state(std::process::id());
            assert_eq!(answer, Answer::LocalFailure, "EMFILE read as {answer:?}");
            assert_eq!(answer.silence(), None);
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "liveness::tests::a_local_failure_to_read_proc_is_no_verdict", "--nocapture"])
            .env(CHILD, "1")
            .output()
            .unwrap();
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("1 passed"),
            "child: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
