//! Large generations: a generation of 16,384 members, whose record would not fit in one etcd
//! request (1.5 MiB), is stored in shards and published by one compare-and-swap of a small
//! generation record; on a real etcd and on the memory store.

mod common;

use cohort_coordinator::config::Settings;
use cohort_coordinator::hub::Hubs;
use cohort_coordinator::keys;
use cohort_coordinator::metrics::Metrics;
use cohort_coordinator::ops::{self, Context};
use cohort_coordinator::records::{self, Address, Cause, JobState, Placed};
use cohort_coordinator::store::{Compare, Txn, TxnOp};
use common::{bounded, test_settings, Backend, Backing};
use std::sync::Arc;

/// etcd's default request size limit (`--max-request-bytes`).
const ETCD_REQUEST_LIMIT: usize = 1536 * 1024;
/// Members of the large generation.
const MEMBERS: usize = 16_384;

fn context(backing: &Backing, backend: Backend, name: &str, shutdown: &tokio::sync::watch::Receiver<bool>) -> Context {
    Context {
        store: backing.store.clone(),
        settings: Settings::uniform(test_settings(backend)).expect("settings"),
        exclusion: Default::default(),
        metrics: Arc::new(Metrics::default()),
        hubs: Hubs::new(backing.store.clone()),
        replica: name.into(),
        shutdown: shutdown.clone(),
        ended_ttl: ops::ENDED_TTL,
    }
}

/// `n` members as a large job has them: ids, hosts of 8 ranks, one TCP address each.
fn members(n: usize, tag: &str) -> Vec<Placed> {
    (0..n)
        .map(|i| Placed {
            worker_id: format!("{tag}-worker-{i:06}"),
            incarnation: 7_587_000_000_000_000_000 + i as u64,
            host: format!("node-{:05}.cluster.example", i / 8),
            addresses: vec![Address {
                transport: "tcp".into(),
                address: format!("127.{}.{}.{}:40000", i >> 16, (i >> 8) & 255, i & 255),
            }],
            domain: format!("node-{:05}.cluster.example", i / 8),
        })
        .collect()
}

/// Every key of the job whose path contains `part`.
async fn count_keys(backing: &Backing, job: &str, part: &str) -> usize {
    let (kvs, _) = backing.store.get_prefix(&keys::job_prefix(job)).await.expect("read the job");
    kvs.iter().filter(|kv| kv.key.contains(part)).count()
}

async fn large_generation(backend: Backend) {
    bounded(async {
        let backing = Backing::new(backend).await;
        let (_tx, rx) = tokio::sync::watch::channel(false);
        let (a, b) = (context(&backing, backend, "a", &rx), context(&backing, backend, "b", &rx));
        let job = "large";
        let (ma, mb) = (members(MEMBERS, "a"), members(MEMBERS, "b"));
        // At the limit: inline, this generation would be refused by etcd.
        let inline = records::encode(&records::GenerationRecord {
            number: 1,
            members: ma.clone(),
            formed_at_ms: 1,
            revoked: None,
            revoked_at_ms: None,
            departed: vec![],
            below_min_since_ms: None,
            history: vec![],
            recoveries: vec![],
            shards: None,
        });
        assert!(inline.len() > ETCD_REQUEST_LIMIT, "the test generation is over etcd's limit ({} bytes)", inline.len());

        // Two replicas race to form generation 1 of 16,384 members: one wins, the loser's
        // shards are gone, and the record read back is the winner's, whole.
        let (ra, rb) = tokio::join!(
            ops::form_generation(&a, job, None, None, ma.clone()),
            ops::form_generation(&b, job, None, None, mb.clone()),
        );
        let (ra, rb) = (ra.expect("store"), rb.expect("store"));
        assert!(ra.is_some() != rb.is_some(), "exactly one formation wins");
        let winner = ra.or(rb).expect("one");
        assert_eq!(winner.members.len(), MEMBERS);
        let set = winner.shards.clone().expect("a generation this large is sharded");
        assert!(set.count >= 2, "{set:?}");
        let (stored, head) =
            ops::read_generation(backing.store.as_ref(), job).await.expect("read").expect("generation");
        assert_eq!(stored, winner);
        assert!(head.value.len() < 4096, "the generation record itself stays small: {} bytes", head.value.len());
        assert_eq!(count_keys(&backing, job, "/shards/").await, set.count as usize, "only the winner's shards remain");
        let (kvs, _) = backing.store.get_prefix(&keys::job_prefix(job)).await.expect("read the job");
        assert!(kvs.iter().all(|kv| kv.value.len() < ETCD_REQUEST_LIMIT / 2), "every value is well under the limit");

        // A prefix read of the job (the hub's and the leader's view) assembles it.
        let (kvs, revision) = backing.store.get_prefix(&keys::job_prefix(job)).await.expect("read the job");
        let state = JobState::from_kvs(job, &kvs, revision);
        assert_eq!(state.current(), Some(&winner));
        assert!(state.shards.is_empty(), "assembled shards are not kept twice");

        // A replica whose view holds this formation reads the small record alone and takes
        // the members from its view: the same record as the store's.
        let hub = a.hubs.get(job, &test_settings(backend)).await.expect("a hub");
        assert_eq!(hub.members_of(1, &set).as_deref(), Some(&winner.members[..]));
        let other = records::ShardSet { set: "1-another-attempt".into(), ..set.clone() };
        assert_eq!(hub.members_of(1, &other), None, "another formation's members are read from the store");
        assert_eq!(hub.members_of(2, &set), None);
        let (via_view, _) = ops::read_generation_in(&a, job).await.expect("read").expect("generation");
        assert_eq!(via_view, winner);

        // Revoking (on the replica with the view) rewrites the small record only; the members
        // stay.
        let cause = Cause::member(Some(5), &winner.members[5].worker_id, "h", "test".into(), "test");
        let revoked = ops::revoke_generation(&a, job, 1, cause, None, false).await.expect("revoke");
        assert!(revoked.accepted);
        let (g1, _) = ops::read_generation(backing.store.as_ref(), job).await.expect("read").expect("generation");
        assert!(g1.revoked.is_some());
        assert_eq!(g1.members, winner.members);

        // The next formation (smaller: inline) deletes the previous shards in its CAS.
        let (_, head) = ops::read_generation(backing.store.as_ref(), job).await.expect("read").expect("generation");
        let g2 = ops::form_generation(&b, job, Some(&g1), Some(head.mod_revision), members(100, "c"))
            .await
            .expect("store")
            .expect("formed");
        assert!(g2.shards.is_none());
        assert_eq!(count_keys(&backing, job, "/shards/").await, 0, "the previous generation's shards are gone");
        let (stored, _) = ops::read_generation(backing.store.as_ref(), job).await.expect("read").expect("generation");
        assert_eq!(stored, g2);
        assert_eq!(stored.history.first().map(|(n, _)| *n), Some(1));

        // A large generation again, then the job ends: no shard is left behind.
        let (_, head) = ops::read_generation(backing.store.as_ref(), job).await.expect("read").expect("generation");
        let g3 = ops::form_generation(&a, job, Some(&g2), Some(head.mod_revision), members(MEMBERS, "d"))
            .await
            .expect("store")
            .expect("formed");
        assert!(g3.shards.is_some());

        // Every member of it leaves (every other one finished: the worst case for the ranks'
        // runs), written as a leave writes it. As records the departures alone would be over
        // etcd's limit; the stored record holds them as ranks and reads back whole.
        let (_, head) = ops::read_generation(backing.store.as_ref(), job).await.expect("read").expect("generation");
        let mut left = g3.clone();
        left.departed = g3
            .members
            .iter()
            .enumerate()
            .map(|(r, m)| records::Departure {
                worker_id: m.worker_id.clone(),
                incarnation: m.incarnation,
                finished: r % 2 == 0,
            })
            .collect();
        assert!(records::encode(&left.departed).len() > ETCD_REQUEST_LIMIT / 2);
        let value = records::encode_generation(&left);
        assert!(value.len() < ETCD_REQUEST_LIMIT / 8, "the record with every departure is {} bytes", value.len());
        let gen_key = keys::generation(job);
        let txn = Txn {
            compares: vec![Compare::ModRevision(gen_key.clone(), head.mod_revision)],
            success: vec![TxnOp::Put { key: gen_key, value, lease: None }],
            failure: vec![],
        };
        assert!(backing.store.txn(txn).await.expect("write").succeeded);
        let (stored, _) = ops::read_generation(backing.store.as_ref(), job).await.expect("read").expect("generation");
        assert_eq!(stored, left, "read back whole from the store");
        let (kvs, revision) = backing.store.get_prefix(&keys::job_prefix(job)).await.expect("read the job");
        assert_eq!(JobState::from_kvs(job, &kvs, revision).current(), Some(&left), "and by a view of the job");

        let (_, head) = ops::read_generation(backing.store.as_ref(), job).await.expect("read").expect("generation");
        let ended =
            ops::end_job(&a, job, records::Outcome::Finished, "done", Some(head.mod_revision), &[]).await.expect("end");
        assert!(ended);
        assert_eq!(count_keys(&backing, job, "/shards/").await, 0, "the job's end deletes its shards");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_of_16384_members_fits_etcd_in_shards() {
    large_generation(Backend::Etcd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_of_16384_members_in_shards_on_the_memory_store() {
    large_generation(Backend::Memory).await;
}
