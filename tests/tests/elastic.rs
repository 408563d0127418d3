//! The elastic runtime end to end: real coordinator and worker processes.
//!
//! Each test runs a small job (`cohort-worker train`, every step's allreduce verified),
//! injects one fault, and checks what the workers printed. Every test is bounded.

use cohort_chaos::cluster::{Cluster, StoreKind};
use cohort_chaos::invariants;
use cohort_integration_tests::{check, of, test_cluster, test_worker};
use std::time::Duration;

const BOUND: Duration = Duration::from_secs(150);

async fn kill_one_of_four(store: StoreKind, job: &str) {
    let mut cluster = Cluster::start(test_cluster(job, store, 2)).await.expect("cluster");
    let spec = test_worker(40, "8M");
    for i in 0..4 {
        cluster.spawn_worker(&format!("w{i}"), &spec).expect("spawn");
    }
    cluster.wait_for("generation of 4", Duration::from_secs(60), |e| e.kind == "generation" && e.int("world") == Some(4)).await.expect("formed");
    cluster.wait_for("5 steps", Duration::from_secs(60), |e| e.kind == "step" && e.int("step").unwrap_or(0) >= 5).await.expect("steps");
    cluster.wait_for("w1 in an allreduce", Duration::from_secs(30), |e| e.kind == "allreduce" && e.worker == "w1").await.expect("allreduce");
    let killed_at = cluster.signal_worker("w1", libc::SIGKILL).expect("kill");
    let codes = cluster.wait_workers(Duration::from_secs(120)).await;
    let events = &cluster.events;
    for w in ["w0", "w2", "w3"] {
        let error = of(events, w, "error").find(|e| e.t_ms() >= killed_at);
        check(error.is_some(), &format!("{w} saw no error after the kill"), events);
        let cause = error.and_then(|e| e.text("cause")).unwrap_or_default();
        check(cause.contains("w1"), &format!("{w}'s error does not name the root cause w1: {cause:?}"), events);
        check(codes.get(w) == Some(&Some(0)), &format!("{w} exit code {:?}", codes.get(w)), events);
        let summary = of(events, w, "summary").last();
        check(summary.and_then(|s| s.int("final_step")) == Some(40), &format!("{w} did not finish all steps"), events);
    }
    check(events.iter().any(|e| e.kind == "generation" && e.int("world") == Some(3)), "no generation of 3 formed", events);
    check(
        events.iter().filter(|e| e.kind == "generation").all(|e| e.text("transport") == Some("tcp")),
        "a generation does not say transport=tcp",
        events,
    );
    for c in [invariants::no_wrong_results(events), invariants::generations_increase(events), invariants::commits_never_lost(events)] {
        check(c.ok, &format!("{}: {}", c.what, c.detail), events);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_one_of_four_memory_store() {
    tokio::time::timeout(BOUND, kill_one_of_four(StoreKind::Memory, "kill9-mem")).await.expect("test bound");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_one_of_four_etcd_store() {
    tokio::time::timeout(BOUND, kill_one_of_four(StoreKind::Etcd, "kill9-etcd")).await.expect("test bound");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstopped_rank_is_caught_and_the_job_goes_on() {
    tokio::time::timeout(BOUND, async {
        let mut cluster = Cluster::start(test_cluster("sigstop", StoreKind::Memory, 2)).await.expect("cluster");
        let spec = test_worker(40, "1M");
        for i in 0..4 {
            cluster.spawn_worker(&format!("w{i}"), &spec).expect("spawn");
        }
        cluster.wait_for("5 steps", Duration::from_secs(60), |e| e.kind == "step" && e.int("step").unwrap_or(0) >= 5).await.expect("steps");
        let stopped_at = cluster.signal_worker("w2", libc::SIGSTOP).expect("stop");
        // The others finish without it (deadline and lease catch it); then it is killed.
        let mut finished = 0;
        while finished < 3 {
            let e = cluster.wait_for("survivors to finish", Duration::from_secs(100), |e| e.kind == "summary" && e.worker != "w2").await.expect("finish");
            assert_eq!(e.int("final_step"), Some(40), "{} stopped early", e.worker);
            finished += 1;
        }
        cluster.signal_worker("w2", libc::SIGKILL);
        cluster.wait_workers(Duration::from_secs(10)).await;
        let events = &cluster.events;
        for w in ["w0", "w1", "w3"] {
            let error = of(events, w, "error").find(|e| e.t_ms() >= stopped_at);
            check(error.is_some(), &format!("{w} saw no error after the SIGSTOP"), events);
        }
        check(events.iter().any(|e| e.kind == "generation" && e.int("world") == Some(3)), "no generation of 3", events);
        check(invariants::no_wrong_results(events).ok, "wrong result", events);
    })
    .await
    .expect("test bound");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifth_worker_joins_with_the_committed_state() {
    tokio::time::timeout(BOUND, async {
        let mut cluster = Cluster::start(test_cluster("join5", StoreKind::Memory, 2)).await.expect("cluster");
        let spec = test_worker(60, "1M");
        for i in 0..4 {
            cluster.spawn_worker(&format!("w{i}"), &spec).expect("spawn");
        }
        cluster.wait_for("10 steps", Duration::from_secs(60), |e| e.kind == "step" && e.int("world") == Some(4) && e.int("step").unwrap_or(0) >= 10).await.expect("steps");
        cluster.spawn_worker("w4", &spec).expect("spawn joiner");
        let joined = cluster.wait_for("w4's generation", Duration::from_secs(60), |e| e.kind == "generation" && e.worker == "w4").await.expect("joined");
        assert_eq!(joined.int("world"), Some(5));
        let restored = cluster.wait_for("w4's restore", Duration::from_secs(30), |e| e.kind == "restored" && e.worker == "w4").await.expect("restored");
        assert!(restored.int("step").unwrap_or(-1) >= 10, "joiner restored step {:?}", restored.int("step"));
        assert_eq!(restored.text("changed"), Some("true"));
        let codes = cluster.wait_workers(Duration::from_secs(120)).await;
        let events = &cluster.events;
        for (w, code) in &codes {
            check(*code == Some(0), &format!("{w} exited {code:?}"), events);
        }
        // A join never aborts a collective.
        check(!events.iter().any(|e| e.kind == "error"), "a join caused an error", events);
        check(invariants::no_wrong_results(events).ok, "wrong result", events);
    })
    .await
    .expect("test bound");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_leave_reforms_without_a_failure() {
    tokio::time::timeout(BOUND, async {
        let mut cluster = Cluster::start(test_cluster("leave", StoreKind::Memory, 2)).await.expect("cluster");
        let spec = test_worker(50, "1M");
        for i in 0..4 {
            cluster.spawn_worker(&format!("w{i}"), &spec).expect("spawn");
        }
        cluster.wait_for("5 steps", Duration::from_secs(60), |e| e.kind == "step" && e.int("step").unwrap_or(0) >= 5).await.expect("steps");
        cluster.signal_worker("w3", libc::SIGTERM).expect("term");
        let codes = cluster.wait_workers(Duration::from_secs(120)).await;
        let events = &cluster.events;
        check(of(events, "w3", "leave").next().is_some(), "w3 did not leave gracefully", events);
        for (w, code) in &codes {
            check(*code == Some(0), &format!("{w} exited {code:?}"), events);
        }
        check(!events.iter().any(|e| e.kind == "error"), "a graceful leave caused an error", events);
        check(events.iter().any(|e| e.kind == "generation" && e.int("world") == Some(3)), "no generation of 3", events);
        for w in ["w0", "w1", "w2"] {
            check(of(events, w, "summary").last().and_then(|s| s.int("final_step")) == Some(50), &format!("{w} did not finish"), events);
        }
    })
    .await
    .expect("test bound");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn below_min_workers_ends_the_job_with_a_clear_error() {
    tokio::time::timeout(BOUND, async {
        let mut cluster = Cluster::start(test_cluster("belowmin", StoreKind::Memory, 3)).await.expect("cluster");
        let spec = test_worker(100_000, "64K");
        for i in 0..3 {
            cluster.spawn_worker(&format!("w{i}"), &spec).expect("spawn");
        }
        cluster.wait_for("5 steps", Duration::from_secs(60), |e| e.kind == "step" && e.int("step").unwrap_or(0) >= 5).await.expect("steps");
        cluster.signal_worker("w0", libc::SIGKILL).expect("kill");
        let codes = cluster.wait_workers(Duration::from_secs(60)).await;
        let events = &cluster.events;
        for w in ["w1", "w2"] {
            check(codes.get(w).is_some_and(|c| *c != Some(0)), &format!("{w} should fail, exit {:?}", codes.get(w)), events);
            let fatal = of(events, w, "fatal").last().and_then(|e| e.text("error")).unwrap_or_default().to_string();
            check(fatal.contains("min") || fatal.contains("elastic"), &format!("{w}'s error is not about min_workers: {fatal:?}"), events);
        }
    })
    .await
    .expect("test bound");
}
