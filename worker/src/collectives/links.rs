//! Which links a generation makes up front: the peers the schedules exchange with, so that a
//! large job's ranks hold O(log N + ranks per host) links instead of N - 1.
//!
//! A mesh set up with this plan ([`cohort_transports::tcp::Upfront::Only`]) links any other
//! peer when an operation first needs it (alltoall, send/recv, BCube on factors other than
//! two), so every collective works on it; the plan only decides what is ready at once.
//!
//! The plan, for rank `r` of `n` on a [`HostLayout`]:
//! - `r ± 2^j (mod n)` for every `2^j < n`: the dissemination barrier's partners, every
//!   binomial tree's (broadcast, reduce, gather and scatter from any root: a parent or child is
//!   always `2^j` away), the ring's neighbours (`j = 0`), and recursive doubling's (its fold
//!   is `p` away and its rounds `r XOR 2^j`, which is `r ± 2^j`);
//! - every rank on `r`'s host (the hierarchical schedule's phases within a host; these links
//!   are shared memory where the host has it);
//! - the hierarchical schedule's two cross-host ring neighbours.
//!
//! Every part is symmetric (if `r` lists `p`, `p` lists `r`), as a plan must be: the lower rank
//! of a planned pair waits at set-up for the higher one's dial.

use super::{hierarchical, recursive_doubling};
use crate::topology::HostLayout;

/// The peers rank `rank` links at set-up on `layout` (ascending, without `rank` itself).
pub fn upfront_links(rank: u32, layout: &HostLayout) -> Vec<u32> {
    let n = layout.world_size() as usize;
    let r = rank as usize;
    if r >= n {
        return Vec::new();
    }
    let mut peers = Vec::new();
    let mut dist = 1usize;
    while dist < n {
        peers.push((r + dist) % n);
        peers.push((r + n - dist) % n);
        dist <<= 1;
    }
    peers.extend(recursive_doubling::partners(r, n));
    let hosts = layout.hosts();
    if let Some(own) = hosts.get(layout.host_of(r)) {
        peers.extend(own.iter().copied());
    }
    if layout.is_hierarchical() {
        peers.extend(hierarchical::cross_host_partners(r, &hosts));
    }
    peers.sort_unstable();
    peers.dedup();
    peers.retain(|&p| p != r);
    peers.into_iter().map(|p| p as u32).collect()
}

/// The most links the plan makes for `rank`: `2 ceil(log2 n)` plus the ranks on its host (it
/// included). For a power of two `n` that is the issue's `2 log2(n) + ranks on the host`; for
/// other sizes the `± 2^j` partners can number up to two more than `2 log2(n)`.
pub fn upfront_bound(rank: u32, layout: &HostLayout) -> usize {
    let n = layout.world_size().max(1);
    let host = layout.hosts().get(layout.host_of(rank as usize)).map_or(1, Vec::len);
    2 * n.next_power_of_two().trailing_zeros() as usize + host
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layouts() -> Vec<HostLayout> {
        let mut out = Vec::new();
        for n in 1..=70u32 {
            out.push(HostLayout::flat(n));
            for per_host in [2, 3, 4, 8] {
                if n > per_host {
                    out.push(HostLayout::blocks(n, n.div_ceil(per_host)));
                }
            }
        }
        for n in [128, 1000, 1024, 4096] {
            out.push(HostLayout::flat(n));
            out.push(HostLayout::blocks(n, n / 8));
        }
        out.push(HostLayout::from_keys(&["a", "b", "a", "c", "b", "a", "c", "d"]));
        out
    }

    #[test]
    fn plans_are_symmetric() {
        for layout in layouts() {
            let n = layout.world_size();
            let plans: Vec<Vec<u32>> = (0..n).map(|r| upfront_links(r, &layout)).collect();
            for (r, plan) in plans.iter().enumerate() {
                for &p in plan {
                    assert!(plans[p as usize].contains(&(r as u32)), "{layout:?}: {r} lists {p} but not back");
                }
            }
        }
    }

    #[test]
    fn plans_cover_what_the_schedules_use() {
        for layout in layouts() {
            let n = layout.world_size() as usize;
            let hosts = layout.hosts();
            for r in 0..n {
                let plan = upfront_links(r as u32, &layout);
                let has = |p: usize| p == r || plan.contains(&(p as u32));
                assert!(has((r + 1) % n) && has((r + n - 1) % n), "ring neighbours of {r} in {layout:?}");
                for p in recursive_doubling::partners(r, n) {
                    assert!(has(p), "recursive doubling partner {p} of {r} in {layout:?}");
                }
                if layout.is_hierarchical() {
                    for p in hierarchical::cross_host_partners(r, &hosts) {
                        assert!(has(p), "hierarchical partner {p} of {r} in {layout:?}");
                    }
                }
                for p in &hosts[layout.host_of(r)] {
                    assert!(has(*p), "host peer {p} of {r}");
                }
            }
        }
    }

    #[test]
    fn links_per_rank_stay_within_two_log2_n_plus_the_host() {
        let mut layouts = layouts();
        layouts.push(HostLayout::flat(16_384));
        layouts.push(HostLayout::blocks(16_384, 2048));
        for layout in layouts {
            let n = layout.world_size();
            // Every rank of small worlds; a sample of large ones.
            let step = (n / 64).max(1);
            for r in (0..n).step_by(step as usize) {
                let count = upfront_links(r, &layout).len();
                let bound = upfront_bound(r, &layout);
                assert!(count <= bound, "rank {r} of {n}: {count} links over the bound {bound} ({layout:?})");
                if n.is_power_of_two() {
                    let host = layout.hosts()[layout.host_of(r as usize)].len();
                    let target = 2.0 * f64::from(n).log2() + host as f64;
                    assert!(count as f64 <= target, "rank {r} of {n}: {count} links over {target}");
                }
            }
        }
        // The figures the docs quote: 16,384 ranks, one per host and 8 per host.
        assert_eq!(upfront_links(5000, &HostLayout::flat(16_384)).len(), 27);
        assert_eq!(upfront_links(5000, &HostLayout::blocks(16_384, 2048)).len(), 31);
    }

    #[test]
    fn recursive_doubling_partners_are_powers_of_two_away() {
        // 6 ranks: 4 and 5 fold into 0 and 1; 0-3 run two rounds.
        assert_eq!(recursive_doubling::partners(0, 6), vec![1, 2, 4]);
        assert_eq!(recursive_doubling::partners(3, 6), vec![2, 1]);
        assert_eq!(recursive_doubling::partners(4, 6), vec![0]);
        assert_eq!(recursive_doubling::partners(5, 8), vec![4, 7, 1]);
        assert!(recursive_doubling::partners(0, 1).is_empty());
    }
}
