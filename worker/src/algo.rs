//! Allreduce algorithms and the automatic choice between them.

use crate::topology::HostLayout;
use std::fmt;
use std::str::FromStr;

/// On two ranks, messages below this many bytes go to recursive doubling under
/// [`Algorithm::Auto`], and to the ring at and above it. With two ranks both move the same
/// bytes over the one link (the ring in two rounds of half the vector, recursive doubling in
/// one round of all of it), and measured on loopback TCP neither wins consistently above
/// 64 KiB; the ring halves the reduction work per rank, so it keeps the large sizes.
pub const AUTO_RING_MIN_BYTES_TWO_RANKS: usize = 64 * 1024;

/// On three or more ranks, messages below this many bytes go to recursive doubling under
/// [`Algorithm::Auto`] (about log2(n) rounds of whole-vector exchanges), and to the ring at
/// and above it (2(n-1) rounds, each moving 1/n of the vector). The ring's extra rounds cost
/// more the more ranks there are: measured on loopback TCP (`docs/benchmarks-journal.md`,
/// "Choosing the algorithm") recursive doubling takes 0.4-0.75 of the ring's time up to
/// 128 KiB on 3 and 4 ranks, they tie at 256 KiB, and the ring wins from 512 KiB. The
/// latency-bandwidth model puts the crossover for 8-16 ranks at 9-12 times the bytes a link
/// moves in one round trip, the same order (256-384 KiB at 32 KiB per round trip).
pub const AUTO_RING_MIN_BYTES: usize = 256 * 1024;

/// On a world with several hosts of several ranks, messages of at least this many bytes go
/// to [`Algorithm::Hierarchical`] under [`Algorithm::Auto`].
pub const AUTO_HIERARCHICAL_MIN_BYTES: usize = AUTO_RING_MIN_BYTES;

/// How an allreduce is scheduled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// Ring reduce-scatter + ring allgather, segmented and pipelined (Gloo's ring-chunked):
    /// bandwidth optimal, 2(n-1) steps.
    Ring,
    /// BCube (Gloo's allreduce_bcube): ranks in groups by a factorisation of the world size;
    /// reduce-scatter within groups dimension by dimension, then allgather back.
    Bcube,
    /// Recursive doubling with the usual fold for non-powers of two: log2(n) exchanges of the
    /// whole vector; best for small messages.
    RecursiveDoubling,
    /// Two levels by host (see [`crate::topology::HostLayout`]): reduce-scatter within each
    /// host, allreduce of each rank's block across hosts, allgather within each host. On a
    /// layout without several hosts of several ranks it is a ring in host order.
    Hierarchical,
    /// Chosen per call by message size and world size (see [`Algorithm::resolve`]).
    #[default]
    Auto,
}

impl Algorithm {
    /// Every concrete algorithm (not `Auto`).
    pub const CONCRETE: [Algorithm; 4] =
        [Algorithm::Ring, Algorithm::Bcube, Algorithm::RecursiveDoubling, Algorithm::Hierarchical];

    /// Resolves `Auto` for a message of `bytes` bytes on `world_size` ranks: recursive
    /// doubling below [`AUTO_RING_MIN_BYTES_TWO_RANKS`] (two ranks) or
    /// [`AUTO_RING_MIN_BYTES`] (more), the ring at and above. Concrete algorithms are
    /// returned unchanged. The choice depends only on arguments every rank shares, so all
    /// ranks resolve alike.
    pub fn resolve(self, bytes: usize, world_size: u32) -> Algorithm {
        let ring_from = if world_size <= 2 { AUTO_RING_MIN_BYTES_TWO_RANKS } else { AUTO_RING_MIN_BYTES };
        match self {
            Algorithm::Auto if world_size > 1 && bytes < ring_from => Algorithm::RecursiveDoubling,
            Algorithm::Auto => Algorithm::Ring,
            other => other,
        }
    }

    /// Resolves `Auto` as [`Algorithm::resolve`] does, and to [`Algorithm::Hierarchical`] for
    /// messages of at least [`AUTO_HIERARCHICAL_MIN_BYTES`] on a `layout` with several hosts
    /// of several ranks. Every rank holds the same layout, so all ranks resolve alike.
    pub fn resolve_on(self, bytes: usize, layout: &HostLayout) -> Algorithm {
        match self {
            Algorithm::Auto if bytes >= AUTO_HIERARCHICAL_MIN_BYTES && layout.is_hierarchical() => {
                Algorithm::Hierarchical
            }
            other => other.resolve(bytes, layout.world_size()),
        }
    }

    /// Lower-case name (`ring`, `bcube`, `recursive-doubling`, `auto`).
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::Bcube => "bcube",
            Algorithm::RecursiveDoubling => "recursive-doubling",
            Algorithm::Hierarchical => "hierarchical",
            Algorithm::Auto => "auto",
        }
    }

    /// Stable numeric code used in call signatures.
    pub(crate) fn code(self) -> u8 {
        match self {
            Algorithm::Ring => 1,
            Algorithm::Bcube => 2,
            Algorithm::RecursiveDoubling => 3,
            Algorithm::Auto => 4,
            Algorithm::Hierarchical => 5,
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Error of [`Algorithm::from_str`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown algorithm {0:?} (expected ring, bcube, recursive-doubling, hierarchical or auto)")]
pub struct ParseAlgorithmError(pub String);

impl FromStr for Algorithm {
    type Err = ParseAlgorithmError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "ring" => Ok(Algorithm::Ring),
            "bcube" => Ok(Algorithm::Bcube),
            "recursive-doubling" | "rd" | "recursive_doubling" => Ok(Algorithm::RecursiveDoubling),
            "hierarchical" | "hier" => Ok(Algorithm::Hierarchical),
            "auto" => Ok(Algorithm::Auto),
            _ => Err(ParseAlgorithmError(s.to_owned())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_choice() {
        assert_eq!(Algorithm::Auto.resolve(4096, 8), Algorithm::RecursiveDoubling);
        assert_eq!(Algorithm::Auto.resolve(1 << 20, 8), Algorithm::Ring);
        assert_eq!(Algorithm::Auto.resolve(1 << 20, 2), Algorithm::Ring);
        assert_eq!(Algorithm::Auto.resolve(100, 2), Algorithm::RecursiveDoubling);
        // The threshold depends on the world: 128 KiB is a ring on 2 ranks, not on 4.
        assert_eq!(Algorithm::Auto.resolve(128 << 10, 2), Algorithm::Ring);
        assert_eq!(Algorithm::Auto.resolve(128 << 10, 4), Algorithm::RecursiveDoubling);
        assert_eq!(Algorithm::Auto.resolve(256 << 10, 3), Algorithm::Ring);
        assert_eq!(Algorithm::Auto.resolve(1 << 30, 1), Algorithm::Ring, "one rank: nothing to exchange");
        assert_eq!(Algorithm::Bcube.resolve(1, 8), Algorithm::Bcube);
        assert_eq!("rd".parse::<Algorithm>().unwrap(), Algorithm::RecursiveDoubling);
        assert_eq!("hierarchical".parse::<Algorithm>().unwrap(), Algorithm::Hierarchical);
    }

    #[test]
    fn auto_goes_hierarchical_only_on_several_hosts_of_several_ranks() {
        let two_by_two = HostLayout::blocks(4, 2);
        assert_eq!(Algorithm::Auto.resolve_on(1 << 20, &two_by_two), Algorithm::Hierarchical);
        assert_eq!(Algorithm::Auto.resolve_on(4096, &two_by_two), Algorithm::RecursiveDoubling);
        assert_eq!(Algorithm::Auto.resolve_on(1 << 20, &HostLayout::flat(4)), Algorithm::Ring);
        assert_eq!(Algorithm::Auto.resolve_on(1 << 20, &HostLayout::blocks(4, 1)), Algorithm::Ring);
        assert_eq!(Algorithm::Ring.resolve_on(1 << 20, &two_by_two), Algorithm::Ring);
    }
}
