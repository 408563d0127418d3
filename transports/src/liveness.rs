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
//! thread of the peer's [`crate::tcp::TcpEndpoint`]. No answer within [`PROBE_WITHIN`]
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

use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long a probe waits for the answer (it is sent again every quarter of it).
pub const PROBE_WITHIN: Duration = Duration::from_millis(200);

const REQUEST: &[u8; 4] = b"CHLQ";
const ANSWER: &[u8; 4] = b"CHLA";
const LEN: usize = 16;
/// How often the responder thread looks at its stop flag.
const RESPONDER_POLL: Duration = Duration::from_millis(200);

/// What a probe found out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    /// The peer's process answered.
    Alive,
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
            // Anything else (wrong size, wrong magic, timeouts, ICMP errors) is ignored.
            _ => {}
        }
    }
}

/// Asks the process behind `target` whether it runs, within `within`.
///
/// # Cancel safety
/// Cancel safe: it holds nothing but its own socket.
pub(crate) async fn probe(target: SocketAddr, within: Duration) -> Answer {
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
    let mut request = [0u8; LEN];
    request[..4].copy_from_slice(REQUEST);
    request[4..12].copy_from_slice(&nonce);
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
                Ok(Ok(n)) if n == LEN && &buf[..4] == ANSWER && buf[4..12] == nonce => return Answer::Alive,
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
            Self::Alive | Self::NoResponder | Self::LocalFailure => None,
        }
    }
}

/// Whether the process `pid` on this host runs: it is looked up in `/proc` every few
/// milliseconds for up to `within`; `Alive` as soon as it is seen in any state but stopped
/// (`T`, SIGSTOP) or traced-stopped (`t`, a debugger); else, at the end, `Stopped` if it was
/// stopped at the last look, `Gone` if it was gone or a zombie. For peers on the same host
/// (shared memory), where no datagram is needed.
///
/// # Cancel safety
/// Cancel safe: it holds nothing.
pub(crate) async fn probe_local_process(pid: u32, within: Duration) -> Answer {
    let until = tokio::time::Instant::now() + within;
    loop {
        let state = process_state(pid);
        if state == Answer::Alive || tokio::time::Instant::now() >= until {
            return state;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// One look at `/proc/PID/stat`: `Alive`, `Stopped` (stopped or traced) or `Gone` (a
/// zombie, or no such process).
fn process_state(pid: u32) -> Answer {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return Answer::Gone };
    // "PID (COMM) STATE ...": COMM may hold spaces and parentheses; the state follows the last ')'.
    match stat.rfind(')').and_then(|i| stat[i + 1..].trim_start().chars().next()) {
        Some('T' | 't') => Answer::Stopped,
        Some('Z' | 'X' | 'x') | None => Answer::Gone,
        Some(_) => Answer::Alive,
    }
}

#[cfg(test)]
fn process_runs(pid: u32) -> bool {
    process_state(pid) == Answer::Alive
}

/// Probes `target` once, with a generous bound, right after its link came up: true if the
/// peer's responder answered (then a later silence means something).
///
/// # Cancel safety
/// Cancel safe, as [`probe`].
pub(crate) async fn verify(target: SocketAddr) -> bool {
    probe(target, Duration::from_secs(2)).await == Answer::Alive
}

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
        assert_eq!(probe(addr, Duration::from_secs(2)).await, Answer::Alive);
        assert!(verify(addr).await);
        drop(r);
        // Its thread stops within RESPONDER_POLL; then the port is closed and the host
        // refuses: no verdict. Until then it still answers.
        let until = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            match probe(addr, Duration::from_millis(100)).await {
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
        assert_eq!(probe(addr, Duration::from_millis(120)).await, Answer::Silent);
        assert!(t0.elapsed() >= Duration::from_millis(120));
        // Garbage and wrong nonces are no answer.
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
        assert_eq!(probe(addr2, Duration::from_millis(120)).await, Answer::Silent);
        echo.join().unwrap();
        drop(held);
        assert!(!verify_within(addr, Duration::from_millis(50)).await);
    }

    #[tokio::test]
    async fn a_local_process_is_running_until_stopped() {
        assert_eq!(probe_local_process(std::process::id(), PROBE_WITHIN).await, Answer::Alive);
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("sleep");
        let pid = child.id();
        assert_eq!(probe_local_process(pid, PROBE_WITHIN).await, Answer::Alive);
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
        assert_eq!(probe_local_process(pid, Duration::from_secs(5)).await, Answer::Alive);
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
        assert_eq!(probe(broadcast, Duration::from_millis(100)).await, Answer::LocalFailure);
        assert!(!verify(broadcast).await);
    }

    async fn verify_within(target: SocketAddr, within: Duration) -> bool {
        probe(target, within).await == Answer::Alive
    }
}
