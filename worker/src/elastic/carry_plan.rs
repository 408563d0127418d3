//! Which links of the last generation the next one carries (incremental re-formation): pure
//! logic over two member views, whole or sparse, shared by production's data plane
//! ([`super::SocketPlane`]) and the deterministic simulation's, so that the simulation's seeds
//! run the same decision over sparse views, restarts and compacted ranks.
//!
//! A link is carried to a peer of the new plan only if that peer held a rank in the last
//! generation this worker connected, as the same process (worker id and incarnation), and
//! this worker is the same process too: a worker that joined again has no links to carry.
//! The link carried is the one to the peer's *old* rank: the coordinator compacts ranks past
//! a failed one, so a peer's rank usually changes. A member the view does not know (a sparse
//! view) is not carried: its link, if any, is shut down and the pair dials afresh.

use super::members::Members;
use std::collections::HashMap;

/// Who held which rank in the generation a worker connected last, as its view knew them.
#[derive(Clone, Debug)]
pub struct PreviousView {
    number: u64,
    /// This worker's incarnation in it.
    incarnation: u64,
    /// Each known member's incarnation and rank, by worker id.
    ranks: HashMap<String, (u64, u32)>,
    /// Each known rank's member: worker id and incarnation.
    members: HashMap<u32, (String, u64)>,
}

impl PreviousView {
    /// The view of generation `number`, which this worker (in its incarnation `incarnation`)
    /// connected with `members`.
    pub fn of(number: u64, incarnation: u64, members: &Members) -> Self {
        let known: Vec<(String, u64, u32)> = members
            .iter()
            .filter_map(|m| Some((m.worker_id.clone(), members.incarnation_of(m.rank)?, m.rank)))
            .collect();
        Self {
            number,
            incarnation,
            ranks: known.iter().map(|(w, inc, r)| (w.clone(), (*inc, *r))).collect(),
            members: known.into_iter().map(|(w, inc, r)| (r, (w, inc))).collect(),
        }
    }

    /// The generation's number.
    pub fn number(&self) -> u64 {
        self.number
    }

    /// The member that held `rank` in this generation (worker id, incarnation), if known.
    pub fn member_at(&self, rank: u32) -> Option<(&str, u64)> {
        self.members.get(&rank).map(|(w, inc)| (w.as_str(), *inc))
    }

    /// The links to carry into generation `number`, which this worker joined in its
    /// incarnation `incarnation` with the view `members`: for each peer in `planned` (ranks
    /// of the new generation) that held a rank here as the same process, its new rank and
    /// its rank here. Nothing when this worker is another process now, or `number` is not
    /// newer.
    pub fn carry_into(
        &self,
        number: u64,
        members: &Members,
        incarnation: u64,
        planned: impl IntoIterator<Item = u32>,
    ) -> Vec<(u32, u32)> {
        if self.incarnation != incarnation || self.number >= number {
            return Vec::new();
        }
        planned
            .into_iter()
            .filter_map(|p| {
                if same_ranks_planted() {
                    // The planted bug: the old link at the same rank number, whoever held it.
                    return self.members.contains_key(&p).then_some((p, p));
                }
                let m = members.get(p)?;
                let peer_incarnation = members.incarnation_of(p)?;
                let &(_, old_rank) = self.ranks.get(&m.worker_id).filter(|(inc, _)| *inc == peer_incarnation)?;
                Some((p, old_rank))
            })
            .collect()
    }
}

/// Whether a bug is planted in the decision on this thread (never without `test-support`).
fn same_ranks_planted() -> bool {
    #[cfg(feature = "test-support")]
    return planted::same_ranks();
    #[cfg(not(feature = "test-support"))]
    false
}

/// Bugs a test plants on purpose in the carry decision, to show that the deterministic
/// simulation catches them (`test-support` only). Per thread: the simulation runs every
/// worker on one.
#[cfg(feature = "test-support")]
pub mod planted {
    use std::cell::Cell;

    thread_local! {
        static SAME_RANKS: Cell<bool> = const { Cell::new(false) };
    }

    /// Plants (or removes) a bug on this thread: a link is carried to the peer's new rank from
    /// the old link *at the same rank number*, as if ranks never moved, whoever held it.
    pub fn set_same_ranks(on: bool) {
        SAME_RANKS.with(|c| c.set(on));
    }

    /// Whether the same-ranks bug is planted on this thread.
    pub(super) fn same_ranks() -> bool {
        SAME_RANKS.with(Cell::get)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_proto::v1 as pb;

    /// A whole view of `ids` (worker id, incarnation) at ranks 0.., on hosts of their own.
    fn view(ids: &[(&str, u64)]) -> Members {
        let members = ids
            .iter()
            .enumerate()
            .map(|(r, (w, inc))| pb::Member {
                worker_id: (*w).into(),
                rank: r as u32,
                incarnation: *inc,
                host: format!("host-{w}"),
                addresses: vec![pb::TransportAddress { transport: "tcp".into(), address: "127.0.0.1:7000".into() }],
                ..Default::default()
            })
            .collect();
        let g = pb::Generation { number: 1, size: ids.len() as u32, members, ..Default::default() };
        Members::from_answer(&g).expect("a valid list").expect("whole")
    }

    #[test]
    fn a_survivor_is_carried_from_its_old_rank_to_its_new_one() {
        let old = PreviousView::of(3, 7, &view(&[("a", 1), ("b", 1), ("c", 1), ("d", 1)]));
        // "b" failed: the coordinator compacts, so "c" and "d" move down a rank.
        let new = view(&[("a", 1), ("c", 1), ("d", 1)]);
        assert_eq!(old.carry_into(4, &new, 7, [1, 2]), vec![(1, 2), (2, 3)]);
        assert_eq!(old.member_at(2), Some(("c", 1)));
    }

    #[test]
    fn a_restarted_peer_a_rejoined_worker_and_an_old_generation_carry_nothing() {
        let old = PreviousView::of(3, 7, &view(&[("a", 1), ("b", 1), ("c", 1)]));
        // "c" restarted (a new incarnation): its old link reached a process that is gone.
        let new = view(&[("a", 1), ("b", 1), ("c", 2)]);
        assert_eq!(old.carry_into(4, &new, 7, [1, 2]), vec![(1, 1)]);
        // This worker joined again: it is another process, with no links.
        assert!(old.carry_into(4, &new, 8, [1, 2]).is_empty());
        // Not a newer generation.
        assert!(old.carry_into(3, &new, 7, [1, 2]).is_empty());
    }

    #[test]
    fn a_peer_the_new_view_does_not_know_is_not_carried() {
        let old = PreviousView::of(3, 7, &view(&[("a", 1), ("b", 1), ("c", 1)]));
        let new = view(&[("a", 1), ("b", 1), ("c", 1)]);
        // Rank 5 is outside the new world; a planned rank without an entry is left alone.
        assert_eq!(old.carry_into(4, &new, 7, [1, 5]), vec![(1, 1)]);
    }
}
