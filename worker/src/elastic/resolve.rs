//! Addresses of peers a sparse generation view leaves out, asked of the coordinator when a
//! link to one is first made (the TCP mesh's [`ResolvePeer`]).
//!
//! Look-ups are batched, so that what they cost is bounded per generation whatever the
//! collectives reach: each `Members` call asks for the peer wanted and the next missing ranks
//! after it (in rank order, wrapping), a batch twice as large as the one before (2, 4, 8, …,
//! at most [`cohort_proto::MAX_MEMBERS_PER_CALL`]). Every call brings only ranks not yet
//! known, so a rank that misses `M` addresses makes at most `ceil(log2(M + 2)) - 1` calls
//! (while the batches stay under the per-call cap: up to 8,190 addresses), whichever peers it
//! asks about and in whichever order: one alltoall in a sparse generation of `N` ranks costs
//! at most `N·log2 N` look-ups across the job, not `N²`. A batch costs at most twice the
//! addresses its rank needed since the previous one. Misses that arrive while a call is in
//! flight wait for it and are answered from it when it brought them.

use super::members::Members;
use crate::control::ControlClient;
use cohort_proto::v1 as pb;
use cohort_proto::MAX_MEMBERS_PER_CALL;
use cohort_transports::tcp::ResolvePeer;
use cohort_transports::{Rank, TransportError};
use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};

/// The first batch's size: the peer wanted and the next missing one.
const FIRST_BATCH: usize = 2;

/// Asks `Members` for the ranks of one generation its view lacks, in growing batches, each
/// answer checked against the generation's digest. One per generation (its cache is the
/// generation's).
pub(crate) struct CoordinatorResolver {
    client: ControlClient,
    /// Who asks, and about which generation (`ranks` filled per call).
    question: pb::MembersRequest,
    digest: u64,
    /// What the look-ups found so far; held across a `Members` call, so that concurrent
    /// misses share it (the next one is answered from it, or asks for the next batch).
    batches: tokio::sync::Mutex<Batches>,
    /// `Members` calls made.
    calls: AtomicU64,
}

impl std::fmt::Debug for CoordinatorResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoordinatorResolver")
            .field("job", &self.question.job)
            .field("generation", &self.question.generation)
            .field("calls", &self.calls())
            .finish()
    }
}

impl CoordinatorResolver {
    /// The resolver of the generation `question.generation` (members digest `digest`), of
    /// which this worker holds the view `members` (its entries are never asked for).
    pub(crate) fn new(client: ControlClient, question: pb::MembersRequest, digest: u64, members: &Members) -> Self {
        let known = members.iter().map(|m| m.rank).collect();
        Self {
            client,
            question: pb::MembersRequest { ranks: Vec::new(), host: String::new(), ..question },
            digest,
            batches: tokio::sync::Mutex::new(Batches::new(members.size(), known)),
            calls: AtomicU64::new(0),
        }
    }

    /// `Members` calls this resolver has made.
    pub(crate) fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }
}

impl ResolvePeer for CoordinatorResolver {
    fn resolve(&self, peer: Rank) -> Pin<Box<dyn Future<Output = Result<SocketAddr, TransportError>> + Send + '_>> {
        Box::pin(async move {
            // Cancel safe: a call dropped part-way records nothing and releases the lock.
            let mut batches = self.batches.lock().await;
            if let Some(found) = batches.lookup(peer) {
                return found;
            }
            let batch = batches.next_batch(peer);
            self.calls.fetch_add(1, Ordering::Relaxed);
            let request = pb::MembersRequest { ranks: batch.clone(), ..self.question.clone() };
            let fetched =
                self.client.fetch_members(request, self.digest).await.map_err(|e| TransportError::Handshake {
                    peer,
                    detail: format!("asking the coordinator for rank {peer}'s address: {e}"),
                })?;
            batches.record(&batch, &fetched);
            tracing::debug!(peer, batch = batch.len(), calls = self.calls(), "addresses resolved in a batch");
            batches.lookup(peer).unwrap_or_else(|| {
                Err(TransportError::Handshake { peer, detail: format!("the coordinator's answer lacks rank {peer}") })
            })
        })
    }
}

/// The addresses one generation's look-ups found, and what the next batch asks for.
#[derive(Debug)]
struct Batches {
    size: u32,
    /// Ranks of the view, ascending: never asked for.
    known: Vec<u32>,
    /// Each rank asked for: its address, or why its record is unusable.
    found: HashMap<Rank, Result<SocketAddr, String>>,
    /// The next batch's size.
    window: usize,
}

impl Batches {
    fn new(size: u32, mut known: Vec<u32>) -> Self {
        known.sort_unstable();
        Self { size, known, found: HashMap::new(), window: FIRST_BATCH }
    }

    /// What an earlier batch found about `peer`, if it was asked for.
    fn lookup(&self, peer: Rank) -> Option<Result<SocketAddr, TransportError>> {
        self.found.get(&peer).map(|found| {
            found
                .clone()
                .map_err(|detail| TransportError::Handshake { peer, detail: format!("rank {peer}'s record: {detail}") })
        })
    }

    /// The next batch: `peer`, then the ranks after it (in rank order, wrapping) that are
    /// neither in the view nor asked for yet, `window` in all (fewer when fewer remain).
    fn next_batch(&self, peer: Rank) -> Vec<Rank> {
        let mut batch = vec![peer];
        let mut next = peer;
        for _ in 1..self.size {
            if batch.len() >= self.window {
                break;
            }
            next = if next + 1 >= self.size { 0 } else { next + 1 };
            if self.known.binary_search(&next).is_err() && !self.found.contains_key(&next) {
                batch.push(next);
            }
        }
        batch
    }

    /// Notes what the `Members` answer to `batch` brought, and doubles the next batch.
    fn record(&mut self, batch: &[Rank], fetched: &[pb::Member]) {
        for m in fetched.iter().filter(|m| batch.contains(&m.rank)) {
            let found = super::members::parse_member(m).map(|m| m.tcp).map_err(|e| e.to_string());
            self.found.insert(m.rank, found);
        }
        for &rank in batch {
            self.found.entry(rank).or_insert_with(|| Err("the coordinator's answer lacks it".into()));
        }
        self.window = (self.window * 2).min(MAX_MEMBERS_PER_CALL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(rank: u32) -> pb::Member {
        pb::Member {
            rank,
            worker_id: format!("w{rank}"),
            addresses: vec![pb::TransportAddress {
                transport: "tcp".into(),
                address: format!("127.0.0.1:{}", 7000 + rank),
            }],
            ..Default::default()
        }
    }

    /// Resolves every rank in `order` through `batches`, answering each batch as the
    /// coordinator would; the calls made.
    fn resolve_all(batches: &mut Batches, order: impl IntoIterator<Item = u32>) -> u32 {
        let mut calls = 0;
        for peer in order {
            if batches.known.binary_search(&peer).is_ok() {
                continue;
            }
            if batches.lookup(peer).is_none() {
                let batch = batches.next_batch(peer);
                assert!(batch.len() <= MAX_MEMBERS_PER_CALL);
                let answer: Vec<pb::Member> = batch.iter().map(|&r| member(r)).collect();
                batches.record(&batch, &answer);
                calls += 1;
            }
            let addr = batches.lookup(peer).expect("asked").expect("an address");
            assert_eq!(addr.port(), 7000 + peer as u16);
        }
        calls
    }

    #[test]
    fn misses_cost_a_logarithmic_number_of_calls_whatever_their_order() {
        for n in [2u32, 3, 5, 20, 32, 100, 1000, 4096] {
            for own in [0, n / 2, n - 1] {
                let known: Vec<u32> = std::iter::once(own).chain(cohort_proto::partner_ranks(own, n)).collect();
                let missing = (0..n).filter(|r| !known.contains(r)).count() as f64;
                let bound = ((missing + 2.0).log2().ceil() - 1.0).max(0.0) as u32;
                // In rank order from own (an alltoall's), descending, and scattered.
                let forward: Vec<u32> = (1..n).map(|i| (own + i) % n).collect();
                let backward: Vec<u32> = (1..n).map(|i| (own + n - i) % n).collect();
                let scattered: Vec<u32> = (0..n).map(|i| (i * 7919 + 13) % n).collect();
                for order in [forward, backward, scattered] {
                    let mut batches = Batches::new(n, known.clone());
                    let calls = resolve_all(&mut batches, order);
                    assert!(calls <= bound, "{n} ranks, rank {own}: {calls} calls for {missing} misses");
                    assert!(f64::from(calls) <= f64::from(n).log2(), "{n} ranks: {calls} calls");
                    assert!(batches.found.keys().all(|r| !known.contains(r)), "a rank of the view asked for");
                }
            }
        }
    }

    #[test]
    fn a_record_the_answer_lacks_or_cannot_use_fails_its_rank_alone() {
        let mut batches = Batches::new(8, vec![0]);
        let batch = batches.next_batch(5);
        assert_eq!(batch, [5, 6]);
        let mut bad = member(6);
        bad.addresses.clear();
        batches.record(&batch, &[bad]);
        assert!(matches!(batches.lookup(5), Some(Err(TransportError::Handshake { peer: 5, .. }))), "lacked");
        assert!(matches!(batches.lookup(6), Some(Err(TransportError::Handshake { peer: 6, .. }))), "no tcp address");
        assert!(batches.lookup(7).is_none());
        assert_eq!(batches.next_batch(7), [7, 1, 2, 3], "doubled, wrapping, skipping the view and what was asked");
    }
}
