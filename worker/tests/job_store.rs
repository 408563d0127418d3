//! The job's key-value store on the coordinator (`StoreOp`, torch's c10d store) through the
//! worker library's [`JobStore`]: every operation on the memory store and on a real etcd,
//! compare_set's semantics, a wait that runs out, bad input refused with nothing changed, a
//! wrong credential refused, the keys deleted when the job ends, and (on etcd) the store
//! working on through the death of the replica a client was talking to.

mod common;

use cohort::control::{ControlClient, ControlConfig, ControlError, JobStore};
use cohort::elastic::JobId;
use cohort_coordinator::kv::{MAX_KEYS_PER_JOB, MAX_KEY_LEN, MAX_VALUE_LEN, MAX_WAIT_KEYS};
use cohort_coordinator::store::etcd::EtcdStore;
use cohort_coordinator::store::memory::MemoryStore;
use cohort_coordinator::store::{Store, Txn, TxnOp};
use cohort_coordinator::{JobSettings, ServeConfig, ServerHandle, Settings};
use cohort_proto::credentials::job_token;
use cohort_proto::v1 as pb;
use cohort_testkit::etcd::EtcdProcess;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::Code;

const BOUND: Duration = Duration::from_secs(120);
const OPERATOR: &str = "operator secret";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    Memory,
    Etcd,
}

/// A store and the etcd behind it (kept alive).
struct Backing {
    store: Arc<dyn Store>,
    _etcd: Option<EtcdProcess>,
}

async fn backing(backend: Backend) -> Backing {
    match backend {
        Backend::Memory => Backing { store: Arc::new(MemoryStore::new()), _etcd: None },
        Backend::Etcd => {
            let etcd = tokio::task::spawn_blocking(EtcdProcess::start)
                .await
                .expect("etcd start task")
                .unwrap_or_else(|e| panic!("cannot start etcd: {e}"));
            let store = EtcdStore::connect(&[etcd.endpoint()]).await.expect("connect to etcd");
            Backing { store: Arc::new(store), _etcd: Some(etcd) }
        }
    }
}

async fn replica(store: Arc<dyn Store>, token: Option<&str>) -> ServerHandle {
    let settings = JobSettings {
        min_workers: 1,
        max_workers: 8,
        join_window: Duration::from_millis(100),
        heartbeat_interval: Duration::from_millis(200),
        lease_ttl: Duration::from_secs(3),
        ..Default::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let mut config = ServeConfig::new(store, Settings::uniform(settings).expect("settings"));
    config.token = token.map(str::to_string);
    cohort_coordinator::start(config, listener).await.expect("coordinator")
}

/// A job id known to be valid.
fn job(id: &str) -> JobId {
    JobId::new(id).expect("a valid job id")
}

fn client(servers: &[&ServerHandle], token: Option<String>) -> ControlClient {
    let mut config = ControlConfig::new(servers.iter().map(|s| format!("http://{}", s.local_addr())).collect());
    config.token = token;
    config.request_timeout = Duration::from_secs(3);
    config.retry_budget = Duration::from_secs(20);
    ControlClient::new(config).expect("client")
}

fn code(e: ControlError) -> (Code, String) {
    match e {
        ControlError::Rejected { code, message, .. } => (code, message),
        other => panic!("expected a refusal, got {other}"),
    }
}

async fn bounded(test: impl std::future::Future<Output = ()>) {
    tokio::time::timeout(BOUND, test).await.expect("test exceeded its bound");
}

fn keys(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}

async fn every_operation(backend: Backend) {
    let b = backing(backend).await;
    let server = replica(b.store.clone(), None).await;
    let kv = JobStore::new(client(&[&server], None), job("job"), "g1");

    // set, get, try_get, check, num_keys, delete.
    assert_eq!(kv.try_get("a").await.expect("try_get"), None);
    kv.set("a", b"alpha".to_vec()).await.expect("set");
    assert_eq!(kv.try_get("a").await.expect("get").as_deref(), Some(&b"alpha"[..]));
    assert_eq!(kv.get("a", Duration::from_secs(1)).await.expect("get").as_deref(), Some(&b"alpha"[..]));
    kv.set("a", b"again".to_vec()).await.expect("overwrite");
    assert_eq!(kv.try_get("a").await.expect("get").as_deref(), Some(&b"again"[..]));
    kv.set("empty", Vec::new()).await.expect("an empty value");
    assert_eq!(kv.try_get("empty").await.expect("get"), Some(Vec::new()), "an empty value exists");
    assert!(kv.check(&keys(&["a", "empty"])).await.expect("check"));
    assert!(!kv.check(&keys(&["a", "b"])).await.expect("check"));
    assert_eq!(kv.num_keys().await.expect("num_keys"), 2);
    assert!(kv.delete("empty").await.expect("delete"));
    assert!(!kv.delete("empty").await.expect("delete again"));
    assert_eq!(kv.num_keys().await.expect("num_keys"), 1);

    // Scopes never meet.
    let other = JobStore::new(client(&[&server], None), job("job"), "g2");
    assert_eq!(other.try_get("a").await.expect("get"), None);
    assert_eq!(other.num_keys().await.expect("num_keys"), 0);
    let root = JobStore::new(client(&[&server], None), job("job"), "");
    root.set("g1/a", b"root".to_vec()).await.expect("a key with a slash in the root scope");
    assert_eq!(kv.try_get("a").await.expect("get").as_deref(), Some(&b"again"[..]));
    let other_job = JobStore::new(client(&[&server], None), job("job2"), "g1");
    assert_eq!(other_job.try_get("a").await.expect("get"), None, "jobs never meet");

    // add: decimal integers, as torch keeps them.
    assert_eq!(kv.add("n", 1).await.expect("add"), 1);
    assert_eq!(kv.add("n", 5).await.expect("add"), 6);
    assert_eq!(kv.add("n", -7).await.expect("add"), -1);
    assert_eq!(kv.try_get("n").await.expect("get").as_deref(), Some(&b"-1"[..]));
    let (c, m) = code(kv.add("a", 1).await.expect_err("add on text"));
    assert_eq!(c, Code::FailedPrecondition, "{m}");
    assert!(m.contains("not an integer"), "{m}");
    kv.set("big", i64::MAX.to_string().into_bytes()).await.expect("set");
    assert_eq!(code(kv.add("big", 1).await.expect_err("overflow")).0, Code::FailedPrecondition);
    // Concurrent adds are each applied once (compare-and-swap retries).
    let adders = (0..6).map(|_| {
        let kv = kv.clone();
        tokio::spawn(async move {
            for _ in 0..10 {
                kv.add("count", 1).await.expect("concurrent add");
            }
        })
    });
    for a in futures::future::join_all(adders).await {
        a.expect("adder");
    }
    assert_eq!(kv.add("count", 0).await.expect("read by add 0"), 60);

    // append: to an absent key (empty), then to what it holds; concurrent appends each once.
    kv.append("log", b"ab".to_vec()).await.expect("append to an absent key");
    kv.append("log", b"cd".to_vec()).await.expect("append");
    kv.append("log", Vec::new()).await.expect("append nothing");
    assert_eq!(kv.try_get("log").await.expect("get").as_deref(), Some(&b"abcd"[..]));
    let appenders = (0..4u8).map(|i| {
        let kv = kv.clone();
        tokio::spawn(async move {
            for _ in 0..5 {
                kv.append("same", vec![b'x']).await.expect("concurrent append");
                kv.append("mixed", vec![b'0' + i]).await.expect("concurrent append");
            }
        })
    });
    for a in futures::future::join_all(appenders).await {
        a.expect("appender");
    }
    assert_eq!(kv.try_get("same").await.expect("get"), Some(vec![b'x'; 20]), "equal appends are not merged");
    let mut mixed = kv.try_get("mixed").await.expect("get").expect("mixed");
    mixed.sort_unstable();
    assert_eq!(mixed, b"00000111112222233333", "each append once");

    // compare_set, as torch's TCPStore answers it.
    assert_eq!(kv.compare_set("cs", b"x".to_vec(), b"y".to_vec()).await.expect("cas"), b"x", "absent, expected x");
    assert_eq!(kv.try_get("cs").await.expect("get"), None, "nothing written");
    assert_eq!(
        kv.compare_set("cs", Vec::new(), b"first".to_vec()).await.expect("cas"),
        b"first",
        "absent, expected empty"
    );
    assert_eq!(kv.try_get("cs").await.expect("get").as_deref(), Some(&b"first"[..]));
    assert_eq!(kv.compare_set("cs", b"wrong".to_vec(), b"z".to_vec()).await.expect("cas"), b"first", "mismatch");
    assert_eq!(kv.compare_set("cs", b"first".to_vec(), b"second".to_vec()).await.expect("cas"), b"second", "match");
    assert_eq!(kv.try_get("cs").await.expect("get").as_deref(), Some(&b"second"[..]));

    // wait and get block until the keys exist; a wait runs out with `false`.
    let waiter = {
        let kv = kv.clone();
        tokio::spawn(async move { kv.wait(&keys(&["w1", "w2"]), Duration::from_secs(30)).await })
    };
    let getter = {
        let kv = kv.clone();
        tokio::spawn(async move { kv.get("w2", Duration::from_secs(30)).await })
    };
    kv.set("w1", b"1".to_vec()).await.expect("set w1");
    kv.set("w2", b"2".to_vec()).await.expect("set w2");
    assert!(waiter.await.expect("waiter").expect("wait"), "the wait saw both keys");
    assert_eq!(getter.await.expect("getter").expect("get").as_deref(), Some(&b"2"[..]));
    let started = Instant::now();
    assert!(!kv.wait(&keys(&["w1", "never"]), Duration::from_millis(400)).await.expect("wait"));
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(400) && waited < Duration::from_secs(5), "waited {waited:?}");
    let started = Instant::now();
    assert_eq!(kv.get("never", Duration::from_millis(300)).await.expect("get"), None);
    assert!(started.elapsed() >= Duration::from_millis(300));
    server.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_on_memory() {
    bounded(every_operation(Backend::Memory)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_on_etcd() {
    bounded(every_operation(Backend::Etcd)).await;
}

/// Fills the job's store up to `n` keys straight in the backend (the RPC path would take
/// minutes on etcd), in transactions of 128 puts (etcd's default `--max-txn-ops`).
async fn fill(store: &dyn Store, job: &str, n: u64) {
    let names: Vec<String> = (0..n).map(|i| format!("/cohort/v1/kv/{job}/fill/k{i:06}")).collect();
    for chunk in names.chunks(128) {
        let success = chunk.iter().map(|k| TxnOp::Put { key: k.clone(), value: vec![1], lease: None }).collect();
        assert!(store.txn(Txn { compares: vec![], success, failure: vec![] }).await.expect("fill").succeeded);
    }
}

async fn bad_input(backend: Backend) {
    let b = backing(backend).await;
    let server = replica(b.store.clone(), None).await;
    let c = client(&[&server], None);
    let kv = JobStore::new(c.clone(), job("job"), "g1");
    kv.set("kept", b"v".to_vec()).await.expect("set");
    let invalid = |r: Result<(), ControlError>, what: &str| {
        let (c, m) = code(r.expect_err(what));
        assert_eq!(c, Code::InvalidArgument, "{what}: {m}");
        m
    };
    let m = invalid(kv.set("", b"v".to_vec()).await, "empty key");
    assert!(m.contains("empty"), "{m}");
    let long = "k".repeat(MAX_KEY_LEN + 1);
    let m = invalid(kv.set(&long, b"v".to_vec()).await, "long key");
    assert!(m.contains(&format!("at most {MAX_KEY_LEN}")), "{m}");
    let m = invalid(kv.set("big", vec![0; MAX_VALUE_LEN + 1]).await, "oversized value");
    assert!(m.contains("1 MiB"), "{m}");
    invalid(kv.compare_set("kept", Vec::new(), vec![0; MAX_VALUE_LEN + 1]).await.map(drop), "oversized desired");
    invalid(kv.append("", b"v".to_vec()).await, "empty key on append");
    invalid(kv.append("big", vec![0; MAX_VALUE_LEN + 1]).await, "oversized append");
    // An append that would pass the value bound is refused whole: the key keeps its value.
    kv.append("kept", vec![1; MAX_VALUE_LEN - 2]).await.expect("an append up to 1 byte short of the bound");
    let m = invalid(kv.append("kept", b"xy".to_vec()).await, "an append past the value bound");
    assert!(m.contains("value bound") && m.contains("nothing written"), "{m}");
    kv.append("kept", b"z".to_vec()).await.expect("an append to exactly the bound");
    let kept = kv.try_get("kept").await.expect("get").expect("kept");
    assert_eq!((kept.len(), &kept[..1], kept[kept.len() - 1]), (MAX_VALUE_LEN, &b"v"[..], b'z'));
    kv.set("kept", b"v".to_vec()).await.expect("set back");
    invalid(kv.get(&long, Duration::ZERO).await.map(drop), "long key on get");
    invalid(kv.add("", 1).await.map(drop), "empty key on add");
    invalid(kv.delete("").await.map(drop), "empty key on delete");
    invalid(kv.check(&[]).await.map(drop), "no keys to check");
    let many: Vec<String> = (0..=MAX_WAIT_KEYS).map(|i| format!("k{i}")).collect();
    invalid(kv.wait(&many, Duration::from_millis(10)).await.map(drop), "too many keys to wait for");
    invalid(kv.check(&["ok".into(), String::new()]).await.map(drop), "an empty key among the checked");
    let bad_scope = JobStore::new(c.clone(), job("job"), "g/1");
    invalid(bad_scope.set("k", b"v".to_vec()).await, "a scope with a slash");
    // A bad job id is refused where it is made; the coordinator refuses one sent anyway.
    assert!(JobId::new("no such/job").is_err());
    let op = pb::store_request::Op::Set(pb::StoreSet { key: "k".into(), value: b"v".to_vec() });
    let bad_job = pb::StoreRequest { job: "no such/job".into(), scope: String::new(), op: Some(op) };
    invalid(c.store_op(bad_job).await.map(drop), "a bad job id");
    // The value at the bound is accepted.
    kv.set("max", vec![7; MAX_VALUE_LEN]).await.expect("a value of exactly 1 MiB");
    assert_eq!(kv.try_get("max").await.expect("get").map(|v| v.len()), Some(MAX_VALUE_LEN));
    assert!(kv.delete("max").await.expect("delete"));
    // Nothing the refusals named was written.
    assert_eq!(kv.num_keys().await.expect("num_keys"), 1);
    assert_eq!(kv.try_get("big").await.expect("get"), None);

    // Too many keys in the job: the last one fits, one more is refused, overwriting is fine.
    fill(b.store.as_ref(), "job", MAX_KEYS_PER_JOB - 2).await;
    kv.set("last", b"v".to_vec()).await.expect("the job's last key");
    let m = invalid(kv.set("one-more", b"v".to_vec()).await, "a key past the job's bound");
    assert!(m.contains(&format!("at most {MAX_KEYS_PER_JOB}")), "{m}");
    invalid(
        JobStore::new(c.clone(), job("job"), "g9").add("n", 1).await.map(drop),
        "a key past the bound, other scope",
    );
    kv.set("last", b"overwritten".to_vec()).await.expect("overwriting needs no new key");
    assert_eq!(kv.try_get("one-more").await.expect("get"), None);
    assert!(kv.delete("last").await.expect("delete"));
    kv.set("one-more", b"v".to_vec()).await.expect("room again after a delete");
    // Another job has its own bound.
    JobStore::new(c, job("job2"), "").set("k", b"v".to_vec()).await.expect("another job");
    server.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_changes_nothing_on_memory() {
    bounded(bad_input(Backend::Memory)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_changes_nothing_on_etcd() {
    bounded(bad_input(Backend::Etcd)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_jobs_credential_admits_its_job_only() {
    bounded(async {
        let b = backing(Backend::Memory).await;
        let server = replica(b.store.clone(), Some(OPERATOR)).await;
        let own = JobStore::new(client(&[&server], Some(job_token(OPERATOR.as_bytes(), "a"))), job("a"), "");
        own.set("k", b"a's".to_vec()).await.expect("a's credential on a");
        let foreign = JobStore::new(client(&[&server], Some(job_token(OPERATOR.as_bytes(), "a"))), job("b"), "");
        assert_eq!(
            code(foreign.set("k", b"x".to_vec()).await.expect_err("a's credential on b")).0,
            Code::PermissionDenied
        );
        let forged = JobStore::new(client(&[&server], Some(job_token(b"another secret", "a"))), job("a"), "");
        assert_eq!(code(forged.set("k", b"x".to_vec()).await.expect_err("forged")).0, Code::Unauthenticated);
        let wrong = JobStore::new(client(&[&server], Some("wrong".into())), job("a"), "");
        assert_eq!(code(wrong.set("k", b"x".to_vec()).await.expect_err("wrong token")).0, Code::Unauthenticated);
        assert_eq!(code(wrong.try_get("k").await.expect_err("wrong token reads")).0, Code::Unauthenticated);
        let none = JobStore::new(client(&[&server], None), job("a"), "");
        assert_eq!(code(none.add("k", 1).await.expect_err("no token")).0, Code::Unauthenticated);
        assert_eq!(own.try_get("k").await.expect("get").as_deref(), Some(&b"a's"[..]), "nothing changed");
        let operator = JobStore::new(client(&[&server], Some(OPERATOR.into())), job("b"), "");
        assert_eq!(operator.try_get("k").await.expect("operator reads b"), None, "nothing written to b");
        server.shutdown().await.expect("shutdown");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_keys_go_when_the_job_ends() {
    bounded(async {
        let b = backing(Backend::Memory).await;
        let server = replica(b.store.clone(), None).await;
        let c = client(&[&server], None);
        let kv = JobStore::new(c.clone(), job("ending"), "g1");
        kv.set("k", b"v".to_vec()).await.expect("set");
        kv.add("n", 3).await.expect("add");
        let kept = JobStore::new(c.clone(), job("other"), "");
        kept.set("k", b"v".to_vec()).await.expect("another job's key");
        let joined = common::coordinator::join(&c, "ending", "host", "w0").await;
        let formed = c
            .rendezvous(pb::RendezvousRequest {
                job: "ending".into(),
                worker_id: "w0".into(),
                incarnation: joined.incarnation,
                after_generation: 0,
                wait_ms: 10_000,
                ..Default::default()
            })
            .await
            .expect("rendezvous");
        assert!(matches!(formed.outcome, Some(pb::rendezvous_response::Outcome::Formed(_))), "{formed:?}");
        c.leave(pb::LeaveRequest {
            job: "ending".into(),
            worker_id: "w0".into(),
            incarnation: joined.incarnation,
            mode: pb::leave_request::Mode::Finished as i32,
        })
        .await
        .expect("leave");
        assert_eq!(b.store.count_prefix("/cohort/v1/kv/ending/").await.expect("count"), 0, "the job's keys are gone");
        assert_eq!(kv.try_get("k").await.expect("get"), None);
        let (code, message) = code(kv.set("k", b"late".to_vec()).await.expect_err("a write after the end"));
        assert_eq!(code, Code::FailedPrecondition, "{message}");
        assert!(message.contains("ended"), "{message}");
        assert_eq!(kv.num_keys().await.expect("num_keys"), 0, "nothing written after the end");
        assert_eq!(kept.try_get("k").await.expect("get").as_deref(), Some(&b"v"[..]), "another job keeps its keys");
        server.shutdown().await.expect("shutdown");
    })
    .await;
}

/// Two replicas on one etcd; the client talks to the first, which dies (killed, no
/// shutdown), normally while a wait is in flight on it. The wait goes on at the second replica and sees
/// the key set after the death; every key written before it is still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_outlives_a_replica_on_etcd() {
    bounded(async {
        let b = backing(Backend::Etcd).await;
        let first = replica(b.store.clone(), Some(OPERATOR)).await;
        let second = replica(b.store.clone(), Some(OPERATOR)).await;
        let token = Some(job_token(OPERATOR.as_bytes(), "ha"));
        let kv = JobStore::new(client(&[&first, &second], token.clone()), job("ha"), "g1");
        kv.set("before", b"v".to_vec()).await.expect("set");
        assert_eq!(kv.add("n", 2).await.expect("add"), 2);
        // A wait in flight on the first replica (the client's preferred endpoint).
        let waiter = {
            let kv = JobStore::new(client(&[&first, &second], token.clone()), job("ha"), "g1");
            tokio::spawn(async move { kv.wait(&keys(&["after"]), Duration::from_secs(60)).await })
        };
        // One more round trip through the first replica: the waiter, spawned before it, has
        // almost always reached it by now; either way its wait must come back true.
        assert_eq!(kv.try_get("before").await.expect("get").as_deref(), Some(&b"v"[..]));
        first.kill();
        assert_eq!(kv.try_get("before").await.expect("read after the death").as_deref(), Some(&b"v"[..]));
        assert_eq!(kv.add("n", 3).await.expect("add after the death"), 5);
        kv.set("after", b"w".to_vec()).await.expect("set after the death");
        assert!(waiter.await.expect("waiter").expect("the wait goes on at the other replica"));
        assert_eq!(kv.compare_set("after", b"w".to_vec(), b"x".to_vec()).await.expect("cas"), b"x");
        assert_eq!(kv.num_keys().await.expect("num_keys"), 3);
        second.shutdown().await.expect("shutdown");
    })
    .await;
}
