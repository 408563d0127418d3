//! Allreduce algorithms and the automatic choice between them.

use std::fmt;
use std::str::FromStr;

/// Messages below this many bytes are latency bound: [`Algorithm::Auto`] picks recursive
/// doubling for them (log2(n) rounds of whole-vector exchanges), and ring allreduce
/// (2(n-1) rounds, each moving 1/n of the data) at and above it. 64 KiB is where, on loopback
/// TCP with ~20-50 us per round trip and ~2 GB/s per stream, the ring's bandwidth advantage
/// starts to outweigh its extra rounds for the world sizes this targets (2-16).
pub const AUTO_RING_MIN_BYTES: usize = 64 * 1024;

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
    /// Chosen per call by message size (see [`AUTO_RING_MIN_BYTES`]).
    #[default]
    Auto,
}

impl Algorithm {
    /// Every concrete algorithm (not `Auto`).
    pub const CONCRETE: [Algorithm; 3] = [Algorithm::Ring, Algorithm::Bcube, Algorithm::RecursiveDoubling];

    /// Resolves `Auto` for a message of `bytes` bytes on `world_size` ranks; concrete
    /// algorithms are returned unchanged. The choice depends only on arguments every rank
    /// shares, so all ranks resolve alike.
    pub fn resolve(self, bytes: usize, world_size: u32) -> Algorithm {
        match self {
            Algorithm::Auto if world_size > 1 && bytes < AUTO_RING_MIN_BYTES => Algorithm::RecursiveDoubling,
            Algorithm::Auto => Algorithm::Ring,
            other => other,
        }
    }

    /// Lower-case name (`ring`, `bcube`, `recursive-doubling`, `auto`).
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::Bcube => "bcube",
            Algorithm::RecursiveDoubling => "recursive-doubling",
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
#[error("unknown algorithm {0:?} (expected ring, bcube, recursive-doubling or auto)")]
pub struct ParseAlgorithmError(pub String);

impl FromStr for Algorithm {
    type Err = ParseAlgorithmError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "ring" => Ok(Algorithm::Ring),
            "bcube" => Ok(Algorithm::Bcube),
            "recursive-doubling" | "rd" | "recursive_doubling" => Ok(Algorithm::RecursiveDoubling),
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
        assert_eq!(Algorithm::Bcube.resolve(1, 8), Algorithm::Bcube);
        assert_eq!("rd".parse::<Algorithm>().unwrap(), Algorithm::RecursiveDoubling);
    }
}
