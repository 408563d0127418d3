//! Fuzzing (property-based, generated inputs) of the coordinator's request handling: every
//! RPC with arbitrary messages (ids of any text and length, any numbers, any bytes, ids that
//! name a real job and its real members with wrong incarnations). The property: every call is
//! answered (a response or a status with a message) within a bound, the replica never panics
//! and stays healthy, and the job that is running beside the noise is not changed by it:
//! its keys in the store keep their values and revisions.

mod common;

use cohort_proto::v1 as pb;
use common::*;
use proptest::prelude::*;
use std::time::Duration;

const VICTIM: &str = "victim";

/// Ids: valid-looking, the victim's own names, and arbitrary text of any length.
fn id() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(VICTIM.to_string()),
        Just("w0".to_string()),
        Just("w1".to_string()),
        "[A-Za-z0-9._-]{1,20}",
        any::<String>(),
        "[a-z]{200,300}",
        Just(String::new()),
        Just("..".to_string()),
    ]
}

/// Numbers: small, boundaries, arbitrary.
fn num() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..4, Just(u64::MAX), Just(u64::from(u32::MAX) + 1), any::<u64>()]
}

#[derive(Debug, Clone)]
enum Rpc {
    Join(pb::JoinRequest),
    Heartbeat(pb::HeartbeatRequest),
    Rendezvous(pb::RendezvousRequest),
    Watch(pb::WatchRequest),
    Report(pb::FailureReport),
    Leave(pb::LeaveRequest),
    Commit(pb::CommitRequest),
    Status(pb::StatusRequest),
    Members(pb::MembersRequest),
    HostHeartbeat(pb::HostHeartbeatRequest),
}

fn beat() -> impl Strategy<Value = pb::HeartbeatRequest> {
    (id(), id(), num(), num(), num(), any::<String>(), any::<String>()).prop_map(
        |(job, worker_id, incarnation, generation, step, activity, deadlines)| pb::HeartbeatRequest {
            job,
            worker_id,
            incarnation,
            generation,
            step,
            activity,
            deadlines,
            timing: None,
        },
    )
}

fn rpc() -> impl Strategy<Value = Rpc> {
    let address = (prop_oneof![Just("tcp".to_string()), Just("rdma".to_string()), any::<String>()], any::<String>())
        .prop_map(|(transport, address)| pb::TransportAddress { transport, address });
    prop_oneof![
        // Joins never name the victim job: a join there is legitimate and would change it.
        (
            id().prop_filter("not the victim", |j| j != VICTIM),
            id(),
            any::<String>(),
            prop::collection::vec(address, 0..4),
            prop::collection::vec(any::<String>(), 0..4),
            any::<u32>(),
            any::<String>()
        )
            .prop_map(|(job, worker_id, host, addresses, capabilities, protocol_version, domain)| Rpc::Join(
                pb::JoinRequest {
                    job,
                    worker_id,
                    host,
                    addresses,
                    capabilities,
                    protocol_version,
                    domain,
                    replaces: 0
                }
            )),
        beat().prop_map(Rpc::Heartbeat),
        (id(), id(), num(), num(), 0u64..300).prop_map(|(job, worker_id, incarnation, after_generation, wait_ms)| {
            Rpc::Rendezvous(pb::RendezvousRequest {
                job,
                worker_id,
                incarnation,
                after_generation,
                wait_ms,
                compact: false,
                partners: false,
                layout: false,
            })
        }),
        (id(), id(), num(), any::<bool>()).prop_map(|(job, worker_id, incarnation, quiet)| {
            Rpc::Watch(pb::WatchRequest { job, worker_id, incarnation, compact: false, quiet })
        }),
        (id(), id(), num(), num(), prop::option::of(any::<u32>()), any::<String>(), any::<i32>(), any::<(u32, u64)>())
            .prop_map(|(job, worker_id, incarnation, generation, failed_rank, reason, kind, (seq, received))| {
                Rpc::Report(pb::FailureReport {
                    job,
                    worker_id,
                    incarnation,
                    generation,
                    failed_rank,
                    reason,
                    kind,
                    progress: Some(pb::OpProgress { seq, received }),
                })
            }),
        (id(), id(), num(), any::<i32>()).prop_map(|(job, worker_id, incarnation, mode)| Rpc::Leave(
            pb::LeaveRequest { job, worker_id, incarnation, mode }
        )),
        (id(), id(), num(), num(), num(), prop::collection::vec(any::<u8>(), 0..300)).prop_map(
            |(job, worker_id, incarnation, generation, step, digest)| Rpc::Commit(pb::CommitRequest {
                job,
                worker_id,
                incarnation,
                generation,
                step,
                digest
            })
        ),
        id().prop_map(|job| Rpc::Status(pb::StatusRequest { job })),
        (
            id(),
            id(),
            num(),
            num(),
            prop_oneof![
                prop::collection::vec(any::<u32>(), 0..8),
                prop::collection::vec(0u32..4, 0..8),
                prop::collection::vec(0u32..4, 4096..4099)
            ],
            prop_oneof![any::<String>(), Just("host-w0".to_string()), Just(String::new())]
        )
            .prop_map(|(job, worker_id, incarnation, generation, ranks, host)| Rpc::Members(
                pb::MembersRequest { job, worker_id, incarnation, generation, ranks, host }
            )),
        // Batches: of the call's job (each beat judged alone) or mixed (refused whole).
        (id(), prop::collection::vec(beat(), 0..5), any::<bool>()).prop_map(|(job, mut beats, same_job)| {
            if same_job {
                beats.iter_mut().for_each(|b| b.job = job.clone());
            }
            Rpc::HostHeartbeat(pb::HostHeartbeatRequest { job, beats })
        }),
    ]
}

/// Sends one request; `Err` if it was neither answered nor refused within the bound.
async fn send(
    c: &mut pb::coordinator_client::CoordinatorClient<tonic::transport::Channel>,
    r: Rpc,
) -> Result<(), String> {
    let bound = Duration::from_secs(5);
    let answered = match r {
        Rpc::Join(m) => tokio::time::timeout(bound, c.join(m)).await.map(|r| r.map(drop)),
        Rpc::Heartbeat(m) => tokio::time::timeout(bound, c.heartbeat(m)).await.map(|r| r.map(drop)),
        Rpc::Rendezvous(m) => tokio::time::timeout(bound, c.rendezvous(m)).await.map(|r| r.map(drop)),
        Rpc::Watch(m) => tokio::time::timeout(bound, c.watch(m)).await.map(|r| r.map(drop)),
        Rpc::Report(m) => tokio::time::timeout(bound, c.report_failure(m)).await.map(|r| r.map(drop)),
        Rpc::Leave(m) => tokio::time::timeout(bound, c.leave(m)).await.map(|r| r.map(drop)),
        Rpc::Commit(m) => tokio::time::timeout(bound, c.commit(m)).await.map(|r| r.map(drop)),
        Rpc::Status(m) => tokio::time::timeout(bound, c.status(m)).await.map(|r| r.map(drop)),
        Rpc::Members(m) => tokio::time::timeout(bound, c.members(m)).await.map(|r| r.map(drop)),
        Rpc::HostHeartbeat(m) => match tokio::time::timeout(bound, c.host_heartbeat(m)).await {
            // Each refused beat is held to what a refused call is.
            Ok(Ok(answer)) => {
                for a in answer.into_inner().answers {
                    if let Some(pb::heartbeat_answer::Outcome::Refused(r)) = a.outcome {
                        let code = tonic::Code::from(r.code);
                        if r.message.is_empty() || matches!(code, tonic::Code::Unknown | tonic::Code::Internal) {
                            return Err(format!("a beat refused badly: {code:?} {:?}", r.message));
                        }
                    }
                }
                Ok(Ok(()))
            }
            other => other.map(|r| r.map(drop)),
        },
    };
    match answered {
        Err(_) => Err("no answer within 5 s".into()),
        Ok(Err(status)) if status.message().is_empty() => Err(format!("refused without a message: {status:?}")),
        Ok(Err(status)) if matches!(status.code(), tonic::Code::Unknown | tonic::Code::Internal) => {
            Err(format!("an internal error (a panic or a bug), not a refusal: {status:?}"))
        }
        Ok(_) => Ok(()),
    }
}

async fn victim_keys(store: &dyn cohort_coordinator::store::Store) -> Vec<(String, Vec<u8>, i64)> {
    let (kvs, _) = store.get_prefix(&cohort_coordinator::keys::job_prefix(VICTIM)).await.expect("read store");
    kvs.into_iter().map(|kv| (kv.key, kv.value, kv.mod_revision)).collect()
}

/// How many batches of 24 requests to run: `PROPTEST_CASES` (the knob every property test
/// of the workspace takes) when set, else 24 (each case starts a replica, so fewer than
/// proptest's default of 256).
fn batches(proptest_cases: Option<&str>) -> u32 {
    match proptest_cases {
        None => 24,
        Some(v) => v.trim().parse().unwrap_or_else(|_| panic!("PROPTEST_CASES={v:?} is not a number of cases")),
    }
}

#[test]
fn proptest_cases_sets_the_number_of_batches() {
    assert_eq!(batches(None), 24);
    assert_eq!(batches(Some("500")), 500);
    assert_eq!(batches(Some("1")), 1);
}

proptest! {
    // Each case starts a replica; the cases (PROPTEST_CASES, else 24) count batches of 24
    // requests.
    #![proptest_config(ProptestConfig {
        cases: batches(std::env::var("PROPTEST_CASES").ok().as_deref()),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn arbitrary_requests_are_answered_and_leave_other_jobs_alone(batch in prop::collection::vec(rpc(), 24)) {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let failure: Result<(), String> = runtime.block_on(async {
            let backing = Backing::new(Backend::Memory).await;
            let mut settings = test_settings(Backend::Memory);
            // A long lease: the victim's members need no heartbeats, so its keys stay still.
            settings.lease_ttl = Duration::from_secs(600);
            settings.elastic_timeout = Duration::from_secs(600);
            let server = replica(backing.store.clone(), &Options::new(settings)).await;
            let addr = server.local_addr();
            let mut members = Vec::new();
            for i in 0..2 {
                let mut w = Worker::join(addr, VICTIM, &format!("w{i}"), Duration::from_secs(3600)).await;
                w.stop_heartbeats();
                members.push(w);
            }
            form_all(&members, 0).await;
            let incarnations: Vec<u64> = members.iter().map(|w| w.incarnation).collect();
            let before = victim_keys(backing.store.as_ref()).await;
            let mut c = client(addr).await;
            for r in batch {
                // A request that names a real member of the victim (incarnations are small
                // numbers, so the generator hits them) may legitimately act on it: skipped.
                let real = |job: &str, inc: u64| job == VICTIM && incarnations.contains(&inc);
                let names_a_member = match &r {
                    Rpc::Heartbeat(m) => real(&m.job, m.incarnation),
                    Rpc::Rendezvous(m) => real(&m.job, m.incarnation),
                    Rpc::Watch(m) => real(&m.job, m.incarnation),
                    Rpc::Report(m) => real(&m.job, m.incarnation),
                    Rpc::Leave(m) => real(&m.job, m.incarnation),
                    Rpc::Commit(m) => real(&m.job, m.incarnation),
                    Rpc::HostHeartbeat(m) => m.beats.iter().any(|b| real(&b.job, b.incarnation)),
                    // Members only reads: even a real member's question changes nothing.
                    Rpc::Join(_) | Rpc::Status(_) | Rpc::Members(_) => false,
                };
                if names_a_member {
                    continue;
                }
                send(&mut c, r.clone()).await.map_err(|e| format!("{r:?}: {e}"))?;
            }
            let after = victim_keys(backing.store.as_ref()).await;
            if after != before {
                return Err(format!("the victim job changed:\nbefore {before:?}\nafter {after:?}"));
            }
            let status = status(addr, VICTIM).await;
            if status.members.len() != 2 || status.current_revoked {
                return Err(format!("the victim job's status changed: {status:?}"));
            }
            server.shutdown().await.map_err(|e| e.to_string())
        });
        prop_assert!(failure.is_ok(), "{}", failure.unwrap_err());
    }
}
