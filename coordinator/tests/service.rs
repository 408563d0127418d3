//! The coordinator service end to end over real loopback gRPC, once on the memory store and
//! once on a private etcd per test (`suite!` instantiates each scenario for both).

mod common;

use cohort_coordinator::exclusion::ExclusionPolicy;
use cohort_coordinator::server::ServerHandle;
use cohort_proto::v1 as pb;
use common::*;
use pb::job_event::Event;
use pb::rendezvous_response::Outcome;
use std::time::{Duration, Instant};

const HB: Duration = Duration::from_millis(100);

/// Four workers rendezvous concurrently: one generation, the same for all, ranks 0..3.
async fn four_workers_form_one_generation(backend: Backend) {
    let backing = Backing::new(backend).await;
    let server = replica(backing.store.clone(), &Options::new(test_settings(backend))).await;
    let addr = server.local_addr();
    let workers = Worker::join_many(addr, "job-a", 4, HB).await;
    let generations = form_all(&workers, 0).await;
    let first = &generations[0];
    assert_eq!(first.number, 1);
    assert_eq!(first.members.len(), 4);
    for (rank, m) in first.members.iter().enumerate() {
        assert_eq!(m.rank as usize, rank);
    }
    for g in &generations {
        assert_eq!(g, first, "every worker sees the identical generation");
    }
    let ids: Vec<_> = first.members.iter().map(|m| m.worker_id.clone()).collect();
    for w in &workers {
        assert!(ids.contains(&w.id));
    }
    let s = status(addr, "job-a").await;
    assert_eq!(s.current.as_ref().map(|g| g.number), Some(1));
    assert_eq!(s.members.len(), 4);
    assert!(s.members.iter().all(|m| m.rank.is_some()));
    assert!(!s.leader.is_empty());
    server.shutdown().await.expect("shutdown");
}

/// Every address a worker published at join (tcp and rdma) reaches the generation record,
/// so that every member can choose the mesh's transport from the record alone.
async fn every_published_address_reaches_the_generation(backend: Backend) {
    let backing = Backing::new(backend).await;
    let server = replica(backing.store.clone(), &Options::new(test_settings(backend))).await;
    let addr = server.local_addr();
    let rdma = "rdma-ep1;lid=17;gid=fe80000000000000021a4bfffe001234;mtu=4096;boot=127.0.0.1:45001";
    let mut both = join_request("job-addr", "w0");
    both.addresses.push(pb::TransportAddress { transport: "rdma".into(), address: rdma.into() });
    both.capabilities.push("transport:rdma".into());
    let workers = vec![Worker::join_with(addr, both.clone(), HB).await, Worker::join(addr, "job-addr", "w1", HB).await];
    let generations = form_all(&workers, 0).await;
    for g in &generations {
        assert_eq!(g.members.len(), 2);
        let w0 = g.members.iter().find(|m| m.worker_id == "w0").expect("w0 is a member");
        assert_eq!(w0.addresses, both.addresses, "w0's tcp and rdma addresses, in the order published");
        let w1 = g.members.iter().find(|m| m.worker_id == "w1").expect("w1 is a member");
        assert_eq!(w1.addresses, join_request("job-addr", "w1").addresses, "w1 published tcp only");
    }
    server.shutdown().await.expect("shutdown");
}

/// The first report is the root cause every watcher gets; a second one and one about an
/// older generation are ignored; survivors re-form at once, keeping their order.
async fn failure_report_revokes_and_survivors_reform_at_once(backend: Backend) {
    let backing = Backing::new(backend).await;
    let mut settings = test_settings(backend);
    settings.join_window = Duration::from_secs(5); // "at once" must not mean "after the window"
    settings.max_workers = 4;
    settings.elastic_timeout = Duration::from_secs(30);
    let server = replica(backing.store.clone(), &Options::new(settings)).await;
    let addr = server.local_addr();
    let workers = Worker::join_many(addr, "job-b", 4, HB).await;
    let g1 = form_all(&workers, 0).await.remove(0); // max reached: forms at once
    let order: Vec<String> = g1.members.iter().map(|m| m.worker_id.clone()).collect();
    let mut watches = Vec::new();
    for w in &workers {
        let mut s = w.watch().await;
        match next_event(&mut s).await {
            Event::GenerationFormed(g) => assert_eq!(g.number, 1),
            other => panic!("first watch message should describe generation 1, got {other:?}"),
        }
        watches.push(s);
    }
    let reporter = workers.iter().find(|w| w.id == order[0]).expect("rank 0");
    let first = reporter.report(1, Some(2), "peer closed the connection").await.expect("report");
    assert!(first.accepted);
    let cause = first.cause.expect("cause");
    assert_eq!((cause.rank, cause.worker_id.as_str()), (Some(2), order[2].as_str()));
    assert_eq!(cause.reported_by, order[0]);
    let second_reporter = workers.iter().find(|w| w.id == order[1]).expect("rank 1");
    let second = second_reporter.report(1, Some(0), "timeout").await.expect("second report");
    assert!(!second.accepted, "the second report is not the root cause");
    assert_eq!(second.cause.as_ref(), Some(&cause));
    for s in &mut watches {
        let revoked = wait_event(s, |e| match e {
            Event::GenerationRevoked(r) => Some(r.clone()),
            _ => None,
        })
        .await;
        assert_eq!(revoked.generation, 1);
        assert_eq!(revoked.cause.as_ref(), Some(&cause));
    }
    // The suspect was evicted.
    let suspect = workers.iter().find(|w| w.id == order[2]).expect("rank 2");
    let err = suspect.rendezvous(1, Duration::from_millis(10)).await.expect_err("evicted");
    assert_eq!(err.code(), tonic::Code::NotFound);
    // Survivors re-form at once, in their old relative order.
    let survivors: Vec<&Worker> =
        order.iter().filter(|id| **id != order[2]).map(|id| workers.iter().find(|w| &w.id == id).expect("w")).collect();
    let started = Instant::now();
    let g2s = futures::future::join_all(survivors.iter().map(|w| w.next_generation(1))).await;
    assert!(started.elapsed() < Duration::from_secs(3), "re-formation took {:?}", started.elapsed());
    let g2 = &g2s[0];
    assert!(g2s.iter().all(|g| g == g2));
    assert_eq!(g2.number, 2);
    let ids: Vec<_> = g2.members.iter().map(|m| m.worker_id.clone()).collect();
    assert_eq!(ids, vec![order[0].clone(), order[1].clone(), order[3].clone()]);
    // A late report about generation 1 changes nothing and gets the old cause.
    let late = survivors[0].report(1, Some(1), "late").await.expect("late report");
    assert!(!late.accepted);
    assert_eq!(late.cause.as_ref(), Some(&cause));
    let s = status(addr, "job-b").await;
    assert_eq!(s.current.as_ref().map(|g| g.number), Some(2));
    assert!(!s.current_revoked);
    server.shutdown().await.expect("shutdown");
}

/// Polls `status` until `worker`'s control stream reads `want` (bounded).
async fn wait_control(addr: std::net::SocketAddr, job: &str, worker: &str, want: Option<bool>) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = status(addr, job).await;
        let seen = s.members.iter().find(|m| m.worker_id == worker).map(|m| m.control_connected);
        if seen == Some(want) {
            return;
        }
        assert!(Instant::now() < deadline, "{worker}'s control stream never read {want:?} (last: {seen:?})");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Two members die together (one host lost): the first report evicts one; the other's
/// lease is still alive, but its control stream closed with its process, so the survivors
/// re-form at once instead of waiting out the join window for it.
async fn two_dead_at_once_reform_without_the_join_window(backend: Backend) {
    let backing = Backing::new(backend).await;
    let mut settings = test_settings(backend);
    settings.join_window = Duration::from_secs(20); // "at once" must not mean "after the window"
    settings.lease_ttl = Duration::from_secs(30); // nor "after the lease lapsed"
    settings.max_workers = 4;
    settings.elastic_timeout = Duration::from_secs(60);
    let server = replica(backing.store.clone(), &Options::new(settings)).await;
    let addr = server.local_addr();
    let mut workers = Worker::join_many(addr, "job-node", 4, HB).await;
    let g1 = form_all(&workers, 0).await.remove(0);
    let rank_of = |id: &str| g1.members.iter().position(|m| m.worker_id == id).expect("placed") as u32;
    let mut watches = Vec::new();
    for w in &workers {
        watches.push(w.watch().await);
    }
    for w in &workers {
        wait_control(addr, "job-node", &w.id, Some(true)).await;
    }
    // w2 and w3 die: their connections close (streams and channels dropped).
    let w3 = workers.pop().expect("w3");
    let w2 = workers.pop().expect("w2");
    drop(watches.split_off(2));
    drop(w3);
    wait_control(addr, "job-node", "w3", Some(false)).await;
    let dead_rank = rank_of("w2");
    let first = workers[0]
        .report_kind(1, Some(dead_rank), "peer closed the connection", pb::failure_report::FailureKind::PeerClosed)
        .await
        .expect("report");
    assert!(first.accepted);
    drop(w2);
    let started = Instant::now();
    let g2s = futures::future::join_all(workers.iter().map(|w| w.next_generation(1))).await;
    assert!(started.elapsed() < Duration::from_secs(5), "re-formation took {:?}", started.elapsed());
    let ids: Vec<String> = g2s[0].members.iter().map(|m| m.worker_id.clone()).collect();
    let mut expected: Vec<String> =
        g1.members.iter().map(|m| m.worker_id.clone()).filter(|id| id == "w0" || id == "w1").collect();
    assert_eq!(ids, std::mem::take(&mut expected), "the survivors, in their old order");
    // w3 is still a member (its lease lives) but is reported with its stream closed.
    let s = status(addr, "job-node").await;
    let w3 = s.members.iter().find(|m| m.worker_id == "w3").expect("w3 still holds its lease");
    assert_eq!(w3.control_connected, Some(false));
    assert_eq!(w3.rank, None, "not placed in generation 2");
    server.shutdown().await.expect("shutdown");
}

/// A live worker whose control stream broke is expected again once it reopens it; a
/// replica's own shutdown does not mark its watchers as gone.
async fn a_reopened_control_stream_counts_as_connected(backend: Backend) {
    let backing = Backing::new(backend).await;
    let server = replica(backing.store.clone(), &Options::new(test_settings(backend))).await;
    let addr = server.local_addr();
    let w = Worker::join(addr, "job-reopen", "w0", HB).await;
    wait_control(addr, "job-reopen", "w0", None).await;
    let first = w.watch().await;
    wait_control(addr, "job-reopen", "w0", Some(true)).await;
    drop(first);
    wait_control(addr, "job-reopen", "w0", Some(false)).await;
    let _second = w.watch().await;
    wait_control(addr, "job-reopen", "w0", Some(true)).await;
    // A watcher that is not a member (an operator's tool) records nothing.
    let mut c = client(addr).await;
    let tool = c
        .watch(pb::WatchRequest {
            job: "job-reopen".into(),
            worker_id: "w0".into(),
            incarnation: w.incarnation + 1000,
            compact: false,
            quiet: false,
        })
        .await
        .expect("watch")
        .into_inner();
    drop(tool);
    // The shutdown ends the stream from the replica's side: w0 stays connected in the store.
    server.shutdown().await.expect("shutdown");
    let again = replica(backing.store.clone(), &Options::new(test_settings(backend))).await;
    let s = status(again.local_addr(), "job-reopen").await;
    let m = s.members.iter().find(|m| m.worker_id == "w0").expect("w0");
    assert_eq!(m.control_connected, Some(true), "a replica's shutdown is not its watchers' death");
    again.shutdown().await.expect("shutdown");
}

/// A stream's first message comes once the stream is recorded as the member's control stream,
/// full or quiet, also when the job has no state yet (an empty event then): so a worker that
/// replaces its stream closes the old one only after the new one counts, and the rendezvous
/// never sees it gone in between.
async fn a_streams_first_message_comes_once_it_is_recorded(backend: Backend) {
    let backing = Backing::new(backend).await;
    let server = replica(backing.store.clone(), &Options::new(test_settings(backend))).await;
    let addr = server.local_addr();
    let w = Worker::join(addr, "job-first", "w0", HB).await;
    for quiet in [false, true, false] {
        let mut stream = w.watch_with(quiet).await;
        let first = tokio::time::timeout(Duration::from_secs(20), stream.message())
            .await
            .expect("a first message within 20 s")
            .expect("watch stream error")
            .expect("watch stream ended");
        assert_eq!(first.event, None, "no generation yet: the first message is empty (quiet: {quiet})");
        let s = status(addr, "job-first").await;
        let m = s.members.iter().find(|m| m.worker_id == "w0").expect("w0");
        assert_eq!(m.control_connected, Some(true), "recorded before its first message (quiet: {quiet})");
        drop(stream);
        wait_control(addr, "job-first", "w0", Some(false)).await;
    }
    server.shutdown().await.expect("shutdown");
}

/// A quiet watch (a member whose host relay carries its events): the state once the stream
/// is recorded, then nothing, not even the revocation a full watch hears; it holds the
/// member's control stream as a full one does, and its close is the member's.
async fn a_quiet_watch_holds_the_control_stream_and_sends_only_the_state(backend: Backend) {
    let backing = Backing::new(backend).await;
    let server = replica(backing.store.clone(), &Options::new(test_settings(backend))).await;
    let addr = server.local_addr();
    let workers = Worker::join_many(addr, "job-quiet", 3, HB).await;
    let g1 = form_all(&workers, 0).await.remove(0);
    let rank_of_w2 = g1.members.iter().position(|m| m.worker_id == workers[2].id).expect("w2 placed") as u32;
    let mut quiet = workers[0].watch_with(true).await;
    match next_event(&mut quiet).await {
        Event::GenerationFormed(g) => assert_eq!(g.number, 1),
        other => panic!("a quiet stream's first message should describe generation 1, got {other:?}"),
    }
    // The state came after the stream was recorded.
    let s = status(addr, "job-quiet").await;
    let w0 = s.members.iter().find(|m| m.worker_id == workers[0].id).expect("w0");
    assert_eq!(w0.control_connected, Some(true));
    let mut full = workers[1].watch().await;
    next_event(&mut full).await;
    assert_eq!(server.metrics().watch_streams(), (1, 1), "one stream with events, one quiet");
    let report = workers[1].report(1, Some(rank_of_w2), "peer closed the connection").await.expect("report");
    assert!(report.accepted);
    wait_event(&mut full, |e| matches!(e, Event::GenerationRevoked(r) if r.generation == 1).then_some(())).await;
    // The full stream has the revocation; nothing is waiting on the quiet one.
    assert!(futures::FutureExt::now_or_never(quiet.message()).is_none(), "a quiet stream carried an event");
    drop(quiet);
    wait_control(addr, "job-quiet", &workers[0].id, Some(false)).await;
    assert_eq!(server.metrics().watch_streams(), (1, 0), "the quiet stream is no longer counted");
    server.shutdown().await.expect("shutdown");
}

/// A member that stops heartbeating revokes the generation with cause "lease expired".
async fn lease_lapse_revokes(backend: Backend) {
    let backing = Backing::new(backend).await;
    let server = replica(backing.store.clone(), &Options::new(test_settings(backend))).await;
    let addr = server.local_addr();
    let mut workers = Worker::join_many(addr, "job-c", 3, HB).await;
    let g1 = form_all(&workers, 0).await.remove(0);
    let mut watch = workers[0].watch().await;
    let victim_rank = g1.members.iter().position(|m| m.worker_id == "w1").expect("w1 placed") as u32;
    let started = Instant::now();
    workers[1].stop_heartbeats();
    let revoked = wait_event(&mut watch, |e| match e {
        Event::GenerationRevoked(r) => Some(r.clone()),
        _ => None,
    })
    .await;
    let cause = revoked.cause.expect("cause");
    assert_eq!(revoked.generation, 1);
    assert_eq!(cause.rank, Some(victim_rank));
    assert_eq!(cause.worker_id, "w1");
    assert_eq!(cause.reported_by, "coordinator");
    assert!(cause.reason.contains("lease expired"), "{}", cause.reason);
    let ttl = test_settings(backend).lease_ttl;
    assert!(started.elapsed() >= ttl / 2, "revoked before the lease could lapse ({:?})", started.elapsed());
    server.shutdown().await.expect("shutdown");
}

/// A hung rank V blocks its neighbour, and a third rank times out waiting on that
/// neighbour: its TIMEOUT report names a live member. The coordinator blames V (silent, by
/// its own heartbeat observations) instead, and evicts V, not the live one.
async fn timeout_report_blames_the_silent_member(backend: Backend) {
    let backing = Backing::new(backend).await;
    let mut settings = test_settings(backend);
    // A long lease, so that lease-lapse detection cannot revoke first; a 1 s heartbeat
    // interval (workers beat every 50 ms), so "fresh" (< 2 s) has a wide margin on a busy
    // machine and etcd's whole-second lease TTLs are fine enough.
    settings.heartbeat_interval = Duration::from_secs(1);
    settings.lease_ttl = Duration::from_secs(20);
    settings.max_workers = 3;
    settings.elastic_timeout = Duration::from_secs(60);
    let server = replica(backing.store.clone(), &Options::new(settings)).await;
    let addr = server.local_addr();
    let mut workers = Worker::join_many(addr, "job-t", 3, Duration::from_millis(50)).await;
    let g1 = form_all(&workers, 0).await.remove(0);
    let rank = |id: &str| g1.members.iter().position(|m| m.worker_id == id).expect("placed") as u32;
    workers[1].stop_heartbeats(); // w1 hangs (SIGSTOP)
                                  // Let w1's silence grow past 2 x heartbeat_interval as the coordinator can certainly
                                  // tell (the passage of time is the condition under test, not a synchronisation):
                                  // exact on the memory store; etcd's lease TTL has whole-second resolution.
    tokio::time::sleep(match backend {
        Backend::Memory => Duration::from_millis(2400),
        Backend::Etcd => Duration::from_millis(3400),
    })
    .await;
    // w0 timed out waiting on w2, which is itself blocked behind w1.
    let reason = format!("timed out after 1.5s waiting on rank {}", rank("w2"));
    let response = workers[0]
        .report_kind(1, Some(rank("w2")), &reason, pb::failure_report::FailureKind::Timeout)
        .await
        .expect("report");
    assert!(response.accepted);
    let cause = response.cause.expect("cause");
    assert_eq!((cause.rank, cause.worker_id.as_str()), (Some(rank("w1")), "w1"), "{}", cause.reason);
    assert_eq!(cause.reported_by, "w0");
    assert!(cause.reason.starts_with("no heartbeat for "), "{}", cause.reason);
    assert!(cause.reason.contains("which is alive"), "{}", cause.reason);
    // The silent one is evicted; the live one named by the report is not.
    let err = workers[1].rendezvous(1, Duration::from_millis(10)).await.expect_err("w1 evicted");
    assert_eq!(err.code(), tonic::Code::NotFound);
    workers[2].rendezvous(1, Duration::from_millis(10)).await.expect("w2 is still a member");
    let s = status(addr, "job-t").await;
    assert_eq!(s.revocation_cause.as_ref(), Some(&cause));
    // A later report is answered with the same (first) cause.
    let late = workers[2]
        .report_kind(1, Some(rank("w0")), "timed out", pb::failure_report::FailureKind::Timeout)
        .await
        .expect("late");
    assert!(!late.accepted);
    assert_eq!(late.cause.as_ref(), Some(&cause));
    server.shutdown().await.expect("shutdown");
}

/// A joiner while a generation is active: ReformationPending on the watch, Commit says
/// pending, and the members re-form with the joiner appended.
async fn joiner_makes_reformation_pending(backend: Backend) {
    let backing = Backing::new(backend).await;
    let server = replica(backing.store.clone(), &Options::new(test_settings(backend))).await;
    let addr = server.local_addr();
    let workers = vec![Worker::join(addr, "job-d", "w0", HB).await, Worker::join(addr, "job-d", "w1", HB).await];
    let g1 = form_all(&workers, 0).await.remove(0);
    assert_eq!(g1.members.len(), 2);
    let mut watch = workers[0].watch().await;
    let commit = workers[0].commit(1, 10).await.expect("commit");
    assert!(!commit.reformation_pending, "nobody waits yet");
    let joiner = Worker::join(addr, "job-d", "j", HB).await;
    let joiner_poll = tokio::spawn(async move {
        let g = joiner.next_generation(0).await;
        (joiner, g)
    });
    let pending = wait_event(&mut watch, |e| match e {
        Event::ReformationPending(p) => Some(*p),
        _ => None,
    })
    .await;
    assert_eq!((pending.generation, pending.joiners), (1, 1));
    assert!(workers[0].commit(1, 20).await.expect("commit").reformation_pending);
    // The generation is still active: the joiner waits until the members come.
    let s = status(addr, "job-d").await;
    assert_eq!(s.current.as_ref().map(|g| g.number), Some(1));
    let g2s = form_all(&workers, 1).await;
    let (_joiner, jg) = joiner_poll.await.expect("joiner task");
    assert_eq!(g2s[0], jg);
    let ids: Vec<_> = jg.members.iter().map(|m| m.worker_id.clone()).collect();
    let mut expected: Vec<String> = g1.members.iter().map(|m| m.worker_id.clone()).collect();
    expected.push("j".into());
    assert_eq!(ids, expected, "survivors keep their order, the joiner is appended");
    server.shutdown().await.expect("shutdown");
}

/// Below min_workers after a failure: the waiting member's Rendezvous gets JobEnded FAILED
/// after the elastic timeout.
async fn below_min_ends_after_elastic_timeout(backend: Backend) {
    let backing = Backing::new(backend).await;
    let mut settings = test_settings(backend);
    settings.min_workers = 2;
    let server = replica(backing.store.clone(), &Options::new(settings)).await;
    let addr = server.local_addr();
    let workers = vec![Worker::join(addr, "job-e", "w0", HB).await, Worker::join(addr, "job-e", "w1", HB).await];
    let g1 = form_all(&workers, 0).await.remove(0);
    let w1_rank = g1.members.iter().position(|m| m.worker_id == "w1").expect("w1") as u32;
    let mut watch = workers[0].watch().await;
    assert!(workers[0].report(1, Some(w1_rank), "w1 died").await.expect("report").accepted);
    let started = Instant::now();
    let ended = loop {
        match workers[0].rendezvous(1, Duration::from_secs(5)).await.expect("rendezvous").outcome {
            Some(Outcome::Ended(e)) => break e,
            Some(Outcome::Waiting(w)) => assert_eq!(w.min_workers, 2),
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(ended.outcome, pb::job_ended::Outcome::Failed as i32);
    assert!(ended.reason.contains("min_workers"), "{}", ended.reason);
    let elapsed = started.elapsed();
    assert!(elapsed >= settings.elastic_timeout - Duration::from_millis(200), "ended too early: {elapsed:?}");
    let on_watch = wait_event(&mut watch, |e| match e {
        Event::JobEnded(e) => Some(e.clone()),
        _ => None,
    })
    .await;
    assert_eq!(on_watch, ended);
    // Late callers are told.
    let mut c = client(addr).await;
    let err = c.join(join_request("job-e", "w9")).await.expect_err("ended job");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert_eq!(status(addr, "job-e").await.ended, Some(ended));
    server.shutdown().await.expect("shutdown");
}

/// A worker blamed for three failures is excluded: its Join is refused, naming why.
async fn repeated_failures_exclude(backend: Backend) {
    let backing = Backing::new(backend).await;
    let mut settings = test_settings(backend);
    settings.min_workers = 2;
    settings.elastic_timeout = Duration::from_secs(60);
    let mut options = Options::new(settings);
    options.exclusion = ExclusionPolicy {
        threshold: 3,
        window: Duration::from_secs(600),
        base_cooldown: Duration::from_secs(30),
        max_cooldown: Duration::from_secs(1800),
    };
    let server = replica(backing.store.clone(), &options).await;
    let addr = server.local_addr();
    let good = Worker::join(addr, "job-f", "good", HB).await;
    let mut after = 0;
    for round in 0..3 {
        // min_workers = 2: `good` cannot re-form alone, so each round's generation has both.
        let flaky = Worker::join(addr, "job-f", "flaky", HB).await;
        let gs = futures::future::join_all([good.next_generation(after), flaky.next_generation(0)]).await;
        assert_eq!(gs[0], gs[1], "round {round}");
        let g = gs[0].clone();
        let rank = g.members.iter().position(|m| m.worker_id == "flaky").expect("flaky placed") as u32;
        assert!(good.report(g.number, Some(rank), "flaky broke").await.expect("report").accepted);
        after = g.number;
    }
    let mut c = client(addr).await;
    let err = c.join(join_request("job-f", "flaky")).await.expect_err("excluded");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(err.message().contains("excluded") && err.message().contains("3 failures"), "{}", err.message());
    // The refusal says, machine-readably, when to come back: the rest of the 30 s cool-down.
    let retry_after: u64 = err
        .metadata()
        .get(cohort_proto::RETRY_AFTER_MS_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {} on the refusal: {:?}", cohort_proto::RETRY_AFTER_MS_HEADER, err.metadata()));
    assert!((20_000..=30_000).contains(&retry_after), "retry after {retry_after} ms of a 30 s cool-down");
    let s = status(addr, "job-f").await;
    assert!(
        s.exclusions.iter().any(|x| x.worker_id == "flaky" && x.reason.starts_with("3 failures within 10 min")),
        "{:?}",
        s.exclusions
    );
    // A graceful leave never counts: the good worker can leave and come back.
    good.leave(false).await.expect("leave");
    let back = Worker::join(addr, "job-f", "good", HB).await;
    assert!(back.incarnation != good.incarnation);
    server.shutdown().await.expect("shutdown");
}

/// Graceful leave re-forms the rest without revocation; when every member finishes, the job
/// ends FINISHED and its keys are gone.
async fn leave_and_finish(backend: Backend) {
    let backing = Backing::new(backend).await;
    let server = replica(backing.store.clone(), &Options::new(test_settings(backend))).await;
    let addr = server.local_addr();
    let workers = Worker::join_many(addr, "job-g", 3, HB).await;
    let g1 = form_all(&workers, 0).await.remove(0);
    let mut watch = workers[0].watch().await;
    workers[2].leave(false).await.expect("graceful leave");
    workers[2].leave(false).await.expect("leaving twice is harmless");
    let pending = wait_event(&mut watch, |e| match e {
        Event::ReformationPending(p) => Some(*p),
        _ => None,
    })
    .await;
    assert_eq!((pending.generation, pending.joiners), (1, 0));
    assert!(workers[0].commit(1, 5).await.expect("commit").reformation_pending, "the rest should re-form");
    let s = status(addr, "job-g").await;
    assert!(!s.current_revoked, "a graceful leave does not revoke");
    let g2s = form_all(&workers[..2], 1).await;
    assert_eq!(g2s[0].number, 2);
    let expected: Vec<String> = g1.members.iter().map(|m| m.worker_id.clone()).filter(|w| w != "w2").collect();
    assert_eq!(g2s[0].members.iter().map(|m| m.worker_id.clone()).collect::<Vec<_>>(), expected);
    for w in &workers[..2] {
        w.leave(true).await.expect("finished");
    }
    let ended = wait_event(&mut watch, |e| match e {
        Event::JobEnded(e) => Some(e.clone()),
        _ => None,
    })
    .await;
    assert_eq!(ended.outcome, pb::job_ended::Outcome::Finished as i32);
    let (kvs, _) = backing.store.get_prefix("/cohort/v1/jobs/job-g/").await.expect("read");
    let keys: Vec<_> = kvs.iter().map(|kv| kv.key.clone()).collect();
    assert_eq!(keys, vec!["/cohort/v1/jobs/job-g/ended".to_string()], "only the end record is left");
    server.shutdown().await.expect("shutdown");
}

/// A job's end as a training run's: every member finishes at once, split between two
/// replicas of one store. The leaves are more than one group's worth per replica, so they are
/// written in several shared transactions, contending with the other replica's for the
/// generation record. Every leave is answered OK, the job ends Finished, and only the end
/// record is left.
async fn a_whole_job_finishing_at_once_ends_it(backend: Backend) {
    const N: usize = 120;
    let backing = Backing::new(backend).await;
    let mut settings = test_settings(backend);
    settings.max_workers = N as u32;
    settings.join_window = Duration::from_secs(5);
    settings.elastic_timeout = Duration::from_secs(60);
    // Heartbeats once a second keep 120 members alive without loading the test machine.
    settings.lease_ttl = Duration::from_secs(20);
    let options = Options::new(settings);
    let (a, b) = tokio::join!(replica(backing.store.clone(), &options), replica(backing.store.clone(), &options));
    let mut workers = Vec::with_capacity(N);
    for i in 0..N {
        let addr = if i % 2 == 0 { a.local_addr() } else { b.local_addr() };
        workers.push(Worker::join(addr, "job-end", &format!("w{i:03}"), Duration::from_secs(1)).await);
    }
    let g1 = form_all(&workers, 0).await.remove(0);
    assert_eq!(g1.members.len(), N);
    let mut watch = workers[0].watch().await;
    let leaves = futures::future::join_all(workers.iter().map(|w| w.leave(true))).await;
    let refused: Vec<String> =
        leaves.iter().zip(&workers).filter_map(|(r, w)| r.as_ref().err().map(|s| format!("{}: {s}", w.id))).collect();
    assert!(refused.is_empty(), "{} leaves refused: {refused:?}", refused.len());
    let ended = wait_event(&mut watch, |e| match e {
        Event::JobEnded(e) => Some(e.clone()),
        _ => None,
    })
    .await;
    assert_eq!(ended.outcome, pb::job_ended::Outcome::Finished as i32, "{}", ended.reason);
    let (kvs, _) = backing.store.get_prefix("/cohort/v1/jobs/job-end/").await.expect("read");
    let keys: Vec<_> = kvs.iter().map(|kv| kv.key.clone()).collect();
    assert_eq!(keys, vec!["/cohort/v1/jobs/job-end/ended".to_string()], "only the end record is left");
    let late = client(a.local_addr()).await.join(join_request("job-end", "late")).await.expect_err("the job ended");
    assert!(late.message().contains("has ended"), "{}", late.message());
    // A member still beating in the generation it had: the job's generations are gone (the
    // newest reads as 0), but it must hear that the job ended (NOT_FOUND: its heartbeat stops),
    // not that its generation is in the future, which a worker retries for ever.
    let mut c = workers[1].client.clone();
    let beat = pb::HeartbeatRequest {
        job: "job-end".into(),
        worker_id: workers[1].id.clone(),
        incarnation: workers[1].incarnation,
        generation: g1.number,
        ..Default::default()
    };
    let refused = c.heartbeat(beat).await.expect_err("the job ended");
    assert_eq!(refused.code(), tonic::Code::NotFound, "{}", refused.message());
    drop(workers);
    a.shutdown().await.expect("shutdown");
    b.shutdown().await.expect("shutdown");
}

/// A restarted worker (same id, new join) revokes the generation it was in.
async fn restart_revokes(backend: Backend) {
    let backing = Backing::new(backend).await;
    let mut settings = test_settings(backend);
    settings.min_workers = 2;
    settings.elastic_timeout = Duration::from_secs(60);
    // A lease longer than the 1.2 s after which a silent holder counts as gone: the restart,
    // not the lease's lapse, is what replaces the dead incarnation.
    settings.lease_ttl = Duration::from_secs(5);
    let server = replica(backing.store.clone(), &Options::new(settings)).await;
    let addr = server.local_addr();
    let workers = vec![Worker::join(addr, "job-h", "w0", HB).await, Worker::join(addr, "job-h", "w1", HB).await];
    form_all(&workers, 0).await;
    let mut watch = workers[0].watch().await;
    // w1's process dies (its heartbeats stop) and a new one starts with its id at once: it is
    // refused while the predecessor may still be alive, told when it counts as gone, and
    // joins then.
    let mut workers = workers;
    workers[1].stop_heartbeats();
    let again = join_after_silent_predecessor(addr, join_request("job-h", "w1")).await;
    assert_ne!(again.incarnation, workers[1].incarnation);
    let revoked = wait_event(&mut watch, |e| match e {
        Event::GenerationRevoked(r) => Some(r.clone()),
        _ => None,
    })
    .await;
    let cause = revoked.cause.expect("cause");
    assert!(cause.reason.contains("restarted"), "{}", cause.reason);
    assert_eq!(cause.worker_id, "w1");
    let err = workers[1].rendezvous(1, Duration::from_millis(10)).await.expect_err("old incarnation");
    assert_eq!(err.code(), tonic::Code::NotFound);
    let gs = futures::future::join_all([workers[0].next_generation(1), again.next_generation(0)]).await;
    assert_eq!(gs[0], gs[1]);
    assert_eq!(gs[0].number, 2);
    server.shutdown().await.expect("shutdown");
}

/// Joins with `request`, whose worker id a process that has died (stopped heartbeating) may
/// still hold: on ALREADY_EXISTS it asks again when the coordinator says the holder counts as
/// gone (at most twice), as the worker's own join does.
async fn join_after_silent_predecessor(addr: std::net::SocketAddr, request: pb::JoinRequest) -> Worker {
    for _ in 0..3 {
        match Worker::try_join_with(addr, request.clone(), HB).await {
            Ok(w) => return w,
            Err(s) if s.code() == tonic::Code::AlreadyExists => {
                let wait: u64 = s
                    .metadata()
                    .get(cohort_proto::RETRY_AFTER_MS_HEADER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("ALREADY_EXISTS without a retry-after: {s:?}"));
                assert!(wait <= 2_000, "a silent holder counts as gone within 2 s here, not {wait} ms");
                // The coordinator's answer says when to ask again: waiting for it is the protocol.
                tokio::time::sleep(Duration::from_millis(wait + 50)).await;
            }
            Err(s) => panic!("join {}: {s}", request.worker_id),
        }
    }
    panic!("{} was refused three times after its predecessor stopped", request.worker_id)
}

/// A second process joining with the id of a live member is refused at once with
/// ALREADY_EXISTS naming the holder's host (and changes nothing: the holder stays, nothing is
/// revoked, no lease is left behind); the holder's own re-join, naming the incarnation it replaces, is accepted.
async fn a_live_worker_id_is_refused_to_a_second_process(backend: Backend) {
    let backing = Backing::new(backend).await;
    let server = replica(backing.store.clone(), &Options::new(test_settings(backend))).await;
    let addr = server.local_addr();
    // Both heartbeat throughout (they live until the end of the test).
    let workers = Worker::join_many(addr, "job-dup", 2, HB).await;
    let g = form_all(&workers, 0).await.remove(0);
    let holder_incarnation = g.members.iter().find(|m| m.worker_id == "w0").expect("w0").incarnation;
    let mut second = join_request("job-dup", "w0");
    second.host = "second-host".into();
    let mut c = client(addr).await;
    // The join's lease is granted while the join is decided: a refused join gives it back.
    let leases_before = backing.live_leases().await;
    for _ in 0..3 {
        let refused = c.join(second.clone()).await.expect_err("a live holder keeps its id");
        assert_eq!(refused.code(), tonic::Code::AlreadyExists, "{refused:?}");
        assert!(refused.message().contains("held by a live process on host host-w0"), "{}", refused.message());
        assert!(refused.message().contains(&format!("incarnation {holder_incarnation}")), "{}", refused.message());
        assert!(refused.metadata().get(cohort_proto::RETRY_AFTER_MS_HEADER).is_some(), "{refused:?}");
    }
    assert_eq!(backing.live_leases().await, leases_before, "a refused join leaves no lease behind");
    let s = status(addr, "job-dup").await;
    assert!(!s.current_revoked, "a refused join revokes nothing: {:?}", s.revocation_cause);
    let m = s.members.iter().find(|m| m.worker_id == "w0").expect("w0 is a member");
    assert_eq!(m.incarnation, holder_incarnation, "the holder keeps its incarnation");
    // The holder itself joins again (as after an eviction it did not see yet): accepted.
    let own = pb::JoinRequest { replaces: holder_incarnation, ..join_request("job-dup", "w0") };
    let again = c.join(own).await.expect("the holder's own re-join").into_inner();
    assert_ne!(again.incarnation, holder_incarnation);
    server.shutdown().await.expect("shutdown");
}

/// Two processes joining with one new worker id at the same moment: exactly one is admitted
/// (the first join of the id), the other is refused with ALREADY_EXISTS naming the first,
/// which stays the member. The store holds both joins' reads of the id's member record until
/// both have read it (both decide "nobody holds it"), so the race happens every time.
async fn two_first_joins_of_one_worker_id_admit_one(backend: Backend) {
    let backing = Backing::new(backend).await;
    let gated = common::gate::GatedStore::new(backing.store.clone(), 2, |key| key.ends_with("/job-race/members/w0"));
    let server = replica(gated.clone(), &Options::new(test_settings(backend))).await;
    let addr = server.local_addr();
    let join = |host: &str| {
        Worker::try_join_with(addr, pb::JoinRequest { host: host.into(), ..join_request("job-race", "w0") }, HB)
    };
    let (a, b) = tokio::join!(join("host-a"), join("host-b"));
    assert!(gated.met(), "both joins read the member record before either wrote it");
    let (admitted, refused) = match (a, b) {
        (Ok(w), Err(e)) | (Err(e), Ok(w)) => (w, e),
        (Ok(x), Ok(y)) => {
            panic!("both joins of w0 were admitted: incarnations {} and {}", x.incarnation, y.incarnation)
        }
        (Err(x), Err(y)) => panic!("both joins of w0 were refused: {x:?}, {y:?}"),
    };
    assert_eq!(refused.code(), tonic::Code::AlreadyExists, "{refused:?}");
    assert!(refused.message().contains("held by a live process"), "{}", refused.message());
    let s = status(addr, "job-race").await;
    let m = s.members.iter().find(|m| m.worker_id == "w0").expect("w0 is a member");
    assert_eq!(m.incarnation, admitted.incarnation, "the admitted join's incarnation holds the id");
    server.shutdown().await.expect("shutdown");
}

/// Three heartbeating workers (long leases) in generation 1 of `job`.
struct Trio {
    _backing: Backing,
    server: ServerHandle,
    options: Options,
    workers: Vec<Worker>,
    g1: pb::Generation,
}

impl Trio {
    /// Each worker on a host of its own.
    async fn form(backend: Backend, job: &str) -> Self {
        Self::form_on(backend, job, None, None).await
    }

    /// Every worker on `host` when given (one failure domain), else each on its own; the
    /// replica's exclusion policy when given, else the default.
    async fn form_on(backend: Backend, job: &str, host: Option<&str>, exclusion: Option<ExclusionPolicy>) -> Self {
        let backing = Backing::new(backend).await;
        let mut settings = test_settings(backend);
        settings.max_workers = 3;
        settings.lease_ttl = Duration::from_secs(20);
        let mut options = Options::new(settings);
        if let Some(exclusion) = exclusion {
            options.exclusion = exclusion;
        }
        let server = replica(backing.store.clone(), &options).await;
        let addr = server.local_addr();
        let mut workers = Vec::new();
        for i in 0..3 {
            let mut request = join_request(job, &format!("w{i}"));
            if let Some(host) = host {
                request.host = host.to_string();
            }
            workers.push(Worker::join_with(addr, request, Duration::from_millis(50)).await);
        }
        let g1 = form_all(&workers, 0).await.remove(0);
        Self { _backing: backing, server, options, workers, g1 }
    }

    /// The workers in rank order of generation 1.
    fn by_rank(&self) -> Vec<&Worker> {
        self.g1
            .members
            .iter()
            .map(|m| self.workers.iter().find(|w| w.id == m.worker_id).expect("member is a worker"))
            .collect()
    }
}

/// Rank `rank` of a three-rank ring reports a timeout waiting on rank `rank - 1`, having
/// received `received` messages of operation 5.
async fn ring_timeout(worker: &Worker, rank: usize, received: u64) -> pb::FailureReportResponse {
    let suspect = ((rank + 2) % 3) as u32;
    let reason = format!("rank {rank} timed out");
    let progress = Some(pb::OpProgress { seq: 5, received });
    worker
        .report_with(1, Some(suspect), &reason, pb::failure_report::FailureKind::Timeout, progress)
        .await
        .unwrap_or_else(|s| panic!("rank {rank}'s report: {s}"))
}

/// Every answer names rank 0, either from rank 1's own report or re-attributed to it; only
/// rank 0 is evicted.
async fn assert_link_from_rank_0_blamed(by_rank: &[&Worker], responses: [pb::FailureReportResponse; 3]) {
    for response in responses {
        let cause = response.cause.expect("cause");
        assert_eq!(cause.rank, Some(0), "{}", cause.reason);
        assert!(cause.reason.contains("got least far") || cause.reason == "rank 1 timed out", "{}", cause.reason);
    }
    let err = by_rank[0].rendezvous(1, Duration::from_millis(10)).await.expect_err("rank 0 evicted");
    assert_eq!(err.code(), tonic::Code::NotFound);
    by_rank[1].rendezvous(1, Duration::from_millis(10)).await.expect("rank 1 is still a member");
    by_rank[2].rendezvous(1, Duration::from_millis(10)).await.expect("rank 2 is still a member");
}

/// A blackholed link: everyone is alive and heartbeating, the timeouts cascade. w0 times out
/// waiting on w1, which itself times out waiting on w2 a moment later: the root cause is the
/// end of the chain (w2), whichever report arrives first, and only w2 is evicted.
async fn cascading_timeouts_blame_the_end_of_the_chain(backend: Backend) {
    let Trio { _backing, server, workers, g1, .. } = Trio::form(backend, "job-c").await;
    let rank = |id: &str| g1.members.iter().position(|m| m.worker_id == id).expect("placed") as u32;
    let timeout = pb::failure_report::FailureKind::Timeout;
    let first = workers[0].report_kind(1, Some(rank("w1")), "timed out after 1.5s waiting on w1", timeout);
    let second = workers[1].report_kind(1, Some(rank("w2")), "timed out after 1.5s waiting on w2", timeout);
    let (a, b) = tokio::join!(first, second);
    for response in [a.expect("w0's report"), b.expect("w1's report")] {
        let cause = response.cause.expect("cause");
        assert_eq!((cause.rank, cause.worker_id.as_str()), (Some(rank("w2")), "w2"), "{}", cause.reason);
    }
    let err = workers[2].rendezvous(1, Duration::from_millis(10)).await.expect_err("w2 evicted");
    assert_eq!(err.code(), tonic::Code::NotFound);
    workers[1].rendezvous(1, Duration::from_millis(10)).await.expect("w1 is still a member");
    workers[0].rendezvous(1, Duration::from_millis(10)).await.expect("w0 is still a member");
    server.shutdown().await.expect("shutdown");
}

/// A ring of three in which the link from one rank to the next goes silent: every rank
/// starves and times out naming the rank it waits on, so the reports form a cycle. The rank
/// behind the silent link got least far in the operation; the rank it waits on is blamed,
/// whichever report arrives first.
async fn a_cycle_of_timeouts_blames_the_link_that_went_silent_first(backend: Backend) {
    let trio = Trio::form(backend, "job-y").await;
    let by_rank = trio.by_rank();
    // Ring: rank r receives from rank r-1. The link 0 -> 1 is silent: rank 1 received 2
    // messages of op 5, rank 2 one more, rank 0 one more again. Two of the three reports name
    // a healthy rank; whichever the coordinator settles first, every rank gets the same answer.
    let (a, b, c) =
        tokio::join!(ring_timeout(by_rank[0], 0, 4), ring_timeout(by_rank[2], 2, 3), ring_timeout(by_rank[1], 1, 2));
    assert_link_from_rank_0_blamed(&by_rank, [a, b, c]).await;
    trio.server.shutdown().await.expect("shutdown");
}

/// The same cycle with its reports split between two replicas of one store, as behind one
/// Kubernetes Service: ranks 0 and 2 report to one replica, rank 1 to the other. Each replica
/// judges the whole cascade from the store, so the replica holding ranks 0 and 2 does not
/// read rank 1 as the chain's end and evict it.
async fn a_cascade_split_across_replicas_is_judged_whole(backend: Backend) {
    let mut trio = Trio::form(backend, "job-s").await;
    let other = replica(trio._backing.store.clone(), &trio.options).await;
    let rank1 = trio.g1.members[1].worker_id.clone();
    let w = trio.workers.iter_mut().find(|w| w.id == rank1).expect("rank 1 is a worker");
    w.client = client(other.local_addr()).await;
    let by_rank = trio.by_rank();
    let (a, b, c) =
        tokio::join!(ring_timeout(by_rank[0], 0, 4), ring_timeout(by_rank[2], 2, 3), ring_timeout(by_rank[1], 1, 2));
    assert_link_from_rank_0_blamed(&by_rank, [a, b, c]).await;
    other.shutdown().await.expect("shutdown");
    trio.server.shutdown().await.expect("shutdown");
}

/// The cycle of timeouts of one silent link with every rank on one host (one failure
/// domain), heard from by no heartbeat for longer than twice the interval (as behind several
/// replicas, where another replica's heartbeats show only in the progress record, written
/// once a period). Every rank is some peer's suspect, but every rank reported: they are
/// alive, so this is the link's failure, not the host's. Only rank 0 is blamed and evicted,
/// the cause names no domain, and the failure counts against rank 0's worker, not the host
/// (a threshold of 1 excludes whatever it counts against).
async fn a_cycle_of_timeouts_on_one_host_is_not_a_host_loss(backend: Backend) {
    let exclusion = ExclusionPolicy {
        threshold: 1,
        window: Duration::from_secs(600),
        base_cooldown: Duration::from_secs(30),
        max_cooldown: Duration::from_secs(1800),
    };
    let mut trio = Trio::form_on(backend, "job-h", Some("vm"), Some(exclusion)).await;
    for w in &mut trio.workers {
        w.stop_heartbeats();
    }
    let addr = trio.server.local_addr();
    // Bounded: polls status until the replica has certainly heard nothing from any of them
    // for longer than two heartbeat intervals (100 ms in the test settings).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let st = status(addr, "job-h").await;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis() as u64;
        if st.members.iter().all(|m| now.saturating_sub(m.last_heartbeat_ms) > 400) {
            break;
        }
        assert!(Instant::now() < deadline, "members still heard from: {:?}", st.members);
        tokio::time::sleep(Duration::from_millis(50)).await; // polling status until the deadline above
    }
    let by_rank = trio.by_rank();
    let (a, b, c) =
        tokio::join!(ring_timeout(by_rank[0], 0, 4), ring_timeout(by_rank[2], 2, 3), ring_timeout(by_rank[1], 1, 2));
    for response in [&a, &b, &c] {
        let cause = response.cause.as_ref().expect("cause");
        assert!(cause.domain.is_empty() && cause.lost_ranks.is_empty(), "not a host loss: {cause:?}");
    }
    assert_link_from_rank_0_blamed(&by_rank, [a, b, c]).await;
    let st = status(addr, "job-h").await;
    let excluded: Vec<&str> = st.exclusions.iter().map(|e| e.worker_id.as_str()).collect();
    assert_eq!(excluded, [by_rank[0].id.as_str()], "{:?}", st.exclusions);
    trio.server.shutdown().await.expect("shutdown");
}

/// The body of a replica's `GET /metrics`.
async fn scrape(server: &ServerHandle) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(server.metrics_addr().expect("metrics")).await.expect("connect");
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await.expect("write");
    let mut body = String::new();
    conn.read_to_string(&mut body).await.expect("read");
    body
}

/// Members of one generation that commit one step with different state digests are flagged:
/// status names the step and every member's digest (and keeps it after they move on), the
/// replica counts it in `cohort_digest_mismatches_total{job}`; equal digests are not flagged;
/// an oversized digest is refused and changes nothing.
async fn different_commit_digests_are_flagged(backend: Backend) {
    let backing = Backing::new(backend).await;
    let server = replica(backing.store.clone(), &Options::new(test_settings(backend))).await;
    let addr = server.local_addr();
    let job = "job-digest";
    let workers = Worker::join_many(addr, job, 3, HB).await;
    form_all(&workers, 0).await;
    for w in &workers {
        w.commit_digest(1, 4, vec![1; 32]).await.expect("commit");
    }
    let s = status(addr, job).await;
    assert!(s.digest_mismatches.is_empty(), "{:?}", s.digest_mismatches);
    assert!(s.members.iter().all(|m| m.last_commit_digest == "01".repeat(32)));
    let odd = &workers[2].id;
    for w in &workers {
        let digest = if w.id == *odd { vec![2; 32] } else { vec![1; 32] };
        w.commit_digest(1, 5, digest).await.expect("commit");
    }
    let bad = workers[0].commit_digest(1, 6, vec![7; 4096]).await.expect_err("an oversized digest is refused");
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    let s = status(addr, job).await;
    assert_eq!(s.digest_mismatches.len(), 1, "{:?}", s.digest_mismatches);
    let m = &s.digest_mismatches[0];
    assert_eq!((m.generation, m.step), (1, 5));
    let mut want: Vec<(String, String)> =
        workers.iter().map(|w| (w.id.clone(), if w.id == *odd { "02" } else { "01" }.repeat(32))).collect();
    want.sort();
    let got: Vec<(String, String)> = m.commits.iter().map(|c| (c.worker_id.clone(), c.digest.clone())).collect();
    assert_eq!(got, want);
    assert!(scrape(&server).await.contains(&format!("cohort_digest_mismatches_total{{job=\"{job}\"}} 1")));
    // Every member moves on to an agreed step 6: the mismatch at step 5 stays in the status.
    for w in &workers {
        w.commit_digest(1, 6, vec![3; 32]).await.expect("commit");
    }
    let s = status(addr, job).await;
    assert_eq!(s.digest_mismatches.iter().map(|m| m.step).collect::<Vec<_>>(), vec![5]);
    assert!(s.members.iter().all(|m| m.last_commit_step == 6 && m.last_commit_digest == "03".repeat(32)));
    assert!(scrape(&server).await.contains(&format!("cohort_digest_mismatches_total{{job=\"{job}\"}} 1")));
    server.shutdown().await.expect("shutdown");
}

/// A node of two ranks lost at once (`n1`: both silent), reported by a survivor: one cause
/// naming the domain and both ranks, both evicted, and the failure counted once against the
/// domain (threshold 1: every worker of `n1` is then refused, also one never blamed, while
/// other domains join). Ranks group by domain whatever the join order.
async fn a_lost_domain_is_one_failure_of_the_domain(backend: Backend) {
    let backing = Backing::new(backend).await;
    let mut settings = test_settings(backend);
    // Long enough that the leader's lease-lapse check never races the report below.
    settings.lease_ttl = Duration::from_secs(5);
    settings.elastic_timeout = Duration::from_secs(60);
    let mut options = Options::new(settings);
    options.exclusion = ExclusionPolicy {
        threshold: 1,
        window: Duration::from_secs(600),
        base_cooldown: Duration::from_secs(30),
        max_cooldown: Duration::from_secs(1800),
    };
    let server = replica(backing.store.clone(), &options).await;
    let addr = server.local_addr();
    let on = |id: &str, domain: &str| pb::JoinRequest { domain: domain.into(), ..join_request("job-d", id) };
    let mut workers = Vec::new();
    for (id, domain) in [("a", "n1"), ("c", "n2"), ("b", "n1"), ("d", "n2")] {
        workers.push(Worker::join_with(addr, on(id, domain), HB).await);
    }
    let gens = form_all(&workers, 0).await;
    // The rendezvous arrival order is the join order here only by chance; whatever it is,
    // each domain's ranks are adjacent.
    let domains: Vec<&str> = gens[0].members.iter().map(|m| m.domain.as_str()).collect();
    assert!(domains == ["n1", "n1", "n2", "n2"] || domains == ["n2", "n2", "n1", "n1"], "{domains:?}");
    let rank_of = |id: &str| gens[0].members.iter().position(|m| m.worker_id == id).expect("member") as u32;
    let st = status(addr, "job-d").await;
    assert!(
        st.members.iter().all(|m| m.domain == if m.worker_id.as_str() < "c" { "n1" } else { "n2" }),
        "{:?}",
        st.members
    );

    // n1 goes silent (both ranks); wait (bounded) until the coordinator has certainly not
    // heard from either for longer than two heartbeat intervals.
    workers[0].stop_heartbeats();
    workers[2].stop_heartbeats();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let st = status(addr, "job-d").await;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis() as u64;
        let silent =
            st.members.iter().filter(|m| m.domain == "n1" && now.saturating_sub(m.last_heartbeat_ms) > 1500).count();
        if silent == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "n1's members still heard from: {:?}", st.members);
        tokio::time::sleep(Duration::from_millis(50)).await; // polling status until the deadline above
    }
    let (ra, rb) = (rank_of("a"), rank_of("b"));
    let answer = workers[1]
        .report_kind(1, Some(rb), "peer closed the link", pb::failure_report::FailureKind::PeerClosed)
        .await
        .expect("report");
    assert!(answer.accepted);
    let cause = answer.cause.expect("cause");
    let lost = [ra.min(rb), ra.max(rb)];
    assert_eq!((cause.domain.as_str(), cause.lost_ranks.as_slice()), ("n1", &lost[..]), "{cause:?}");
    assert_eq!(cause.rank, Some(rb), "the reported rank stays the cause's rank");
    let named = format!("domain n1 lost: ranks {}, {} (all 2 of its ranks)", lost[0], lost[1]);
    assert!(cause.reason.starts_with(&named), "{}", cause.reason);

    // Both evicted at once: the one never reported too.
    for w in [&workers[0], &workers[2]] {
        let mut c = w.client.clone();
        let hb = c
            .heartbeat(pb::HeartbeatRequest {
                job: "job-d".into(),
                worker_id: w.id.clone(),
                incarnation: w.incarnation,
                ..Default::default()
            })
            .await;
        assert_eq!(hb.map(|_| ()).map_err(|s| s.code()), Err(tonic::Code::NotFound), "{} evicted", w.id);
    }
    // Counted against the domain: any worker of n1 is refused, other domains are not.
    let mut c = client(addr).await;
    for id in ["a", "e"] {
        let refused = c.join(on(id, "n1")).await.expect_err("n1 is excluded");
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
        assert!(refused.message().contains("failure domain n1 is excluded"), "{}", refused.message());
        assert!(refused.metadata().get(cohort_proto::RETRY_AFTER_MS_HEADER).is_some());
    }
    c.join(on("f", "n3")).await.expect("another domain joins");
    // The survivors re-form at once, without waiting for n1's leases.
    let survivors = [&workers[1], &workers[3]];
    let (g2c, g2d) = tokio::join!(survivors[0].next_generation(1), survivors[1].next_generation(1));
    assert_eq!(g2c, g2d);
    assert!(g2c.members.iter().all(|m| m.domain != "n1"), "{:?}", g2c.members);
}

/// One heartbeat of `w` in generation `g` carrying a step timing (compute and collective ms
/// per step over 10 steps).
async fn heartbeat_timing(w: &Worker, g: u64, compute_ms: u64, collective_ms: u64) -> pb::HeartbeatResponse {
    let mut c = w.client.clone();
    c.heartbeat(pb::HeartbeatRequest {
        job: w.job.clone(),
        worker_id: w.id.clone(),
        incarnation: w.incarnation,
        generation: g,
        step: 10,
        activity: "allreduce".into(),
        deadlines: String::new(),
        timing: Some(pb::StepTiming {
            steps: 10,
            compute_us: compute_ms * 1000,
            collective_us: collective_ms * 1000,
            peer_waits: Vec::new(),
        }),
    })
    .await
    .unwrap_or_else(|s| panic!("heartbeat {}: {s}", w.id))
    .into_inner()
}

/// A member whose reported compute per step is 3x the others' is named a straggler after 3
/// consecutive reports (not before), with its figures and the rule, in `status` and the
/// metrics; under the `exclude` policy its heartbeat answer tells it to leave, its graceful
/// leave revokes nothing, its join is refused for the cool-down (with a retry-after), and the
/// others re-form without it.
async fn a_straggler_is_named_and_excluded(backend: Backend) {
    let backing = Backing::new(backend).await;
    let mut settings = test_settings(backend);
    settings.min_workers = 2;
    settings.straggler_policy = cohort_coordinator::stragglers::StragglerPolicy::Exclude;
    settings.straggler_cooldown = Duration::from_secs(5);
    let server = replica(backing.store.clone(), &Options::new(settings)).await;
    let addr = server.local_addr();
    let workers = Worker::join_many(addr, "job-s", 3, HB).await;
    let mut watch = workers[0].watch().await;
    let gs = futures::future::join_all(workers.iter().map(|w| w.next_generation(0))).await;
    let g = gs[0].clone();
    let slow_rank = 1usize;
    let slow = workers.iter().find(|w| w.id == g.members[slow_rank].worker_id).expect("rank 1's worker");
    for round in 1..=3 {
        for w in workers.iter().filter(|w| w.id != slow.id) {
            let answer = heartbeat_timing(w, g.number, 10, 20).await;
            assert!(answer.leave_as_straggler.is_empty(), "{} is no straggler", w.id);
        }
        let answer = heartbeat_timing(slow, g.number, 30, 1).await;
        if round < 3 {
            assert!(answer.leave_as_straggler.is_empty(), "named after {round} reports, before 3");
            let s = status(addr, "job-s").await;
            assert!(s.members.iter().all(|m| m.straggler.is_none()), "round {round}: {:?}", s.members);
        } else {
            assert!(answer.leave_as_straggler.contains("compute slow"), "{}", answer.leave_as_straggler);
        }
    }
    let s = status(addr, "job-s").await;
    for m in &s.members {
        if m.worker_id == slow.id {
            let v = m.straggler.as_ref().expect("the slow member is named");
            assert_eq!((v.kind.as_str(), v.reports), ("compute", 3));
            assert!((v.ratio - 3.0).abs() < 0.01, "{}", v.ratio);
            assert!(v.reason.contains("compute 30.0 ms per step, 3.0x the median 10.0 ms"), "{}", v.reason);
            assert!(v.reason.contains("rule: >= 1.5x"), "{}", v.reason);
            assert!(v.action.starts_with("excluded until"), "{}", v.action);
            assert_eq!(m.timing.as_ref().map(|t| t.compute_us), Some(30_000));
        } else {
            assert!(m.straggler.is_none(), "{} named: {:?}", m.worker_id, m.straggler);
        }
    }
    // The event stream announces it (once its progress reached the store: within a second).
    let named = wait_event(&mut watch, |e| match e {
        Event::StragglerNamed(n) => Some(n.clone()),
        _ => None,
    })
    .await;
    assert_eq!((named.worker_id.as_str(), named.rank, named.generation), (slow.id.as_str(), Some(1), g.number));
    assert_eq!(named.verdict.map(|v| v.kind), Some("compute".to_string()));
    let text = scrape(&server).await;
    assert!(text.contains("cohort_stragglers_named_total{job=\"job-s\",kind=\"compute\"} 1"), "{text}");
    assert!(text.contains("cohort_stragglers_excluded_total{job=\"job-s\"} 1"), "{text}");
    // It leaves gracefully at its commit point: nothing is revoked, its join is refused for
    // the rest of the cool-down, and the others re-form without it.
    slow.leave(false).await.expect("leave");
    let s = status(addr, "job-s").await;
    assert!(!s.current_revoked, "a straggler's leave revokes nothing: {:?}", s.revocation_cause);
    // Status still says why it is gone.
    assert_eq!(s.exclusions.len(), 1, "{:?}", s.exclusions);
    assert_eq!(s.exclusions[0].worker_id, slow.id);
    assert!(
        s.exclusions[0].reason.starts_with("straggler: compute slow: compute 30.0 ms"),
        "{}",
        s.exclusions[0].reason
    );
    let mut c = client(addr).await;
    let err = c.join(join_request("job-s", &slow.id)).await.expect_err("excluded for the cool-down");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    let retry_after: u64 = err
        .metadata()
        .get(cohort_proto::RETRY_AFTER_MS_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("a retry-after on the refusal");
    assert!((1..=5_000).contains(&retry_after), "retry after {retry_after} ms of a 5 s cool-down");
    let rest: Vec<&Worker> = workers.iter().filter(|w| w.id != slow.id).collect();
    let next = futures::future::join_all(rest.iter().map(|w| w.next_generation(g.number))).await;
    assert_eq!(next[0], next[1]);
    assert_eq!(next[0].members.len(), 2);
    assert!(next[0].members.iter().all(|m| m.worker_id != slow.id));
    server.shutdown().await.expect("shutdown");
}

/// Three rounds of heartbeats with `slow` at 30 ms of compute per step and the others at
/// 10 ms; the last answer to `slow`.
async fn slow_rounds(workers: &[Worker], slow: &Worker, generation: u64) -> pb::HeartbeatResponse {
    let mut last = None;
    for _ in 0..3 {
        for w in workers.iter().filter(|w| w.id != slow.id) {
            heartbeat_timing(w, generation, 10, 20).await;
        }
        last = Some(heartbeat_timing(slow, generation, 30, 1).await);
    }
    last.expect("three rounds")
}

/// Exclusions in force count against `min_workers`: with three members and `min_workers` 2,
/// a first straggler is excluded (it stays a member until its commit point), and a second one
/// named in the same generation is not, so the job never falls below `min_workers`.
async fn a_second_straggler_is_not_excluded_below_min_workers(backend: Backend) {
    let backing = Backing::new(backend).await;
    let mut settings = test_settings(backend);
    settings.min_workers = 2;
    settings.straggler_policy = cohort_coordinator::stragglers::StragglerPolicy::Exclude;
    settings.straggler_cooldown = Duration::from_secs(60);
    let server = replica(backing.store.clone(), &Options::new(settings)).await;
    let addr = server.local_addr();
    let workers = Worker::join_many(addr, "job-s2", 3, HB).await;
    let gs = futures::future::join_all(workers.iter().map(|w| w.next_generation(0))).await;
    let g = gs[0].clone();
    let by_rank = |rank: usize| workers.iter().find(|w| w.id == g.members[rank].worker_id).expect("a member");
    let (first, second) = (by_rank(0), by_rank(1));
    let answer = slow_rounds(&workers, first, g.number).await;
    assert!(answer.leave_as_straggler.contains("compute slow"), "the first is excluded: {answer:?}");
    // The first has not left yet (its exclusion is in force); now the second is slow.
    let answer = slow_rounds(&workers, second, g.number).await;
    assert!(answer.leave_as_straggler.is_empty(), "the second must stay: {answer:?}");
    let s = status(addr, "job-s2").await;
    let m = s.members.iter().find(|m| m.worker_id == second.id).expect("the second is a member");
    let v = m.straggler.as_ref().expect("the second is named");
    assert!(v.action.contains("not excluded") && v.action.contains("1 of them excluded already"), "{}", v.action);
    assert_eq!(s.exclusions.len(), 1, "only the first is excluded: {:?}", s.exclusions);
    assert_eq!(s.exclusions[0].worker_id, first.id);
    server.shutdown().await.expect("shutdown");
}

macro_rules! suite {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::common::bounded(super::$name(super::Backend::Memory)).await;
                }
            )*
        }
        mod etcd {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::common::bounded(super::$name(super::Backend::Etcd)).await;
                }
            )*
        }
    };
}

/// One member's beat as a host's relay forwards it.
fn beat(job: &str, id: &str, incarnation: u64, activity: &str) -> pb::HeartbeatRequest {
    pb::HeartbeatRequest {
        job: job.into(),
        worker_id: id.into(),
        incarnation,
        activity: activity.into(),
        ..Default::default()
    }
}

/// `HostHeartbeat` carries several members' heartbeats in one call: each beat is answered
/// alone (a stranger's refused with NOT_FOUND, the others kept), a malformed batch is refused
/// whole and changes nothing, and the batches alone keep their members' leases: the one member
/// left out lapses and is named the cause, the two carried re-form without it.
async fn host_heartbeats_keep_the_leases_they_carry(backend: Backend) {
    let backing = Backing::new(backend).await;
    let server = replica(backing.store.clone(), &Options::new(test_settings(backend))).await;
    let addr = server.local_addr();
    let job = "job-host";
    let shared = client(addr).await;
    let mut workers = Vec::new();
    for id in ["w0", "w1", "w2"] {
        workers.push(Worker::join_on(shared.clone(), join_request(job, id)).await.expect("join"));
    }
    let mut c = shared.clone();
    let mut beats: Vec<_> = workers.iter().map(|w| beat(job, &w.id, w.incarnation, "batched")).collect();
    beats.push(beat(job, "stranger", 77, "batched"));
    let answers = c
        .host_heartbeat(pb::HostHeartbeatRequest { job: job.into(), beats })
        .await
        .expect("a batch with a stranger's beat is answered")
        .into_inner()
        .answers;
    assert_eq!(answers.len(), 4);
    for a in &answers[..3] {
        assert!(matches!(a.outcome, Some(pb::heartbeat_answer::Outcome::Ok(_))), "{a:?}");
    }
    match &answers[3].outcome {
        Some(pb::heartbeat_answer::Outcome::Refused(r)) => {
            assert_eq!(tonic::Code::from_i32(r.code), tonic::Code::NotFound, "{r:?}")
        }
        other => panic!("the stranger's beat was not refused: {other:?}"),
    }
    let activity = |s: &pb::StatusResponse, id: &str| {
        s.members.iter().find(|m| m.worker_id == id).map(|m| m.activity.clone()).expect("listed")
    };
    assert_eq!(activity(&status(addr, job).await, "w0"), "batched");

    // Malformed batches: refused whole, nothing recorded.
    let refused =
        |r: Result<tonic::Response<pb::HostHeartbeatResponse>, tonic::Status>| r.map(|_| ()).map_err(|s| s.code());
    let empty = c.host_heartbeat(pb::HostHeartbeatRequest { job: job.into(), beats: vec![] }).await;
    assert_eq!(refused(empty), Err(tonic::Code::InvalidArgument));
    let w0 = &workers[0];
    let mixed = pb::HostHeartbeatRequest {
        job: job.into(),
        beats: vec![beat(job, &w0.id, w0.incarnation, "mixed"), beat("job-other", "x", 1, "mixed")],
    };
    assert_eq!(refused(c.host_heartbeat(mixed).await), Err(tonic::Code::InvalidArgument));
    let too_many = pb::HostHeartbeatRequest {
        job: job.into(),
        beats: vec![beat(job, &w0.id, w0.incarnation, "many"); cohort_proto::MAX_BEATS_PER_CALL + 1],
    };
    assert_eq!(refused(c.host_heartbeat(too_many).await), Err(tonic::Code::InvalidArgument));
    assert_eq!(activity(&status(addr, job).await, "w0"), "batched", "a refused batch records nothing");

    // w0 and w1 heartbeat only in batches; w2 alone, until it stops.
    let carried: Vec<_> = workers[..2].iter().map(|w| beat(job, &w.id, w.incarnation, "batched")).collect();
    let batches = tokio::spawn(async move {
        let mut tick = tokio::time::interval(HB);
        loop {
            tick.tick().await;
            let _ = c.host_heartbeat(pb::HostHeartbeatRequest { job: "job-host".into(), beats: carried.clone() }).await;
        }
    });
    workers[2].start_heartbeats(HB);
    let g1 = form_all(&workers, 0).await.remove(0);
    assert_eq!(g1.members.len(), 3);
    let mut watch = workers[0].watch().await;
    workers[2].stop_heartbeats();
    let revoked = wait_event(&mut watch, |e| match e {
        Event::GenerationRevoked(r) => Some(r.clone()),
        _ => None,
    })
    .await;
    let cause = revoked.cause.expect("cause");
    assert_eq!((revoked.generation, cause.worker_id.as_str()), (1, "w2"), "{cause:?}");
    assert!(cause.reason.contains("lease expired"), "{}", cause.reason);
    let (g2a, g2b) = tokio::join!(workers[0].next_generation(1), workers[1].next_generation(1));
    assert_eq!(g2a, g2b);
    let ids: Vec<_> = g2a.members.iter().map(|m| m.worker_id.as_str()).collect();
    assert_eq!(ids.len(), 2, "{ids:?}");
    assert!(!ids.contains(&"w2"), "{ids:?}");
    batches.abort();
    server.shutdown().await.expect("shutdown");
}

/// Under `lease_scope = "host"` the members of one host (or of the failure domain they name)
/// share one store lease: the host's record names it, each member record carries it, and the incarnations stay distinct. A
/// member that stops heartbeating while its host-mates go on is swept by the leader (its
/// records deleted, which revokes the generation with "lease expired"); the others re-form
/// without it, and a member that leaves takes its records but not its host's lease.
async fn a_host_shares_one_lease_and_its_silent_member_is_swept(backend: Backend) {
    use cohort_coordinator::keys::{self, Kind};
    use cohort_coordinator::records::{decode, MemberRecord};
    let backing = Backing::new(backend).await;
    let settings =
        cohort_coordinator::JobSettings { lease_scope: cohort_coordinator::LeaseScope::Host, ..test_settings(backend) };
    let server = replica(backing.store.clone(), &Options::new(settings)).await;
    let addr = server.local_addr();
    let job = "job-host-lease";
    let shared = client(addr).await;
    let mut workers = Vec::new();
    // w2 runs on another host of node-a's failure domain: the lease is the domain's.
    let joins = [("w0", "node-a", ""), ("w1", "node-a", ""), ("w2", "node-a2", "node-a"), ("w3", "node-b", "")];
    for (id, host, domain) in joins {
        let request = pb::JoinRequest { host: host.into(), domain: domain.into(), ..join_request(job, id) };
        let mut w = Worker::join_on(shared.clone(), request).await.expect("join");
        w.start_heartbeats(HB);
        workers.push(w);
    }
    let store = backing.store.clone();
    let record = |id: &'static str| {
        let store = store.clone();
        async move {
            let key = keys::worker_key(job, Kind::Member, id);
            let kv = store.get(&key).await.expect("read").expect("member record");
            decode::<MemberRecord>(&key, &kv.value).expect("decodes")
        }
    };
    let (m0, m1, m2, m3) = tokio::join!(record("w0"), record("w1"), record("w2"), record("w3"));
    assert!(!m0.owns_lease() && m0.host_lease != 0, "{m0:?}");
    assert_eq!((m1.lease(), m2.lease()), (m0.lease(), m0.lease()), "one lease for node-a");
    assert_ne!(m3.lease(), m0.lease(), "node-b has its own");
    let incarnations: std::collections::HashSet<u64> = [&m0, &m1, &m2, &m3].iter().map(|m| m.incarnation).collect();
    assert_eq!(incarnations.len(), 4, "distinct incarnations");
    let host_record = store.get(&keys::host_key(job, "node-a")).await.expect("read").expect("node-a's record");
    assert_eq!(host_record.lease, Some(m0.lease()), "the host's record lives on its lease");
    assert!(store.lease_time_to_live(m0.lease()).await.expect("ttl").is_some());

    let g1 = form_all(&workers, 0).await.remove(0);
    assert_eq!(g1.members.len(), 4);
    let mut watch = workers[0].watch().await;
    // w1 falls silent; w0 and w2 keep node-a's lease alive.
    workers[1].stop_heartbeats();
    let revoked = wait_event(&mut watch, |e| match e {
        Event::GenerationRevoked(r) => Some(r.clone()),
        _ => None,
    })
    .await;
    let cause = revoked.cause.expect("cause");
    assert_eq!((revoked.generation, cause.worker_id.as_str()), (1, "w1"), "{cause:?}");
    assert!(cause.reason.contains("lease expired"), "{}", cause.reason);
    assert!(
        store.get(&keys::worker_key(job, Kind::Member, "w1")).await.expect("read").is_none(),
        "the silent member's records are gone"
    );
    assert!(store.lease_time_to_live(m0.lease()).await.expect("ttl").is_some(), "node-a's lease lives on");
    let metrics = scrape(&server).await;
    assert!(metrics.contains("cohort_members_swept_total 1\n"), "{metrics}");
    assert!(metrics.contains("cohort_host_leases_granted_total 2\n"), "one grant per host: {metrics}");
    let survivors = [&workers[0], &workers[2], &workers[3]];
    let (a, b, c) =
        tokio::join!(survivors[0].next_generation(1), survivors[1].next_generation(1), survivors[2].next_generation(1));
    assert!(a == b && b == c);
    let ids: Vec<&str> = a.members.iter().map(|m| m.worker_id.as_str()).collect();
    assert_eq!(ids.len(), 3, "{ids:?}");
    assert!(!ids.contains(&"w1"), "{ids:?}");

    // w2 leaves: its records go, node-a's lease (w0's too) stays.
    let mut c2 = shared.clone();
    c2.leave(pb::LeaveRequest {
        job: job.into(),
        worker_id: "w2".into(),
        incarnation: m2.incarnation,
        mode: pb::leave_request::Mode::Graceful as i32,
    })
    .await
    .expect("leave");
    workers[2].stop_heartbeats();
    for kind in [Kind::Member, Kind::Progress, Kind::Control] {
        assert!(store.get(&keys::worker_key(job, kind, "w2")).await.expect("read").is_none(), "{kind:?} of w2");
    }
    assert!(store.lease_time_to_live(m0.lease()).await.expect("ttl").is_some(), "node-a's lease lives on");
    assert!(store.get(&keys::worker_key(job, Kind::Member, "w0")).await.expect("read").is_some());
    server.shutdown().await.expect("shutdown");
}

suite!(
    a_host_shares_one_lease_and_its_silent_member_is_swept,
    four_workers_form_one_generation,
    every_published_address_reaches_the_generation,
    failure_report_revokes_and_survivors_reform_at_once,
    lease_lapse_revokes,
    joiner_makes_reformation_pending,
    below_min_ends_after_elastic_timeout,
    repeated_failures_exclude,
    leave_and_finish,
    a_whole_job_finishing_at_once_ends_it,
    restart_revokes,
    timeout_report_blames_the_silent_member,
    cascading_timeouts_blame_the_end_of_the_chain,
    a_cycle_of_timeouts_blames_the_link_that_went_silent_first,
    a_cascade_split_across_replicas_is_judged_whole,
    a_cycle_of_timeouts_on_one_host_is_not_a_host_loss,
    two_dead_at_once_reform_without_the_join_window,
    a_reopened_control_stream_counts_as_connected,
    a_streams_first_message_comes_once_it_is_recorded,
    a_quiet_watch_holds_the_control_stream_and_sends_only_the_state,
    different_commit_digests_are_flagged,
    a_lost_domain_is_one_failure_of_the_domain,
    a_straggler_is_named_and_excluded,
    a_second_straggler_is_not_excluded_below_min_workers,
    a_live_worker_id_is_refused_to_a_second_process,
    two_first_joins_of_one_worker_id_admit_one,
    host_heartbeats_keep_the_leases_they_carry,
);
