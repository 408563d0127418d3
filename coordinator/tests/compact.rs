//! The compact answer: a Rendezvous with `compact` set gets the generation's size, the
//! caller's rank and own entry and the member list's digest instead of the list; `Members`
//! answers entries by rank and by host with the same digest; bad questions are refused with
//! their codes and change nothing; older clients still get the whole list. Over real sockets,
//! on the memory store and on a private etcd.

mod common;

use cohort_proto::credentials::job_token;
use cohort_proto::v1 as pb;
use common::*;
use std::time::Duration;
use tonic::Code;

/// Hosts of the six members: ranks are grouped by failure domain (the host), so each
/// host's members get adjacent ranks.
fn host_of(i: usize) -> &'static str {
    if i < 3 {
        "host-a"
    } else {
        "host-b"
    }
}

/// How a member asks for its generation.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ask {
    /// The whole member list (an older client).
    Whole,
    /// The compact answer.
    Compact,
    /// The compact answer with the caller's partners' entries.
    Partners,
    /// The sparse view: partners, host run and host runs (the job's generations are larger
    /// than its `whole_answer_up_to`).
    Layout,
}

/// Long polls (bounded by the test's bound) until a generation newer than `after` forms.
async fn formed(w: &Worker, after: u64, ask: Ask) -> pb::Generation {
    loop {
        let mut c = w.client.clone();
        let r = c
            .rendezvous(pb::RendezvousRequest {
                job: w.job.clone(),
                worker_id: w.id.clone(),
                incarnation: w.incarnation,
                after_generation: after,
                wait_ms: 5_000,
                compact: ask != Ask::Whole,
                partners: matches!(ask, Ask::Partners | Ask::Layout),
                layout: ask == Ask::Layout,
            })
            .await
            .unwrap_or_else(|s| panic!("rendezvous {}: {s}", w.id))
            .into_inner();
        match r.outcome {
            Some(pb::rendezvous_response::Outcome::Formed(g)) => return g,
            Some(pb::rendezvous_response::Outcome::Waiting(_)) => continue,
            other => panic!("{}: unexpected outcome {other:?}", w.id),
        }
    }
}

fn ask(w: &Worker, generation: u64, ranks: Vec<u32>, host: &str) -> pb::MembersRequest {
    pb::MembersRequest {
        job: w.job.clone(),
        worker_id: w.id.clone(),
        incarnation: w.incarnation,
        generation,
        ranks,
        host: host.into(),
    }
}

async fn members(w: &Worker, request: pb::MembersRequest) -> Result<pb::MembersResponse, tonic::Status> {
    w.client.clone().members(request).await.map(|r| r.into_inner())
}

fn code_of(r: Result<pb::MembersResponse, tonic::Status>) -> Code {
    r.err().map_or(Code::Ok, |s| s.code())
}

async fn compact_answers_and_members_by_rank_and_host(backend: Backend) {
    let backing = Backing::new(backend).await;
    let mut settings = test_settings(backend);
    settings.max_workers = 6;
    settings.whole_answer_up_to = 4;
    let server = replica(backing.store.clone(), &Options::new(settings)).await;
    let addr = server.local_addr();
    let job = "job-compact";
    let mut workers = Vec::new();
    for i in 0..6 {
        let mut request = join_request(job, &format!("w{i}"));
        request.host = host_of(i).into();
        // A shared-memory address: the members of one host share memory (host runs).
        request.addresses.push(pb::TransportAddress {
            transport: "shm".into(),
            address: format!("shm1;host=id-{};nonce={i:08x}", host_of(i)),
        });
        workers.push(Worker::join_with(addr, request, Duration::from_millis(100)).await);
    }
    // w0..w2 ask compactly, w3 for the sparse view, w4 with its partners; w5 is an older
    // client and asks for the whole list.
    let how = |i: usize| match i {
        0..=2 => Ask::Compact,
        3 => Ask::Layout,
        4 => Ask::Partners,
        _ => Ask::Whole,
    };
    let answers = futures::future::join_all(workers.iter().enumerate().map(|(i, w)| formed(w, 0, how(i)))).await;
    let full = answers[5].clone();
    assert_eq!((full.number, full.members.len(), full.size), (1, 6, 6), "the old-style answer is whole");
    assert_eq!(full.rank, None);
    assert!(full.member.is_none());
    let digest = cohort_proto::members_digest(&full.members);
    assert_eq!(full.members_digest, digest, "the whole list carries its own digest");
    for (i, g) in answers[..5].iter().enumerate() {
        if how(i) == Ask::Partners {
            // Its partners' entries (rank ± 1, 2, 4 mod 6), as the whole list has them.
            let rank = g.rank.expect("the caller's rank");
            let want: Vec<pb::Member> =
                cohort_proto::partner_ranks(rank, 6).iter().map(|&p| full.members[p as usize].clone()).collect();
            assert!(want.len() >= 3, "rank {rank} of 6 has at least three partners: {want:?}");
            assert_eq!(g.members, want, "w{i}'s partners");
        } else if how(i) == Ask::Layout {
            // Six members above `whole_answer_up_to` = 4: its partners and its host-mates
            // (the two hosts of three hold ranks 0-2 and 3-5), and the host runs.
            let rank = g.rank.expect("the caller's rank");
            let mut ranks = cohort_proto::partner_ranks(rank, 6);
            ranks.extend((0..6).filter(|&r| r != rank && r / 3 == rank / 3));
            ranks.sort_unstable();
            ranks.dedup();
            let want: Vec<pb::Member> = ranks.iter().map(|&p| full.members[p as usize].clone()).collect();
            assert_eq!(g.members, want, "w{i}'s partners and host-mates");
            assert_eq!(g.host_runs, vec![pb::HostRuns { ranks: 3, hosts: 2 }]);
        } else {
            assert!(g.members.is_empty(), "a compact answer carries no member list: {g:?}");
        }
        assert_eq!((g.number, g.size, g.members_digest, g.formed_at_ms), (1, 6, digest, full.formed_at_ms));
        let rank = g.rank.expect("the caller's rank");
        let own = g.member.as_ref().expect("the caller's own entry");
        assert_eq!(own, &full.members[rank as usize], "w{i}'s own entry");
        assert_eq!(own.worker_id, format!("w{i}"));
    }

    // By ranks: each once, in rank order, equal to the whole list's entries.
    let w0 = &workers[0];
    let by_rank = members(w0, ask(w0, 1, vec![5, 1, 1, 3], "")).await.expect("members by rank");
    assert_eq!((by_rank.generation, by_rank.size, by_rank.members_digest), (1, 6, digest));
    let want: Vec<pb::Member> = [1, 3, 5].iter().map(|&r| full.members[r].clone()).collect();
    assert_eq!(by_rank.members, want);
    // By host: the caller's host group, and a host with a rank asked besides.
    let on_b: Vec<pb::Member> = full.members.iter().filter(|m| m.host == "host-b").cloned().collect();
    assert_eq!(on_b.len(), 3);
    let by_host = members(w0, ask(w0, 1, vec![], "host-b")).await.expect("members by host");
    assert_eq!((by_host.members_digest, &by_host.members), (digest, &on_b));
    let a_rank = full.members.iter().find(|m| m.host == "host-a").map(|m| m.rank).expect("a rank on host-a");
    let both = members(w0, ask(w0, 1, vec![a_rank], "host-b")).await.expect("ranks and host");
    let mut want_both = on_b.clone();
    want_both.push(full.members[a_rank as usize].clone());
    want_both.sort_by_key(|m| m.rank);
    assert_eq!(both.members, want_both);
    assert!(members(w0, ask(w0, 1, vec![], "nowhere")).await.expect("empty host").members.is_empty());

    // A compact watcher hears the generation without its list; an old one, the whole list.
    let mut compact_watch = w0
        .client
        .clone()
        .watch(pb::WatchRequest {
            job: job.into(),
            worker_id: "w0".into(),
            incarnation: w0.incarnation,
            compact: true,
            quiet: false,
        })
        .await
        .expect("compact watch")
        .into_inner();
    let g = wait_event(&mut compact_watch, |e| match e {
        pb::job_event::Event::GenerationFormed(g) => Some(g.clone()),
        _ => None,
    })
    .await;
    assert!(g.members.is_empty());
    assert_eq!((g.number, g.size, g.members_digest), (1, 6, digest));
    let mut old_watch = w0.watch().await;
    let g = wait_event(&mut old_watch, |e| match e {
        pb::job_event::Event::GenerationFormed(g) => Some(g.clone()),
        _ => None,
    })
    .await;
    assert_eq!(g, full, "an old watcher hears the whole generation, as the old-style answer");

    // Bad questions: each refused with its code, and nothing changes.
    let before = status(addr, job).await;
    let outsider = Worker::join(addr, job, "outsider", Duration::from_millis(100)).await;
    let mut wrong_incarnation = ask(w0, 1, vec![0], "");
    wrong_incarnation.incarnation += 1000;
    let refusals = [
        ("stale generation", code_of(members(w0, ask(w0, 0, vec![0], "")).await), Code::FailedPrecondition),
        ("unknown generation", code_of(members(w0, ask(w0, 2, vec![0], "")).await), Code::NotFound),
        ("rank out of range", code_of(members(w0, ask(w0, 1, vec![0, 6], "")).await), Code::InvalidArgument),
        (
            "too many ranks",
            code_of(members(w0, ask(w0, 1, vec![0; cohort_proto::MAX_MEMBERS_PER_CALL + 1], "")).await),
            Code::InvalidArgument,
        ),
        ("nothing asked", code_of(members(w0, ask(w0, 1, vec![], "")).await), Code::InvalidArgument),
        ("not a member", code_of(members(&outsider, ask(&outsider, 1, vec![0], "")).await), Code::PermissionDenied),
        ("another incarnation", code_of(members(w0, wrong_incarnation).await), Code::PermissionDenied),
        (
            "bad job id",
            code_of(members(w0, pb::MembersRequest { job: "a b".into(), ..ask(w0, 1, vec![0], "") }).await),
            Code::InvalidArgument,
        ),
    ];
    for (what, got, want) in refusals {
        assert_eq!(got, want, "{what}");
    }
    let after = status(addr, job).await;
    assert_eq!(after.current, before.current, "the refusals changed no generation");
    assert!(!after.current_revoked);

    // Once generation 2 forms, generation 1 is stale even for its members.
    let rank_of_w5 = full.members.iter().find(|m| m.worker_id == "w5").map(|m| m.rank).expect("w5's rank");
    w0.report(1, Some(rank_of_w5), "test: w5 failed").await.expect("report");
    let survivors: Vec<&Worker> = workers[..5].iter().collect();
    let second = futures::future::join_all(survivors.iter().map(|w| formed(w, 1, Ask::Compact))).await;
    assert!(second.iter().all(|g| g.number == 2 && g.members.is_empty() && g.rank.is_some()));
    assert_eq!(code_of(members(w0, ask(w0, 1, vec![0], "")).await), Code::FailedPrecondition);
    let now = members(w0, ask(w0, 2, vec![0], "")).await.expect("members of generation 2");
    assert_eq!(now.members_digest, second[0].members_digest);
    assert_ne!(now.members_digest, digest, "another list, another digest");
    drop(outsider);
    drop(workers);
    server.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_compact_answers_and_members_by_rank_and_host() {
    bounded(compact_answers_and_members_by_rank_and_host(Backend::Memory)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_compact_answers_and_members_by_rank_and_host() {
    bounded(compact_answers_and_members_by_rank_and_host(Backend::Etcd)).await;
}

/// `message` carrying `Bearer token`.
fn authed<T>(message: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.metadata_mut().insert("authorization", format!("Bearer {token}").parse().expect("ascii"));
    r
}

/// A job's credential may ask `Members` about its own job only; the operator's about any.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_of_another_job_are_refused_to_a_job_credential() {
    bounded(async {
        const OPERATOR: &str = "operator secret";
        let backing = Backing::new(Backend::Memory).await;
        let mut settings = test_settings(Backend::Memory);
        settings.max_workers = 1;
        let mut options = Options::new(settings);
        options.token = Some(OPERATOR.into());
        let server = replica(backing.store.clone(), &options).await;
        let mut c = client(server.local_addr()).await;
        let (cred_a, cred_b) = (job_token(OPERATOR.as_bytes(), "a"), job_token(OPERATOR.as_bytes(), "b"));
        c.join(authed(join_request("a", "wa"), &cred_a)).await.expect("a's member joins a");
        let wb = c.join(authed(join_request("b", "wb"), &cred_b)).await.expect("b joins").into_inner();
        let rendezvous = pb::RendezvousRequest {
            job: "b".into(),
            worker_id: "wb".into(),
            incarnation: wb.incarnation,
            after_generation: 0,
            wait_ms: 5_000,
            compact: true,
            partners: true,
            layout: true,
        };
        let g = loop {
            let r = c.rendezvous(authed(rendezvous.clone(), &cred_b)).await.expect("rendezvous").into_inner();
            if let Some(pb::rendezvous_response::Outcome::Formed(g)) = r.outcome {
                break g;
            }
        };
        // One member, below the default `whole_answer_up_to`: the sparse view of a small
        // generation is the whole list.
        assert_eq!((g.rank, g.members.len(), g.host_runs.len()), (None, 1, 0), "{g:?}");
        let question = pb::MembersRequest {
            job: "b".into(),
            worker_id: "wb".into(),
            incarnation: wb.incarnation,
            generation: g.number,
            ranks: vec![0],
            host: String::new(),
        };
        let denied = c.members(authed(question.clone(), &cred_a)).await.expect_err("a's credential asks about b");
        assert_eq!(denied.code(), Code::PermissionDenied, "{denied}");
        let unauthenticated = c.members(question.clone()).await.expect_err("no credential");
        assert_eq!(unauthenticated.code(), Code::Unauthenticated, "{unauthenticated}");
        let own = c.members(authed(question.clone(), &cred_b)).await.expect("b's own credential").into_inner();
        assert_eq!(own.members.len(), 1);
        assert_eq!(own.members_digest, g.members_digest);
        c.members(authed(question, OPERATOR)).await.expect("the operator asks about any job");
        server.shutdown().await.expect("shutdown");
    })
    .await;
}
