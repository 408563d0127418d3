//! Merging concurrent requests into shared etcd transactions.
//!
//! A large job's formation is thousands of members each reading a few keys and writing a few
//! records at about the same time. Sent one by one, every write is its own raft entry and
//! every read its own linearizable round trip, and etcd's request rate, not the coordinator,
//! bounds how fast the job forms (docs/benchmarks-journal.md, "Where etcd's time goes").
//!
//! [`Batcher`] queues single-key reads ([`Request::Get`]) and writes ([`Request::Put`], and
//! [`Request::Txn`] without a failure branch) and sends whatever has queued up as one etcd
//! transaction: reads in a read-only transaction (served without a raft entry), writes in one
//! transaction whose compares are every member's compares and whose operations are every
//! member's operations, in queue order. A queue that is idle adds nothing: a request that
//! finds a free slot goes at once, alone, as the plain request it always was.
//!
//! # What a batch may hold ([`BatchShape`])
//! - at most [`MAX_BATCH_OPS`] operations and compares (etcd's default `--max-txn-ops`; a
//!   cluster run with another limit is matched with [`super::EtcdTuning::max_txn_ops`],
//!   `cohort-coordinator serve --etcd-max-txn-ops`) and [`MAX_BATCH_BYTES`] of keys and values
//!   (below etcd's 1.5 MiB request limit);
//! - no two writes of one key (etcd refuses a transaction that writes a key twice);
//! - no compare on a key that an earlier request of the batch writes: etcd evaluates every
//!   compare before any operation, so such a compare would see the key as it was before the
//!   earlier write, not after it as it would on its own.
//!
//! A request that does not fit starts the next batch, so each queue keeps its order.
//!
//! # When a batch fails
//! - Its compares fail (some member's transaction would fail), or etcd refuses it as invalid
//!   (a member's lease expired, too many operations for this cluster): every member is run
//!   again on its own, concurrently, and gets the answer it would have had alone.
//! - etcd is unavailable or the deadline passes: every member gets that error, as it would
//!   have alone. As with any write that timed out, the caller cannot know whether it was
//!   applied (see [`crate::store::Store`]'s cancel-safety note).
//!
//! Two requests of one batch were in flight at the same time, so either order was possible;
//! a caller that needs an order awaits its first request before it sends the second.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{KvClient, PutOptions, TxnOpResponse};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};

use super::{compare_to_etcd, convert_kv, header_revision, map_error, op_to_etcd};
use crate::store::{Compare, KeyValue, LeaseId, StoreError, Txn, TxnOp, TxnResult};

/// Most operations (and, separately, compares) in one batch by default: etcd's default
/// `--max-txn-ops`. A cluster configured lower refuses a full batch; its members are then run
/// alone.
pub const MAX_BATCH_OPS: usize = 128;

/// Most bytes of keys and values in one batch, below etcd's default 1.5 MiB request limit.
pub const MAX_BATCH_BYTES: usize = 1 << 20;

/// Batches of one queue in flight at once. While they are, new requests queue up and leave
/// together in the next batch.
const IN_FLIGHT: usize = 4;

/// Requests that may wait in one queue before senders wait for room.
const QUEUE_CAPACITY: usize = 8192;

/// Largest answer of a read accepted, batched or not: 128 generation shards of up to 1.5 MiB
/// fit, and a prefix of the keys of tens of thousands of members (gRPC's default is 4 MiB,
/// which the leader's read of every job's keys passed at 8,192 members).
pub(super) const MAX_READ_ANSWER: usize = 256 << 20;

/// One request that can share a transaction with others.
#[derive(Clone, Debug)]
pub(super) enum Request {
    /// Reads one key.
    Get(String),
    /// Writes one key, optionally on a lease.
    Put { key: String, value: Vec<u8>, lease: Option<LeaseId> },
    /// A transaction without a failure branch or a prefix deletion ([`Request::batchable_txn`]).
    Txn(Txn),
}

/// The answer to one [`Request`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Reply {
    /// The key read, if it exists.
    Get(Option<KeyValue>),
    /// The store revision after the write.
    Put(i64),
    /// Whether the transaction's compares held, and the revision after it.
    Txn(TxnResult),
}

impl Request {
    /// Whether `txn` may share a batch: a failure branch would need its own compares' answer,
    /// and a prefix deletion's keys are not known in advance for the conflict rules.
    pub(super) fn batchable_txn(txn: &Txn) -> bool {
        txn.failure.is_empty() && !txn.success.iter().any(|op| matches!(op, TxnOp::DeletePrefix(_)))
    }

    /// The lease a request attaches keys to, named in a "lease not found" error.
    fn lease(&self) -> Option<LeaseId> {
        match self {
            Request::Get(_) => None,
            Request::Put { lease, .. } => *lease,
            Request::Txn(txn) => txn.success.iter().find_map(|op| match op {
                TxnOp::Put { lease, .. } => *lease,
                _ => None,
            }),
        }
    }

    /// How many operation answers this request takes from a batch's response.
    fn answers(&self) -> usize {
        match self {
            Request::Get(_) | Request::Put { .. } => 1,
            Request::Txn(txn) => txn.success.len(),
        }
    }
}

/// What one batch holds so far, to decide whether the next request may join it.
#[derive(Debug)]
pub(super) struct BatchShape {
    /// Most operations (and, separately, compares) of the batch.
    max_ops: usize,
    ops: usize,
    compares: usize,
    bytes: usize,
    written: HashSet<String>,
}

impl Default for BatchShape {
    /// An empty batch of at most [`MAX_BATCH_OPS`] operations.
    fn default() -> Self {
        Self::new(MAX_BATCH_OPS)
    }
}

impl BatchShape {
    /// An empty batch of at most `max_ops` operations (and as many compares).
    pub(super) fn new(max_ops: usize) -> Self {
        Self { max_ops, ops: 0, compares: 0, bytes: 0, written: HashSet::new() }
    }

    /// Adds `request` if it fits (see the module docs); an empty shape takes any request, so
    /// that one too large for a batch still goes, alone.
    pub(super) fn admit(&mut self, request: &Request) -> bool {
        let (ops, compares, bytes, writes, compared): (usize, usize, usize, Vec<&str>, Vec<&str>) = match request {
            Request::Get(key) => (1, 0, key.len(), vec![], vec![]),
            Request::Put { key, value, .. } => (1, 0, key.len() + value.len(), vec![key], vec![]),
            Request::Txn(txn) => {
                let mut bytes = 0;
                let mut writes = Vec::new();
                for op in &txn.success {
                    match op {
                        TxnOp::Put { key, value, .. } => {
                            bytes += key.len() + value.len();
                            writes.push(key.as_str());
                        }
                        TxnOp::Delete(key) | TxnOp::DeletePrefix(key) => {
                            bytes += key.len();
                            writes.push(key.as_str());
                        }
                    }
                }
                let compared: Vec<&str> = txn.compares.iter().map(compare_key).collect();
                bytes += txn.compares.iter().map(|c| compare_key(c).len() + compare_value_len(c)).sum::<usize>();
                (txn.success.len(), txn.compares.len(), bytes, writes, compared)
            }
        };
        let first = self.ops == 0 && self.compares == 0;
        if !first {
            let fits = self.ops + ops <= self.max_ops
                && self.compares + compares <= self.max_ops
                && self.bytes + bytes <= MAX_BATCH_BYTES;
            let conflicts =
                writes.iter().chain(&compared).any(|k| self.written.contains(*k)) || has_duplicates(&writes);
            if !fits || conflicts {
                return false;
            }
        }
        self.ops += ops;
        self.compares += compares;
        self.bytes += bytes;
        self.written.extend(writes.into_iter().map(str::to_string));
        true
    }
}

fn compare_key(c: &Compare) -> &str {
    match c {
        Compare::Absent(k) | Compare::Exists(k) | Compare::ModRevision(k, _) | Compare::ValueEquals(k, _) => k,
    }
}

fn compare_value_len(c: &Compare) -> usize {
    match c {
        Compare::ValueEquals(_, v) => v.len(),
        _ => 8,
    }
}

fn has_duplicates(keys: &[&str]) -> bool {
    let mut seen = HashSet::with_capacity(keys.len());
    !keys.iter().all(|k| seen.insert(*k))
}

/// A queued request and where its answer goes.
struct Queued {
    request: Request,
    reply: oneshot::Sender<Result<Reply, StoreError>>,
}

/// Counts of what the batcher sent ([`BatchStats`] is a snapshot).
#[derive(Debug, Default)]
struct BatchCounters {
    shared_transactions: AtomicU64,
    requests_shared: AtomicU64,
    retried_alone: AtomicU64,
    sent_alone: AtomicU64,
    largest_batch: AtomicU64,
    waiting: AtomicU64,
}

/// What an etcd store's batching queues have sent so far ([`super::EtcdStore::batch_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// Transactions that carried two or more requests.
    pub shared_transactions: u64,
    /// Requests that went in such transactions.
    pub requests_shared: u64,
    /// Shared transactions whose members were run again on their own.
    pub retried_alone: u64,
    /// Requests that found the queue idle and went alone, as plain requests.
    pub sent_alone: u64,
    /// The most requests one shared transaction carried.
    pub largest_batch: u64,
    /// Requests queued now, not yet sent (they wait for one of the queue's transactions in
    /// flight to be answered).
    pub waiting: u64,
}

/// The two queues (reads, writes) and their counters. Clones share them; the queues' tasks end
/// when the last clone is dropped.
#[derive(Clone)]
pub(super) struct Batcher {
    reads: mpsc::Sender<Queued>,
    writes: mpsc::Sender<Queued>,
    counters: Arc<BatchCounters>,
    deadline: Duration,
}

impl Batcher {
    /// Starts the read and the write queue on the current Tokio runtime, each sending its
    /// batches through `kv` with `request_timeout` per transaction.
    pub(super) fn start(kv: KvClient, request_timeout: Duration, max_ops: usize) -> Batcher {
        let counters = Arc::new(BatchCounters::default());
        let (reads, read_rx) = mpsc::channel(QUEUE_CAPACITY);
        let (writes, write_rx) = mpsc::channel(QUEUE_CAPACITY);
        let sender = Sender { kv, timeout: request_timeout, counters: counters.clone() };
        tokio::spawn(run_queue(
            read_rx,
            Sender { kv: sender.kv.clone().max_decoding_message_size(MAX_READ_ANSWER), ..sender.clone() },
            max_ops,
        ));
        tokio::spawn(run_queue(write_rx, sender, max_ops));
        // Waiting in the queue, the batch, then (if it failed) the request alone.
        Batcher { reads, writes, counters, deadline: request_timeout * 3 }
    }

    /// Queues `request` (a get on the read queue, the rest on the write queue) and waits for
    /// its answer, within three request timeouts.
    ///
    /// # Cancel safety
    /// Dropping the future after the request was queued does not withdraw it: it is applied
    /// wholly or not at all, as a plain etcd request dropped in flight would be.
    pub(super) async fn submit(&self, request: Request) -> Result<Reply, StoreError> {
        let queue = if matches!(request, Request::Get(_)) { &self.reads } else { &self.writes };
        let (reply, answer) = oneshot::channel();
        let waited = tokio::time::timeout(self.deadline, async {
            // Counted before it is queued, so that the queue's task, which uncounts it, never
            // sees it first; uncounted here if it never got into the queue.
            let counted = Waiting::count(&self.counters.waiting);
            queue.send(Queued { request, reply }).await.map_err(|_| closed())?;
            counted.queued();
            answer.await.map_err(|_| closed())?
        })
        .await;
        waited.unwrap_or_else(|_| {
            Err(StoreError::Unavailable(format!(
                "etcd request not answered within {:?} (queued behind others)",
                self.deadline
            )))
        })
    }

    /// What the queues have sent so far.
    pub(super) fn stats(&self) -> BatchStats {
        let c = &self.counters;
        BatchStats {
            shared_transactions: c.shared_transactions.load(Ordering::Relaxed),
            requests_shared: c.requests_shared.load(Ordering::Relaxed),
            retried_alone: c.retried_alone.load(Ordering::Relaxed),
            sent_alone: c.sent_alone.load(Ordering::Relaxed),
            largest_batch: c.largest_batch.load(Ordering::Relaxed),
            waiting: c.waiting.load(Ordering::Relaxed),
        }
    }
}

/// One request counted in [`BatchStats::waiting`] on its way into a queue: uncounted when
/// dropped before it was queued (the queue was closed or full and the caller gave up).
struct Waiting<'a>(Option<&'a AtomicU64>);

impl<'a> Waiting<'a> {
    fn count(waiting: &'a AtomicU64) -> Self {
        waiting.fetch_add(1, Ordering::Relaxed);
        Self(Some(waiting))
    }

    /// In the queue: from now on the queue's task uncounts it.
    fn queued(mut self) {
        self.0 = None;
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Some(w) = self.0 {
            w.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

fn closed() -> StoreError {
    StoreError::Unavailable("the etcd request queue has stopped".into())
}

/// Sends batches: a connection, the per-transaction deadline, and the counters.
#[derive(Clone)]
struct Sender {
    kv: KvClient,
    timeout: Duration,
    counters: Arc<BatchCounters>,
}

/// One queue's loop: take the oldest request, wait for a free slot (more requests queue up
/// meanwhile), add every queued request that fits, and send the batch on its own task.
async fn run_queue(mut queue: mpsc::Receiver<Queued>, sender: Sender, max_ops: usize) {
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    let mut next: Option<Queued> = None;
    loop {
        let first = match next.take() {
            Some(q) => q,
            None => match queue.recv().await {
                Some(q) => q,
                None => return,
            },
        };
        let Ok(slot) = slots.clone().acquire_owned().await else { return };
        let mut shape = BatchShape::new(max_ops);
        shape.admit(&first.request);
        let mut batch = vec![first];
        while let Ok(q) = queue.try_recv() {
            if shape.admit(&q.request) {
                batch.push(q);
            } else {
                next = Some(q);
                break;
            }
        }
        sender.counters.waiting.fetch_sub(batch.len() as u64, Ordering::Relaxed);
        tokio::spawn(sender.clone().send(batch, slot));
    }
}

impl Sender {
    /// Sends one batch and answers its members; the slot is freed when all are answered.
    async fn send(self, batch: Vec<Queued>, _slot: OwnedSemaphorePermit) {
        if batch.len() == 1 {
            let Some(q) = batch.into_iter().next() else { return };
            self.counters.sent_alone.fetch_add(1, Ordering::Relaxed);
            let _ = q.reply.send(self.alone(q.request).await);
            return;
        }
        self.counters.shared_transactions.fetch_add(1, Ordering::Relaxed);
        self.counters.requests_shared.fetch_add(batch.len() as u64, Ordering::Relaxed);
        self.counters.largest_batch.fetch_max(batch.len() as u64, Ordering::Relaxed);
        let (requests, replies): (Vec<Request>, Vec<_>) = batch.into_iter().map(|q| (q.request, q.reply)).unzip();
        match self.shared(&requests).await {
            Ok(answers) => {
                for (reply, answer) in replies.into_iter().zip(answers) {
                    let _ = reply.send(Ok(answer));
                }
            }
            Err(StoreError::Unavailable(e)) => {
                for reply in replies {
                    let _ = reply.send(Err(StoreError::Unavailable(e.clone())));
                }
            }
            Err(e) => {
                // Compares that failed, or a refusal (a lease gone, a limit of this cluster):
                // each member on its own gets the answer it would have had.
                tracing::debug!(members = requests.len(), error = %e, "shared etcd transaction failed; running its members alone");
                self.counters.retried_alone.fetch_add(1, Ordering::Relaxed);
                let answers = futures::future::join_all(requests.into_iter().map(|r| self.alone(r))).await;
                for (reply, answer) in replies.into_iter().zip(answers) {
                    let _ = reply.send(answer);
                }
            }
        }
    }

    /// Runs one request as the plain etcd request it stands for.
    async fn alone(&self, request: Request) -> Result<Reply, StoreError> {
        let lease = request.lease();
        let mut kv = self.kv.clone();
        match request {
            Request::Get(key) => {
                let resp = self.call(lease, kv.get(key, None)).await?;
                Ok(Reply::Get(resp.kvs().first().map(convert_kv)))
            }
            Request::Put { key, value, lease } => {
                let options = lease.map(|id| PutOptions::new().with_lease(id));
                let resp = self.call(lease, kv.put(key, value, options)).await?;
                Ok(Reply::Put(header_revision(resp.header())?))
            }
            Request::Txn(txn) => {
                let resp = self.call(lease, kv.txn(to_etcd(txn))).await?;
                Ok(Reply::Txn(TxnResult { succeeded: resp.succeeded(), revision: header_revision(resp.header())? }))
            }
        }
    }

    /// Sends `requests` as one transaction. `Err` with anything but
    /// [`StoreError::Unavailable`] (compares that failed included) means: run them alone.
    async fn shared(&self, requests: &[Request]) -> Result<Vec<Reply>, StoreError> {
        let mut compares = Vec::new();
        let mut ops = Vec::new();
        for request in requests {
            match request.clone() {
                Request::Get(key) => ops.push(etcd_client::TxnOp::get(key, None)),
                Request::Put { key, value, lease } => ops.push(op_to_etcd(TxnOp::Put { key, value, lease })),
                Request::Txn(txn) => {
                    compares.extend(txn.compares.into_iter().map(compare_to_etcd));
                    ops.extend(txn.success.into_iter().map(op_to_etcd));
                }
            }
        }
        let mut kv = self.kv.clone();
        let resp = self.call(None, kv.txn(etcd_client::Txn::new().when(compares).and_then(ops))).await?;
        if !resp.succeeded() {
            return Err(StoreError::Invalid("a compare of the shared transaction failed".into()));
        }
        let revision = header_revision(resp.header())?;
        let answers = resp.op_responses();
        let expected: usize = requests.iter().map(Request::answers).sum();
        if answers.len() != expected {
            return Err(StoreError::Invalid(format!("etcd answered {} operations of {expected}", answers.len())));
        }
        let mut answers = answers.into_iter();
        let mut replies = Vec::with_capacity(requests.len());
        for request in requests {
            replies.push(match request {
                Request::Get(_) => match answers.next() {
                    Some(TxnOpResponse::Get(get)) => Reply::Get(get.kvs().first().map(convert_kv)),
                    _ => return Err(StoreError::Invalid("etcd answered a read with another kind of answer".into())),
                },
                Request::Put { .. } => {
                    answers.next();
                    Reply::Put(revision)
                }
                Request::Txn(txn) => {
                    answers.by_ref().take(txn.success.len()).for_each(drop);
                    Reply::Txn(TxnResult { succeeded: true, revision })
                }
            });
        }
        Ok(replies)
    }

    /// Runs one etcd call under the deadline and maps its error.
    async fn call<T>(
        &self,
        lease: Option<LeaseId>,
        request: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.timeout, request).await {
            Ok(result) => result.map_err(|e| map_error(e, lease)),
            Err(_) => Err(StoreError::Unavailable(format!("etcd request timed out after {:?}", self.timeout))),
        }
    }
}

/// The etcd transaction for one of ours.
pub(super) fn to_etcd(txn: Txn) -> etcd_client::Txn {
    etcd_client::Txn::new()
        .when(txn.compares.into_iter().map(compare_to_etcd).collect::<Vec<_>>())
        .and_then(txn.success.into_iter().map(op_to_etcd).collect::<Vec<_>>())
        .or_else(txn.failure.into_iter().map(op_to_etcd).collect::<Vec<_>>())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(key: &str, bytes: usize) -> Request {
        Request::Put { key: key.into(), value: vec![0; bytes], lease: None }
    }

    fn cas(key: &str, rev: i64, write: &str) -> Request {
        Request::Txn(Txn {
            compares: vec![Compare::ModRevision(key.into(), rev)],
            success: vec![TxnOp::Put { key: write.into(), value: vec![1], lease: None }],
            failure: vec![],
        })
    }

    #[test]
    fn distinct_keys_share_a_batch_up_to_the_operation_limit() {
        let mut shape = BatchShape::default();
        for i in 0..MAX_BATCH_OPS {
            assert!(shape.admit(&put(&format!("k{i}"), 10)), "request {i}");
        }
        assert!(!shape.admit(&put("one-more", 10)));
        assert!(!shape.admit(&Request::Get("a-read-too".into())));
    }

    #[test]
    fn a_second_write_of_a_key_or_a_compare_on_a_written_key_starts_the_next_batch() {
        let mut shape = BatchShape::default();
        assert!(shape.admit(&put("a", 1)));
        assert!(!shape.admit(&put("a", 1)), "etcd refuses two writes of one key in a transaction");
        assert!(!shape.admit(&cas("a", 3, "b")), "the compare would miss the earlier write");
        assert!(shape.admit(&cas("c", 3, "b")));
        assert!(!shape.admit(&put("b", 1)));
        // A compare on a key that a later request writes is fine: compares see the state
        // before the batch, as they would before the later request on its own.
        assert!(shape.admit(&cas("d", 1, "e")));
        assert!(shape.admit(&put("d", 1)));
    }

    #[test]
    fn a_transaction_that_writes_one_key_twice_goes_alone() {
        let twice = Request::Txn(Txn {
            compares: vec![],
            success: vec![TxnOp::Put { key: "x".into(), value: vec![], lease: None }, TxnOp::Delete("x".into())],
            failure: vec![],
        });
        let mut shape = BatchShape::default();
        assert!(shape.admit(&put("y", 1)));
        assert!(!shape.admit(&twice));
        let mut alone = BatchShape::default();
        assert!(alone.admit(&twice), "an empty batch takes anything; etcd then judges it alone");
    }

    #[test]
    fn bytes_are_capped_but_an_oversized_request_still_goes_alone() {
        let mut shape = BatchShape::default();
        assert!(shape.admit(&put("big", MAX_BATCH_BYTES - 100)));
        assert!(!shape.admit(&put("more", 200)));
        let mut alone = BatchShape::default();
        assert!(alone.admit(&put("huge", 2 * MAX_BATCH_BYTES)));
        assert!(!alone.admit(&put("tiny", 1)));
    }

    #[test]
    fn compares_are_capped_like_operations() {
        let mut shape = BatchShape::default();
        let many = Request::Txn(Txn {
            compares: (0..MAX_BATCH_OPS).map(|i| Compare::Exists(format!("c{i}"))).collect(),
            success: vec![],
            failure: vec![],
        });
        assert!(shape.admit(&many));
        assert!(!shape.admit(&cas("z", 1, "w")));
        assert!(shape.admit(&put("w2", 1)), "a plain write adds no compare");
    }

    #[test]
    fn only_transactions_without_a_failure_branch_or_a_prefix_deletion_are_batched() {
        let plain = Txn { compares: vec![Compare::Absent("a".into())], success: vec![], failure: vec![] };
        assert!(Request::batchable_txn(&plain));
        let with_failure = Txn { failure: vec![TxnOp::Delete("a".into())], ..plain.clone() };
        assert!(!Request::batchable_txn(&with_failure));
        let with_prefix = Txn { success: vec![TxnOp::DeletePrefix("p/".into())], ..plain };
        assert!(!Request::batchable_txn(&with_prefix));
    }
}
