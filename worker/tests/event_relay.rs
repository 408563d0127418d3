//! The host's event relay against a real coordinator (memory store, loopback gRPC) over real
//! abstract Unix sockets: one worker serves it and the host's workers hear every event
//! through its one watch; a late subscriber gets the state first; when the relay ends
//! another worker serves it and the events go on; an idle relay keeps its subscribers with
//! keepalives, and one that never writes is found hung; what a subscriber writes changes
//! nothing.

mod common;

use common::squatter;

use cohort::control::{AbstractUnix, ControlClient, ControlConfig, EventRelay, RelayEvents, SILENCE_LIMIT};
use cohort::elastic::{JobId, WorkerId};
use cohort_coordinator::{JobSettings, ServerHandle};
use cohort_proto::v1::{self as pb, job_event::Event};
use std::os::linux::net::SocketAddrExt;
use std::sync::Arc;
use std::time::Duration;

/// Bound on each test.
const BOUND: Duration = Duration::from_secs(60);
/// Bound on each event's arrival.
const EVENT_BOUND: Duration = Duration::from_secs(10);

async fn coordinator(members: u32) -> ServerHandle {
    common::coordinator::start(JobSettings {
        min_workers: members,
        max_workers: members,
        heartbeat_interval: Duration::from_millis(200),
        lease_ttl: Duration::from_secs(5),
        ..Default::default()
    })
    .await
}

fn control(server: &ServerHandle) -> ControlClient {
    ControlClient::new(ControlConfig::new(vec![format!("http://{}", server.local_addr())])).expect("client")
}

/// A member of `job` on `host`: its id, incarnation, client and event relay path.
struct Member {
    id: String,
    incarnation: u64,
    client: ControlClient,
    relay: EventRelay,
}

async fn join(server: &ServerHandle, job: &str, host: &str, id: &str) -> Member {
    let client = control(server);
    let joined = common::coordinator::join(&client, job, host, id).await;
    let (job, worker) = (JobId::new(job).expect("job id"), WorkerId::new(id).expect("worker id"));
    let relay = EventRelay::new(client.clone(), &job, &worker, host, Arc::new(AbstractUnix));
    Member { id: id.into(), incarnation: joined.incarnation, client, relay }
}

/// Every member rendezvous after `after`; the generation formed.
async fn form(job: &str, members: &[Member], after: u64) -> pb::Generation {
    let polls = members.iter().map(|m| async move {
        loop {
            let answer = m
                .client
                .rendezvous(pb::RendezvousRequest {
                    job: job.into(),
                    worker_id: m.id.clone(),
                    incarnation: m.incarnation,
                    after_generation: after,
                    wait_ms: 5_000,
                    compact: false,
                    partners: false,
                    layout: false,
                })
                .await
                .expect("rendezvous");
            if let Some(pb::rendezvous_response::Outcome::Formed(g)) = answer.outcome {
                return g;
            }
        }
    });
    futures::future::join_all(polls).await.remove(0)
}

/// Reads `events` until `pick` matches (bounded); the events skipped on the way.
async fn wait_for(events: &mut RelayEvents, mut pick: impl FnMut(&Event) -> bool) -> Vec<Event> {
    let mut seen = Vec::new();
    loop {
        let next = tokio::time::timeout(EVENT_BOUND, events.next()).await.expect("an event within the bound");
        let event = next.expect("relay read").expect("the relay closed the subscription").event.expect("payload");
        if pick(&event) {
            return seen;
        }
        seen.push(event);
    }
}

fn formed(n: u64) -> impl FnMut(&Event) -> bool {
    move |e| matches!(e, Event::GenerationFormed(g) if g.number == n)
}

fn revoked(n: u64) -> impl FnMut(&Event) -> bool {
    move |e| matches!(e, Event::GenerationRevoked(r) if r.generation == n)
}

async fn report(job: &str, by: &Member, generation: u64, rank: u32) {
    let answer = by
        .client
        .report_failure(pb::FailureReport {
            job: job.into(),
            worker_id: by.id.clone(),
            incarnation: by.incarnation,
            generation,
            failed_rank: Some(rank),
            reason: "event relay test".into(),
            ..Default::default()
        })
        .await
        .expect("report");
    assert!(answer.accepted, "the report revoked generation {generation}");
}

fn serving(members: &[Member]) -> Vec<&str> {
    members.iter().filter(|m| m.relay.is_serving()).map(|m| m.id.as_str()).collect()
}

/// Three workers of one host subscribe: one serves the relay, and the coordinator holds one
/// watch stream for them all (its `Watch` count), through which each hears the generation
/// form and its revocation. A fourth subscriber, late, first gets the state: the generation
/// formed, then its revocation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hosts_workers_hear_every_event_through_one_watch() {
    tokio::time::timeout(BOUND, async {
        let server = coordinator(3).await;
        let job = "events-shared";
        let mut members = Vec::new();
        for i in 0..3 {
            members.push(join(&server, job, "host-a", &format!("w{i}")).await);
        }
        let mut subs: Vec<RelayEvents> = members.iter().map(|m| m.relay.subscribe().expect("subscribe")).collect();
        assert_eq!(serving(&members).len(), 1, "one relay: {:?}", serving(&members));
        let g1 = form(job, &members, 0).await;
        for s in &mut subs {
            wait_for(s, formed(1)).await;
        }
        let victim = g1.members.iter().position(|m| m.worker_id == "w2").expect("w2 placed") as u32;
        report(job, &members[0], 1, victim).await;
        for s in &mut subs {
            let skipped = wait_for(s, revoked(1)).await;
            assert!(skipped.iter().all(|e| !matches!(e, Event::GenerationRevoked(_))), "{skipped:?}");
        }
        let watches = server.metrics().rpc_count("Watch", tonic::Code::Ok);
        assert_eq!(watches, 1, "the host's workers share one watch stream");
        assert_eq!(server.metrics().watch_streams(), (1, 0), "open now: the relay's");
        let late = join(&server, job, "host-a", "w3").await;
        let mut sub = late.relay.subscribe().expect("subscribe late");
        assert!(!late.relay.is_serving());
        let first = wait_for(&mut sub, revoked(1)).await;
        assert!(
            matches!(first.as_slice(), [Event::GenerationFormed(g)] if g.number == 1),
            "the state first: {first:?}"
        );
        server.shutdown().await.expect("shutdown");
    })
    .await
    .expect("bounded");
}

/// The serving worker goes away: the others' subscriptions end, they subscribe again, one of
/// them serves next (with a watch of its own), and they hear the state and the next events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_worker_serves_the_relay_when_it_ends() {
    tokio::time::timeout(BOUND, async {
        let server = coordinator(3).await;
        let job = "events-takeover";
        let mut members = Vec::new();
        for i in 0..3 {
            members.push(join(&server, job, "host-b", &format!("w{i}")).await);
        }
        let mut subs: Vec<RelayEvents> = members.iter().map(|m| m.relay.subscribe().expect("subscribe")).collect();
        let g1 = form(job, &members, 0).await;
        for s in &mut subs {
            wait_for(s, formed(1)).await;
        }
        let first = serving(&members)[0].to_string();
        let index = members.iter().position(|m| m.id == first).expect("serving member");
        // Its process ends: its relay and its subscription go with it.
        subs.remove(index);
        let gone = members.remove(index);
        drop(gone.relay);
        for s in &mut subs {
            let end = tokio::time::timeout(EVENT_BOUND, s.next()).await.expect("the subscription ends");
            assert!(!matches!(end, Ok(Some(_))), "an event after the relay ended: {end:?}");
        }
        let mut subs: Vec<RelayEvents> = members.iter().map(|m| m.relay.subscribe().expect("resubscribe")).collect();
        let now = serving(&members);
        assert_eq!(now.len(), 1, "{now:?}");
        assert_ne!(now[0], first);
        for s in &mut subs {
            wait_for(s, formed(1)).await;
        }
        let rank = g1.members.iter().position(|m| m.worker_id == gone.id).expect("placed") as u32;
        report(job, &members[0], 1, rank).await;
        for s in &mut subs {
            wait_for(s, revoked(1)).await;
        }
        server.shutdown().await.expect("shutdown");
    })
    .await
    .expect("bounded");
}

/// A subscriber that writes (garbage, or a huge length) changes nothing: the relay ignores
/// what subscribers write, and it and the others go on hearing events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_subscriber_writes_changes_nothing() {
    tokio::time::timeout(BOUND, async {
        let server = coordinator(2).await;
        let job = "events-bad";
        let members = vec![join(&server, job, "host-c", "w0").await, join(&server, job, "host-c", "w1").await];
        let mut good = members[0].relay.subscribe().expect("subscribe");
        let name = members[0].relay.socket_name().to_string();
        let raw = tokio::task::spawn_blocking(move || {
            use std::io::Write;
            let address = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).expect("name");
            let mut raw = std::os::unix::net::UnixStream::connect_addr(&address).expect("connect");
            raw.write_all(&u32::MAX.to_le_bytes()).expect("write a huge length");
            raw.write_all(b"not a frame at all").expect("write garbage");
            raw
        })
        .await
        .expect("raw writer");
        let g1 = form(job, &members, 0).await;
        wait_for(&mut good, formed(1)).await;
        let rank = g1.members.iter().position(|m| m.worker_id == "w1").expect("placed") as u32;
        report(job, &members[0], 1, rank).await;
        wait_for(&mut good, revoked(1)).await;
        // The writer was served too: its socket holds the same events (and keepalives).
        let frames = tokio::task::spawn_blocking(move || {
            use std::io::Read;
            let mut raw = raw;
            raw.set_read_timeout(Some(EVENT_BOUND)).expect("timeout");
            let mut kinds = Vec::new();
            while !kinds.contains(&"revoked") {
                let mut len = [0u8; 4];
                raw.read_exact(&mut len).expect("a frame's length");
                let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
                raw.read_exact(&mut body).expect("a frame");
                let event = <pb::JobEvent as prost::Message>::decode(body.as_slice()).expect("an event");
                kinds.push(match event.event {
                    Some(Event::GenerationFormed(_)) => "formed",
                    Some(Event::GenerationRevoked(_)) => "revoked",
                    None => continue, // a keepalive
                    _ => "other",
                });
            }
            kinds
        })
        .await
        .expect("raw reader");
        assert_eq!(frames, ["formed", "revoked"]);
        server.shutdown().await.expect("shutdown");
    })
    .await
    .expect("bounded");
}

/// A relay with no event to send keeps its subscribers (keepalives, not seen as events): for
/// longer than the silence limit nothing ends the subscription, and the next event comes
/// through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_relay_keeps_its_subscribers() {
    tokio::time::timeout(BOUND, async {
        let server = coordinator(2).await;
        let job = "events-idle";
        let members = vec![join(&server, job, "host-d", "w0").await, join(&server, job, "host-d", "w1").await];
        let mut sub = members[1].relay.subscribe().expect("subscribe");
        let g1 = form(job, &members, 0).await;
        wait_for(&mut sub, formed(1)).await;
        let quiet = tokio::time::timeout(SILENCE_LIMIT + Duration::from_secs(1), sub.next()).await;
        assert!(quiet.is_err(), "an idle subscription ended or carried something: {quiet:?}");
        let rank = g1.members.iter().position(|m| m.worker_id == "w0").expect("placed") as u32;
        report(job, &members[1], 1, rank).await;
        wait_for(&mut sub, revoked(1)).await;
        server.shutdown().await.expect("shutdown");
    })
    .await
    .expect("bounded");
}

/// A socket that holds the relay's name and never serves (a stopped relay, or a forked child
/// that inherited it): the subscription connects, hears nothing, and ends with `TimedOut`
/// after the silence limit, so that its worker watches alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_never_writes_is_found_hung() {
    tokio::time::timeout(BOUND, async {
        let server = coordinator(1).await;
        let m = join(&server, "events-hung", "host-e", "w0").await;
        let address = std::os::unix::net::SocketAddr::from_abstract_name(m.relay.socket_name()).expect("name");
        let hung = std::os::unix::net::UnixListener::bind_addr(&address).expect("bind the name first");
        let started = tokio::time::Instant::now();
        let mut sub = m.relay.subscribe().expect("connects to the hung socket");
        assert!(!m.relay.is_serving());
        let end = tokio::time::timeout(SILENCE_LIMIT * 3, sub.next()).await.expect("ends within the bound");
        let error = end.expect_err("a hung relay is an error");
        assert_eq!(error.kind(), std::io::ErrorKind::TimedOut, "{error}");
        assert!(started.elapsed() >= SILENCE_LIMIT, "gave up after {:?}", started.elapsed());
        drop(hung);
        server.shutdown().await.expect("shutdown");
    })
    .await
    .expect("bounded");
}

/// A process of another user binds the relay's name first and greets every subscriber with
/// a forged revocation and the job's end: subscribing refuses it (its server is not of this
/// user), with an error that says so, and never hears its events; the worker then watches
/// alone, as when its relay cannot be reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_of_another_user_is_refused() {
    use prost::Message;
    tokio::time::timeout(BOUND, async {
        let server = coordinator(1).await;
        let m = join(&server, "events-squatted", "host-f", "w0").await;
        let revoked = pb::JobEvent {
            event: Some(Event::GenerationRevoked(pb::GenerationRevoked { generation: 1, cause: None })),
        };
        let ended = pb::JobEvent {
            event: Some(Event::JobEnded(pb::JobEnded {
                outcome: pb::job_ended::Outcome::Failed as i32,
                reason: "forged".into(),
            })),
        };
        let mut greeting = squatter::frame(&revoked.encode_to_vec());
        greeting.extend(squatter::frame(&ended.encode_to_vec()));
        let Some(_squatter) = squatter::Squatter::start(m.relay.socket_name(), &greeting, &[]) else { return };
        match m.relay.subscribe() {
            Ok(mut sub) => {
                let heard = tokio::time::timeout(EVENT_BOUND, sub.next()).await;
                panic!("subscribed to another user's relay; heard {heard:?}");
            }
            Err(e) => {
                assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
                assert!(e.to_string().contains(&format!("uid {}", squatter::SQUATTER_UID)), "{e}");
            }
        }
        assert!(!m.relay.is_serving());
        server.shutdown().await.expect("shutdown");
    })
    .await
    .expect("bounded");
}
