//! The in-process [`Store`] backend: the coordinator's default, with nothing else to run.
//!
//! It follows etcd v3's semantics closely so that code tested against it behaves the same on
//! etcd: one global revision bumped once per mutating request (a transaction's writes share
//! it), `create_revision`/`mod_revision` per key, transactions that reject duplicate keys,
//! leases with whole-second TTLs whose expiry deletes the attached keys (one revision per
//! lease), and prefix watches that can start from any revision still in the event history.
//!
//! Watches never buffer without bound: each watcher has a bounded channel, and a watcher
//! whose channel fills up is detached from the live feed; when its consumer drains the
//! channel it re-attaches by replaying the event history from where it stopped, exactly like
//! etcd's "unsynced" watchers. Only when the history no longer reaches back that far does the
//! stream end, with [`StoreError::Compacted`].

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::ops::Bound;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;

use super::{
    check_key, ttl_seconds, Compare, KeyValue, LeaseId, Store, StoreError, Txn, TxnOp, TxnResult, WatchEvent,
    WatchStream,
};

/// How many events the history ring keeps by default (watches can start this far back).
pub const DEFAULT_HISTORY_LIMIT: usize = 10_000;

/// Events buffered per watcher before it is detached from the live feed and has to catch up
/// from the history.
pub const WATCH_CHANNEL_CAPACITY: usize = 1024;

/// An in-memory [`Store`]. Clones share one state; the lease timer stops when the last clone
/// is dropped, and open watch streams then end.
#[derive(Clone)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

/// State shared by the clones of one store.
struct Shared {
    state: Mutex<State>,
    /// Wakes the lease expiry task: a new (possibly earlier) deadline, or shutdown.
    wake: Arc<Notify>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The expiry task holds only a weak reference; wake it so it sees the store is gone.
        self.wake.notify_one();
    }
}

/// A stored value.
struct Entry {
    value: Vec<u8>,
    create_revision: i64,
    mod_revision: i64,
    lease: Option<LeaseId>,
}

/// A live lease.
struct Lease {
    ttl: Duration,
    deadline: Instant,
    keys: BTreeSet<String>,
}

/// A registered watch feed.
struct Watcher {
    prefix: String,
    tx: mpsc::Sender<WatchEvent>,
}

struct State {
    revision: i64,
    kvs: BTreeMap<String, Entry>,
    leases: HashMap<LeaseId, Lease>,
    /// Lease deadlines in time order, for the expiry task.
    expiries: BTreeSet<(Instant, LeaseId)>,
    next_lease: LeaseId,
    /// The most recent events, oldest first (revisions non-decreasing).
    history: VecDeque<WatchEvent>,
    history_limit: usize,
    /// Events with revision <= this may be missing from `history`.
    compacted_through: i64,
    watchers: Vec<Watcher>,
    expiry_task_started: bool,
}

/// The revision at which an event happened.
fn event_revision(ev: &WatchEvent) -> i64 {
    match ev {
        WatchEvent::Put(kv) => kv.mod_revision,
        WatchEvent::Delete { revision, .. } => *revision,
    }
}

/// The key an event is about.
fn event_key(ev: &WatchEvent) -> &str {
    match ev {
        WatchEvent::Put(kv) => &kv.key,
        WatchEvent::Delete { key, .. } => key,
    }
}

/// Checks one transaction branch the way etcd does: keys present, no key written twice, and
/// no written key also deleted.
fn check_branch(ops: &[TxnOp]) -> Result<(), StoreError> {
    let mut puts = HashSet::new();
    for op in ops {
        match op {
            TxnOp::Put { key, .. } => {
                check_key(key)?;
                if !puts.insert(key.as_str()) {
                    return Err(StoreError::Invalid(format!("duplicate key {key:?} in transaction")));
                }
            }
            TxnOp::Delete(key) => check_key(key)?,
            TxnOp::DeletePrefix(_) => {}
        }
    }
    for op in ops {
        let overlapping = match op {
            TxnOp::Put { .. } => None,
            TxnOp::Delete(key) => puts.contains(key.as_str()).then_some(key),
            TxnOp::DeletePrefix(prefix) => puts.iter().any(|k| k.starts_with(prefix.as_str())).then_some(prefix),
        };
        if let Some(key) = overlapping {
            return Err(StoreError::Invalid(format!("transaction both writes and deletes {key:?}")));
        }
    }
    Ok(())
}

impl State {
    fn new(history_limit: usize) -> State {
        State {
            revision: 1,
            kvs: BTreeMap::new(),
            leases: HashMap::new(),
            expiries: BTreeSet::new(),
            next_lease: 1,
            history: VecDeque::new(),
            history_limit: history_limit.max(1),
            compacted_through: 0,
            watchers: Vec::new(),
            expiry_task_started: false,
        }
    }

    fn to_key_value(key: &str, e: &Entry) -> KeyValue {
        KeyValue {
            key: key.to_owned(),
            value: e.value.clone(),
            create_revision: e.create_revision,
            mod_revision: e.mod_revision,
            lease: e.lease,
        }
    }

    /// Keys with `prefix`, in order.
    fn keys_with_prefix(&self, prefix: &str) -> Vec<String> {
        self.kvs
            .range::<str, _>((Bound::Included(prefix), Bound::Unbounded))
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Whether `lease` is alive at `now`; a lease past its deadline that the timer has not
    /// reaped yet is expired here and now, so nobody can observe it alive late.
    fn lease_alive(&mut self, lease: LeaseId, now: Instant) -> bool {
        match self.leases.get(&lease) {
            None => false,
            Some(l) if l.deadline <= now => {
                self.remove_lease(lease, "expired");
                false
            }
            Some(_) => true,
        }
    }

    fn write_put(&mut self, rev: i64, key: &str, value: Vec<u8>, lease: Option<LeaseId>, events: &mut Vec<WatchEvent>) {
        let (create_revision, old_lease) = match self.kvs.get(key) {
            Some(e) => (e.create_revision, e.lease),
            None => (rev, None),
        };
        if old_lease != lease {
            if let Some(l) = old_lease.and_then(|id| self.leases.get_mut(&id)) {
                l.keys.remove(key);
            }
            if let Some(l) = lease.and_then(|id| self.leases.get_mut(&id)) {
                l.keys.insert(key.to_owned());
            }
        }
        let entry = Entry { value, create_revision, mod_revision: rev, lease };
        events.push(WatchEvent::Put(Self::to_key_value(key, &entry)));
        self.kvs.insert(key.to_owned(), entry);
    }

    fn write_delete(&mut self, rev: i64, key: &str, events: &mut Vec<WatchEvent>) -> bool {
        let Some(old) = self.kvs.remove(key) else { return false };
        if let Some(l) = old.lease.and_then(|id| self.leases.get_mut(&id)) {
            l.keys.remove(key);
        }
        events.push(WatchEvent::Delete { key: key.to_owned(), revision: rev });
        true
    }

    /// Applies validated operations at one new revision; returns the events they made.
    fn apply(&mut self, ops: Vec<TxnOp>) -> Vec<WatchEvent> {
        let rev = self.revision + 1;
        let mut events = Vec::new();
        for op in ops {
            match op {
                TxnOp::Put { key, value, lease } => self.write_put(rev, &key, value, lease, &mut events),
                TxnOp::Delete(key) => {
                    self.write_delete(rev, &key, &mut events);
                }
                TxnOp::DeletePrefix(prefix) => {
                    for key in self.keys_with_prefix(&prefix) {
                        self.write_delete(rev, &key, &mut events);
                    }
                }
            }
        }
        self.commit(events.clone());
        events
    }

    /// Makes a request's events visible: bumps the revision (if anything changed), records
    /// them in the history and feeds the watchers.
    fn commit(&mut self, events: Vec<WatchEvent>) {
        let Some(first) = events.first() else { return };
        self.revision = event_revision(first);
        for ev in &events {
            self.history.push_back(ev.clone());
        }
        while self.history.len() > self.history_limit {
            if let Some(old) = self.history.pop_front() {
                self.compacted_through = event_revision(&old);
            }
        }
        self.watchers.retain(|w| {
            if w.tx.is_closed() {
                return false;
            }
            for ev in events.iter().filter(|ev| event_key(ev).starts_with(w.prefix.as_str())) {
                match w.tx.try_send(ev.clone()) {
                    Ok(()) => {}
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        tracing::debug!(prefix = %w.prefix, "watcher fell behind; it will catch up from history");
                        return false;
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => return false,
                }
            }
            true
        });
    }

    /// Removes a lease and deletes its keys at one new revision.
    fn remove_lease(&mut self, lease: LeaseId, why: &'static str) {
        let Some(l) = self.leases.remove(&lease) else { return };
        self.expiries.remove(&(l.deadline, lease));
        tracing::debug!(lease, keys = l.keys.len(), why, "lease removed");
        let ops = l.keys.into_iter().map(TxnOp::Delete).collect();
        self.apply(ops);
    }

    /// Expires every lease whose deadline has passed; returns the next deadline, if any.
    fn expire_due(&mut self, now: Instant) -> Option<Instant> {
        while let Some(&(deadline, lease)) = self.expiries.first() {
            if deadline > now {
                return Some(deadline);
            }
            self.remove_lease(lease, "expired");
        }
        None
    }

    /// Registers a live feed for `prefix` and returns the history from `from` (inclusive).
    fn subscribe(
        &mut self,
        prefix: &str,
        from: i64,
    ) -> Result<(VecDeque<WatchEvent>, mpsc::Receiver<WatchEvent>), StoreError> {
        if from <= self.compacted_through {
            return Err(StoreError::Compacted(self.compacted_through + 1));
        }
        let start = self.history.partition_point(|ev| event_revision(ev) < from);
        let backlog = self.history.range(start..).filter(|ev| event_key(ev).starts_with(prefix)).cloned().collect();
        let (tx, rx) = mpsc::channel(WATCH_CHANNEL_CAPACITY);
        self.watchers.push(Watcher { prefix: prefix.to_owned(), tx });
        Ok((backlog, rx))
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // No code path panics while holding the lock, so the state is consistent even if a
        // poison flag was set by a panic elsewhere in the holder's thread.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The lease timer: sleeps until the earliest lease deadline (or a wake-up), expires due
/// leases, and exits once the store is gone.
async fn lease_timer(shared: Weak<Shared>, wake: Arc<Notify>) {
    loop {
        let next = {
            let Some(shared) = shared.upgrade() else { return };
            let next = shared.lock().expire_due(Instant::now());
            next
        };
        match next {
            Some(deadline) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(deadline) => {}
                    _ = wake.notified() => {}
                }
            }
            None => wake.notified().await,
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl MemoryStore {
    /// An empty store (revision 1) keeping [`DEFAULT_HISTORY_LIMIT`] events of history.
    pub fn new() -> MemoryStore {
        MemoryStore::with_history_limit(DEFAULT_HISTORY_LIMIT)
    }

    /// An empty store keeping the last `limit` (at least 1) events for watches to replay.
    pub fn with_history_limit(limit: usize) -> MemoryStore {
        MemoryStore { shared: Arc::new(Shared { state: Mutex::new(State::new(limit)), wake: Arc::new(Notify::new()) }) }
    }

    /// The current store revision.
    pub fn revision(&self) -> i64 {
        self.shared.lock().revision
    }

    /// How many leases are alive (granted, neither revoked nor expired): for tests and
    /// diagnostics.
    pub fn live_leases(&self) -> usize {
        let now = Instant::now();
        self.shared.lock().leases.values().filter(|l| l.deadline > now).count()
    }

    /// Starts the lease timer on the current Tokio runtime, once.
    fn ensure_lease_timer(&self, state: &mut State) -> Result<(), StoreError> {
        if state.expiry_task_started {
            return Ok(());
        }
        let handle = tokio::runtime::Handle::try_current()
            .map_err(|_| StoreError::Unavailable("the memory store's lease timer needs a Tokio runtime".into()))?;
        handle.spawn(lease_timer(Arc::downgrade(&self.shared), Arc::clone(&self.shared.wake)));
        state.expiry_task_started = true;
        Ok(())
    }
}

/// A watch over a [`MemoryStore`]: replays a backlog, then follows the live feed, and
/// re-attaches from the history if it was detached for falling behind.
struct MemoryWatch {
    shared: Weak<Shared>,
    prefix: String,
    /// Where the watch started (used if it is re-attached before delivering anything).
    start: i64,
    /// Revision of the last delivered event (0: none yet).
    last_rev: i64,
    /// How many events of `last_rev` were delivered.
    seen_at_last: usize,
    backlog: VecDeque<WatchEvent>,
    rx: mpsc::Receiver<WatchEvent>,
    finished: bool,
}

impl MemoryWatch {
    fn deliver(&mut self, ev: WatchEvent) -> Poll<Option<Result<WatchEvent, StoreError>>> {
        let rev = event_revision(&ev);
        if rev == self.last_rev {
            self.seen_at_last += 1;
        } else {
            self.last_rev = rev;
            self.seen_at_last = 1;
        }
        Poll::Ready(Some(Ok(ev)))
    }

    /// Re-attaches after the live feed was dropped. `Ok(false)`: the store is gone.
    fn reattach(&mut self) -> Result<bool, StoreError> {
        let Some(shared) = self.shared.upgrade() else { return Ok(false) };
        let from = if self.last_rev == 0 { self.start } else { self.last_rev };
        let (mut backlog, rx) = shared.lock().subscribe(&self.prefix, from)?;
        if self.last_rev != 0 {
            // Drop the events of `last_rev` that were already delivered.
            for _ in 0..self.seen_at_last {
                if backlog.front().is_some_and(|ev| event_revision(ev) == self.last_rev) {
                    backlog.pop_front();
                }
            }
        }
        tracing::debug!(prefix = %self.prefix, from, replay = backlog.len(), "watch re-attached from history");
        self.backlog = backlog;
        self.rx = rx;
        Ok(true)
    }
}

impl futures::Stream for MemoryWatch {
    type Item = Result<WatchEvent, StoreError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if this.finished {
                return Poll::Ready(None);
            }
            if let Some(ev) = this.backlog.pop_front() {
                return this.deliver(ev);
            }
            match this.rx.poll_recv(cx) {
                Poll::Ready(Some(ev)) => return this.deliver(ev),
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => match this.reattach() {
                    Ok(true) => continue,
                    Ok(false) => {
                        this.finished = true;
                        return Poll::Ready(None);
                    }
                    Err(e) => {
                        this.finished = true;
                        return Poll::Ready(Some(Err(e)));
                    }
                },
            }
        }
    }
}

#[async_trait::async_trait]
impl Store for MemoryStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        check_key(key)?;
        let st = self.shared.lock();
        Ok(st.kvs.get(key).map(|e| State::to_key_value(key, e)))
    }

    async fn get_prefix(&self, prefix: &str) -> Result<(Vec<KeyValue>, i64), StoreError> {
        let st = self.shared.lock();
        let kvs = st
            .kvs
            .range::<str, _>((Bound::Included(prefix), Bound::Unbounded))
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, e)| State::to_key_value(k, e))
            .collect();
        Ok((kvs, st.revision))
    }

    async fn count_prefix(&self, prefix: &str) -> Result<u64, StoreError> {
        let st = self.shared.lock();
        let n = st
            .kvs
            .range::<str, _>((Bound::Included(prefix), Bound::Unbounded))
            .take_while(|(k, _)| k.starts_with(prefix))
            .count();
        Ok(n as u64)
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<i64, StoreError> {
        check_key(key)?;
        let mut st = self.shared.lock();
        if let Some(id) = lease {
            if !st.lease_alive(id, Instant::now()) {
                return Err(StoreError::LeaseNotFound(id));
            }
        }
        st.apply(vec![TxnOp::Put { key: key.to_owned(), value, lease }]);
        Ok(st.revision)
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        check_key(key)?;
        let mut st = self.shared.lock();
        let events = st.apply(vec![TxnOp::Delete(key.to_owned())]);
        Ok(!events.is_empty())
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<u64, StoreError> {
        let mut st = self.shared.lock();
        let events = st.apply(vec![TxnOp::DeletePrefix(prefix.to_owned())]);
        Ok(events.len() as u64)
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResult, StoreError> {
        check_branch(&txn.success)?;
        check_branch(&txn.failure)?;
        let mut st = self.shared.lock();
        let succeeded = txn.compares.iter().all(|c| match c {
            Compare::Absent(k) => !st.kvs.contains_key(k),
            Compare::Exists(k) => st.kvs.contains_key(k),
            // A missing key compares as mod_revision 0, as in etcd.
            Compare::ModRevision(k, rev) => st.kvs.get(k).map_or(0, |e| e.mod_revision) == *rev,
            // etcd: a value comparison on a missing key is always false.
            Compare::ValueEquals(k, v) => st.kvs.get(k).is_some_and(|e| e.value == *v),
        });
        let ops = if succeeded { txn.success } else { txn.failure };
        let now = Instant::now();
        for op in &ops {
            if let TxnOp::Put { lease: Some(id), .. } = op {
                if !st.lease_alive(*id, now) {
                    return Err(StoreError::LeaseNotFound(*id));
                }
            }
        }
        st.apply(ops);
        Ok(TxnResult { succeeded, revision: st.revision })
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, StoreError> {
        let secs = ttl_seconds(ttl)?;
        let ttl = Duration::from_secs(secs);
        let mut st = self.shared.lock();
        self.ensure_lease_timer(&mut st)?;
        let id = st.next_lease;
        st.next_lease += 1;
        let deadline = Instant::now() + ttl;
        st.leases.insert(id, Lease { ttl, deadline, keys: BTreeSet::new() });
        st.expiries.insert((deadline, id));
        drop(st);
        self.shared.wake.notify_one();
        tracing::debug!(lease = id, ttl_s = secs, "lease granted");
        Ok(id)
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        let mut st = self.shared.lock();
        let now = Instant::now();
        if !st.lease_alive(lease, now) {
            return Err(StoreError::LeaseNotFound(lease));
        }
        let Some(l) = st.leases.get_mut(&lease) else { return Err(StoreError::LeaseNotFound(lease)) };
        let old = l.deadline;
        l.deadline = now + l.ttl;
        let new = l.deadline;
        st.expiries.remove(&(old, lease));
        st.expiries.insert((new, lease));
        Ok(())
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.shared.lock().remove_lease(lease, "revoked");
        Ok(())
    }

    fn lease_ttl_resolution(&self) -> Duration {
        Duration::ZERO
    }

    async fn lease_time_to_live(&self, lease: LeaseId) -> Result<Option<Duration>, StoreError> {
        let mut st = self.shared.lock();
        let now = Instant::now();
        if !st.lease_alive(lease, now) {
            return Ok(None);
        }
        Ok(st.leases.get(&lease).map(|l| l.deadline.saturating_duration_since(now)))
    }

    async fn watch_prefix(&self, prefix: &str, from_revision: i64) -> Result<WatchStream, StoreError> {
        let mut st = self.shared.lock();
        let start = if from_revision <= 0 { st.revision + 1 } else { from_revision };
        let (backlog, rx) = st.subscribe(prefix, start)?;
        drop(st);
        Ok(Box::pin(MemoryWatch {
            shared: Arc::downgrade(&self.shared),
            prefix: prefix.to_owned(),
            start,
            last_rev: 0,
            seen_at_last: 0,
            backlog,
            rx,
            finished: false,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    const BOUND: Duration = Duration::from_secs(10);

    #[tokio::test]
    async fn slow_watcher_catches_up_from_history() {
        tokio::time::timeout(BOUND, async {
            let store = MemoryStore::with_history_limit(4 * WATCH_CHANNEL_CAPACITY);
            let mut watch = store.watch_prefix("k/", 0).await.expect("watch");
            // Overflow the watcher's channel without reading it.
            let total = 2 * WATCH_CHANNEL_CAPACITY + 7;
            for i in 0..total {
                store.put(&format!("k/{i:05}"), vec![1], None).await.expect("put");
            }
            assert!(store.shared.lock().watchers.iter().all(|w| w.prefix != "k/"), "overflowed watcher detached");
            for i in 0..total {
                match watch.next().await {
                    Some(Ok(WatchEvent::Put(kv))) => assert_eq!(kv.key, format!("k/{i:05}")),
                    other => panic!("event {i}: {other:?}"),
                }
            }
            store.put("k/live", vec![2], None).await.expect("put");
            match watch.next().await {
                Some(Ok(WatchEvent::Put(kv))) => assert_eq!(kv.key, "k/live"),
                other => panic!("live event: {other:?}"),
            }
        })
        .await
        .expect("test bound");
    }

    #[tokio::test]
    async fn watcher_behind_history_gets_compacted() {
        tokio::time::timeout(BOUND, async {
            let store = MemoryStore::with_history_limit(16);
            let mut watch = store.watch_prefix("k/", 0).await.expect("watch");
            for i in 0..(WATCH_CHANNEL_CAPACITY + 64) {
                store.put(&format!("k/{i}"), vec![], None).await.expect("put");
            }
            let mut delivered = 0usize;
            loop {
                match watch.next().await {
                    Some(Ok(_)) => delivered += 1,
                    Some(Err(StoreError::Compacted(rev))) => {
                        assert_eq!(delivered, WATCH_CHANNEL_CAPACITY);
                        assert!(rev > delivered as i64 + 1);
                        break;
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
            assert!(watch.next().await.is_none(), "stream ends after the error");
        })
        .await
        .expect("test bound");
    }

    #[tokio::test]
    async fn reattach_mid_revision_skips_delivered_events() {
        tokio::time::timeout(BOUND, async {
            let store = MemoryStore::new();
            let n = WATCH_CHANNEL_CAPACITY + 6;
            for i in 0..n {
                store.put(&format!("p/{i:05}"), vec![], None).await.expect("put");
            }
            let mut watch = store.watch_prefix("p/", 0).await.expect("watch");
            // One revision with more deletions than the watcher's channel holds: it is
            // detached in the middle of the revision and must resume inside it.
            assert_eq!(store.delete_prefix("p/").await.expect("delete"), n as u64);
            let mut keys = Vec::new();
            for _ in 0..n {
                match watch.next().await {
                    Some(Ok(WatchEvent::Delete { key, .. })) => keys.push(key),
                    other => panic!("unexpected {other:?}"),
                }
            }
            let expected: Vec<String> = (0..n).map(|i| format!("p/{i:05}")).collect();
            assert_eq!(keys, expected);
            store.put("p/after", vec![], None).await.expect("put");
            match watch.next().await {
                Some(Ok(WatchEvent::Put(kv))) => assert_eq!(kv.key, "p/after"),
                other => panic!("unexpected {other:?}"),
            }
        })
        .await
        .expect("test bound");
    }

    #[tokio::test]
    async fn lease_timer_stops_with_the_store() {
        tokio::time::timeout(BOUND, async {
            let store = MemoryStore::new();
            store.grant_lease(Duration::from_secs(30)).await.expect("grant");
            let weak = Arc::downgrade(&store.shared);
            let mut watch = store.watch_prefix("", 0).await.expect("watch");
            drop(store);
            assert!(weak.upgrade().is_none(), "watch streams and the timer hold no strong reference");
            assert!(watch.next().await.is_none(), "watch ends when the store is gone");
        })
        .await
        .expect("test bound");
    }

    #[test]
    fn txn_branch_validation_matches_etcd() {
        let put = |k: &str| TxnOp::Put { key: k.into(), value: vec![], lease: None };
        assert!(check_branch(&[put("a"), put("b"), TxnOp::DeletePrefix("c".into())]).is_ok());
        assert!(matches!(check_branch(&[put("a"), put("a")]), Err(StoreError::Invalid(_))));
        assert!(matches!(check_branch(&[put("a/1"), TxnOp::DeletePrefix("a/".into())]), Err(StoreError::Invalid(_))));
        assert!(matches!(check_branch(&[TxnOp::Delete("a".into()), put("a")]), Err(StoreError::Invalid(_))));
        assert!(matches!(check_branch(&[put("")]), Err(StoreError::Invalid(_))));
        assert!(matches!(ttl_seconds(Duration::ZERO), Err(StoreError::Invalid(_))));
        assert_eq!(ttl_seconds(Duration::from_millis(1500)).ok(), Some(2));
    }
}
