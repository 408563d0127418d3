//! Which host each rank of a generation runs on: the layout the hierarchical allreduce
//! ([`crate::Algorithm::Hierarchical`]) follows.
//!
//! A "host" here is a set of ranks that share memory (the elastic runtime groups members by
//! the host identity in their shared-memory addresses, see
//! [`cohort_transports::shm::host_identity`]); a member without one is a host of its own.
//! Every member derives the layout from the same member records, so every member holds the
//! same layout; the call signature of a hierarchical allreduce carries its hash, so ranks that
//! disagree fail with a signature mismatch instead of waiting on each other.

use std::collections::HashMap;
use std::hash::Hash;

/// The host of every rank: `host_of[rank]` is a dense host index (0, 1, ... in the order of
/// each host's lowest rank).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct HostLayout {
    host_of: Vec<u32>,
}

impl HostLayout {
    /// Every rank a host of its own (what a communicator assumes until told otherwise).
    pub fn flat(world_size: u32) -> Self {
        Self { host_of: (0..world_size).collect() }
    }

    /// The layout of ranks whose hosts are named by `keys` (indexed by rank): ranks with
    /// equal keys share a host.
    pub fn from_keys<K: Eq + Hash>(keys: &[K]) -> Self {
        let mut index: HashMap<&K, u32> = HashMap::new();
        let host_of = keys
            .iter()
            .map(|k| {
                let next = index.len() as u32;
                *index.entry(k).or_insert(next)
            })
            .collect();
        Self { host_of }
    }

    /// `ranks` ranks on `hosts` hosts in contiguous blocks (the first `ranks % hosts` hosts
    /// get one rank more), as a launcher places them.
    pub fn blocks(ranks: u32, hosts: u32) -> Self {
        let hosts = hosts.clamp(1, ranks.max(1));
        let counts = crate::blocks::counts_for(ranks as usize, hosts);
        let host_of = counts.iter().enumerate().flat_map(|(h, &c)| std::iter::repeat_n(h as u32, c)).collect();
        Self { host_of }
    }

    /// Consecutive blocks of ranks, block `h` of `runs[h]` ranks on host `h` (the host runs
    /// of a sparse generation view).
    pub fn from_runs(runs: &[u32]) -> Self {
        let host_of = runs.iter().enumerate().flat_map(|(h, &c)| std::iter::repeat_n(h as u32, c as usize)).collect();
        Self { host_of }
    }

    /// The layout of the subgroup whose rank `i` is this layout's rank `ranks[i]` (a rank out
    /// of range counts as a host of its own).
    pub fn restrict(&self, ranks: &[u32]) -> Self {
        let keys: Vec<(bool, u32)> = ranks
            .iter()
            .map(|&r| match self.host_of.get(r as usize) {
                Some(&h) => (true, h),
                None => (false, r),
            })
            .collect();
        Self::from_keys(&keys)
    }

    /// Number of ranks.
    pub fn world_size(&self) -> u32 {
        self.host_of.len() as u32
    }

    /// The host index of `rank`.
    pub fn host_of(&self, rank: usize) -> usize {
        self.host_of[rank] as usize
    }

    /// The ranks of every host, ascending, hosts in order of their lowest rank.
    pub fn hosts(&self) -> Vec<Vec<usize>> {
        let mut hosts: Vec<Vec<usize>> = Vec::new();
        for (rank, &h) in self.host_of.iter().enumerate() {
            let h = h as usize;
            if hosts.len() <= h {
                hosts.resize_with(h + 1, Vec::new);
            }
            hosts[h].push(rank);
        }
        hosts
    }

    /// Whether a hierarchical schedule differs from a flat one here: more than one host, and
    /// some host with more than one rank.
    pub fn is_hierarchical(&self) -> bool {
        let hosts = self.hosts();
        hosts.len() > 1 && hosts.iter().any(|h| h.len() > 1)
    }

    /// A 64-bit FNV-1a hash of the layout, for call signatures.
    pub fn fingerprint(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &x in &self.host_of {
            for b in x.to_le_bytes() {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts() {
        let l = HostLayout::from_keys(&["b", "a", "b", "c", "a"]);
        assert_eq!(l.hosts(), vec![vec![0, 2], vec![1, 4], vec![3]]);
        assert_eq!(l.host_of(4), 1);
        assert!(l.is_hierarchical());
        assert!(!HostLayout::flat(4).is_hierarchical());
        assert!(!HostLayout::from_keys(&[1, 1, 1]).is_hierarchical(), "one host");
        assert_eq!(HostLayout::blocks(5, 2).hosts(), vec![vec![0, 1, 2], vec![3, 4]]);
        assert_eq!(HostLayout::blocks(2, 4).hosts(), vec![vec![0], vec![1]]);
        assert_eq!(HostLayout::from_runs(&[3, 2]), HostLayout::blocks(5, 2));
        assert_ne!(HostLayout::blocks(4, 2).fingerprint(), HostLayout::flat(4).fingerprint());
    }

    #[test]
    fn a_subgroup_keeps_its_members_hosts() {
        // Two hosts of two ranks: the replica groups {0, 2} and {1, 3} span both hosts, the
        // shard groups {0, 1} and {2, 3} sit on one each.
        let l = HostLayout::blocks(4, 2);
        assert_eq!(l.restrict(&[0, 2]).hosts(), vec![vec![0], vec![1]]);
        assert_eq!(l.restrict(&[3, 2]).hosts(), vec![vec![0, 1]]);
        let mixed = HostLayout::from_keys(&["a", "b", "a", "b", "c"]);
        assert_eq!(mixed.restrict(&[4, 0, 2, 3]).hosts(), vec![vec![0], vec![1, 2], vec![3]]);
        assert_eq!(mixed.restrict(&[9, 0]).hosts(), vec![vec![0], vec![1]], "out of range: a host of its own");
    }
}
