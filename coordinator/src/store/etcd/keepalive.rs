//! Lease renewals over long-lived keep-alive streams, one per lease.
//!
//! etcd renews a lease on its `LeaseKeepAlive` stream. A renewal on a fresh stream costs a
//! stream's opening and closing on both sides (HTTP/2 headers, and on etcd a handler started
//! and stopped) for one small message each way; a member heartbeats every 500 ms by
//! default, so at thousands of members the openings, not the renewals, were what etcd and the
//! coordinator spent their time on. [`KeepAlives`] keeps each lease's stream open between
//! renewals and renews on it with one message each way.
//!
//! A renewal *takes* the lease's stream out of the pool for its duration and puts it back
//! once answered. A renewal that is cancelled or fails drops the stream with it, so no answer
//! is ever left on a stream for a later renewal to misread; the next renewal opens another.
//! Two renewals of one lease at once (a member's heartbeats reach two replicas' pools, or
//! overlap after a timeout) each use their own stream. A stream that broke while idle (etcd
//! restarted, the connection was reset) fails the next renewal on it, which then runs once
//! more on a fresh stream: only a fresh stream's failure is the renewal's.
//!
//! The pool is bounded: streams unused for [`IDLE_AFTER`] (their member left, died or moved to
//! another replica) are closed by a sweep that runs when the pool grows past the size of its
//! last sweep's survivors times two, so sweeping is amortised O(1) per renewal, and no more
//! than [`MAX_STREAMS`] are kept at all (past that a renewal's stream is closed after use).

use super::map_error;
use crate::store::{LeaseId, StoreError};
use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper};
use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;
use tokio::time::Instant;

/// How long an idle stream is kept: several heartbeat intervals at any sane setting, and
/// longer than any lease TTL a member is given by default, so a member that stopped renewing
/// has lost its lease by then anyway.
pub(super) const IDLE_AFTER: Duration = Duration::from_secs(30);

/// The most streams kept open between renewals (a job of this many members, each with its
/// own lease, renews every lease on its own stream).
pub(super) const MAX_STREAMS: usize = 65_536;

/// Sweeps never run below this pool size.
const MIN_SWEEP: usize = 1024;

/// One lease's open keep-alive stream.
struct Renewer {
    keeper: LeaseKeeper,
    stream: LeaseKeepAliveStream,
    used: Instant,
}

/// The idle streams, and when to sweep them.
struct Pool {
    idle: HashMap<LeaseId, Renewer>,
    sweep_at: usize,
}

/// Open keep-alive streams by lease (see the module doc).
pub(super) struct KeepAlives {
    pool: Mutex<Pool>,
}

impl KeepAlives {
    pub(super) fn new() -> Self {
        Self { pool: Mutex::new(Pool { idle: HashMap::new(), sweep_at: MIN_SWEEP }) }
    }

    /// Streams open between renewals now.
    pub(super) fn open_streams(&self) -> usize {
        self.pool.lock().unwrap_or_else(PoisonError::into_inner).idle.len()
    }

    /// Renews `lease` once, within `timeout`: [`StoreError::LeaseNotFound`] when etcd no
    /// longer has it.
    ///
    /// # Cancel safety
    /// Cancel safe: a cancelled renewal drops the stream it had taken (etcd may or may not
    /// have renewed the lease), and the next renewal opens another.
    pub(super) async fn renew(&self, client: &Client, lease: LeaseId, timeout: Duration) -> Result<(), StoreError> {
        let deadline = Instant::now() + timeout;
        let taken = self.take(lease);
        let renewer = match taken {
            Some(renewer) => match within(deadline, renew_on(renewer, lease)).await {
                Ok(renewer) => renewer,
                Err(StoreError::LeaseNotFound(id)) => return Err(StoreError::LeaseNotFound(id)),
                // The idle stream broke: this renewal's verdict is a fresh stream's.
                Err(e) => {
                    tracing::debug!(lease, error = %e, "a kept keep-alive stream failed; renewing on a fresh one");
                    within(deadline, open(client, lease)).await?
                }
            },
            None => within(deadline, open(client, lease)).await?,
        };
        self.put_back(lease, renewer);
        Ok(())
    }

    fn take(&self, lease: LeaseId) -> Option<Renewer> {
        self.pool.lock().unwrap_or_else(PoisonError::into_inner).idle.remove(&lease)
    }

    fn put_back(&self, lease: LeaseId, mut renewer: Renewer) {
        let now = Instant::now();
        renewer.used = now;
        let mut pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
        if pool.idle.len() >= pool.sweep_at {
            pool.idle.retain(|_, r| now.duration_since(r.used) < IDLE_AFTER);
            pool.sweep_at = (pool.idle.len() * 2).max(MIN_SWEEP);
        }
        if pool.idle.len() < MAX_STREAMS || pool.idle.contains_key(&lease) {
            // A concurrent renewal's stream for the same lease, if any, is closed here.
            pool.idle.insert(lease, renewer);
        }
    }
}

/// Runs `f` until `deadline`.
async fn within<T>(
    deadline: Instant,
    f: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout_at(deadline, f).await {
        Ok(result) => result,
        Err(_) => Err(StoreError::Unavailable("etcd lease renewal timed out".into())),
    }
}

/// Opens a keep-alive stream for `lease`; its opening renews the lease once.
async fn open(client: &Client, lease: LeaseId) -> Result<Renewer, StoreError> {
    let (keeper, stream) = client.lease_client().keep_alive(lease).await.map_err(|e| map_error(e, Some(lease)))?;
    Ok(Renewer { keeper, stream, used: Instant::now() })
}

/// Renews `lease` on its kept stream: one request, one answer (a TTL of 0 means the lease is
/// gone).
async fn renew_on(mut renewer: Renewer, lease: LeaseId) -> Result<Renewer, StoreError> {
    renewer.keeper.keep_alive().await.map_err(|e| map_error(e, Some(lease)))?;
    match renewer.stream.message().await.map_err(|e| map_error(e, Some(lease)))? {
        Some(answer) if answer.ttl() > 0 => Ok(renewer),
        Some(_) => Err(StoreError::LeaseNotFound(lease)),
        None => Err(StoreError::Unavailable("etcd closed the keep-alive stream".into())),
    }
}
