//! One behavioural suite for every `Store` backend.
//!
//! Each scenario is a generic async fn over `S: Store`; the `suite!` macro instantiates it
//! once on a fresh `MemoryStore` (with Tokio's clock paused, so lease TTLs pass instantly)
//! and once on the real etcd that this test binary starts (one shared server, a distinct key
//! prefix per test, real time). etcd-only tests (compaction, outage, restart) start their
//! own server so they cannot disturb the shared one.

use std::sync::OnceLock;
use std::time::Duration;

use cohort_coordinator::store::etcd::EtcdStore;
use cohort_coordinator::store::memory::MemoryStore;
use cohort_coordinator::store::{Compare, KeyValue, Store, StoreError, Txn, TxnOp, WatchEvent, WatchStream};
use cohort_testkit::etcd::EtcdProcess;
use futures::{FutureExt, StreamExt};
use tokio::time::{timeout, Instant};

/// Bound on a whole test.
const BOUND: Duration = Duration::from_secs(60);
/// Bound on waiting for one watch event.
const EVENT_DEADLINE: Duration = Duration::from_secs(15);

static SHARED_ETCD: OnceLock<Result<EtcdProcess, String>> = OnceLock::new();

/// The endpoint of the etcd shared by this test binary (started on first use).
async fn shared_etcd_endpoint() -> String {
    let started = tokio::task::spawn_blocking(|| {
        match SHARED_ETCD.get_or_init(|| EtcdProcess::start().map_err(|e| e.to_string())) {
            Ok(etcd) => Ok(etcd.endpoint()),
            Err(e) => Err(e.clone()),
        }
    })
    .await
    .expect("etcd start task");
    started.unwrap_or_else(|e| panic!("cannot start etcd: {e}"))
}

async fn shared_etcd_store() -> EtcdStore {
    EtcdStore::connect(&[shared_etcd_endpoint().await]).await.expect("connect to the shared etcd")
}

/// The next watch event, which must arrive within [`EVENT_DEADLINE`] and not be an error.
async fn next_event(watch: &mut WatchStream) -> WatchEvent {
    match timeout(EVENT_DEADLINE, watch.next()).await {
        Ok(Some(Ok(ev))) => ev,
        Ok(Some(Err(e))) => panic!("watch error: {e}"),
        Ok(None) => panic!("watch ended"),
        Err(_) => panic!("no watch event within {EVENT_DEADLINE:?}"),
    }
}

fn put_of(ev: &WatchEvent) -> &KeyValue {
    match ev {
        WatchEvent::Put(kv) => kv,
        other => panic!("expected a put, got {other:?}"),
    }
}

fn delete_of(ev: &WatchEvent) -> (&str, i64) {
    match ev {
        WatchEvent::Delete { key, revision } => (key, *revision),
        other => panic!("expected a delete, got {other:?}"),
    }
}

fn revision_of(ev: &WatchEvent) -> i64 {
    match ev {
        WatchEvent::Put(kv) => kv.mod_revision,
        WatchEvent::Delete { revision, .. } => *revision,
    }
}

/// Writes a sentinel key and checks that it is the very next event (nothing unexpected
/// came before it).
async fn expect_only_sentinel_next<S: Store>(store: &S, watch: &mut WatchStream, prefix: &str) {
    let key = format!("{prefix}~sentinel");
    let rev = store.put(&key, b"s".to_vec(), None).await.expect("put sentinel");
    let ev = next_event(watch).await;
    assert_eq!(put_of(&ev).key, key, "unexpected event before the sentinel");
    assert_eq!(put_of(&ev).mod_revision, rev);
}

// ---------------------------------------------------------------------------------------
// Scenarios
// ---------------------------------------------------------------------------------------

async fn put_get_revisions<S: Store>(s: S, p: String) {
    let a = format!("{p}a");
    let b = format!("{p}b");
    assert_eq!(s.get(&a).await.expect("get"), None);
    let r1 = s.put(&a, b"1".to_vec(), None).await.expect("put");
    let r2 = s.put(&b, b"2".to_vec(), None).await.expect("put");
    assert!(r2 > r1, "revisions increase: {r1} then {r2}");
    let kv = s.get(&a).await.expect("get").expect("present");
    assert_eq!((kv.key.as_str(), kv.value.as_slice()), (a.as_str(), &b"1"[..]));
    assert_eq!((kv.create_revision, kv.mod_revision, kv.lease), (r1, r1, None));
    let r3 = s.put(&a, b"3".to_vec(), None).await.expect("overwrite");
    assert!(r3 > r2);
    let kv = s.get(&a).await.expect("get").expect("present");
    assert_eq!((kv.value.as_slice(), kv.create_revision, kv.mod_revision), (&b"3"[..], r1, r3));
    let (_, read_rev) = s.get_prefix(&p).await.expect("get_prefix");
    assert!(read_rev >= r3, "a read's revision covers earlier writes");
    assert!(matches!(s.get("").await, Err(StoreError::Invalid(_))));
    assert!(matches!(s.put("", vec![], None).await, Err(StoreError::Invalid(_))));
}

async fn get_prefix_in_key_order<S: Store>(s: S, p: String) {
    for k in ["c", "a", "sub/2", "b", "sub/1", "suba"] {
        s.put(&format!("{p}{k}"), k.as_bytes().to_vec(), None).await.expect("put");
    }
    let (kvs, _) = s.get_prefix(&p).await.expect("get_prefix");
    let keys: Vec<&str> = kvs.iter().map(|kv| kv.key.strip_prefix(p.as_str()).expect("prefix")).collect();
    assert_eq!(keys, ["a", "b", "c", "sub/1", "sub/2", "suba"]);
    let (kvs, _) = s.get_prefix(&format!("{p}sub/")).await.expect("get_prefix");
    let values: Vec<&[u8]> = kvs.iter().map(|kv| kv.value.as_slice()).collect();
    assert_eq!(values, [&b"sub/1"[..], &b"sub/2"[..]]);
    let (kvs, _) = s.get_prefix(&format!("{p}none/")).await.expect("get_prefix");
    assert!(kvs.is_empty());
}

async fn count_prefix_counts_without_values<S: Store>(s: S, p: String) {
    for k in ["a", "sub/1", "sub/2", "suba"] {
        s.put(&format!("{p}{k}"), vec![7; 1000], None).await.expect("put");
    }
    assert_eq!(s.count_prefix(&p).await.expect("count"), 4);
    assert_eq!(s.count_prefix(&format!("{p}sub/")).await.expect("count"), 2);
    assert_eq!(s.count_prefix(&format!("{p}sub")).await.expect("count"), 3);
    assert_eq!(s.count_prefix(&format!("{p}none/")).await.expect("count"), 0);
    s.delete(&format!("{p}sub/1")).await.expect("delete");
    assert_eq!(s.count_prefix(&format!("{p}sub/")).await.expect("count"), 1);
}

async fn delete_and_delete_prefix<S: Store>(s: S, p: String) {
    for k in ["x", "d/1", "d/2", "d/3", "e"] {
        s.put(&format!("{p}{k}"), vec![], None).await.expect("put");
    }
    assert!(s.delete(&format!("{p}x")).await.expect("delete"));
    assert!(!s.delete(&format!("{p}x")).await.expect("delete again"));
    assert_eq!(s.get(&format!("{p}x")).await.expect("get"), None);
    assert_eq!(s.delete_prefix(&format!("{p}d/")).await.expect("delete_prefix"), 3);
    assert_eq!(s.delete_prefix(&format!("{p}d/")).await.expect("delete_prefix again"), 0);
    let (kvs, _) = s.get_prefix(&p).await.expect("get_prefix");
    let keys: Vec<String> = kvs.into_iter().map(|kv| kv.key).collect();
    assert_eq!(keys, [format!("{p}e")]);
}

async fn txn_compare_and_swap<S: Store>(s: S, p: String) {
    let k = format!("{p}k");
    let flag = format!("{p}failed");
    let r1 = s.put(&k, b"v1".to_vec(), None).await.expect("put");
    let cas = |rev: i64, value: &[u8]| Txn {
        compares: vec![Compare::ModRevision(k.clone(), rev)],
        success: vec![TxnOp::Put { key: k.clone(), value: value.to_vec(), lease: None }],
        failure: vec![TxnOp::Put { key: flag.clone(), value: b"yes".to_vec(), lease: None }],
    };
    let res = s.txn(cas(r1, b"v2")).await.expect("txn");
    assert!(res.succeeded);
    let kv = s.get(&k).await.expect("get").expect("present");
    assert_eq!((kv.value.as_slice(), kv.mod_revision), (&b"v2"[..], res.revision));
    assert_eq!(s.get(&flag).await.expect("get"), None, "failure branch not applied");

    // A stale mod_revision: the failure branch runs, the success branch does not.
    let res = s.txn(cas(r1, b"v3")).await.expect("txn");
    assert!(!res.succeeded);
    assert_eq!(s.get(&k).await.expect("get").expect("present").value, b"v2");
    let flagged = s.get(&flag).await.expect("get").expect("failure branch applied");
    assert_eq!(flagged.mod_revision, res.revision);
}

async fn txn_conditions<S: Store>(s: S, p: String) {
    let k = format!("{p}k");
    let missing = format!("{p}missing");
    let put = |key: &str, v: &[u8]| TxnOp::Put { key: key.to_owned(), value: v.to_vec(), lease: None };
    let when = |c: Vec<Compare>| Txn { compares: c, success: vec![], failure: vec![] };

    // Absent: put-if-absent succeeds once.
    let create = Txn { compares: vec![Compare::Absent(k.clone())], success: vec![put(&k, b"v")], failure: vec![] };
    assert!(s.txn(create.clone()).await.expect("txn").succeeded);
    assert!(!s.txn(create).await.expect("txn").succeeded);

    let cases = [
        (vec![Compare::Exists(k.clone())], true),
        (vec![Compare::Exists(missing.clone())], false),
        (vec![Compare::Absent(missing.clone())], true),
        (vec![Compare::ValueEquals(k.clone(), b"v".to_vec())], true),
        (vec![Compare::ValueEquals(k.clone(), b"other".to_vec())], false),
        // As in etcd, a value comparison on a missing key fails even against empty bytes.
        (vec![Compare::ValueEquals(missing.clone(), Vec::new())], false),
        // A missing key has mod_revision 0.
        (vec![Compare::ModRevision(missing.clone(), 0)], true),
        // All compares must hold.
        (vec![Compare::Exists(k.clone()), Compare::Absent(k.clone())], false),
        (vec![Compare::Exists(k.clone()), Compare::Absent(missing.clone())], true),
        (vec![], true),
    ];
    for (compares, expected) in cases {
        let res = s.txn(when(compares.clone())).await.expect("txn");
        assert_eq!(res.succeeded, expected, "compares {compares:?}");
    }

    // Several writes in one transaction share one revision; deletes run in the same step.
    let a = format!("{p}multi/a");
    let b = format!("{p}multi/b");
    let res = s
        .txn(Txn {
            compares: vec![],
            success: vec![put(&a, b"a"), put(&b, b"b"), TxnOp::Delete(k.clone())],
            failure: vec![],
        })
        .await
        .expect("txn");
    assert!(res.succeeded);
    assert_eq!(s.get(&a).await.expect("get").expect("a").mod_revision, res.revision);
    assert_eq!(s.get(&b).await.expect("get").expect("b").mod_revision, res.revision);
    assert_eq!(s.get(&k).await.expect("get"), None);
    let res = s
        .txn(Txn { compares: vec![], success: vec![TxnOp::DeletePrefix(format!("{p}multi/"))], failure: vec![] })
        .await
        .expect("txn");
    assert!(res.succeeded);
    assert!(s.get_prefix(&format!("{p}multi/")).await.expect("get_prefix").0.is_empty());

    // Writing one key twice in a branch is rejected, as etcd does.
    let dup = Txn { compares: vec![], success: vec![put(&a, b"1"), put(&a, b"2")], failure: vec![] };
    assert!(matches!(s.txn(dup).await, Err(StoreError::Invalid(_))));
    assert_eq!(s.get(&a).await.expect("get"), None, "a rejected transaction applies nothing");
}

async fn lease_expiry_deletes_keys<S: Store>(s: S, p: String) {
    let lease = s.grant_lease(Duration::from_secs(1)).await.expect("grant");
    let ttl = s.lease_time_to_live(lease).await.expect("ttl").expect("lease alive");
    assert!(ttl <= Duration::from_secs(1), "granted TTL {ttl:?}");
    let key = format!("{p}member");
    let rev = s.put(&key, b"alive".to_vec(), Some(lease)).await.expect("put on lease");
    assert_eq!(s.get(&key).await.expect("get").expect("present").lease, Some(lease));
    let mut watch = s.watch_prefix(&p, rev + 1).await.expect("watch");
    let started = Instant::now();
    let ev = next_event(&mut watch).await;
    let (deleted, del_rev) = delete_of(&ev);
    assert_eq!(deleted, key);
    assert!(del_rev > rev);
    assert!(started.elapsed() >= Duration::from_millis(500), "expired after {:?}, before its TTL", started.elapsed());
    assert_eq!(s.get(&key).await.expect("get"), None);
    assert!(matches!(s.keep_alive(lease).await, Err(StoreError::LeaseNotFound(id)) if id == lease));
    assert_eq!(s.lease_time_to_live(lease).await.expect("ttl"), None);
    assert!(matches!(s.put(&key, vec![], Some(lease)).await, Err(StoreError::LeaseNotFound(id)) if id == lease));
}

async fn keep_alive_extends_lease<S: Store>(s: S, p: String) {
    let lease = s.grant_lease(Duration::from_secs(2)).await.expect("grant");
    let key = format!("{p}member");
    let rev = s.put(&key, vec![], Some(lease)).await.expect("put on lease");
    let mut watch = s.watch_prefix(&p, rev + 1).await.expect("watch");
    // Keep the lease alive for twice its TTL.
    let started = Instant::now();
    let mut ticks = tokio::time::interval(Duration::from_millis(500));
    while started.elapsed() < Duration::from_secs(4) {
        ticks.tick().await;
        s.keep_alive(lease).await.expect("keep_alive");
    }
    assert!(s.get(&key).await.expect("get").is_some(), "key survives while the lease is kept alive");
    assert!(s.lease_time_to_live(lease).await.expect("ttl").is_some());
    // Then stop: it lapses and the key goes.
    let stopped = Instant::now();
    let ev = next_event(&mut watch).await;
    assert_eq!(delete_of(&ev).0, key);
    assert!(
        stopped.elapsed() >= Duration::from_millis(500),
        "lapsed {:?} after the last keep-alive",
        stopped.elapsed()
    );
}

async fn revoke_deletes_keys_at_once<S: Store>(s: S, p: String) {
    let lease = s.grant_lease(Duration::from_secs(60)).await.expect("grant");
    let a = format!("{p}a");
    let b = format!("{p}b");
    let free = format!("{p}free");
    s.put(&a, vec![], Some(lease)).await.expect("put");
    s.put(&b, vec![], Some(lease)).await.expect("put");
    let rev = s.put(&free, vec![], None).await.expect("put");
    let mut watch = s.watch_prefix(&p, rev + 1).await.expect("watch");
    s.revoke_lease(lease).await.expect("revoke");
    let mut deleted = vec![delete_of(&next_event(&mut watch).await).0.to_owned()];
    deleted.push(delete_of(&next_event(&mut watch).await).0.to_owned());
    deleted.sort();
    assert_eq!(deleted, [a.clone(), b.clone()]);
    assert_eq!(s.get(&a).await.expect("get"), None);
    assert!(s.get(&free).await.expect("get").is_some(), "keys without the lease stay");
    s.revoke_lease(lease).await.expect("revoking again is not an error");
    assert!(matches!(s.keep_alive(lease).await, Err(StoreError::LeaseNotFound(_))));
    assert!(matches!(s.put(&a, vec![], Some(lease)).await, Err(StoreError::LeaseNotFound(_))));
    // A lease that never existed.
    assert!(matches!(s.keep_alive(0x5eed_0000_0001).await, Err(StoreError::LeaseNotFound(_))));
    expect_only_sentinel_next(&s, &mut watch, &p).await;
}

async fn watch_history_then_live<S: Store>(s: S, p: String) {
    let a = format!("{p}a");
    let b = format!("{p}b");
    let r1 = s.put(&a, b"1".to_vec(), None).await.expect("put");
    let r2 = s.put(&b, b"2".to_vec(), None).await.expect("put");
    s.put(&format!("{p}-outside"), vec![], None).await.expect("put outside the watched prefix");
    let mut watch = s.watch_prefix(&p, r1).await.expect("watch");
    let mut inner = s.watch_prefix(&format!("{p}a"), r1).await.expect("watch a");
    // History first.
    let ev = next_event(&mut watch).await;
    assert_eq!((put_of(&ev).key.as_str(), put_of(&ev).mod_revision), (a.as_str(), r1));
    let ev = next_event(&mut watch).await;
    assert_eq!((put_of(&ev).key.as_str(), put_of(&ev).mod_revision), (b.as_str(), r2));
    let ev = next_event(&mut watch).await;
    assert_eq!(put_of(&ev).key, format!("{p}-outside"));
    // Then live changes, in order.
    let r4 = s.put(&a, b"4".to_vec(), None).await.expect("put");
    let del =
        s.txn(Txn { compares: vec![], success: vec![TxnOp::Delete(b.clone())], failure: vec![] }).await.expect("txn");
    let ev = next_event(&mut watch).await;
    assert_eq!(
        (put_of(&ev).value.as_slice(), put_of(&ev).mod_revision, put_of(&ev).create_revision),
        (&b"4"[..], r4, r1)
    );
    let ev = next_event(&mut watch).await;
    assert_eq!(delete_of(&ev), (b.as_str(), del.revision));
    // The narrower watch saw only its own key.
    assert_eq!(put_of(&next_event(&mut inner).await).mod_revision, r1);
    assert_eq!(put_of(&next_event(&mut inner).await).mod_revision, r4);
    expect_only_sentinel_next(&s, &mut watch, &p).await;
}

async fn watch_from_now_sees_only_new_changes<S: Store>(s: S, p: String) {
    s.put(&format!("{p}old"), vec![], None).await.expect("put");
    let mut watch = s.watch_prefix(&p, 0).await.expect("watch");
    // Registered on return: a change made right away is delivered.
    let rev = s.put(&format!("{p}new"), vec![], None).await.expect("put");
    let ev = next_event(&mut watch).await;
    assert_eq!((put_of(&ev).key.clone(), put_of(&ev).mod_revision), (format!("{p}new"), rev));
}

async fn watch_resume_sees_exactly_missed_events<S: Store>(s: S, p: String) {
    let mut watch = s.watch_prefix(&p, 0).await.expect("watch");
    s.put(&format!("{p}1"), vec![], None).await.expect("put");
    s.put(&format!("{p}2"), vec![], None).await.expect("put");
    next_event(&mut watch).await;
    let last = next_event(&mut watch).await;
    let last_rev = revision_of(&last);
    drop(watch); // the "disconnect"

    let r3 = s.put(&format!("{p}3"), vec![], None).await.expect("put");
    let d1 = s.delete(&format!("{p}1")).await.expect("delete");
    assert!(d1);
    let r4 = s.put(&format!("{p}2"), b"again".to_vec(), None).await.expect("put");

    let mut resumed = s.watch_prefix(&p, last_rev + 1).await.expect("resume");
    let ev = next_event(&mut resumed).await;
    assert_eq!((put_of(&ev).key.clone(), put_of(&ev).mod_revision), (format!("{p}3"), r3));
    let ev = next_event(&mut resumed).await;
    let (key, rev) = delete_of(&ev);
    assert_eq!(key, format!("{p}1"));
    assert!(rev > r3 && rev < r4);
    let ev = next_event(&mut resumed).await;
    assert_eq!((put_of(&ev).value.as_slice(), put_of(&ev).mod_revision), (&b"again"[..], r4));
    expect_only_sentinel_next(&s, &mut resumed, &p).await;
}

/// The rest of the revision of `first`, which must all be ready now (no waiting): the
/// contract that lets a consumer end a batch when nothing is ready without splitting one.
fn rest_of_revision_now(watch: &mut WatchStream, first: &WatchEvent, count: usize) -> Vec<WatchEvent> {
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        match tokio::task::unconstrained(watch.next()).now_or_never() {
            Some(Some(Ok(ev))) => {
                assert_eq!(revision_of(&ev), revision_of(first), "event {i} of the revision");
                out.push(ev);
            }
            other => panic!(
                "event {} of {} of revision {} was not ready at once: {other:?}",
                i + 1,
                count,
                revision_of(first)
            ),
        }
    }
    out
}

async fn watch_delivers_a_revision_at_once<S: Store>(s: S, p: String) {
    const KEYS: usize = 100; // within etcd's default limit of 128 operations per transaction
    let mut watch = s.watch_prefix(&p, 0).await.expect("watch");
    let success = (0..KEYS).map(|i| TxnOp::Put { key: format!("{p}{i:03}"), value: vec![1], lease: None }).collect();
    let r = s.txn(Txn { compares: vec![], success, failure: vec![] }).await.expect("txn");
    let first = next_event(&mut watch).await;
    assert_eq!(revision_of(&first), r.revision);
    let rest = rest_of_revision_now(&mut watch, &first, KEYS - 1);
    assert_eq!(put_of(&rest[KEYS - 2]).key, format!("{p}{:03}", KEYS - 1), "in the transaction's order");
    expect_only_sentinel_next(&s, &mut watch, &p).await;
}

/// Members sent together by [`concurrent_requests_each_get_their_own_answer`].
const CONCURRENT: usize = 200;

/// Many members at once (all queued in one poll, so an etcd store merges them into shared
/// transactions), each with a write, a read, a transaction that holds and one that fails, and
/// one member whose lease is gone: every member gets the answer it would have had alone.
async fn concurrent_requests_each_get_their_own_answer<S: Store>(s: S, p: String) {
    let live = s.grant_lease(Duration::from_secs(60)).await.expect("grant");
    let gone = s.grant_lease(Duration::from_secs(60)).await.expect("grant");
    s.revoke_lease(gone).await.expect("revoke");
    let s = &s;
    let p = &p;
    let member = |i: usize| async move {
        let key = format!("{p}m{i}");
        let lease = if i % 2 == 0 { Some(live) } else { None };
        let written = s.put(&key, i.to_string().into_bytes(), lease).await.expect("put");
        let read = s.get(&key).await.expect("get").expect("written");
        assert_eq!(read.value, i.to_string().into_bytes(), "member {i} reads its own value");
        assert_eq!(read.mod_revision, written, "member {i}: the put's revision is the key's");
        let holds = Txn {
            compares: vec![Compare::ValueEquals(key.clone(), i.to_string().into_bytes())],
            success: vec![TxnOp::Put { key: format!("{key}/done"), value: b"y".to_vec(), lease }],
            failure: vec![],
        };
        assert!(s.txn(holds).await.expect("txn").succeeded, "member {i}'s compare holds");
        let stale = Txn {
            compares: vec![Compare::ModRevision(key.clone(), written - 1_000_000)],
            success: vec![TxnOp::Put { key: format!("{key}/never"), value: b"n".to_vec(), lease: None }],
            failure: vec![],
        };
        assert!(!s.txn(stale).await.expect("txn").succeeded, "member {i}'s stale compare fails");
        let orphan = s.put(&format!("{key}/orphan"), vec![], Some(gone)).await;
        assert!(matches!(orphan, Err(StoreError::LeaseNotFound(id)) if id == gone), "member {i}: {orphan:?}");
    };
    futures::future::join_all((0..CONCURRENT).map(member)).await;
    let (kvs, _) = s.get_prefix(p).await.expect("get_prefix");
    let keys: std::collections::BTreeSet<&str> = kvs.iter().map(|kv| kv.key.as_str()).collect();
    for i in 0..CONCURRENT {
        let key = format!("{p}m{i}");
        assert!(keys.contains(key.as_str()) && keys.contains(format!("{key}/done").as_str()), "member {i}");
        assert!(!keys.contains(format!("{key}/never").as_str()), "member {i}: a failed compare wrote");
        assert!(!keys.contains(format!("{key}/orphan").as_str()), "member {i}: a put on a gone lease wrote");
    }
    assert_eq!(kvs.len(), 2 * CONCURRENT);
}

/// Compare-and-swap increments of one counter from many tasks at once lose no update, however
/// the store groups them.
async fn concurrent_compare_and_swap_loses_no_update<S: Store>(s: S, p: String) {
    const TASKS: usize = 32;
    let counter = format!("{p}counter");
    s.put(&counter, b"0".to_vec(), None).await.expect("put");
    let (s, counter) = (&s, &counter);
    let increment = |_| async move {
        loop {
            let kv = s.get(counter).await.expect("get").expect("present");
            let n: u64 = String::from_utf8_lossy(&kv.value).parse().expect("a number");
            let txn = Txn {
                compares: vec![Compare::ModRevision(counter.clone(), kv.mod_revision)],
                success: vec![TxnOp::Put {
                    key: counter.clone(),
                    value: (n + 1).to_string().into_bytes(),
                    lease: None,
                }],
                failure: vec![],
            };
            if s.txn(txn).await.expect("txn").succeeded {
                return;
            }
        }
    };
    futures::future::join_all((0..TASKS).map(increment)).await;
    let kv = s.get(counter).await.expect("get").expect("present");
    assert_eq!(kv.value, TASKS.to_string().into_bytes());
}

async fn bounded<F: std::future::Future<Output = ()>>(test: F) {
    timeout(BOUND, test).await.expect("test exceeded its time bound");
}

macro_rules! suite {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(start_paused = true)]
                async fn $name() {
                    super::bounded(super::$name(super::MemoryStore::new(), concat!("/", stringify!($name), "/").to_owned())).await;
                }
            )*
        }
        mod etcd {
            $(
                #[tokio::test]
                async fn $name() {
                    super::bounded(async {
                        let store = super::shared_etcd_store().await;
                        super::$name(store, concat!("/suite/", stringify!($name), "/").to_owned()).await;
                    })
                    .await;
                }
            )*
        }
    };
}

suite!(
    put_get_revisions,
    get_prefix_in_key_order,
    count_prefix_counts_without_values,
    delete_and_delete_prefix,
    txn_compare_and_swap,
    txn_conditions,
    lease_expiry_deletes_keys,
    keep_alive_extends_lease,
    revoke_deletes_keys_at_once,
    watch_history_then_live,
    watch_from_now_sees_only_new_changes,
    watch_resume_sees_exactly_missed_events,
    watch_delivers_a_revision_at_once,
    concurrent_requests_each_get_their_own_answer,
    concurrent_compare_and_swap_loses_no_update,
);

/// The concurrent members above really share etcd transactions (on a connection of their
/// own, so that the counts are theirs), and the shared transactions that failed (a stale
/// compare, a gone lease) were re-run member by member.
#[tokio::test]
async fn etcd_concurrent_members_share_transactions() {
    bounded(async {
        let store = shared_etcd_store().await;
        assert_eq!(store.batch_stats(), Default::default());
        concurrent_requests_each_get_their_own_answer(store.clone(), "/shared-txn/".to_owned()).await;
        let stats = store.batch_stats();
        assert!(stats.shared_transactions > 0 && stats.requests_shared > stats.shared_transactions, "{stats:?}");
        assert!(stats.retried_alone > 0, "{stats:?}");
    })
    .await;
}

/// Renewals of a lease ride one kept keep-alive stream; a cancelled renewal takes its stream
/// with it (so no answer is left for a later renewal to misread), and a renewal of a gone
/// lease says so and closes its stream.
#[tokio::test]
async fn etcd_renewals_keep_one_stream_per_lease() {
    bounded(async {
        let store = shared_etcd_store().await;
        let a = store.grant_lease(Duration::from_secs(30)).await.expect("grant");
        let b = store.grant_lease(Duration::from_secs(30)).await.expect("grant");
        assert_eq!(store.keep_alive_streams(), 0);
        for _ in 0..5 {
            store.keep_alive(a).await.expect("renew a");
        }
        assert_eq!(store.keep_alive_streams(), 1, "five renewals of one lease, one stream");
        store.keep_alive(b).await.expect("renew b");
        assert_eq!(store.keep_alive_streams(), 2);
        // Cancelled while waiting for etcd's answer: the stream goes with it.
        if timeout(Duration::ZERO, store.keep_alive(a)).await.is_err() {
            assert_eq!(store.keep_alive_streams(), 1, "the cancelled renewal's stream is closed");
        }
        store.keep_alive(a).await.expect("renew a after a cancelled renewal");
        assert_eq!(store.keep_alive_streams(), 2);
        assert!(store.lease_time_to_live(a).await.expect("ttl").is_some());
        // Gone: the kept stream answers TTL 0, and is closed.
        store.revoke_lease(a).await.expect("revoke");
        assert!(matches!(store.keep_alive(a).await, Err(StoreError::LeaseNotFound(id)) if id == a));
        assert_eq!(store.keep_alive_streams(), 1);
        store.keep_alive(b).await.expect("b is unaffected");
        store.revoke_lease(b).await.expect("revoke");
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// Backend-specific behaviour
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn memory_watch_beyond_history_is_compacted() {
    bounded(async {
        let s = MemoryStore::with_history_limit(8);
        let mut last = 0;
        for i in 0..20 {
            last = s.put(&format!("/h/{i:02}"), vec![], None).await.expect("put");
        }
        let oldest = match s.watch_prefix("/h/", 1).await {
            Err(StoreError::Compacted(oldest)) => oldest,
            Err(e) => panic!("expected Compacted, got {e}"),
            Ok(_) => panic!("expected Compacted, got a watch"),
        };
        assert_eq!(oldest, last - 7, "the last 8 revisions are kept");
        let mut watch = s.watch_prefix("/h/", oldest).await.expect("watch from the oldest kept revision");
        assert_eq!(revision_of(&next_event(&mut watch).await), oldest);
    })
    .await;
}

/// A revision larger than a watcher's channel detaches the watcher mid-revision; the rest
/// still comes at once (replayed from the history), not split from what came before.
#[tokio::test]
async fn memory_revision_larger_than_the_watch_channel_is_ready_at_once() {
    bounded(async {
        use cohort_coordinator::store::memory::WATCH_CHANNEL_CAPACITY;
        let keys = WATCH_CHANNEL_CAPACITY + WATCH_CHANNEL_CAPACITY / 2;
        let s = MemoryStore::new();
        let mut watch = s.watch_prefix("/big/", 0).await.expect("watch");
        let success =
            (0..keys).map(|i| TxnOp::Put { key: format!("/big/{i:05}"), value: vec![], lease: None }).collect();
        s.txn(Txn { compares: vec![], success, failure: vec![] }).await.expect("txn");
        let first = next_event(&mut watch).await;
        let rest = rest_of_revision_now(&mut watch, &first, keys - 1);
        assert_eq!(put_of(&rest[keys - 2]).key, format!("/big/{:05}", keys - 1));
        expect_only_sentinel_next(&s, &mut watch, "/big/").await;
    })
    .await;
}

/// Connects to a private etcd with a short request deadline.
async fn private_store(etcd: &EtcdProcess) -> EtcdStore {
    EtcdStore::connect_with_timeout(&[etcd.endpoint()], Duration::from_secs(2)).await.expect("connect")
}

async fn start_private_etcd() -> EtcdProcess {
    tokio::task::spawn_blocking(EtcdProcess::start).await.expect("start task").expect("start etcd")
}

#[tokio::test]
async fn etcd_watch_beyond_compaction_is_compacted() {
    bounded(async {
        let etcd = start_private_etcd().await;
        let s = private_store(&etcd).await;
        let first = s.put("/c/a", vec![], None).await.expect("put");
        let last = s.put("/c/b", vec![], None).await.expect("put");
        let mut raw = etcd_client::Client::connect([etcd.endpoint()], None).await.expect("raw client");
        raw.compact(last, None).await.expect("compact");
        match s.watch_prefix("/c/", first).await {
            Err(StoreError::Compacted(rev)) => assert_eq!(rev, last),
            Err(e) => panic!("expected Compacted, got {e}"),
            Ok(mut w) => match timeout(EVENT_DEADLINE, w.next()).await {
                Ok(Some(Err(StoreError::Compacted(rev)))) => assert_eq!(rev, last),
                other => panic!("expected Compacted, got {other:?}"),
            },
        }
        let mut watch = s.watch_prefix("/c/", last).await.expect("watch from the compaction revision");
        assert_eq!(put_of(&next_event(&mut watch).await).key, "/c/b");
    })
    .await;
}

#[tokio::test]
async fn etcd_connect_to_nothing_is_unavailable() {
    bounded(async {
        let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
        let started = Instant::now();
        match EtcdStore::connect_with_timeout(&[format!("http://127.0.0.1:{port}")], Duration::from_secs(2)).await {
            Err(StoreError::Unavailable(_)) => {}
            Err(e) => panic!("expected Unavailable, got {e}"),
            Ok(_) => panic!("connected to a closed port"),
        }
        assert!(started.elapsed() < Duration::from_secs(15), "gave up after {:?}", started.elapsed());
    })
    .await;
}

/// Retries `op` while etcd is unavailable (a restarted server takes a moment to be reached
/// again), within [`EVENT_DEADLINE`].
async fn until_available<T, F, Fut>(mut op: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let deadline = Instant::now() + EVENT_DEADLINE;
    loop {
        match op().await {
            Ok(v) => return v,
            Err(StoreError::Unavailable(e)) if Instant::now() < deadline => {
                tracing::debug!(error = %e, "etcd not reachable yet");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("etcd did not come back: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_process_restart_keeps_data_and_clients_recover() {
    bounded(async {
        let mut etcd = start_private_etcd().await;
        let s = private_store(&etcd).await;
        let rev = s.put("/r/kept", b"v".to_vec(), None).await.expect("put");
        let mut watch = s.watch_prefix("/r/", rev + 1).await.expect("watch");

        // A crash: requests fail fast with Unavailable, the watch ends with an error.
        etcd.kill();
        assert!(!etcd.is_running());
        match s.get("/r/kept").await {
            Err(StoreError::Unavailable(_)) => {}
            other => panic!("expected Unavailable from a dead etcd, got {other:?}"),
        }
        match timeout(EVENT_DEADLINE, watch.next()).await {
            Ok(Some(Err(StoreError::Unavailable(_))) | None) => {}
            other => panic!("expected the watch to fail, got {other:?}"),
        }

        // Back on the same port and data: committed data survived SIGKILL, and the same
        // client reconnects.
        tokio::task::block_in_place(|| etcd.restart()).expect("restart after kill");
        let kv = until_available(|| s.get("/r/kept")).await.expect("data persisted");
        assert_eq!((kv.value.as_slice(), kv.mod_revision), (&b"v"[..], rev));

        // A graceful stop and restart keeps it too.
        let rev2 = s.put("/r/second", b"w".to_vec(), None).await.expect("put");
        tokio::task::block_in_place(|| etcd.restart()).expect("graceful restart");
        let (kvs, _) = until_available(|| s.get_prefix("/r/")).await;
        assert_eq!(kvs.iter().map(|kv| kv.mod_revision).collect::<Vec<_>>(), [rev, rev2]);
    })
    .await;
}

/// `EtcdTuning::max_txn_ops` sizes the shared transactions. Against an etcd run with
/// `--max-txn-ops 512` and stopped (SIGSTOP) while 1,500 puts queue up behind the
/// transactions in flight, the puts go, once it runs again, in shared transactions of more
/// than etcd's default 128, every one applied; a store with the default tuning never puts
/// more than 128 in one, on the same server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_shared_transactions_grow_to_the_clusters_max_txn_ops() {
    use cohort_coordinator::store::etcd::{EtcdSecurity, EtcdTuning, DEFAULT_REQUEST_TIMEOUT, MAX_BATCH_OPS};
    const PUTS: u64 = 1500;
    bounded(async {
        let etcd = tokio::task::spawn_blocking(|| EtcdProcess::start_with_flags(&["--max-txn-ops", "512"]))
            .await
            .expect("etcd start task")
            .expect("etcd with --max-txn-ops 512");
        let pid = etcd.pid().expect("etcd runs") as libc::pid_t;
        let endpoints = [etcd.endpoint()];
        let security = EtcdSecurity::default();
        for (max_txn_ops, prefix) in [(512, "/tuned/"), (MAX_BATCH_OPS, "/default/")] {
            let tuning = EtcdTuning { max_txn_ops };
            let store = EtcdStore::connect_tuned(&endpoints, DEFAULT_REQUEST_TIMEOUT, &security, tuning)
                .await
                .expect("connect");
            // SAFETY: signalling the etcd child this test started and has not reaped.
            unsafe { libc::kill(pid, libc::SIGSTOP) };
            let puts = tokio::spawn({
                let store = store.clone();
                async move {
                    let puts = (0..PUTS).map(|i| {
                        let store = &store;
                        async move { store.put(&format!("{prefix}{i}"), i.to_string().into_bytes(), None).await }
                    });
                    futures::future::join_all(puts).await
                }
            });
            // Every put is either in a transaction in flight (to the stopped etcd) or queued.
            let until = Instant::now() + Duration::from_secs(20);
            loop {
                let stats = store.batch_stats();
                let in_flight = stats.requests_shared + stats.sent_alone;
                if stats.waiting + in_flight >= PUTS && stats.waiting > 0 {
                    break;
                }
                assert!(Instant::now() < until, "the puts never all queued: {stats:?}");
                tokio::time::sleep(Duration::from_millis(10)).await; // polling the queue until `until`
            }
            // SAFETY: as above.
            unsafe { libc::kill(pid, libc::SIGCONT) };
            let puts = puts.await.expect("puts task");
            for (i, put) in puts.into_iter().enumerate() {
                put.unwrap_or_else(|e| panic!("put {i} with max_txn_ops {max_txn_ops}: {e}"));
            }
            let (kvs, _) = store.get_prefix(prefix).await.expect("get_prefix");
            assert_eq!(kvs.len() as u64, PUTS, "every put applied ({prefix})");
            let stats = store.batch_stats();
            eprintln!("max_txn_ops {max_txn_ops}: {stats:?}");
            // A replica's metrics say the same.
            let metrics = cohort_coordinator::metrics::Metrics::default();
            metrics.watch_store(std::sync::Arc::new(store.clone()));
            let text = metrics.render();
            for line in [
                format!("cohort_etcd_largest_shared_transaction {}", stats.largest_batch),
                format!("cohort_etcd_requests_shared_total {}", stats.requests_shared),
                "cohort_etcd_requests_waiting 0".to_string(),
            ] {
                assert!(text.lines().any(|l| l == line), "{line:?} not in\n{text}");
            }
            assert_eq!((stats.retried_alone, stats.waiting), (0, 0), "{stats:?}");
            if max_txn_ops > MAX_BATCH_OPS {
                assert!(stats.largest_batch > MAX_BATCH_OPS as u64, "{stats:?}");
            }
            assert!(stats.largest_batch <= max_txn_ops as u64, "{stats:?}");
        }
        let zero = EtcdTuning { max_txn_ops: 0 };
        let refused = EtcdStore::connect_tuned(&endpoints, DEFAULT_REQUEST_TIMEOUT, &security, zero)
            .await
            .expect_err("no operation per transaction");
        assert!(matches!(refused, StoreError::Invalid(_)), "{refused:?}");
    })
    .await;
}

/// Thousands of etcd requests given up at once, their answers already on the way, do not take
/// the connection down: the late answers are ignored, and a request nobody gave up on is
/// answered. With h2's defaults the connection counted each late answer to a reset it no
/// longer remembered (it remembers 50) as a protocol error of its own and closed itself at the
/// 1,024th, failing every request in flight (`ResourceExhausted`): a large job's end on busy
/// cores once did that to the coordinators' etcd connection (store/etcd/channel.rs).
///
/// The coordinator's starvation is played by this test's only thread: it stops running tasks
/// for a moment while etcd answers (a fault injected, not a wait for something), then drops
/// the requests, whose answers the connection reads only afterwards.
#[test]
fn etcd_requests_given_up_in_thousands_leave_the_connection_up() {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(bounded(async {
        let store = shared_etcd_store().await;
        let prefix = "/given-up/";
        // Turns of the scheduler for the requests to go out (not all answered yet).
        const YIELDS: usize = 2000;
        store.put(&format!("{prefix}key"), vec![b'x'; 16], None).await.expect("put");
        let mut given_up = tokio::task::JoinSet::new();
        for _ in 0..4000 {
            let store = store.clone();
            given_up.spawn(async move { store.get_prefix(prefix).await.map(|(kvs, _)| kvs.len()) });
        }
        for _ in 0..YIELDS {
            tokio::task::yield_now().await;
        }
        // The starved process: etcd's answers to the rest pile up unread meanwhile.
        std::thread::sleep(Duration::from_millis(500));
        given_up.abort_all();
        let mut cancelled = 0;
        while let Some(r) = given_up.join_next().await {
            cancelled += usize::from(r.is_err());
        }
        // More than h2 would count before closing the connection (1,024, after the 50 resets
        // it remembers), or the test proves nothing.
        assert!(cancelled > 1100, "only {cancelled} requests were given up");
        // The connection reads the late answers now; it must still serve.
        let (kvs, _) = store.get_prefix(prefix).await.expect("the connection still serves (late answers ignored)");
        assert_eq!(kvs.len(), 1);
    }));
}

/// A prefix holding more than gRPC's default answer limit (4 MiB) is read whole, and watched
/// from its start: the leader's read of every job's keys passed it at 8,192 members, and no
/// replica could lead after that ("decoded message length too large").
#[tokio::test]
async fn etcd_reads_and_watches_a_prefix_above_four_mebibytes() {
    bounded(async {
        let store = shared_etcd_store().await;
        let prefix = "/large-prefix/";
        let mut first = 0;
        // Six values of 1 MiB (etcd takes up to 1.5 MiB a request).
        for i in 0..6u8 {
            let revision = store.put(&format!("{prefix}{i}"), vec![i; 1 << 20], None).await.expect("put");
            if first == 0 {
                first = revision;
            }
        }
        let (kvs, _) = store.get_prefix(prefix).await.expect("the whole prefix is read");
        assert_eq!(kvs.len(), 6);
        assert!(kvs.iter().enumerate().all(|(i, kv)| kv.value.len() == 1 << 20 && kv.value[0] == i as u8));
        let mut watch = store.watch_prefix(prefix, first).await.expect("a watch from the first put");
        for i in 0..6u8 {
            let event = next_event(&mut watch).await;
            let kv = put_of(&event);
            assert_eq!((kv.key.as_str(), kv.value.len()), (format!("{prefix}{i}").as_str(), 1 << 20));
        }
    })
    .await;
}
