//! Malformed requests get the documented code and change nothing; the job token is enforced.

mod common;

use cohort_proto::v1 as pb;
use common::*;
use std::time::Duration;
use tonic::Code;

type Call = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), tonic::Status>> + Send>>;

fn check(name: &str, result: Result<(), tonic::Status>, expected: Code) {
    match result {
        Ok(()) => panic!("{name}: accepted, expected {expected:?}"),
        Err(s) => {
            assert_eq!(s.code(), expected, "{name}: {}", s.message());
            assert!(!s.message().is_empty(), "{name}: the message should say what is wrong");
        }
    }
}

async fn snapshot(store: &dyn cohort_coordinator::store::Store) -> Vec<(String, Vec<u8>, i64)> {
    let (kvs, _) = store.get_prefix("/cohort/v1/jobs/").await.expect("read store");
    kvs.into_iter().map(|kv| (kv.key, kv.value, kv.mod_revision)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_refused_without_state_change() {
    bounded(async {
        let backing = Backing::new(Backend::Memory).await;
        let mut settings = test_settings(Backend::Memory);
        // Long lease: the members need no heartbeats, so the store stays still.
        settings.lease_ttl = Duration::from_secs(60);
        settings.elastic_timeout = Duration::from_secs(60);
        let server = replica(backing.store.clone(), &Options::new(settings)).await;
        let addr = server.local_addr();
        let mut workers = Vec::new();
        for i in 0..2 {
            let mut w = Worker::join(addr, "jb", &format!("w{i}"), Duration::from_secs(3600)).await;
            w.stop_heartbeats();
            workers.push(w);
        }
        let g = form_all(&workers, 0).await.remove(0);
        assert_eq!(g.number, 1);
        let inc = workers[0].incarnation;
        let before = snapshot(backing.store.as_ref()).await;
        let status_before = status(addr, "jb").await;
        let c = client(addr).await;

        let join = |f: &dyn Fn(&mut pb::JoinRequest)| {
            let mut r = join_request("jb", "new-worker");
            f(&mut r);
            let mut c = c.clone();
            Box::pin(async move { c.join(r).await.map(|_| ()) }) as Call
        };
        let hb = |f: &dyn Fn(&mut pb::HeartbeatRequest)| {
            let mut r = pb::HeartbeatRequest {
                job: "jb".into(),
                worker_id: "w0".into(),
                incarnation: inc,
                generation: 1,
                step: 0,
                activity: String::new(),
                deadlines: String::new(),
                timing: None,
            };
            f(&mut r);
            let mut c = c.clone();
            Box::pin(async move { c.heartbeat(r).await.map(|_| ()) }) as Call
        };
        let rdv = |f: &dyn Fn(&mut pb::RendezvousRequest)| {
            let mut r = pb::RendezvousRequest {
                job: "jb".into(),
                worker_id: "w0".into(),
                incarnation: inc,
                after_generation: 1,
                wait_ms: 10,
                compact: false,
                partners: false,
                layout: false,
            };
            f(&mut r);
            let mut c = c.clone();
            Box::pin(async move { c.rendezvous(r).await.map(|_| ()) }) as Call
        };
        let report = |f: &dyn Fn(&mut pb::FailureReport)| {
            let mut r = pb::FailureReport {
                job: "jb".into(),
                worker_id: "w0".into(),
                incarnation: inc,
                generation: 1,
                failed_rank: Some(1),
                reason: "x".into(),
                kind: 0,
                progress: None,
            };
            f(&mut r);
            let mut c = c.clone();
            Box::pin(async move { c.report_failure(r).await.map(|_| ()) }) as Call
        };
        let leave = |f: &dyn Fn(&mut pb::LeaveRequest)| {
            let mut r = pb::LeaveRequest {
                job: "jb".into(),
                worker_id: "w0".into(),
                incarnation: inc,
                mode: pb::leave_request::Mode::Graceful as i32,
            };
            f(&mut r);
            let mut c = c.clone();
            Box::pin(async move { c.leave(r).await.map(|_| ()) }) as Call
        };
        let commit = |f: &dyn Fn(&mut pb::CommitRequest)| {
            let mut r = pb::CommitRequest {
                job: "jb".into(),
                worker_id: "w0".into(),
                incarnation: inc,
                generation: 1,
                step: 1,
                digest: vec![1; 32],
            };
            f(&mut r);
            let mut c = c.clone();
            Box::pin(async move { c.commit(r).await.map(|_| ()) }) as Call
        };
        let long = "x".repeat(129);
        let tcp = |a: &str| vec![pb::TransportAddress { transport: "tcp".into(), address: a.into() }];
        let cases: Vec<(&str, Call, Code)> = vec![
            ("join: empty job", join(&|r| r.job.clear()), Code::InvalidArgument),
            ("join: job with a slash", join(&|r| r.job = "a/b".into()), Code::InvalidArgument),
            ("join: worker id too long", join(&|r| r.worker_id = long.clone()), Code::InvalidArgument),
            ("join: worker id with a space", join(&|r| r.worker_id = "w 1".into()), Code::InvalidArgument),
            ("join: protocol version 2", join(&|r| r.protocol_version = 2), Code::InvalidArgument),
            ("join: protocol version 0", join(&|r| r.protocol_version = 0), Code::InvalidArgument),
            ("join: no address", join(&|r| r.addresses.clear()), Code::InvalidArgument),
            ("join: port 0", join(&|r| r.addresses = tcp("127.0.0.1:0")), Code::InvalidArgument),
            ("join: no port", join(&|r| r.addresses = tcp("localhost")), Code::InvalidArgument),
            ("join: garbage host", join(&|r| r.addresses = tcp("not a host:80")), Code::InvalidArgument),
            ("join: unknown transport", join(&|r| r.addresses[0].transport = "udp".into()), Code::InvalidArgument),
            (
                "join: 9 addresses",
                join(&|r| {
                    r.addresses = (1..=9)
                        .map(|i| pb::TransportAddress { transport: "tcp".into(), address: format!("h:{i}") })
                        .collect()
                }),
                Code::InvalidArgument,
            ),
            (
                "join: empty rdma address",
                join(&|r| r.addresses.push(pb::TransportAddress { transport: "rdma".into(), address: String::new() })),
                Code::InvalidArgument,
            ),
            ("join: 33 capabilities", join(&|r| r.capabilities = vec!["c".into(); 33]), Code::InvalidArgument),
            ("join: host too long", join(&|r| r.host = "h".repeat(300)), Code::InvalidArgument),
            ("heartbeat: incarnation 0", hb(&|r| r.incarnation = 0), Code::InvalidArgument),
            ("heartbeat: generation from the future", hb(&|r| r.generation = 99), Code::InvalidArgument),
            ("heartbeat: unknown worker", hb(&|r| r.worker_id = "ghost".into()), Code::NotFound),
            ("heartbeat: wrong incarnation", hb(&|r| r.incarnation = inc + 1000), Code::NotFound),
            ("heartbeat: activity too long", hb(&|r| r.activity = "a".repeat(300)), Code::InvalidArgument),
            ("heartbeat: deadlines too long", hb(&|r| r.deadlines = "d".repeat(300)), Code::InvalidArgument),
            ("heartbeat: bad job", hb(&|r| r.job = "..".into()), Code::InvalidArgument),
            ("rendezvous: after a future generation", rdv(&|r| r.after_generation = 5), Code::InvalidArgument),
            ("rendezvous: bad worker id", rdv(&|r| r.worker_id = "w/0".into()), Code::InvalidArgument),
            ("rendezvous: unknown member", rdv(&|r| r.worker_id = "ghost".into()), Code::NotFound),
            ("rendezvous: incarnation 0", rdv(&|r| r.incarnation = 0), Code::InvalidArgument),
            ("report: generation from the future", report(&|r| r.generation = 7), Code::InvalidArgument),
            ("report: generation 0", report(&|r| r.generation = 0), Code::InvalidArgument),
            ("report: rank outside the generation", report(&|r| r.failed_rank = Some(9)), Code::InvalidArgument),
            ("report: reason over 4 KiB", report(&|r| r.reason = "r".repeat(5000)), Code::InvalidArgument),
            ("report: reporter not a member", report(&|r| r.worker_id = "ghost".into()), Code::PermissionDenied),
            ("report: bad job", report(&|r| r.job = String::new()), Code::InvalidArgument),
            ("leave: mode unspecified", leave(&|r| r.mode = 0), Code::InvalidArgument),
            ("leave: unknown mode", leave(&|r| r.mode = 7), Code::InvalidArgument),
            ("leave: bad worker id", leave(&|r| r.worker_id = long.clone()), Code::InvalidArgument),
            ("commit: digest over 64 bytes", commit(&|r| r.digest = vec![0; 65]), Code::InvalidArgument),
            ("commit: generation from the future", commit(&|r| r.generation = 9), Code::InvalidArgument),
            ("commit: unknown member", commit(&|r| r.worker_id = "ghost".into()), Code::NotFound),
            (
                "status: empty job",
                {
                    let mut c = c.clone();
                    Box::pin(async move { c.status(pb::StatusRequest { job: String::new() }).await.map(|_| ()) })
                        as Call
                },
                Code::InvalidArgument,
            ),
            (
                "watch: bad job",
                {
                    let mut c = c.clone();
                    Box::pin(async move {
                        c.watch(pb::WatchRequest {
                            job: "a b".into(),
                            worker_id: "w0".into(),
                            incarnation: inc,
                            compact: false,
                            quiet: false,
                        })
                        .await
                        .map(|_| ())
                    }) as Call
                },
                Code::InvalidArgument,
            ),
        ];
        for (name, call, code) in cases {
            check(name, call.await, code);
        }
        assert_eq!(snapshot(backing.store.as_ref()).await, before, "a refused request changed the store");
        let status_after = status(addr, "jb").await;
        assert_eq!(status_after.current, status_before.current);
        assert_eq!(status_after.members, status_before.members);
        assert!(!status_after.current_revoked);
        server.shutdown().await.expect("shutdown");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_job_token_is_required() {
    bounded(async {
        let backing = Backing::new(Backend::Memory).await;
        let mut options = Options::new(test_settings(Backend::Memory));
        options.token = Some("s3cret".into());
        let server = replica(backing.store.clone(), &options).await;
        let mut c = client(server.local_addr()).await;
        let missing = c.status(pb::StatusRequest { job: "j".into() }).await.expect_err("no token");
        assert_eq!(missing.code(), Code::Unauthenticated);
        let mut wrong = tonic::Request::new(join_request("j", "w"));
        wrong.metadata_mut().insert("authorization", "Bearer s3cres".parse().expect("ascii"));
        assert_eq!(c.join(wrong).await.expect_err("wrong token").code(), Code::Unauthenticated);
        let mut right = tonic::Request::new(join_request("j", "w"));
        right.metadata_mut().insert("authorization", "Bearer s3cret".parse().expect("ascii"));
        assert!(c.join(right).await.is_ok());
        // Nothing was registered by the refused join.
        let mut right = tonic::Request::new(pb::StatusRequest { job: "j".into() });
        right.metadata_mut().insert("authorization", "Bearer s3cret".parse().expect("ascii"));
        assert_eq!(c.status(right).await.expect("status").into_inner().members.len(), 1);
        // Health probes need no token.
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.local_addr()))
            .expect("endpoint")
            .connect()
            .await
            .expect("connect");
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
        for service in ["", "cohort.v1.Coordinator"] {
            let r = health
                .check(tonic_health::pb::HealthCheckRequest { service: service.into() })
                .await
                .expect("health")
                .into_inner();
            assert_eq!(r.status, tonic_health::pb::health_check_response::ServingStatus::Serving as i32, "{service:?}");
        }
        server.shutdown().await.expect("shutdown");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_served() {
    bounded(async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let backing = Backing::new(Backend::Memory).await;
        let server = replica(backing.store.clone(), &Options::new(test_settings(Backend::Memory))).await;
        let w = Worker::join(server.local_addr(), "jm", "w0", Duration::from_millis(100)).await;
        form_all(std::slice::from_ref(&w), 0).await;
        let mut conn = tokio::net::TcpStream::connect(server.metrics_addr().expect("metrics")).await.expect("connect");
        conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await.expect("write");
        let mut body = String::new();
        conn.read_to_string(&mut body).await.expect("read");
        assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
        assert!(body.contains("cohort_generations_formed_total 1"), "{body}");
        assert!(body.contains("cohort_is_leader 1"), "{body}");
        assert!(body.contains("cohort_rpcs_total{method=\"Join\",code=\"OK\"} 1"), "{body}");
        assert!(body.contains("cohort_formation_latency_seconds_count 1"), "{body}");
        server.shutdown().await.expect("shutdown");
    })
    .await;
}

/// `StoreOp` (the job's key-value store): every malformed request is INVALID_ARGUMENT, with a
/// message, and changes neither the job's store nor the job's records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_store_requests_are_refused_without_state_change() {
    bounded(async {
        use pb::store_request::Op;
        let backing = Backing::new(Backend::Memory).await;
        let server = replica(backing.store.clone(), &Options::new(test_settings(Backend::Memory))).await;
        let mut c = client(server.local_addr()).await;
        let op = |job: &str, scope: &str, op: Option<Op>| pb::StoreRequest { job: job.into(), scope: scope.into(), op };
        let set = |key: &str, value: Vec<u8>| Some(Op::Set(pb::StoreSet { key: key.into(), value }));
        c.store_op(op("js", "g1", set("kept", b"v".to_vec()))).await.expect("a good set");
        let kv_snapshot = || async {
            let (kvs, _) = backing.store.get_prefix("/cohort/v1/kv/").await.expect("read store");
            kvs.into_iter().map(|kv| (kv.key, kv.value, kv.mod_revision)).collect::<Vec<_>>()
        };
        let before = (kv_snapshot().await, snapshot(backing.store.as_ref()).await);
        let long = "k".repeat(cohort_coordinator::kv::MAX_KEY_LEN + 1);
        let too_many: Vec<String> = (0..=cohort_coordinator::kv::MAX_WAIT_KEYS).map(|i| format!("k{i}")).collect();
        let cases: Vec<(&str, pb::StoreRequest)> = vec![
            ("no op", op("js", "g1", None)),
            ("empty job", op("", "g1", set("k", b"v".to_vec()))),
            ("bad job", op("j/s", "g1", set("k", b"v".to_vec()))),
            ("scope with a slash", op("js", "g/1", set("k", b"v".to_vec()))),
            ("empty key", op("js", "g1", set("", b"v".to_vec()))),
            ("long key", op("js", "g1", set(&long, b"v".to_vec()))),
            ("NUL in a key", op("js", "g1", set("a\0b", b"v".to_vec()))),
            ("oversized value", op("js", "g1", set("k", vec![0; cohort_coordinator::kv::MAX_VALUE_LEN + 1]))),
            (
                "oversized expected",
                op(
                    "js",
                    "g1",
                    Some(Op::CompareSet(pb::StoreCompareSet {
                        key: "kept".into(),
                        expected: vec![0; cohort_coordinator::kv::MAX_VALUE_LEN + 1],
                        desired: b"x".to_vec(),
                    })),
                ),
            ),
            ("empty key on get", op("js", "g1", Some(Op::Get(pb::StoreGet { key: String::new(), wait_ms: 10 })))),
            ("empty key on add", op("js", "g1", Some(Op::Add(pb::StoreAdd { key: String::new(), delta: 1 })))),
            (
                "empty key on append",
                op("js", "g1", Some(Op::Append(pb::StoreAppend { key: String::new(), value: b"v".to_vec() }))),
            ),
            (
                "oversized append",
                op(
                    "js",
                    "g1",
                    Some(Op::Append(pb::StoreAppend {
                        key: "kept".into(),
                        value: vec![0; cohort_coordinator::kv::MAX_VALUE_LEN + 1],
                    })),
                ),
            ),
            ("empty key on delete", op("js", "g1", Some(Op::Delete(pb::StoreDelete { key: String::new() })))),
            ("no keys to check", op("js", "g1", Some(Op::Check(pb::StoreCheck { keys: vec![] })))),
            ("no keys to wait for", op("js", "g1", Some(Op::Wait(pb::StoreWait { keys: vec![], wait_ms: 10 })))),
            (
                "too many keys to wait for",
                op("js", "g1", Some(Op::Wait(pb::StoreWait { keys: too_many.clone(), wait_ms: 10 }))),
            ),
            ("too many keys to check", op("js", "g1", Some(Op::Check(pb::StoreCheck { keys: too_many })))),
        ];
        for (name, request) in cases {
            check(name, c.store_op(request).await.map(drop), Code::InvalidArgument);
        }
        let after = (kv_snapshot().await, snapshot(backing.store.as_ref()).await);
        assert_eq!(before, after, "a refused StoreOp changed the store");
        assert_eq!(server.metrics().rpc_count("StoreOp", Code::InvalidArgument), 18);
        server.shutdown().await.expect("shutdown");
    })
    .await;
}
