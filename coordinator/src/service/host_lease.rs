//! The store leases of `lease_scope = "host"`: one lease per host of a job, shared by its
//! members, found or granted at Join, and renewed at most once per half heartbeat interval
//! per replica however many of the host's members beat.
//!
//! A host's lease is named by its record, `hosts/<host>` ([`keys::host_key`]), which lives on
//! the lease itself: while the record exists the lease is alive, and a lapse takes both. The
//! first member of a host to join grants the lease and creates the record (put if absent);
//! the others read it. Within one replica the host's joins take turns at that (a formation's
//! eight joins of one host make one grant, not eight); two replicas may both grant, and the
//! loser of the put gives its lease back and uses the winner's.

use super::{store_status, CoordinatorService};
use crate::keys;
use crate::records::{decode, encode};
use crate::store::{Compare, LeaseId, Txn, TxnOp};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tonic::Status;

/// Hosts whose lease a replica remembers at most (the least recently used go first; a
/// forgotten one is read from the store again).
const HOSTS_CAP: usize = 16_384;

/// Leases whose last renewal a replica remembers at most (members' own leases included; a
/// forgotten one is renewed by the next beat on it).
const RENEWALS_CAP: usize = 65_536;

/// `hosts/<host>`: the lease a host's members share.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct HostLeaseRecord {
    /// The lease id.
    pub lease: LeaseId,
}

/// One host's lease as this replica knows it.
struct Slot {
    /// Held while the host's lease is found or granted, so that the host's joins take turns.
    lease: Arc<tokio::sync::Mutex<Option<LeaseId>>>,
    used: Instant,
}

/// This replica's hosts' leases, and when each lease (a host's or a member's own) was last
/// renewed or granted here.
#[derive(Default)]
pub(super) struct HostLeases {
    slots: Mutex<HashMap<String, Slot>>,
    renewed: Mutex<HashMap<LeaseId, Instant>>,
}

impl HostLeases {
    fn slot(&self, key: &str) -> Arc<tokio::sync::Mutex<Option<LeaseId>>> {
        let now = Instant::now();
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if !slots.contains_key(key) {
            crate::bounded::make_room(&mut slots, HOSTS_CAP, Duration::from_secs(600), now, |s| s.used);
        }
        let slot = slots.entry(key.to_string()).or_insert_with(|| Slot { lease: Default::default(), used: now });
        slot.used = now;
        slot.lease.clone()
    }

    /// Whether a renewal of `lease` is due: none in the last `period` on this replica. Marks
    /// it renewed now when it is (a renewal that then fails is forgotten by [`Self::failed`]).
    pub(super) fn renewal_due(&self, lease: LeaseId, period: Duration) -> bool {
        let now = Instant::now();
        let mut renewed = self.renewed.lock().unwrap_or_else(|e| e.into_inner());
        if renewed.get(&lease).is_some_and(|at| now.saturating_duration_since(*at) < period) {
            return false;
        }
        Self::mark(&mut renewed, lease, now);
        true
    }

    /// Marks `lease` renewed now: it was just granted, with its whole time to live, so the
    /// first beat on it need not renew it again.
    pub(super) fn granted(&self, lease: LeaseId) {
        Self::mark(&mut self.renewed.lock().unwrap_or_else(|e| e.into_inner()), lease, Instant::now());
    }

    fn mark(renewed: &mut HashMap<LeaseId, Instant>, lease: LeaseId, now: Instant) {
        if !renewed.contains_key(&lease) {
            crate::bounded::make_room(renewed, RENEWALS_CAP, Duration::from_secs(600), now, |at| *at);
        }
        renewed.insert(lease, now);
    }

    /// Forgets `lease` (it was not found, or a renewal failed): the next join of its host
    /// looks the host up again, the next heartbeat renews at once.
    pub(super) fn failed(&self, lease: LeaseId) {
        self.renewed.lock().unwrap_or_else(|e| e.into_inner()).remove(&lease);
    }
}

impl CoordinatorService {
    /// The lease of `host` in `job`, found or granted (with `ttl`). `stale`: a lease this
    /// replica found before and that turned out gone; it is not answered again.
    ///
    /// # Cancel safety
    /// Cancel safe: a lease granted by a cancelled call lapses after `ttl`, unused.
    pub(super) async fn host_lease(
        &self,
        job: &str,
        host: &str,
        ttl: Duration,
        stale: Option<LeaseId>,
    ) -> Result<LeaseId, Status> {
        let key = keys::host_key(job, host);
        let slot = self.host_leases.slot(&key);
        let mut known = slot.lock().await;
        if let Some(lease) = *known {
            if Some(lease) != stale {
                return Ok(lease);
            }
            *known = None;
        }
        let store = self.ctx.store.as_ref();
        // The record lives on its lease: a record found names a live lease (a lapse deletes both).
        let found =
            |kv: Option<crate::store::KeyValue>| kv.and_then(|kv| decode::<HostLeaseRecord>(&key, &kv.value)).map(|r| r.lease);
        if let Some(lease) = found(store.get(&key).await.map_err(store_status)?) {
            *known = Some(lease);
            return Ok(lease);
        }
        let lease = store.grant_lease(ttl).await.map_err(store_status)?;
        self.ctx.metrics.host_lease_granted();
        let put = TxnOp::Put { key: key.clone(), value: encode(&HostLeaseRecord { lease }), lease: Some(lease) };
        // Two tries: another replica may win the first put, and its lease lapse before the read.
        for _ in 0..2 {
            let created = Txn { compares: vec![Compare::Absent(key.clone())], success: vec![put.clone()], failure: vec![] };
            match store.txn(created).await {
                Ok(r) if r.succeeded => {
                    *known = Some(lease);
                    self.host_leases.granted(lease);
                    return Ok(lease);
                }
                Ok(_) => {}
                Err(e) => {
                    let _ = store.revoke_lease(lease).await;
                    return Err(store_status(e));
                }
            }
            match store.get(&key).await {
                Ok(kv) => {
                    if let Some(theirs) = found(kv) {
                        let _ = store.revoke_lease(lease).await;
                        *known = Some(theirs);
                        return Ok(theirs);
                    }
                }
                Err(e) => {
                    let _ = store.revoke_lease(lease).await;
                    return Err(store_status(e));
                }
            }
        }
        let _ = store.revoke_lease(lease).await;
        Err(Status::unavailable(format!("the lease of host {host} of job {job} changed hands twice meanwhile; join again")))
    }
}

/// A fresh incarnation for a member on a shared lease: the time in milliseconds and 20 bits
/// that differ between calls of one process (a counter) and, very likely, between replicas and
/// processes (an offset drawn from their names), so that two incarnations of one worker id
/// never coincide (and later ones are larger while clocks agree). Never 0, at most `i64::MAX`
/// (until the year 2248).
pub(super) fn fresh_incarnation(replica: &str, worker: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let now = crate::records::now_ms();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (replica, worker, std::process::id()).hash(&mut h);
    let low = h.finish().wrapping_add(CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) & 0xF_FFFF;
    (((now & ((1 << 43) - 1)) << 20) | low).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incarnations_are_valid_and_distinct() {
        let a: Vec<u64> = (0..1000).map(|_| fresh_incarnation("r", "w")).collect();
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert_eq!(distinct.len(), a.len());
        assert!(a.iter().all(|&i| i != 0 && i <= i64::MAX as u64));
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_is_renewed_once_per_period() {
        let leases = HostLeases::default();
        let period = Duration::from_millis(250);
        assert!(leases.renewal_due(7, period));
        assert!(!leases.renewal_due(7, period));
        assert!(leases.renewal_due(8, period));
        tokio::time::advance(period).await;
        assert!(leases.renewal_due(7, period));
        leases.failed(7);
        assert!(leases.renewal_due(7, period));
        // A lease just granted has its whole time to live: not due until a period later.
        leases.granted(9);
        assert!(!leases.renewal_due(9, period));
        tokio::time::advance(period).await;
        assert!(leases.renewal_due(9, period));
    }
}
