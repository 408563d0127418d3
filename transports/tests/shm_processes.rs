//! The shared-memory transport between real processes: a SIGKILLed peer fails the waiting
//! rank within milliseconds, a SIGSTOPped one within the no-progress deadline (with learned
//! deadlines: soon after the learned one, while a peer that pauses but runs is waited for),
//! and nothing is left behind (no segment mapped, no socket listening). Each test uses its own generation, so
//! the mapping checks of tests running in parallel do not see each other's segments.
//!
//! The peer is this test binary run again as a child (`child_rank` below, ignored unless run
//! by the parent with `COHORT_SHM_CHILD` set).

use cohort_transports::shm::{ShmAddress, ShmEndpoint, ShmMeshSpec, ShmOptions, ShmTransport};
use cohort_transports::{Deadlines, Learning, Silence, Tag, Transport, TransportError};
use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;
use tokio::time::{timeout, Instant};

const LIMIT: Duration = Duration::from_secs(60);
const TOKEN: &[u8] = b"process-test";

fn options() -> ShmOptions {
    ShmOptions { slots: 4, slot_bytes: 64 << 10, ..ShmOptions::default() }
}

/// The floor of the learned deadlines in the tests that learn.
const FLOOR: Duration = Duration::from_millis(150);

fn spec(generation: u64, rank: u32, peers: [ShmAddress; 2], no_progress: Duration) -> ShmMeshSpec {
    learning_spec(generation, rank, peers, no_progress, None)
}

fn learning_spec(
    generation: u64,
    rank: u32,
    peers: [ShmAddress; 2],
    no_progress: Duration,
    learning: Option<Learning>,
) -> ShmMeshSpec {
    ShmMeshSpec {
        job: "shm-processes".into(),
        generation,
        rank,
        peers: peers.into_iter().map(Some).collect(),
        token: TOKEN.to_vec(),
        deadlines: Deadlines { no_progress, connect: Duration::from_secs(20), learning },
    }
}

/// Kills the child when the test ends, however it ends.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn signal(child: &Child, sig: libc::c_int) {
    // SAFETY: sending a signal to our own child process.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, sig) };
    assert_eq!(rc, 0, "kill({}, {sig})", child.id());
}

/// Starts the child as rank 1 of `generation` in `mode`, returns it, its stdout and its address.
fn spawn_child(mode: &str, generation: u64, parent: &ShmAddress) -> (ChildGuard, BufReader<ChildStdout>, ShmAddress) {
    let exe = std::env::current_exe().expect("test binary");
    let mut child = Command::new(exe)
        .args(["child_rank", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env("COHORT_SHM_CHILD", mode)
        .env("COHORT_SHM_GENERATION", generation.to_string())
        .env("COHORT_SHM_PARENT", parent.encode())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn child");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let guard = ChildGuard(child);
    let address = expect_line(&mut out, "addr=");
    (guard, out, ShmAddress::decode(&address).expect("child address"))
}

/// Reads lines until one starts with `prefix`; returns the rest.
fn expect_line(out: &mut BufReader<ChildStdout>, prefix: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        let n = out.read_line(&mut line).expect("child stdout");
        assert!(n > 0, "child exited before printing {prefix:?}");
        // The test harness may print "test child_rank ... " on the same line first.
        if let Some(at) = line.find(prefix) {
            return line[at + prefix.len()..].trim().to_owned();
        }
    }
}

fn mapped_segments(generation: u64) -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("maps");
    let needle = format!("cohort-shm-g{generation}-");
    maps.lines().filter(|l| l.contains(&needle)).count()
}

/// Whether a socket listens on the worker's abstract name for `generation` (accepted
/// connections show the name too, so only listening sockets count: flag `__SO_ACCEPTCON`).
fn listening(address: &ShmAddress, generation: u64) -> bool {
    let unix = std::fs::read_to_string("/proc/net/unix").expect("/proc/net/unix");
    let needle = format!("@cohort-shm.{}.g{generation}", address.nonce);
    unix.lines().any(|l| l.ends_with(&needle) && l.split_whitespace().nth(3) == Some("00010000"))
}

async fn connect_parent(ep: &ShmEndpoint, child: &ShmAddress, generation: u64, no_progress: Duration) -> ShmTransport {
    let peers = [ep.address().clone(), child.clone()];
    ep.connect_mesh(spec(generation, 0, peers, no_progress)).await.expect("parent mesh")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_peer_fails_the_receiver_within_100ms_and_leaves_nothing() {
    timeout(LIMIT, async {
        let generation = 101;
        let ep = ShmEndpoint::new(options()).unwrap();
        let (mut child, mut out, child_addr) = spawn_child("stream", generation, ep.address());
        let t = connect_parent(&ep, &child_addr, generation, Duration::from_secs(30)).await;
        assert!(mapped_segments(generation) > 0, "the segment is mapped while the link is up");
        assert!(!listening(ep.address(), generation), "the listener is closed once the mesh is up");
        expect_line(&mut out, "streaming");
        // Receive the child's stream; kill it mid-transfer.
        let mut buf = vec![0u8; 300_000];
        let mut killed_at = None;
        let mut seq = 0u32;
        let error = loop {
            match t.recv(1, Tag::new(seq, 0, 1), &mut buf).await {
                Ok(()) => {
                    assert!(buf.iter().all(|&b| b == seq as u8), "message {seq} corrupted");
                    seq += 1;
                    if seq == 20 {
                        signal(&child.0, libc::SIGKILL);
                        killed_at = Some(Instant::now());
                    }
                }
                Err(e) => break e,
            }
        };
        let killed_at = killed_at.expect("the child failed before it was killed");
        let took = killed_at.elapsed();
        assert!(matches!(error, TransportError::PeerClosed { peer: 1, .. }), "{error:?}");
        assert!(took < Duration::from_millis(100), "the death was noticed after {took:?}");
        let _ = child.0.wait();
        drop(t);
        assert_eq!(mapped_segments(generation), 0, "a segment is still mapped after the transport was dropped");
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_peer_fails_a_blocked_sender_too() {
    timeout(LIMIT, async {
        let generation = 102;
        let ep = ShmEndpoint::new(options()).unwrap();
        let (mut child, mut out, child_addr) = spawn_child("idle", generation, ep.address());
        let t = connect_parent(&ep, &child_addr, generation, Duration::from_secs(30)).await;
        expect_line(&mut out, "ready");
        // More than the ring holds: the send blocks until the peer reads, which it never does.
        let big = vec![7u8; 4 << 20];
        let send = t.send(1, Tag::new(0, 0, 1), &big);
        tokio::pin!(send);
        assert!(timeout(Duration::from_millis(200), &mut send).await.is_err(), "the send cannot finish");
        signal(&child.0, libc::SIGKILL);
        let killed_at = Instant::now();
        let error = send.await.unwrap_err();
        let took = killed_at.elapsed();
        assert!(matches!(error, TransportError::PeerClosed { peer: 1, .. }), "{error:?}");
        assert!(took < Duration::from_millis(100), "the death was noticed after {took:?}");
        let _ = child.0.wait();
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigstopped_peer_is_a_timeout_within_the_no_progress_deadline() {
    timeout(LIMIT, async {
        let generation = 103;
        let ep = ShmEndpoint::new(options()).unwrap();
        let (child, mut out, child_addr) = spawn_child("stream", generation, ep.address());
        let no_progress = Duration::from_millis(500);
        let t = connect_parent(&ep, &child_addr, generation, no_progress).await;
        expect_line(&mut out, "streaming");
        let mut buf = vec![0u8; 300_000];
        let mut seq = 0u32;
        let mut stopped_at = None;
        let error = loop {
            match t.recv(1, Tag::new(seq, 0, 1), &mut buf).await {
                Ok(()) => {
                    seq += 1;
                    if seq == 10 {
                        signal(&child.0, libc::SIGSTOP);
                        stopped_at = Some(Instant::now());
                    }
                }
                Err(e) => break e,
            }
        };
        let took = stopped_at.expect("failed before the stop").elapsed();
        // Nothing was asked (fixed deadlines): the error claims no more than the deadline.
        assert!(matches!(error, TransportError::Timeout { peer: 1, silence: Silence::Unprobed, .. }), "{error:?}");
        assert!(took >= no_progress && took < no_progress + Duration::from_secs(1), "timed out after {took:?}");
        signal(&child.0, libc::SIGKILL);
        drop(child);
        drop(t);
        assert_eq!(mapped_segments(generation), 0);
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_learned_deadlines_a_sigstopped_peer_fails_soon_after_the_learned_one() {
    timeout(LIMIT, async {
        let generation = 104;
        let ep = ShmEndpoint::new(options()).unwrap();
        let (child, mut out, child_addr) = spawn_child("stream", generation, ep.address());
        let ceiling = Duration::from_secs(10);
        let peers = [ep.address().clone(), child_addr.clone()];
        let learning = Some(Learning::with_floor(FLOOR));
        let t = ep.connect_mesh(learning_spec(generation, 0, peers, ceiling, learning)).await.expect("mesh");
        expect_line(&mut out, "streaming");
        let mut buf = vec![0u8; 300_000];
        let mut seq = 0u32;
        let mut stopped_at = None;
        let error = loop {
            match t.recv(1, Tag::new(seq, 0, 1), &mut buf).await {
                Ok(()) => {
                    seq += 1;
                    if seq == 20 {
                        let in_force = t.deadlines_in_force()[0].1;
                        assert_eq!(in_force.value, FLOOR, "{in_force}");
                        signal(&child.0, libc::SIGSTOP);
                        stopped_at = Some(Instant::now());
                    }
                }
                Err(e) => break e,
            }
        };
        let took = stopped_at.expect("failed before the stop").elapsed();
        // The error says what the probe found: the peer's process is stopped.
        assert!(
            matches!(error, TransportError::Timeout { peer: 1, silence: Silence::ProcessStopped, .. }),
            "{error:?}"
        );
        assert!(error.to_string().contains("(process stopped)"), "{error}");
        assert!(took >= FLOOR && took < Duration::from_secs(2), "timed out after {took:?} (ceiling {ceiling:?})");
        signal(&child.0, libc::SIGKILL);
        drop(child);
        drop(t);
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_learned_deadlines_a_peer_that_pauses_but_runs_is_waited_for() {
    timeout(LIMIT, async {
        let generation = 105;
        let ep = ShmEndpoint::new(options()).unwrap();
        let (child, mut out, child_addr) = spawn_child("pause", generation, ep.address());
        let peers = [ep.address().clone(), child_addr.clone()];
        let learning = Some(Learning::with_floor(FLOOR));
        let t = ep
            .connect_mesh(learning_spec(generation, 0, peers, Duration::from_secs(10), learning))
            .await
            .expect("mesh");
        expect_line(&mut out, "streaming");
        let mut buf = vec![0u8; 300_000];
        let start = Instant::now();
        // The child sends 20 messages, runs without sending for 1 s (seven learned deadlines),
        // then sends 20 more: every one arrives, none fails.
        for seq in 0..40u32 {
            t.recv(1, Tag::new(seq, 0, 1), &mut buf).await.unwrap_or_else(|e| panic!("message {seq}: {e}"));
            assert!(buf.iter().all(|&b| b == seq as u8), "message {seq} corrupted");
        }
        assert!(start.elapsed() >= Duration::from_secs(1));
        drop(child);
        drop(t);
    })
    .await
    .expect("test timed out");
}

/// The child side (rank 1). Runs only when started by the tests above.
#[test]
#[ignore = "the peer process of the tests in this file; they start it"]
fn child_rank() {
    let Ok(mode) = std::env::var("COHORT_SHM_CHILD") else { return };
    let generation: u64 = std::env::var("COHORT_SHM_GENERATION").unwrap().parse().unwrap();
    let parent = ShmAddress::decode(&std::env::var("COHORT_SHM_PARENT").unwrap()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async move {
        let ep = ShmEndpoint::new(options()).unwrap();
        println!("addr={}", ep.address().encode());
        let peers = [parent, ep.address().clone()];
        let learning = (mode == "pause").then_some(Learning::with_floor(FLOOR));
        let t = ep
            .connect_mesh(learning_spec(generation, 1, peers, Duration::from_secs(60), learning))
            .await
            .expect("child mesh");
        match mode.as_str() {
            "pause" => {
                println!("streaming");
                for seq in 0u32..40 {
                    if seq == 20 {
                        // Running, not sending (a long step, a checkpoint).
                        std::thread::sleep(Duration::from_secs(1));
                    }
                    let msg = vec![seq as u8; 300_000];
                    t.send(0, Tag::new(seq, 0, 1), &msg).await.expect("child send");
                }
                // Park until the parent kills it (a backstop bound, not synchronisation).
                tokio::time::sleep(Duration::from_secs(600)).await;
            }
            "stream" => {
                println!("streaming");
                for seq in 0u32.. {
                    let msg = vec![seq as u8; 300_000];
                    t.send(0, Tag::new(seq, 0, 1), &msg).await.expect("child send");
                }
            }
            _ => {
                // Linked, but never reads: the parent's large send fills the ring and waits.
                // This process only parks here until the parent kills it (the bound is a
                // backstop, not synchronisation; the parent's test has its own limit).
                println!("ready");
                tokio::time::sleep(Duration::from_secs(600)).await;
                drop(t);
            }
        }
    });
}
