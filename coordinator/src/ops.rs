//! The store mutations shared by the RPC handlers and the leader: revoke a generation, form
//! the next one, end a job. Each is one compare-and-swap transaction on the job's
//! `generation` key (its `mod_revision`), so concurrent replicas (even two that both
//! believe they lead) can never publish two different outcomes for one generation.

use crate::config::Settings;
use crate::exclusion::{ExclusionPolicy, FailureHistory};
use crate::hub::Hubs;
use crate::keys::{self, Kind};
use crate::metrics::Metrics;
use crate::records::{self, decode, encode, Cause, EndedRecord, GenerationRecord, MemberRecord, Outcome, Placed};
use crate::revocation;
use crate::store::{Compare, KeyValue, LeaseId, Store, StoreError, Txn, TxnOp};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// How long the `ended` record of a finished or failed job is kept (for late callers), unless
/// configured otherwise ([`Context::ended_ttl`]).
pub const ENDED_TTL: Duration = Duration::from_secs(600);

/// How many times a CAS loop retries under contention before giving up.
const CAS_ATTEMPTS: usize = 16;

/// What every part of a replica shares.
pub struct Context {
    /// The store.
    pub store: Arc<dyn Store>,
    /// Job settings.
    pub settings: Settings,
    /// Exclusion policy.
    pub exclusion: ExclusionPolicy,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Per-job live views.
    pub hubs: Hubs,
    /// This replica's name (in the leader key).
    pub replica: String,
    /// Becomes `true` when the replica shuts down.
    pub shutdown: watch::Receiver<bool>,
    /// How long an ended job's `ended` record is kept; then the job leaves no key behind.
    pub ended_ttl: Duration,
}

/// The outcome of a revocation attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Revoked {
    /// Whether this attempt revoked the generation.
    pub accepted: bool,
    /// The generation's root cause (this one's or the earlier one's), if known.
    pub cause: Option<Cause>,
}

fn compare_for(key: &str, kv: Option<&KeyValue>) -> Compare {
    match kv {
        Some(kv) => Compare::ModRevision(key.to_string(), kv.mod_revision),
        None => Compare::Absent(key.to_string()),
    }
}

/// Reads and decodes the generation record, with its members (read from its shards when it
/// has them, see [`records::ShardSet`]). The returned key-value is the record's own (its
/// `mod_revision` is what a compare-and-swap compares).
///
/// # Cancel safety
/// Cancel safe (read only).
pub async fn read_generation(store: &dyn Store, job: &str) -> Result<Option<(GenerationRecord, KeyValue)>, StoreError> {
    read_generation_knowing(store, job, |_, _| None).await
}

/// [`read_generation`], taking a large generation's members from this replica's view of the
/// job (its hub, where one runs) when the view holds that very formation: the store is then
/// read for the generation record alone, a few hundred bytes instead of every member (1.5 MB
/// at 16,384 members, read and decoded on a failure report's path). A formation's members
/// never change once written (its shard set is named once per formation attempt), so the
/// view's copy is the store's; a view that holds another formation, or none, costs the
/// store read as before.
///
/// # Cancel safety
/// Cancel safe (read only).
pub async fn read_generation_in(ctx: &Context, job: &str) -> Result<Option<(GenerationRecord, KeyValue)>, StoreError> {
    let hub = ctx.hubs.running(job).await;
    read_generation_knowing(ctx.store.as_ref(), job, |number, set| hub?.members_of(number, set)).await
}

/// [`read_generation`] with `known`, which may answer the members of generation `number`
/// stored under a shard set (instead of a read of its shards).
///
/// # Cancel safety
/// Cancel safe (read only).
async fn read_generation_knowing(
    store: &dyn Store,
    job: &str,
    known: impl FnOnce(u64, &records::ShardSet) -> Option<Vec<Placed>>,
) -> Result<Option<(GenerationRecord, KeyValue)>, StoreError> {
    let key = keys::generation(job);
    let Some(kv) = store.get(&key).await? else { return Ok(None) };
    let Some((mut g, ranks)) = records::decode_generation(&key, &kv.value) else {
        return Err(StoreError::Invalid(format!("{key} holds a record this coordinator cannot read")));
    };
    let restore = |g: &mut GenerationRecord| {
        records::restore_departures(g, &ranks)
            .ok_or_else(|| StoreError::Invalid(format!("{key} names departures its members do not have")))
    };
    if let Some(members) = g.shards.as_ref().and_then(|set| known(g.number, set)) {
        g.members = members;
        restore(&mut g)?;
        return Ok(Some((g, kv)));
    }
    if let Some(set) = &g.shards {
        // The shards were written before the record and stay until the next formation.
        let (kvs, _) = store.get_prefix(&keys::shard_set_prefix(job, &set.set)).await?;
        let shards = kvs
            .iter()
            .filter_map(|s| match keys::parse(&s.key) {
                Some(keys::Parsed::Shard { index, .. }) => decode::<Vec<Placed>>(&s.key, &s.value).map(|m| (index, m)),
                _ => None,
            })
            .collect();
        g.members = records::assemble(set, &shards).ok_or_else(|| {
            StoreError::Invalid(format!("{key} names shard set {} whose shards are not all there", set.set))
        })?;
    }
    restore(&mut g)?;
    Ok(Some((g, kv)))
}

/// A name for a formation attempt's shard set: `<generation>-<nonce>`, the nonce unique to
/// this attempt (replica, process, time and a counter), so that concurrent attempts on any
/// replicas never write the same shard keys.
fn shard_set_name(replica: &str, number: u64) -> String {
    use std::hash::{Hash, Hasher};
    static ATTEMPTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (replica, std::process::id(), records::now_ms(), ATTEMPTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
        .hash(&mut h);
    format!("{number}-{:016x}", h.finish())
}

/// Reads and decodes a member record.
///
/// # Cancel safety
/// Cancel safe (read only).
pub async fn read_member(
    store: &dyn Store,
    job: &str,
    worker: &str,
) -> Result<Option<(MemberRecord, KeyValue)>, StoreError> {
    let key = keys::worker_key(job, Kind::Member, worker);
    let Some(kv) = store.get(&key).await? else { return Ok(None) };
    Ok(decode::<MemberRecord>(&key, &kv.value).map(|m| (m, kv)))
}

/// Revokes generation `number` of `job` with `cause`, unless it is no longer the current one
/// or already revoked. `suspect` (worker, incarnation) gets a failure on its exclusion
/// record and is evicted (its lease revoked). With `only_if_gone`, the revocation happens
/// only if the suspect's member key is still gone (lease-lapse detection double-checks a
/// possibly stale view).
///
/// # Cancel safety
/// Cancel safe: the revocation is one transaction (applied wholly or not at all); if
/// dropped after it, the suspect is not evicted here but its lease lapses or the next
/// report evicts it.
pub async fn revoke_generation(
    ctx: &Context,
    job: &str,
    number: u64,
    cause: Cause,
    suspect: Option<(String, u64)>,
    only_if_gone: bool,
) -> Result<Revoked, StoreError> {
    let gen_key = keys::generation(job);
    for _ in 0..CAS_ATTEMPTS {
        let Some((g, gkv)) = read_generation_in(ctx, job).await? else {
            return Ok(Revoked { accepted: false, cause: None });
        };
        if g.number != number {
            return Ok(Revoked { accepted: false, cause: g.cause_of(number).cloned() });
        }
        if let Some(c) = &g.revoked {
            return Ok(Revoked { accepted: false, cause: Some(c.clone()) });
        }
        if only_if_gone {
            if let Some((w, inc)) = &suspect {
                let live = read_member(ctx.store.as_ref(), job, w).await?.is_some_and(|(m, _)| m.incarnation == *inc);
                if live || g.departed(w, *inc).is_some() {
                    return Ok(Revoked { accepted: false, cause: None });
                }
            }
        }
        let now = records::now_ms();
        let new = revocation::revoked(&g, cause.clone(), now);
        let mut txn = Txn {
            compares: vec![Compare::ModRevision(gen_key.clone(), gkv.mod_revision)],
            success: vec![TxnOp::Put { key: gen_key.clone(), value: records::encode_generation(&new), lease: None }],
            failure: vec![],
        };
        let mut excluded_until = None;
        let mut history_lease = None;
        // A whole domain lost counts once, against the domain; any other failure against the
        // suspect.
        let counted = match (&suspect, cause.domain.as_str()) {
            (Some(_), d) if !d.is_empty() => Some(crate::domains::domain_key(d)),
            (Some((w, _)), _) => Some(w.clone()),
            (None, _) => None,
        };
        if let Some(w) = &counted {
            let fkey = keys::worker_key(job, Kind::Failures, w);
            let fkv = ctx.store.get(&fkey).await?;
            let mut history: FailureHistory = fkv.as_ref().and_then(|kv| decode(&fkey, &kv.value)).unwrap_or_default();
            excluded_until = history.record_failure(&ctx.exclusion, now);
            // The record lives on a lease as long as it matters, then leaves the store.
            let lease = ctx.store.grant_lease(history.retention(&ctx.exclusion, now)).await?;
            history_lease = Some(lease);
            txn.compares.push(compare_for(&fkey, fkv.as_ref()));
            txn.success.push(TxnOp::Put { key: fkey, value: encode(&history), lease: Some(lease) });
            if excluded_until.is_some() {
                txn.success.push(exclusion_guard(job, now));
            }
        }
        if !ctx.store.txn(txn).await?.succeeded {
            if let Some(lease) = history_lease {
                if let Err(e) = ctx.store.revoke_lease(lease).await {
                    tracing::debug!(%job, error = %e, "could not revoke an unused lease; it expires by itself");
                }
            }
            continue;
        }
        ctx.metrics.revoked();
        tracing::info!(%job, generation = number, rank = ?cause.rank, suspect = %cause.worker_id,
                       reason = %cause.reason, reported_by = %cause.reported_by, "generation revoked");
        if let Some(until) = excluded_until {
            tracing::warn!(%job, worker = %cause.worker_id, domain = %cause.domain, excluded_until_ms = until,
                           "excluded after repeated failures");
        }
        if let Some((w, inc)) = &suspect {
            evict(ctx, job, w, *inc).await;
        }
        // A lost domain's other ranks go at once too: the survivors do not wait for leases.
        for rank in &cause.lost_ranks {
            if let Some(m) =
                g.members.get(*rank as usize).filter(|m| Some(&m.worker_id) != suspect.as_ref().map(|s| &s.0))
            {
                evict(ctx, job, &m.worker_id, m.incarnation).await;
            }
        }
        return Ok(Revoked { accepted: true, cause: Some(cause) });
    }
    Err(StoreError::Unavailable(format!("revoking generation {number} of {job}: too much contention")))
}

/// What [`exclude_straggler`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StragglerExclusion {
    /// Excluded until this time (ms since the epoch).
    Excluded(u64),
    /// Not excluded: the generation cannot spare it (why, for `status` and the logs).
    Refused(String),
}

/// The write of the job's exclusion guard ([`keys::exclusions`]) that goes with every
/// exclusion.
fn exclusion_guard(job: &str, now_ms: u64) -> TxnOp {
    TxnOp::Put { key: keys::exclusions(job), value: now_ms.to_string().into_bytes(), lease: None }
}

/// Excludes `worker` from `job` as a straggler for `cooldown` (see
/// [`FailureHistory::exclude_straggler`]): a compare-and-swap on its failure record, which
/// the rendezvous and Join then honour. `members` are the worker ids of the current
/// generation: the exclusion is refused when it would leave fewer than `min_workers` of them
/// that are not excluded (counting the exclusions in force, read after the job's exclusion
/// guard, [`keys::exclusions`]), and the transaction compares that guard and rewrites it, so
/// that two replicas excluding two members at once cannot both pass the count: the second
/// transaction fails, and its next attempt counts the first exclusion.
///
/// # Cancel safety
/// Cancel safe: one transaction; a lease granted for one that never ran expires by itself.
pub async fn exclude_straggler(
    ctx: &Context,
    job: &str,
    worker: &str,
    members: &[String],
    min_workers: usize,
    cooldown: Duration,
    reason: &str,
) -> Result<StragglerExclusion, StoreError> {
    let fkey = keys::worker_key(job, Kind::Failures, worker);
    let guard_key = keys::exclusions(job);
    for _ in 0..CAS_ATTEMPTS {
        let now = records::now_ms();
        // The guard first: an exclusion written after this read changes it, and fails the
        // transaction below, whether or not the failure records read next show it.
        let guard = ctx.store.get(&guard_key).await?;
        let (kvs, _) = ctx.store.get_prefix(&keys::kind_prefix(job, Kind::Failures)).await?;
        let records: std::collections::HashMap<&str, &KeyValue> = kvs.iter().map(|kv| (kv.key.as_str(), kv)).collect();
        let member_keys: Vec<String> = members.iter().map(|m| keys::worker_key(job, Kind::Failures, m)).collect();
        let in_force = member_keys
            .iter()
            .filter(|k| **k != fkey)
            .filter(|k| {
                records
                    .get(k.as_str())
                    .and_then(|kv| decode::<FailureHistory>(k, &kv.value))
                    .is_some_and(|h| h.excluded_until(now).is_some())
            })
            .count();
        let staying = members.len().saturating_sub(in_force);
        if staying <= min_workers {
            return Ok(StragglerExclusion::Refused(format!(
                "the generation has {} members, {in_force} of them excluded already, and min_workers is {min_workers}",
                members.len()
            )));
        }
        let fkv = records.get(fkey.as_str()).copied();
        let mut history: FailureHistory = fkv.and_then(|kv| decode(&fkey, &kv.value)).unwrap_or_default();
        let until = history.exclude_straggler(now, cooldown, reason);
        let lease = ctx.store.grant_lease(history.retention(&ctx.exclusion, now)).await?;
        let txn = Txn {
            compares: vec![compare_for(&fkey, fkv), compare_for(&guard_key, guard.as_ref())],
            success: vec![
                TxnOp::Put { key: fkey.clone(), value: encode(&history), lease: Some(lease) },
                exclusion_guard(job, now),
            ],
            failure: vec![],
        };
        if ctx.store.txn(txn).await?.succeeded {
            return Ok(StragglerExclusion::Excluded(until));
        }
        if let Err(e) = ctx.store.revoke_lease(lease).await {
            tracing::debug!(%job, error = %e, "could not revoke an unused lease; it expires by itself");
        }
    }
    Err(StoreError::Unavailable(format!("excluding straggler {worker} of {job}: too much contention")))
}

/// Evicts one incarnation if it is still the worker's member: revokes its lease (its keys go
/// with it), or on a host's shared lease deletes its keys. Errors are logged: a lease of its
/// own expires by itself anyway, and the leader's sweep deletes a silent member on a shared one.
///
/// # Cancel safety
/// Cancel safe (one lease revocation or one transaction).
pub async fn evict(ctx: &Context, job: &str, worker: &str, incarnation: u64) {
    match read_member(ctx.store.as_ref(), job, worker).await {
        Ok(Some((m, kv))) if m.incarnation == incarnation => {
            let evicted = if m.owns_lease() {
                ctx.store.revoke_lease(incarnation as i64).await.map(|_| true)
            } else {
                remove_member(ctx, job, worker, kv.mod_revision).await
            };
            match evicted {
                Ok(true) => tracing::info!(%job, %worker, incarnation, "member evicted"),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(%job, %worker, incarnation, error = %e, "could not evict; the lease will expire by itself")
                }
            }
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(%job, %worker, error = %e, "could not check the member to evict"),
    }
}

/// Publishes the next generation if the generation key still has revision `expected`
/// (`None`: absent). Returns the record, or `None` if another change came first.
///
/// A large generation's members go to shards first ([`records::ShardSet`]: plain writes
/// under a set name unique to this attempt, which nothing reads until a generation record
/// names it); the publication itself is always the one compare-and-swap of the generation
/// record, which also deletes the previous generation's shards. An attempt that loses the
/// compare-and-swap deletes its own shards.
///
/// # Cancel safety
/// Cancel safe: the publication is one transaction. Dropped between writing shards and
/// publishing, the shards stay unread until the job ends (its end deletes every shard).
pub async fn form_generation(
    ctx: &Context,
    job: &str,
    previous: Option<&GenerationRecord>,
    expected: Option<i64>,
    members: Vec<Placed>,
) -> Result<Option<GenerationRecord>, StoreError> {
    let key = keys::generation(job);
    let mut record = crate::rendezvous::next_generation(previous, members, records::now_ms());
    let compare = match expected {
        Some(rev) => Compare::ModRevision(key.clone(), rev),
        None => Compare::Absent(key.clone()),
    };
    let set_name = shard_set_name(&ctx.replica, record.number);
    if let Some((set, shards)) = records::shard_members(&set_name, &record.members) {
        let writes = shards.into_iter().enumerate().map(|(i, value)| {
            let shard_key = keys::shard(job, &set.set, i as u32);
            async move { ctx.store.put(&shard_key, value, None).await }
        });
        let written = futures::future::join_all(writes).await;
        if let Some(Err(e)) = written.into_iter().find(Result::is_err) {
            delete_shards(ctx, job, &set.set).await;
            return Err(e);
        }
        record.shards = Some(set);
    }
    let mut success = vec![TxnOp::Put { key, value: records::encode_generation(&record), lease: None }];
    if let Some(old) = previous.and_then(|p| p.shards.as_ref()) {
        success.push(TxnOp::DeletePrefix(keys::shard_set_prefix(job, &old.set)));
    }
    let txn = Txn { compares: vec![compare, Compare::Absent(keys::ended(job))], success, failure: vec![] };
    // On an error, whether it landed is unknown: its shards stay (the next formation or the
    // job's end deletes them if the record names them, the end if it does not).
    let published = ctx.store.txn(txn).await?.succeeded;
    if !published {
        if let Some(set) = &record.shards {
            delete_shards(ctx, job, &set.set).await;
        }
    }
    Ok(published.then_some(record))
}

/// Deletes one shard set (best effort: the job's end deletes what is left).
///
/// # Cancel safety
/// Cancel safe: one deletion.
async fn delete_shards(ctx: &Context, job: &str, set: &str) {
    if let Err(e) = ctx.store.delete_prefix(&keys::shard_set_prefix(job, set)).await {
        tracing::debug!(%job, set, error = %e, "could not delete an unpublished shard set; the job's end will");
    }
}

/// Replaces the generation record (same generation, e.g. a new `below_min_since_ms`) if its
/// key still has revision `expected`.
///
/// # Cancel safety
/// Cancel safe: one transaction.
pub async fn update_generation(
    ctx: &Context,
    job: &str,
    record: &GenerationRecord,
    expected: i64,
) -> Result<bool, StoreError> {
    let key = keys::generation(job);
    let txn = Txn {
        compares: vec![Compare::ModRevision(key.clone(), expected)],
        success: vec![TxnOp::Put { key, value: records::encode_generation(record), lease: None }],
        failure: vec![],
    };
    Ok(ctx.store.txn(txn).await?.succeeded)
}

/// Deletes a member's records (what a lapse of a lease of its own would delete) if its member
/// record still has revision `member_revision`: how a member on a host's shared lease is
/// evicted, or swept when silent. Answers whether it deleted them.
///
/// # Cancel safety
/// Cancel safe (one transaction).
pub async fn remove_member(ctx: &Context, job: &str, worker: &str, member_revision: i64) -> Result<bool, StoreError> {
    let member_key = keys::worker_key(job, Kind::Member, worker);
    let mut success = vec![TxnOp::Delete(member_key.clone())];
    for kind in [Kind::Waiting, Kind::Progress, Kind::Control, Kind::Timeout] {
        success.push(TxnOp::Delete(keys::worker_key(job, kind, worker)));
    }
    let txn = Txn { compares: vec![Compare::ModRevision(member_key, member_revision)], success, failure: vec![] };
    Ok(ctx.store.txn(txn).await?.succeeded)
}

/// Ends a job if its generation key still has revision `expected` (`None`: absent): writes
/// the `ended` record (on a lease of [`Context::ended_ttl`]) and deletes every other key of the job
/// (its key-value store too),
/// then revokes `leases` (the members', their own or their hosts'). Returns whether this call
/// ended it.
///
/// # Cancel safety
/// Cancel safe: the end is one transaction; a lease granted for a transaction that never
/// ran expires by itself, and members' leases expire without heartbeats.
pub async fn end_job(
    ctx: &Context,
    job: &str,
    outcome: Outcome,
    reason: &str,
    expected: Option<i64>,
    leases: &[LeaseId],
) -> Result<bool, StoreError> {
    let lease = ctx.store.grant_lease(ctx.ended_ttl).await?;
    let gen_key = keys::generation(job);
    let record = EndedRecord { outcome, reason: reason.to_string(), ended_at_ms: records::now_ms() };
    let mut success = vec![TxnOp::Put { key: keys::ended(job), value: encode(&record), lease: Some(lease) }];
    for kind in keys::Kind::ALL {
        success.push(TxnOp::DeletePrefix(keys::kind_prefix(job, kind)));
    }
    success.push(TxnOp::DeletePrefix(keys::shards_prefix(job)));
    success.push(TxnOp::DeletePrefix(keys::kv_prefix(job)));
    success.push(TxnOp::Delete(keys::exclusions(job)));
    success.push(TxnOp::Delete(gen_key.clone()));
    let compare = match expected {
        Some(rev) => Compare::ModRevision(gen_key, rev),
        None => Compare::Absent(gen_key),
    };
    let txn = Txn { compares: vec![compare, Compare::Absent(keys::ended(job))], success, failure: vec![] };
    let result = ctx.store.txn(txn).await;
    match result {
        Ok(r) if r.succeeded => {}
        other => {
            if let Err(e) = ctx.store.revoke_lease(lease).await {
                tracing::debug!(%job, error = %e, "could not revoke an unused lease");
            }
            return other.map(|_| false);
        }
    }
    tracing::info!(%job, ?outcome, %reason, "job ended");
    for lease in leases {
        if let Err(e) = ctx.store.revoke_lease(*lease).await {
            tracing::debug!(%job, lease, error = %e, "could not revoke a member lease of an ended job");
        }
    }
    ctx.metrics.forget_job(job);
    Ok(true)
}

/// Resolves once the replica shuts down (or its shutdown signal is gone).
///
/// # Cancel safety
/// Cancel safe.
pub async fn stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}
