//! The host's heartbeat relay against a real coordinator (memory store, loopback gRPC) over
//! real abstract Unix sockets: one worker serves it and the host's beats reach the
//! coordinator in shared `HostHeartbeat` calls; when the relay ends another worker takes
//! over at once; a relay that accepts but never answers (a stopped process) is bypassed
//! within the lease, one that acknowledges a beat and never answers it within the answer
//! budget; a slow coordinator is waited for through the relay, not bypassed; bad frames get a
//! clear answer and change nothing.

mod common;

use common::slow_link::SlowLink;
use common::squatter;

use cohort::control::{
    relay_answer_budget, AbstractUnix, ControlClient, ControlConfig, HostRelay, RelayNet, SocketDir,
    DIRECT_AFTER_FAILURE,
};
use cohort::elastic::JobId;
use cohort_coordinator::{JobSettings, ServerHandle};
use cohort_proto::v1 as pb;
use prost::Message;
use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::sync::Arc;
use std::time::Duration;

const INTERVAL: Duration = Duration::from_millis(100);
const LEASE: Duration = Duration::from_secs(2);
/// Bound on each test.
const BOUND: Duration = Duration::from_secs(60);

async fn coordinator() -> ServerHandle {
    common::coordinator::start(JobSettings {
        min_workers: 1,
        max_workers: 64,
        heartbeat_interval: INTERVAL,
        lease_ttl: LEASE,
        ..Default::default()
    })
    .await
}

fn control(server: &ServerHandle) -> ControlClient {
    control_at(format!("http://{}", server.local_addr()))
}

fn control_at(endpoint: String) -> ControlClient {
    ControlClient::new(control_config(endpoint)).expect("client")
}

fn control_config(endpoint: String) -> ControlConfig {
    let mut config = ControlConfig::new(vec![endpoint]);
    config.heartbeat_timeout = Duration::from_millis(500);
    config
}

/// A member of `job`: its incarnation and its relay path on host `host`.
struct Member {
    id: String,
    incarnation: u64,
    relay: HostRelay,
}

async fn join(server: &ServerHandle, job: &str, host: &str, id: &str) -> Member {
    join_in(server, job, host, id, Arc::new(AbstractUnix)).await
}

/// As [`join`], with the relay's sockets in `net`.
async fn join_in(server: &ServerHandle, job: &str, host: &str, id: &str, net: Arc<dyn RelayNet>) -> Member {
    join_at(control(server), job, host, id, net).await
}

/// As [`join`], through `client`.
async fn join_at(client: ControlClient, job: &str, host: &str, id: &str, net: Arc<dyn RelayNet>) -> Member {
    let joined = common::coordinator::join(&client, job, host, id).await;
    let interval = Duration::from_millis(joined.heartbeat_interval_ms);
    let lease = Duration::from_millis(joined.lease_ttl_ms);
    let job = JobId::new(job).expect("job id");
    let relay = HostRelay::new(client, &job, host, interval, lease, net).expect("lease long enough");
    Member { id: id.into(), incarnation: joined.incarnation, relay }
}

fn beat(job: &str, m: &Member, activity: &str) -> pb::HeartbeatRequest {
    pb::HeartbeatRequest {
        job: job.into(),
        worker_id: m.id.clone(),
        incarnation: m.incarnation,
        activity: activity.into(),
        ..Default::default()
    }
}

/// Rounds of beats, one an interval as workers beat, until one of `members` serves the relay.
/// A worker whose beat met the old relay dying sends its beats directly for
/// [`DIRECT_AFTER_FAILURE`] intervals before it tries the relay's socket again, so the bound is
/// three times that many rounds (paced, not counted alone: unpaced rounds could all fall
/// within the direct period).
async fn rounds_until_a_relay_serves(job: &str, members: &[Member]) {
    let mut beat_every = tokio::time::interval(INTERVAL);
    let mut rounds = 0;
    while serving(members).is_empty() {
        rounds += 1;
        assert!(rounds <= 3 * DIRECT_AFTER_FAILURE, "no worker took the relay over in {rounds} rounds");
        beat_every.tick().await;
        round(job, members, "after").await;
    }
}

/// One round: every member's beat at once, each answered.
async fn round(job: &str, members: &[Member], activity: &str) {
    let beats = members.iter().map(|m| m.relay.heartbeat(beat(job, m, activity)));
    for (m, answer) in members.iter().zip(futures::future::join_all(beats).await) {
        answer.unwrap_or_else(|e| panic!("{}'s beat: {e}", m.id));
    }
}

/// Binds `m`'s relay name before any worker does, as a process that then stops (or never
/// serves) would: the listener accepts connections and nothing more.
fn bind_first(m: &Member) -> std::os::unix::net::UnixListener {
    let address = std::os::unix::net::SocketAddr::from_abstract_name(m.relay.socket_name()).expect("name");
    std::os::unix::net::UnixListener::bind_addr(&address).expect("bind the name first")
}

fn serving(members: &[Member]) -> Vec<&str> {
    members.iter().filter(|m| m.relay.is_serving()).map(|m| m.id.as_str()).collect()
}

fn count(server: &ServerHandle, method: &str) -> u64 {
    server.metrics().rpc_count(method, tonic::Code::Ok)
}

/// Four workers of one host: one serves the relay, their beats reach the coordinator in
/// shared calls (fewer calls than beats, and no member sends its own), and status shows
/// each member's own activity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_shares_one_relay() {
    tokio::time::timeout(BOUND, async {
        let server = coordinator().await;
        let job = "relay-shared";
        let mut members = Vec::new();
        for i in 0..4 {
            members.push(join(&server, job, "host-a", &format!("w{i}")).await);
        }
        const ROUNDS: u64 = 5;
        for r in 0..ROUNDS {
            round(job, &members, &format!("round {r}")).await;
        }
        assert_eq!(serving(&members).len(), 1, "one relay: {:?}", serving(&members));
        let (calls, beats) = (count(&server, "HostHeartbeat"), count(&server, "Heartbeat"));
        assert_eq!(beats, 4 * ROUNDS, "every beat judged once");
        // A round's four beats share a flush, or two when a tick falls among them.
        assert!((1..=2 * ROUNDS).contains(&calls), "{calls} HostHeartbeat calls for {beats} beats");
        let status = control(&server).status(pb::StatusRequest { job: job.into() }).await.expect("status");
        for m in &members {
            let listed = status.members.iter().find(|s| s.worker_id == m.id).expect("listed");
            assert_eq!(listed.activity, format!("round {}", ROUNDS - 1), "{}", m.id);
        }
        server.shutdown().await.expect("shutdown");
    })
    .await
    .expect("bounded");
}

/// The relay's worker goes away: the others' beats go on being answered, and one of them
/// serves the relay next (within a few rounds: the old relay's task ends asynchronously, and a
/// worker that met it dying beats directly for a while), after which their beats go through
/// it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_worker_takes_over_a_relay_that_ends() {
    tokio::time::timeout(BOUND, async {
        let server = coordinator().await;
        let job = "relay-takeover";
        let mut members = Vec::new();
        for i in 0..3 {
            members.push(join(&server, job, "host-b", &format!("w{i}")).await);
        }
        round(job, &members, "before").await;
        let first = serving(&members)[0].to_string();
        members.retain(|m| m.id != first); // its relay stops with it
        rounds_until_a_relay_serves(job, &members).await;
        let now = serving(&members);
        assert_eq!(now.len(), 1, "{now:?}");
        assert_ne!(now[0], first);
        let calls = count(&server, "HostHeartbeat");
        round(job, &members, "through the new relay").await;
        assert!(count(&server, "HostHeartbeat") > calls, "the beats went through the new relay");
        server.shutdown().await.expect("shutdown");
    })
    .await
    .expect("bounded");
}

/// With the relays' sockets in a directory (`--relay-dir`, shared by a node's pods): the
/// members share one relay through its socket file, and when its worker goes away another
/// serves it from the same file (the name's lock freed with the old listener).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_directory_shares_the_relay_and_hands_it_on() {
    tokio::time::timeout(BOUND, async {
        let dir = std::env::temp_dir().join(format!("cohort-hb-dir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch directory");
        let sockets = || -> Vec<String> {
            let names = std::fs::read_dir(&dir).expect("read the directory").map(|e| e.expect("entry").file_name());
            names.map(|n| n.to_string_lossy().into_owned()).filter(|n| n.ends_with(".sock")).collect()
        };
        let net: Arc<dyn RelayNet> = Arc::new(SocketDir::new(&dir).expect("usable"));
        let server = coordinator().await;
        let job = "relay-dir";
        let mut members = Vec::new();
        for i in 0..3 {
            members.push(join_in(&server, job, "node-a", &format!("w{i}"), net.clone()).await);
        }
        round(job, &members, "before").await;
        assert_eq!(serving(&members).len(), 1, "one relay: {:?}", serving(&members));
        let calls = count(&server, "HostHeartbeat");
        assert!(calls > 0, "the beats went through the relay");
        let file = sockets();
        assert_eq!(file.len(), 1, "one socket file: {file:?}");
        assert!(file[0].starts_with("cohort-heartbeat-relay-"), "{file:?}");

        let first = serving(&members)[0].to_string();
        members.retain(|m| m.id != first);
        rounds_until_a_relay_serves(job, &members).await;
        assert_eq!(serving(&members).len(), 1, "one relay again: {:?}", serving(&members));
        let calls = count(&server, "HostHeartbeat");
        round(job, &members, "through the new relay").await;
        assert!(count(&server, "HostHeartbeat") > calls, "the beats went through the new relay");
        assert_eq!(sockets(), file, "the same socket file, served anew");
        drop(members);
        server.shutdown().await.expect("shutdown");
        let _ = std::fs::remove_dir_all(&dir);
    })
    .await
    .expect("bounded");
}

/// A relay that accepts and never answers (its process stopped): a beat is answered
/// directly within three quarters of an interval, and the next beats go directly without
/// waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_never_answers_is_bypassed() {
    tokio::time::timeout(BOUND, async {
        let server = coordinator().await;
        let job = "relay-hung";
        let m = join(&server, job, "host-c", "w0").await;
        let hung = bind_first(&m);
        let started = tokio::time::Instant::now();
        m.relay.heartbeat(beat(job, &m, "first")).await.expect("answered directly");
        let first = started.elapsed();
        assert!(first >= INTERVAL / 2, "answered after {first:?}, before the relay's wait ran out");
        assert!(first < LEASE / 2, "answered after {first:?}");
        let again = tokio::time::Instant::now();
        m.relay.heartbeat(beat(job, &m, "second")).await.expect("answered directly");
        assert!(again.elapsed() < INTERVAL, "the second beat waited {:?} for the hung relay", again.elapsed());
        assert_eq!(m.relay.bypasses(), 1, "given up once, then bypassed without waiting");
        assert_eq!(count(&server, "HostHeartbeat"), 0);
        assert!(!m.relay.is_serving());
        drop(hung);
        server.shutdown().await.expect("shutdown");
    })
    .await
    .expect("bounded");
}

/// A relay that acknowledges a beat and then never answers it (it stopped after reading it):
/// the beat is answered directly once the answer budget (the next flush, the relay's bound on
/// its own call, a quarter of an interval) has run out, and the next beats go directly
/// without waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_acknowledges_and_never_answers_is_bypassed() {
    tokio::time::timeout(BOUND, async {
        let server = coordinator().await;
        let job = "relay-mute";
        let m = join(&server, job, "host-f", "w0").await;
        let mute = bind_first(&m);
        let (release, released) = std::sync::mpsc::channel::<()>();
        let relay = std::thread::spawn(move || {
            let (mut conn, _) = mute.accept().expect("the worker connects");
            let mut len = [0u8; 4];
            conn.read_exact(&mut len).expect("a beat's length");
            conn.read_exact(&mut vec![0u8; u32::from_le_bytes(len) as usize]).expect("a beat");
            conn.write_all(&0u32.to_le_bytes()).expect("the acknowledgement");
            // Hold the connection open, silent, until the test ends.
            let _ = released.recv_timeout(BOUND);
        });
        let started = tokio::time::Instant::now();
        m.relay.heartbeat(beat(job, &m, "first")).await.expect("answered directly");
        let first = started.elapsed();
        let budget = relay_answer_budget(INTERVAL, &control_config("http://unused".into()));
        assert!(first >= budget, "answered after {first:?}, before the answer budget {budget:?} ran out");
        assert!(first < LEASE, "answered after {first:?}");
        assert_eq!(m.relay.bypasses(), 1);
        let again = tokio::time::Instant::now();
        m.relay.heartbeat(beat(job, &m, "second")).await.expect("answered directly");
        assert!(again.elapsed() < INTERVAL, "the second beat waited {:?} for the mute relay", again.elapsed());
        assert_eq!(count(&server, "Heartbeat"), 2, "both beats reached the coordinator directly");
        assert_eq!(count(&server, "HostHeartbeat"), 0);
        release.send(()).expect("the relay thread waits");
        relay.join().expect("the relay thread");
        server.shutdown().await.expect("shutdown");
    })
    .await
    .expect("bounded");
}

/// A coordinator whose answers come back late, beyond the wait before acknowledgements
/// (3/4 of an interval from the beat) and within the relay's bound on its call (an interval
/// here): the relay acknowledges each beat at once and its workers wait for the answer
/// through it, so no worker leaves the relay and the host's beats still share `HostHeartbeat`
/// calls. (With the answer wait cut to the old bound, every worker leaves it at every beat.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_coordinator_keeps_its_relay() {
    const SLOW_INTERVAL: Duration = Duration::from_secs(1);
    tokio::time::timeout(BOUND, async {
        let server = common::coordinator::start(JobSettings {
            min_workers: 1,
            max_workers: 64,
            heartbeat_interval: SLOW_INTERVAL,
            lease_ttl: SLOW_INTERVAL * 5,
            ..Default::default()
        })
        .await;
        let link = SlowLink::start(server.local_addr(), Duration::ZERO).await;
        let job = "relay-slow";
        let mut members = Vec::new();
        for i in 0..4 {
            let mut config = control_config(link.endpoint());
            config.heartbeat_timeout = SLOW_INTERVAL * 2;
            let client = ControlClient::new(config).expect("client");
            members.push(join_at(client, job, "host-g", &format!("w{i}"), Arc::new(AbstractUnix)).await);
        }
        // Past the old wait (500 ms to the flush, 250 ms more), 200 ms inside the relay's bound.
        let delay = SLOW_INTERVAL * 4 / 5;
        link.set_delay(delay);
        const ROUNDS: u64 = 4;
        for r in 0..ROUNDS {
            let started = tokio::time::Instant::now();
            round(job, &members, &format!("round {r}")).await;
            assert!(started.elapsed() >= delay, "round {r} was answered before the link's delay");
        }
        for m in &members {
            assert_eq!(m.relay.bypasses(), 0, "{} left the relay", m.id);
        }
        assert_eq!(serving(&members).len(), 1, "one relay: {:?}", serving(&members));
        let (calls, beats) = (count(&server, "HostHeartbeat"), count(&server, "Heartbeat"));
        assert_eq!(beats, 4 * ROUNDS, "every beat judged once");
        assert!((1..=2 * ROUNDS).contains(&calls), "{calls} HostHeartbeat calls for {beats} beats");
        drop(members);
        drop(link);
        server.shutdown().await.expect("shutdown");
    })
    .await
    .expect("bounded");
}

/// Bad frames on the relay's socket: a malformed beat and a beat of another job each get an
/// INVALID_ARGUMENT answer on a connection that goes on serving; an oversized frame closes
/// that connection only. The members' beats go on through the same relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_frames_are_refused_and_change_nothing() {
    tokio::time::timeout(BOUND, async {
        let server = coordinator().await;
        let job = "relay-bad";
        let m = join(&server, job, "host-d", "w0").await;
        m.relay.heartbeat(beat(job, &m, "first")).await.expect("beat");
        assert!(m.relay.is_serving());
        let address = std::os::unix::net::SocketAddr::from_abstract_name(m.relay.socket_name()).expect("name");
        let name = m.relay.socket_name().to_string();
        let refusals = tokio::task::spawn_blocking(move || {
            let mut raw = std::os::unix::net::UnixStream::connect_addr(&address).expect("connect");
            raw.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
            let mut ask = |body: &[u8]| {
                raw.write_all(&(body.len() as u32).to_le_bytes()).expect("write");
                raw.write_all(body).expect("write");
                let mut len = [0u8; 4];
                raw.read_exact(&mut len).expect("an answer");
                let mut answer = vec![0u8; u32::from_le_bytes(len) as usize];
                raw.read_exact(&mut answer).expect("an answer");
                pb::HeartbeatAnswer::decode(answer.as_slice()).expect("a well-formed answer")
            };
            let other_job =
                pb::HeartbeatRequest { job: "job-other".into(), worker_id: "x".into(), ..Default::default() };
            let answers = [ask(&[0xff, 0xff, 0xff]), ask(&other_job.encode_to_vec())];
            // Oversized: the relay closes this connection without reading it.
            raw.write_all(&(64u32 << 20).to_le_bytes()).expect("write");
            let mut rest = Vec::new();
            let closed = raw.read_to_end(&mut rest);
            (answers, closed.map(|_| rest.len()).map_err(|e| e.kind()))
        })
        .await
        .expect("raw client");
        let (answers, closed) = refusals;
        for answer in &answers {
            match &answer.outcome {
                Some(pb::heartbeat_answer::Outcome::Refused(r)) => {
                    assert_eq!(tonic::Code::from(r.code), tonic::Code::InvalidArgument, "{r:?}")
                }
                other => panic!("not refused: {other:?}"),
            }
        }
        assert_eq!(closed, Ok(0), "the oversized frame's connection ends with nothing more");
        m.relay.heartbeat(beat(job, &m, "after")).await.expect("the relay still serves");
        assert!(m.relay.is_serving(), "{name} still served by w0");
        assert_eq!(count(&server, "Heartbeat"), 2, "only the member's beats were judged");
        server.shutdown().await.expect("shutdown");
    })
    .await
    .expect("bounded");
}

/// A lease shorter than four intervals leaves no room for a relay's delay: no relay.
#[tokio::test]
async fn a_short_lease_sends_its_own_beats() {
    let client = ControlClient::new(ControlConfig::new(vec!["http://127.0.0.1:9".into()])).expect("client");
    let interval = Duration::from_millis(500);
    let job = JobId::new("j").expect("job id");
    assert!(HostRelay::new(client.clone(), &job, "h", interval, interval * 3, Arc::new(AbstractUnix)).is_none());
    assert!(HostRelay::new(client, &job, "h", interval, interval * 4, Arc::new(AbstractUnix)).is_some());
}

/// A process of another user binds the relay's name first and answers every beat with a
/// forged "revoked, leave as a straggler": the worker refuses it (its server is not of this
/// user) and sends its beats directly, every one answered by the coordinator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_of_another_user_is_refused() {
    tokio::time::timeout(BOUND, async {
        let server = coordinator().await;
        let job = "relay-squatted";
        let m = join(&server, job, "host-e", "w0").await;
        let forged = pb::HeartbeatAnswer {
            outcome: Some(pb::heartbeat_answer::Outcome::Ok(pb::HeartbeatResponse {
                current_revoked: true,
                leave_as_straggler: "w0".into(),
                ..Default::default()
            })),
        };
        let answer = squatter::frame(&forged.encode_to_vec());
        let Some(_squatter) = squatter::Squatter::start(m.relay.socket_name(), &[], &answer) else { return };
        for i in 0..3 {
            let answer = m.relay.heartbeat(beat(job, &m, &format!("beat {i}"))).await.expect("answered");
            assert!(
                !answer.current_revoked && answer.leave_as_straggler.is_empty(),
                "a forged answer was used: {answer:?}"
            );
        }
        assert!(!m.relay.is_serving());
        assert_eq!(count(&server, "Heartbeat"), 3, "every beat reached the coordinator directly");
        assert_eq!(count(&server, "HostHeartbeat"), 0);
        server.shutdown().await.expect("shutdown");
    })
    .await
    .expect("bounded");
}
