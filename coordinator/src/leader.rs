//! Leader election between replicas on one store, and the leader's work.
//!
//! Election: put-if-absent of [`keys::LEADER`] on a lease of this replica (kept alive
//! every TTL/3). A replica that cannot renew its lease stops leading at once; the others
//! watch the key and campaign when it is deleted (resignation, or lease expiry of a
//! crashed leader, so takeover happens within one TTL). A replica restarted under the name
//! of a crashed leader recognises the key, on its first campaign, as its own previous life
//! and takes over at once instead of waiting out that TTL. Replica names must be unique, as
//! pod names are; if two live replicas share one, the newer takes the key once and the
//! older steps down (a leader steps down as soon as its key is deleted or replaced), and
//! every mutation is a CAS anyway, so a moment with two leaders is harmless.
//!
//! The leader follows every job's keys and evaluates a job on every change and at its next
//! deadline (join window, elastic timeout, end of an exclusion): it detects lapsed members
//! of the active generation (revoking it with cause "lease expired"), forms generations,
//! tracks and enforces the elastic timeout, and ends finished jobs. Under `lease_scope =
//! "host"` it also sweeps members silent on their host's shared lease ([`crate::sweep`]),
//! whose deletion it then reads as any lapse. Every mutation is a CAS
//! on the job's generation key ([`crate::ops`]), so a stale leader (one that has not yet
//! noticed it lost its lease) cannot publish a conflicting outcome.

use crate::hub::{Batch, PrefixFollower};
use crate::keys;
use crate::ops::{self, Context};
use crate::records::{self, JobState};
use crate::rendezvous::{self, Action};
use crate::revocation;
use crate::store::{Compare, StoreError, Txn, TxnOp, WatchEvent};
use futures::StreamExt;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tracing::Instrument;

/// How soon a job is looked at again after a mutation that may not have landed.
const RETRY: Duration = Duration::from_millis(200);

/// How often the leader sweeps silent members off hosts' shared leases ([`crate::sweep`]).
const SWEEP_PERIOD: Duration = Duration::from_millis(500);

/// A job's evaluation is O(members). Evaluated once per batch of writes, a large job's
/// arrivals (one write each) would keep the leader busy evaluating: O(N²) for a formation
/// of N members when batches are small. So a job is evaluated again no sooner than this
/// many times its previous evaluation took: evaluations take at most a fifth of the
/// leader's time, and a decision comes at most that much later (some tens of milliseconds
/// at 16,384 members).
const EVALUATION_SPACING: u32 = 4;

/// Runs elections (and, while leading, the leader's work) until the replica shuts down;
/// then resigns if leading.
///
/// # Cancel safety
/// Not meant to be cancelled: dropping it while leading leaves the leader key until its
/// lease expires (which is how a crash looks to the other replicas, and is safe).
pub(crate) async fn run(ctx: Arc<Context>, ttl: Duration, leading: Arc<AtomicBool>) {
    let mut shutdown = ctx.shutdown.clone();
    let span = tracing::info_span!("leader", replica = %ctx.replica);
    async move {
        // Only the first campaign of this process may take the key back from a previous
        // process of this replica: later, a key naming this replica means another process
        // under the same name took it (a misconfiguration), and fighting back would never end.
        let mut first_campaign = true;
        loop {
            if *shutdown.borrow() {
                return;
            }
            let lease = match ctx.store.grant_lease(ttl).await {
                Ok(lease) => lease,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot get a lease to campaign; retrying");
                    pause(&mut shutdown, Duration::from_millis(500)).await;
                    continue;
                }
            };
            let txn = Txn {
                compares: vec![Compare::Absent(keys::LEADER.to_string())],
                success: vec![TxnOp::Put {
                    key: keys::LEADER.to_string(),
                    value: ctx.replica.clone().into_bytes(),
                    lease: Some(lease),
                }],
                failure: vec![],
            };
            let mut won = ctx.store.txn(txn).await.map(|r| r.succeeded);
            if matches!(won, Ok(false)) && std::mem::take(&mut first_campaign) {
                won = take_over_own_key(&ctx, lease).await;
            }
            if won.is_ok() {
                first_campaign = false;
            }
            match won {
                Ok(true) => {
                    lead(&ctx, lease, ttl, &leading, &mut shutdown).await;
                    if *shutdown.borrow() {
                        // Resign: the next replica takes over at once instead of after a TTL.
                        if let Err(e) = ctx.store.revoke_lease(lease).await {
                            tracing::warn!(error = %e, "could not resign; leadership passes when the lease expires");
                        } else {
                            tracing::info!("resigned leadership");
                        }
                        return;
                    }
                }
                Ok(false) => {
                    let _ = ctx.store.revoke_lease(lease).await;
                    follow(&ctx, ttl, &mut shutdown).await;
                }
                Err(e) => {
                    let _ = ctx.store.revoke_lease(lease).await;
                    tracing::warn!(error = %e, "campaign failed; retrying");
                    pause(&mut shutdown, Duration::from_millis(500)).await;
                }
            }
        }
    }
    .instrument(span)
    .await
}

async fn pause(shutdown: &mut tokio::sync::watch::Receiver<bool>, d: Duration) {
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = crate::ops::stopped(shutdown) => {}
    }
}

/// Takes the leader key over, on `lease`, if it names this replica: it was written by a
/// previous process of this replica (crashed or killed, so it never resigned), which no
/// longer leads. The replacement is one CAS on the key's revision, so nobody can slip in
/// between. Answers whether this replica now holds the key.
async fn take_over_own_key(ctx: &Context, lease: i64) -> Result<bool, StoreError> {
    let Some(held) = ctx.store.get(keys::LEADER).await? else { return Ok(false) };
    if held.value != ctx.replica.as_bytes() {
        return Ok(false);
    }
    let txn = Txn {
        compares: vec![Compare::ModRevision(keys::LEADER.to_string(), held.mod_revision)],
        success: vec![TxnOp::Put {
            key: keys::LEADER.to_string(),
            value: ctx.replica.clone().into_bytes(),
            lease: Some(lease),
        }],
        failure: vec![],
    };
    let took = ctx.store.txn(txn).await?.succeeded;
    if took {
        tracing::info!("the leader key named this replica (a previous process that did not resign); took it over");
    }
    Ok(took)
}

/// Resolves when the leader key no longer carries `lease` (deleted, or written by someone
/// else): this replica no longer leads, whatever its lease says.
async fn key_lost(ctx: &Context, lease: i64) -> &'static str {
    loop {
        let watched = async {
            let (kvs, revision) = ctx.store.get_prefix(keys::LEADER).await?;
            match kvs.iter().find(|kv| kv.key == keys::LEADER) {
                Some(kv) if kv.lease == Some(lease) => {}
                _ => return Ok::<bool, StoreError>(true),
            }
            let mut stream = ctx.store.watch_prefix(keys::LEADER, revision + 1).await?;
            while let Some(event) = stream.next().await {
                match event? {
                    WatchEvent::Delete { key, .. } if key == keys::LEADER => return Ok(true),
                    WatchEvent::Put(kv) if kv.key == keys::LEADER && kv.lease != Some(lease) => return Ok(true),
                    _ => {}
                }
            }
            Ok(false)
        };
        match watched.await {
            Ok(true) => return "the leader key was deleted or taken over",
            // The watch ended or failed (store restarting): look again shortly; the lease
            // keep-alive decides meanwhile.
            Ok(false) | Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// Waits until the leader key is deleted, a TTL passes, or shutdown.
async fn follow(ctx: &Context, ttl: Duration, shutdown: &mut tokio::sync::watch::Receiver<bool>) {
    let wait = async {
        let (kvs, revision) = ctx.store.get_prefix(keys::LEADER).await?;
        if !kvs.iter().any(|kv| kv.key == keys::LEADER) {
            return Ok::<(), StoreError>(());
        }
        let mut stream = ctx.store.watch_prefix(keys::LEADER, revision + 1).await?;
        while let Some(event) = stream.next().await {
            if let WatchEvent::Delete { key, .. } = event? {
                if key == keys::LEADER {
                    return Ok(());
                }
            }
        }
        Ok(())
    };
    let failed = tokio::select! {
        r = tokio::time::timeout(ttl, wait) => match r {
            Ok(Err(e)) => Some(e),
            _ => None,
        },
        _ = crate::ops::stopped(shutdown) => None,
    };
    if let Some(e) = failed {
        tracing::debug!(error = %e, "watching the leader key failed");
        pause(shutdown, Duration::from_millis(200)).await;
    }
}

async fn lead(
    ctx: &Arc<Context>,
    lease: i64,
    ttl: Duration,
    leading: &AtomicBool,
    shutdown: &mut tokio::sync::watch::Receiver<bool>,
) {
    leading.store(true, Ordering::SeqCst);
    ctx.metrics.set_leader(true);
    tracing::info!(lease, "leading");
    let keep = async {
        let mut last_ok = Instant::now();
        loop {
            tokio::time::sleep(ttl / 3).await;
            match ctx.store.keep_alive(lease).await {
                Ok(()) => last_ok = Instant::now(),
                Err(StoreError::LeaseNotFound(_)) => return "the leader lease expired",
                Err(e) => {
                    tracing::warn!(error = %e, "leader lease keep-alive failed");
                    if last_ok.elapsed() >= ttl / 2 {
                        return "the leader lease could not be renewed";
                    }
                }
            }
        }
    };
    tokio::select! {
        why = keep => tracing::warn!(why, "lost leadership"),
        why = key_lost(ctx, lease) => tracing::warn!(why, "lost leadership"),
        _ = work(ctx.clone()) => {}
        _ = crate::ops::stopped(shutdown) => {}
    }
    leading.store(false, Ordering::SeqCst);
    ctx.metrics.set_leader(false);
}

/// The leader's loop: follow every job and evaluate the ones that changed or are due.
async fn work(ctx: Arc<Context>) {
    let (mut follower, kvs, revision) = loop {
        match PrefixFollower::start(ctx.store.clone(), keys::JOBS).await {
            Ok(x) => break x,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the jobs; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    };
    let mut states = group(&kvs, revision);
    let mut dirty: BTreeSet<String> = states.keys().cloned().collect();
    // The sweep of silent members on hosts' shared leases (`crate::sweep`), in a task of its
    // own so that its store reads never hold up an evaluation; one at a time. What it noted
    // lasts as long as this lead (a new leader hears from everyone afresh).
    let silences = Arc::new(crate::sweep::Silences::default());
    let mut sweep_tick = tokio::time::interval(SWEEP_PERIOD);
    sweep_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sweeping: Option<tokio::task::JoinHandle<()>> = None;
    let mut deadlines: HashMap<String, u64> = HashMap::new();
    // Per job: when its last evaluation ended and how long the decision took.
    let mut spent: HashMap<String, (Instant, Duration)> = HashMap::new();
    loop {
        let now = records::now_ms();
        deadlines.retain(|job, due| {
            if *due <= now {
                dirty.insert(job.clone());
                false
            } else {
                true
            }
        });
        for job in std::mem::take(&mut dirty) {
            let Some(state) = states.get(&job) else {
                spent.remove(&job);
                continue;
            };
            if let Some(free_at) = spent.get(&job).map(|(ended, took)| *ended + *took * EVALUATION_SPACING) {
                let wait = free_at.saturating_duration_since(Instant::now());
                if !wait.is_zero() {
                    // Looked at again then (or sooner, for a deadline of its own).
                    let due = records::now_ms() + (wait.as_micros() as u64).div_ceil(1000);
                    deadlines.entry(job).and_modify(|d| *d = (*d).min(due)).or_insert(due);
                    continue;
                }
            }
            let span = tracing::info_span!("evaluate", %job, generation = state.current_number());
            let mut took = Duration::ZERO;
            let evaluated = evaluate_job(&ctx, state, &mut took).instrument(span).await;
            spent.insert(job.clone(), (Instant::now(), took));
            let next = match evaluated {
                Ok(next) => next,
                Err(e) => {
                    tracing::warn!(%job, error = %e, "evaluating the job failed; retrying");
                    Some(records::now_ms() + RETRY.as_millis() as u64)
                }
            };
            match next {
                Some(due) => {
                    deadlines.insert(job, due);
                }
                None => {
                    deadlines.remove(&job);
                }
            }
        }
        let sleep_for = deadlines
            .values()
            .min()
            .map(|due| Duration::from_millis(due.saturating_sub(records::now_ms())))
            .unwrap_or(Duration::from_secs(3600));
        tokio::select! {
            batch = follower.next() => match batch {
                Batch::Events(events) => {
                    for event in &events {
                        let key = match event {
                            WatchEvent::Put(kv) => kv.key.as_str(),
                            WatchEvent::Delete { key, .. } => key.as_str(),
                        };
                        let Some(job) = keys::job_of(key) else { continue };
                        // Progress writes (about one per member per second) decide nothing: the
                        // leader's view leaves them out, undecoded.
                        if is_progress(key) {
                            continue;
                        }
                        let state = states.entry(job.to_string()).or_insert_with(|| JobState { job: job.to_string(), ..Default::default() });
                        state.apply(event);
                        if !crate::hub::is_bookkeeping(event) {
                            dirty.insert(job.to_string());
                        }
                    }
                    states.retain(|job, s| {
                        let keep = !s.is_empty();
                        if !keep {
                            ctx.metrics.forget_job(job);
                        }
                        keep
                    });
                    spent.retain(|job, _| states.contains_key(job));
                }
                Batch::Reset(kvs, revision) => {
                    states = group(&kvs, revision);
                    spent.clear();
                    dirty = states.keys().cloned().collect();
                }
            },
            _ = tokio::time::sleep(sleep_for) => {}
            _ = sweep_tick.tick() => {
                if sweeping.as_ref().is_some_and(|t| !t.is_finished()) {
                    continue;
                }
                let jobs: Vec<String> = states
                    .iter()
                    .filter(|(job, state)| {
                        ctx.settings.for_job(job).lease_scope == crate::config::LeaseScope::Host
                            && state.ended.is_none()
                            && state.members.values().any(|m| !m.owns_lease())
                    })
                    .map(|(job, _)| job.clone())
                    .collect();
                let (ctx, silences) = (ctx.clone(), silences.clone());
                sweeping = Some(tokio::spawn(async move { crate::sweep::sweep(&ctx, &silences, jobs).await }.in_current_span()));
            }
        }
    }
}

/// Whether `key` is a member's progress record, which no decision of the leader reads.
fn is_progress(key: &str) -> bool {
    matches!(keys::parse(key), Some(keys::Parsed::Worker { kind: keys::Kind::Progress, .. }))
}

/// The leader's view of every job in `kvs` (progress records left out, see [`is_progress`]).
fn group(kvs: &[crate::store::KeyValue], revision: i64) -> HashMap<String, JobState> {
    let mut by_job: HashMap<String, Vec<crate::store::KeyValue>> = HashMap::new();
    for kv in kvs.iter().filter(|kv| !is_progress(&kv.key)) {
        if let Some(job) = keys::job_of(&kv.key) {
            by_job.entry(job.to_string()).or_default().push(kv.clone());
        }
    }
    by_job.into_iter().map(|(job, kvs)| (job.clone(), JobState::from_kvs(&job, &kvs, revision))).collect()
}

/// Evaluates one job and acts; returns when to look at it again (ms since the epoch), and
/// adds the time the decision took (without the store's) to `took`.
async fn evaluate_job(ctx: &Context, state: &JobState, took: &mut Duration) -> Result<Option<u64>, StoreError> {
    let started = Instant::now();
    let job = state.job.as_str();
    let retry = Some(records::now_ms() + RETRY.as_millis() as u64);
    if state.ended.is_some() {
        ctx.metrics.forget_job(job);
        return Ok(None);
    }
    ctx.metrics.set_job(job, Some((state.members.len() as u64, state.current_number())));
    let settings = ctx.settings.for_job(job);
    let lapsed = revocation::lapsed(state, settings.lease_ttl.as_millis() as u64);
    *took += started.elapsed();
    if let Some(mut cause) = lapsed {
        let Some(g) = state.current() else { return Ok(retry) };
        // Leases of a lost node's ranks lapse together: one cause for the domain.
        if let Some(rank) = cause.rank {
            let evidence = |r: u32| {
                let m = &g.members[r as usize];
                if !state.is_live(&m.worker_id, m.incarnation) || state.is_disconnected(&m.worker_id, m.incarnation) {
                    crate::domains::Evidence::Lost
                } else {
                    crate::domains::Evidence::Unknown
                }
            };
            if let Some(loss) = crate::domains::whole_domain_lost(g, rank, evidence) {
                cause = crate::domains::domain_cause(cause, &loss);
            }
        }
        let suspect = cause.rank.and_then(|r| g.members.get(r as usize)).map(|m| (m.worker_id.clone(), m.incarnation));
        let outcome = ops::revoke_generation(ctx, job, g.number, cause, suspect, true).await?;
        tracing::debug!(accepted = outcome.accepted, "lease-lapse check");
        return Ok(retry);
    }
    let now = records::now_ms();
    let started = Instant::now();
    let eval = rendezvous::evaluate(&settings, state, now);
    *took += started.elapsed();
    let rev = state.generation.as_ref().map(|(_, rev)| *rev);
    match eval.action {
        Action::Form(members) => {
            let first_arrival =
                members.iter().filter_map(|m| state.waiting.get(&m.worker_id).map(|w| w.since_ms)).min().unwrap_or(now);
            let size = members.len();
            if let Some(record) = ops::form_generation(ctx, job, state.current(), rev, members).await? {
                let latency = Duration::from_millis(now.saturating_sub(first_arrival));
                ctx.metrics.formed(latency);
                tracing::info!(
                    generation = record.number,
                    size,
                    latency_ms = latency.as_millis() as u64,
                    "generation formed"
                );
            }
            Ok(retry)
        }
        Action::End(outcome, reason) => {
            let mut leases: Vec<crate::store::LeaseId> = state.members.values().map(|m| m.lease()).collect();
            leases.sort_unstable();
            leases.dedup();
            ops::end_job(ctx, job, outcome, &reason, rev, &leases).await?;
            Ok(retry)
        }
        Action::Nothing => {
            if let Some((g, rev)) = &state.generation {
                if g.below_min_since_ms != eval.below_min_since_ms {
                    let mut updated = g.clone();
                    updated.below_min_since_ms = eval.below_min_since_ms;
                    ops::update_generation(ctx, job, &updated, *rev).await?;
                    if let Some(since) = eval.below_min_since_ms {
                        tracing::warn!(
                            live = state.members.len(),
                            min = settings.min_workers,
                            since_ms = since,
                            "job below min_workers; it fails if this lasts the elastic timeout"
                        );
                    }
                    return Ok(retry);
                }
            }
            Ok(eval.next_deadline_ms)
        }
    }
}
