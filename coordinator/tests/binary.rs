//! The `cohort-coordinator` binary: serve on a free port (the bound address is printed),
//! answer `status`, and stop cleanly on SIGTERM.

mod common;

use common::*;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

fn wait_exit(child: &mut Child, bound: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + bound;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        assert!(Instant::now() < deadline, "no exit within {bound:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_status_and_sigterm() {
    bounded(async {
        // `serve` is the default when the first argument is a flag.
        let (mut running, addr) =
            spawn(&["--listen", "127.0.0.1:0", "--store", "memory", "--join-window", "200ms", "--lease-ttl", "5s"]);
        let w = Worker::join(addr, "binjob", "w0", Duration::from_millis(200)).await;
        let g = form_all(std::slice::from_ref(&w), 0).await.remove(0);
        assert_eq!(g.number, 1);
        let endpoint = format!("http://{addr}");
        let out = tokio::task::spawn_blocking(move || {
            Command::new(BIN).args(["status", "--job", "binjob", "--endpoints", &endpoint]).output()
        })
        .await
        .expect("status task")
        .expect("run status");
        assert!(out.status.success(), "status failed: {}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("generation: 1 (1 members"), "{text}");
        assert!(text.contains("w0") && text.contains("host-w0"), "{text}");
        // A job nobody joined: said so, exit 1 (not a status with default settings).
        let endpoint = format!("http://{addr}");
        let out = tokio::task::spawn_blocking(move || {
            Command::new(BIN).args(["status", "--job", "nobody", "--endpoints", &endpoint]).output()
        })
        .await
        .expect("status task")
        .expect("run status");
        assert!(!out.status.success());
        assert!(String::from_utf8_lossy(&out.stderr).contains("job nobody does not exist here"), "{out:?}");
        assert!(text.contains("leader: "), "{text}");
        drop(w);
        let pid = running.0.id().to_string();
        let killed = Command::new("kill").args(["-TERM", &pid]).status().expect("kill -TERM");
        assert!(killed.success());
        let status = tokio::task::spawn_blocking(move || {
            let s = wait_exit(&mut running.0, Duration::from_secs(15));
            (s, running)
        })
        .await
        .expect("wait task")
        .0;
        assert!(status.success(), "exit status after SIGTERM: {status}");
    })
    .await;
}

/// `status` (table and `--json`) names the members and the step of a digest mismatch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_names_members_that_committed_one_step_with_different_digests() {
    bounded(async {
        let (_running, addr) =
            spawn(&["--listen", "127.0.0.1:0", "--store", "memory", "--join-window", "200ms", "--lease-ttl", "5s"]);
        let workers = vec![
            Worker::join(addr, "digjob", "w0", Duration::from_millis(200)).await,
            Worker::join(addr, "digjob", "w1", Duration::from_millis(200)).await,
        ];
        form_all(&workers, 0).await;
        workers[0].commit_digest(1, 3, vec![0xaa; 32]).await.expect("commit");
        workers[1].commit_digest(1, 3, vec![0xbb; 32]).await.expect("commit");
        let status = |json: bool| {
            let endpoint = format!("http://{addr}");
            tokio::task::spawn_blocking(move || {
                let mut cmd = Command::new(BIN);
                cmd.args(["status", "--job", "digjob", "--endpoints", &endpoint]);
                if json {
                    cmd.arg("--json");
                }
                cmd.output()
            })
        };
        let out = status(false).await.expect("status task").expect("run status");
        assert!(out.status.success(), "status failed: {}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("DIGEST MISMATCH: generation 1 step 3 committed with different state by: w0 aaaaaaaaaaaa, w1 bbbbbbbbbbbb"),
            "{text}"
        );
        let out = status(true).await.expect("status task").expect("run status");
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status --json is JSON");
        let m = &json["digest_mismatches"][0];
        assert_eq!((m["generation"].as_u64(), m["step"].as_u64()), (Some(1), Some(3)), "{json}");
        assert_eq!(m["commits"][1]["worker_id"], "w1", "{json}");
        assert_eq!(m["commits"][1]["digest"], "bb".repeat(32), "{json}");
    })
    .await;
}

/// `status` of a job nobody joined (the coordinator answers NOT_FOUND) says so in words and
/// exits 1, with the leader; `--json` prints `"exists": false` and the leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_of_an_unknown_job_says_it_does_not_exist() {
    bounded(async {
        let (_running, addr) = spawn(&["--listen", "127.0.0.1:0", "--store", "memory"]);
        let status = |json: bool| {
            let endpoint = format!("http://{addr}");
            tokio::task::spawn_blocking(move || {
                let mut cmd = Command::new(BIN);
                cmd.args(["status", "--job", "nobody", "--endpoints", &endpoint]);
                if json {
                    cmd.arg("--json");
                }
                cmd.output()
            })
        };
        let out = status(false).await.expect("status task").expect("run status");
        assert!(!out.status.success(), "an unknown job is a failure: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("job nobody does not exist here"), "{err}");
        assert!(String::from_utf8_lossy(&out.stdout).starts_with("leader: "), "{out:?}");
        let out = status(true).await.expect("status task").expect("run status");
        assert!(!out.status.success(), "{out:?}");
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status --json is JSON");
        assert_eq!(json["exists"], false, "{json}");
        assert_eq!(json["job"], "nobody", "{json}");
        assert!(json.get("leader").is_some(), "the leader (null while none leads): {json}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_of_an_unreachable_coordinator_fails() {
    bounded(async {
        // A port nothing listens on: bind one, note it, close it.
        let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
        let endpoint = format!("http://127.0.0.1:{port}");
        let out = tokio::task::spawn_blocking(move || {
            Command::new(BIN).args(["status", "--job", "j", "--endpoints", &endpoint, "--timeout", "2s"]).output()
        })
        .await
        .expect("task")
        .expect("run status");
        assert!(!out.status.success());
        assert!(String::from_utf8_lossy(&out.stderr).contains("no coordinator answered"));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_settings_are_refused_at_start() {
    bounded(async {
        let out = tokio::task::spawn_blocking(|| {
            Command::new(BIN)
                .args(["serve", "--listen", "127.0.0.1:0", "--min-workers", "4", "--max-workers", "2"])
                .output()
        })
        .await
        .expect("task")
        .expect("run");
        assert!(!out.status.success());
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("max_workers"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // etcd's request limits on the memory store, and a transaction of no operations.
        for (args, says) in [
            (&["--etcd-max-txn-ops", "512"], "--etcd-max-txn-ops needs an etcd store"),
            (&["--etcd-max-txn-ops", "0"], "--etcd-max-txn-ops"),
        ] {
            let out = tokio::task::spawn_blocking(move || {
                Command::new(BIN).args(["serve", "--listen", "127.0.0.1:0"]).args(args).output()
            })
            .await
            .expect("task")
            .expect("run");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success() && stderr.contains(says), "{args:?}: {stderr}");
        }
    })
    .await;
}

#[test]
fn credential_prints_the_jobs_credential() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("operator");
    std::fs::write(&file, "operator secret\n").expect("write");
    let run = |job: &str| Command::new(BIN).args(["credential", "--job", job, "--token-file"]).arg(&file).output();
    let out = run("train-1").expect("run credential");
    assert!(out.status.success(), "{out:?}");
    let printed = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(printed, cohort_proto::credentials::job_token(b"operator secret", "train-1"));
    let out = run("bad/job").expect("run credential");
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("job contains"), "{out:?}");
}
