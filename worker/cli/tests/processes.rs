//! Collectives with every rank in its own OS process, over real TCP on loopback and over
//! shared memory, through the `cohort-worker` binary: verified allreduce across processes for
//! each algorithm, a rank killed with SIGKILL in the middle of a large allreduce, and
//! `--transport rdma` refusing at once where it cannot work.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const WORKER: &str = env!("CARGO_BIN_EXE_cohort-worker");

/// Kills every child still running when dropped, so a failed test leaves nothing behind.
struct Ranks(Vec<Child>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn bench(ranks: u32, algo: &str, sizes: &str, transport: &str) -> String {
    bench_with(ranks, algo, sizes, transport, &[])
}

/// `cohort-worker bench` with `extra` arguments; its stdout (it must succeed within 120 s).
fn bench_with(ranks: u32, algo: &str, sizes: &str, transport: &str, extra: &[&str]) -> String {
    let mut child = Command::new(WORKER)
        .args([
            "bench",
            "--transport",
            transport,
            "--ranks",
            &ranks.to_string(),
            "--sizes",
            sizes,
            "--iters",
            "3",
            "--warmup",
            "1",
            "--algo",
            algo,
        ])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn cohort-worker bench");
    let (tx, rx) = mpsc::channel();
    let mut stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    std::thread::spawn(move || {
        let mut out = String::new();
        let mut err = String::new();
        let _ = std::io::Read::read_to_string(&mut stdout, &mut out);
        let _ = std::io::Read::read_to_string(&mut stderr, &mut err);
        let _ = tx.send((out, err));
    });
    let (out, err) = match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(r) => r,
        Err(_) => {
            let _ = child.kill();
            panic!("bench --ranks {ranks} --algo {algo} did not finish within 120 s");
        }
    };
    let status = child.wait().expect("wait");
    assert!(status.success(), "bench --ranks {ranks} --algo {algo} failed ({status}):\n{out}\n{err}");
    out
}

#[test]
fn bench_verifies_every_op() {
    // Each rank checks every element of every iteration against the op's expected result
    // (exact/OpPattern) and the bench fails on the first wrong one.
    for op in ["sum", "prod", "min", "max", "avg"] {
        for (ranks, algo, dtype) in [(3, "ring", "f32"), (4, "bcube", "i32"), (2, "rd", "f16")] {
            let out = bench_with(ranks, algo, "4,4100,64K", "auto", &["--op", op, "--dtype", dtype]);
            assert!(out.contains(&format!(" dtype={dtype} op={op} ")), "{out}");
            let lines =
                out.lines().filter(|l| l.starts_with("peer=cohort ") && l.contains(&format!(" ranks={ranks} ")));
            assert_eq!(lines.count(), 3, "{op} {algo}: one parseable line per size:\n{out}");
        }
    }
}

#[test]
fn hierarchical_allreduce_across_emulated_hosts_over_shared_memory_and_tcp() {
    // Two and three "hosts" (shared memory within, TCP between); equal hosts take the
    // two-level schedule, 5 ranks on 2 hosts go through the leaders. Every result verified.
    for (ranks, hosts) in [(4, "2"), (5, "2"), (6, "3")] {
        for op in ["sum", "avg"] {
            let out = bench_with(ranks, "hierarchical", "4,4100,1M", "auto", &["--hosts", hosts, "--op", op]);
            assert!(out.contains(&format!("ranks={ranks} hosts={hosts} ")), "{out}");
            let lines = out.lines().filter(|l| l.starts_with("peer=cohort "));
            assert_eq!(lines.count(), 3, "{ranks} ranks on {hosts} hosts, {op}: one line per size:\n{out}");
        }
    }
}

#[test]
fn bench_refuses_at_once_an_op_its_type_cannot_hold_exactly() {
    let out = Command::new(WORKER)
        .args(["bench", "--ranks", "16", "--sizes", "4K", "--dtype", "u8", "--op", "max"])
        .output()
        .expect("run cohort-worker bench");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("u8 cannot hold exact max values over 16 ranks"), "{err}");
}

#[test]
fn allreduce_across_processes_is_verified_for_every_algorithm() {
    // Sizes: one element, a count not divisible by any world here (1025 f32), and 1 MiB.
    // `auto` (the default) links these ranks, all on one host, over shared memory.
    for ((ranks, algo), transport) in [(3, "ring"), (4, "bcube"), (5, "auto"), (2, "rd")]
        .into_iter()
        .zip(["tcp", "auto"].into_iter().cycle())
        .chain([((3, "auto"), "shm"), ((2, "ring"), "tcp")])
    {
        let out = bench(ranks, algo, "4,4100,1M", transport);
        assert!(out.contains(&format!(" transport={transport} ")), "{out}");
        let lines: Vec<&str> = out.lines().filter(|l| l.starts_with("peer=cohort ")).collect();
        assert_eq!(lines.len(), 3, "one parseable line per size:\n{out}");
        for (line, bytes) in lines.iter().zip([4, 4100, 1 << 20]) {
            assert!(line.contains(&format!(" ranks={ranks} ")), "{line}");
            assert!(line.contains(&format!(" bytes={bytes} ")), "{line}");
            assert!(line.contains(" busbw_GBps="), "{line}");
        }
    }
}

#[test]
fn sigkill_mid_allreduce_fails_every_survivor_promptly_with_a_peer_error() {
    sigkill_mid_allreduce("tcp", "64M", Duration::from_secs(5));
}

#[test]
fn sigkill_mid_allreduce_over_shared_memory_fails_every_survivor_within_100ms() {
    sigkill_mid_allreduce("shm", "4M", Duration::from_millis(100));
}

/// Kills rank 1 of 4 in the middle of allreduces of `size` over `transport`; every survivor must
/// fail with a peer error within `prompt`. The bench ranks' no-progress deadline is 30 s:
/// errors well before it come from the kernel closing the dead rank's sockets (EOF/reset),
/// not from a timer.
fn sigkill_mid_allreduce(transport: &str, size: &str, prompt: Duration) {
    const N: usize = 4;
    const VICTIM: usize = 1;
    let mut ranks = Ranks(Vec::new());
    for rank in 0..N {
        let child = Command::new(WORKER)
            .args(["bench-rank", "--rank", &rank.to_string(), "--ranks", &N.to_string(), "--transport", transport])
            .args([
                "--sizes",
                &format!("4K,{size}"),
                "--iters",
                "1000",
                "--warmup",
                "0",
                "--algo",
                "ring",
                "--dtype",
                "f32",
                "--busy-poll",
                "0us",
            ])
            .env("COHORT_BENCH_TOKEN", "processes-test")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn bench-rank");
        ranks.0.push(child);
    }
    // Each rank prints its address; every rank then gets the full list on stdin.
    let (tx, rx) = mpsc::channel::<(usize, String, Instant)>();
    let mut addresses = vec![String::new(); N];
    for (rank, child) in ranks.0.iter_mut().enumerate() {
        let mut reader = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        reader.read_line(&mut line).expect("address line");
        addresses[rank] = line.trim().strip_prefix("addr=").expect("addr= line").to_string();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in reader.lines().map_while(Result::ok) {
                let _ = tx.send((rank, line, Instant::now()));
            }
        });
    }
    let list = addresses.join(",") + "\n";
    for child in &mut ranks.0 {
        child.stdin.as_mut().expect("stdin").write_all(list.as_bytes()).expect("send addresses");
    }
    // Every rank finishing the 4 KiB size means all are now in the large allreduce loop.
    let mut past_small = 0;
    while past_small < N {
        let (rank, line, _) = rx.recv_timeout(Duration::from_secs(60)).expect("ranks reach the 64 MiB allreduce");
        assert!(!line.starts_with("error"), "rank {rank} failed early: {line}");
        if line.starts_with("result bytes=4096") {
            past_small += 1;
        }
    }
    ranks.0[VICTIM].kill().expect("SIGKILL the victim");
    let killed_at = Instant::now();
    let mut errors = std::collections::BTreeMap::new();
    while errors.len() < N - 1 {
        let (rank, line, at) = rx
            .recv_timeout(prompt.max(Duration::from_secs(5)) * 2)
            .unwrap_or_else(|_| panic!("survivors' errors so far: {errors:?}; the others hang"));
        if let Some(e) = line.strip_prefix("error ") {
            errors.insert(rank, (e.to_string(), at.duration_since(killed_at)));
        }
    }
    for (rank, (error, after)) in &errors {
        assert_ne!(*rank, VICTIM);
        assert!(
            error.contains("peer rank ") && error.contains(" failed"),
            "rank {rank}'s error is not PeerFailed: {error}"
        );
        eprintln!("{transport}: rank {rank} failed {after:?} after the kill: {error}");
        assert!(*after < prompt, "rank {rank} took {after:?} to fail: {error}");
    }
    // Survivors exit non-zero; nothing is left running.
    for (rank, child) in ranks.0.iter_mut().enumerate() {
        if rank == VICTIM {
            continue;
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                assert!(!status.success(), "rank {rank} exited 0 after a peer died");
                break;
            }
            assert!(Instant::now() < deadline, "rank {rank} did not exit after its error");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[test]
fn bench_over_rdma_runs_or_fails_at_once_with_a_clear_message() {
    let started = Instant::now();
    let out = Command::new(WORKER)
        .args(["bench", "--ranks", "2", "--sizes", "4K,1M", "--iters", "3", "--transport", "rdma"])
        .output()
        .expect("run bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        // A build with the `rdma` feature on a machine with a device: results verified.
        assert_eq!(stdout.lines().filter(|l| l.starts_with("peer=cohort ")).count(), 2, "{stdout}");
        eprintln!("RDMA device present: bench over rdma ran and verified every result");
        return;
    }
    // Built without the feature it says so; with it, it names the missing device.
    assert!(
        stderr.contains("--transport rdma") && (stderr.contains("`rdma` feature") || stderr.contains("no RDMA device")),
        "unclear error: {stderr}"
    );
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?} to fail", started.elapsed());
    eprintln!("SKIPPED: bench over rdma: {}", stderr.trim());
}

#[test]
fn train_over_rdma_without_the_feature_or_a_device_fails_at_once_with_a_clear_message() {
    #[cfg(feature = "rdma")]
    if let Ok(devices) = cohort_transports::rdma::device_names() {
        if !devices.is_empty() {
            eprintln!("SKIPPED: RDMA devices {devices:?} present: train --transport rdma gets past the check (needs a job to run)");
            return;
        }
    }
    let started = Instant::now();
    // Port 1 on loopback: nothing listens there, and nothing may be dialled before the check.
    let mut child = Command::new(WORKER)
        .args(["train", "--coordinator", "http://127.0.0.1:1", "--job", "rdma-check", "--steps", "1", "--size", "4K"])
        .args(["--transport", "rdma"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn cohort-worker train");
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if started.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("train --transport rdma was still running after 20 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = child.wait_with_output().expect("output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!status.success(), "train --transport rdma succeeded without a device:\n{stdout}\n{stderr}");
    assert!(
        stderr.contains("--transport rdma") && (stderr.contains("`rdma` feature") || stderr.contains("no RDMA device")),
        "unclear error: {stderr}"
    );
    assert!(stdout.contains("event=fatal"), "no event=fatal line: {stdout}");
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?} to fail", started.elapsed());
    eprintln!("train over rdma refused at once: {}", stderr.trim());
}
