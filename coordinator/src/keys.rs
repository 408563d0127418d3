//! The store key layout. Every key of a job lives under `/cohort/v1/jobs/<job>/`:
//!
//! | key | lease ("the member's": its own, or its host's under `lease_scope = "host"`) | value ([`crate::records`], JSON) |
//! | --- | --- | --- |
//! | `members/<worker>` | the member's | host, addresses, incarnation, joined_at |
//! | `waiting/<worker>` | the member's | the generation it waits after, arrival time |
//! | `progress/<worker>` | the member's | last heartbeat, step, activity, last commit |
//! | `control/<worker>` | the member's | whether its control stream (Watch) is open |
//! | `timeouts/<worker>` | the member's | its latest timeout report (generation, ranks, progress) |
//! | `hosts/<host>` | the host's | the host's shared lease, under `lease_scope = "host"` ([`host_key`]) |
//! | `generation` | none | the current generation: number, ordered members (or, for a large generation, the name of its shard set), revocation |
//! | `shards/<set>/<index>` | none | one shard of a large generation's ordered members (see [`crate::records::ShardSet`]) |
//! | `failures/<worker>` | none | failure history for exclusion |
//! | `exclusions` | none | the time of the newest exclusion: every write that excludes a member rewrites it, so that a straggler exclusion, which compares it, sees every exclusion made since it counted them ([`exclusions`]) |
//! | `ended` | a lease of `--ended-ttl` (10 min) | outcome and reason (kept so late callers are told) |
//!
//! and `/cohort/v1/leader` holds the name of the leading replica, on that replica's lease.
//! A job's key-value store (the `StoreOp` RPC, torch's c10d store) lives apart, under
//! `/cohort/v1/kv/<job>/<scope>/<key>` ([`kv_key`]), no lease: it is deleted when the job ends.
//! Ids are validated (`[A-Za-z0-9._-]`), so they can never contain `/` and a job's prefix
//! never matches another job's keys.

/// Root of everything the coordinator stores.
pub const ROOT: &str = "/cohort/v1/";
/// Prefix of every job's keys.
pub const JOBS: &str = "/cohort/v1/jobs/";
/// The leader election key.
pub const LEADER: &str = "/cohort/v1/leader";

/// The kinds of per-worker keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// `members/<worker>`
    Member,
    /// `waiting/<worker>`
    Waiting,
    /// `progress/<worker>`
    Progress,
    /// `failures/<worker>`
    Failures,
    /// `control/<worker>`
    Control,
    /// `timeouts/<worker>`
    Timeout,
    /// `hosts/<host>`: not a worker's but a host's ([`host_key`]).
    Host,
}

impl Kind {
    fn dir(self) -> &'static str {
        match self {
            Kind::Member => "members/",
            Kind::Waiting => "waiting/",
            Kind::Progress => "progress/",
            Kind::Failures => "failures/",
            Kind::Control => "control/",
            Kind::Timeout => "timeouts/",
            Kind::Host => "hosts/",
        }
    }

    /// Every per-worker kind.
    pub const ALL: [Kind; 7] =
        [Kind::Member, Kind::Waiting, Kind::Progress, Kind::Failures, Kind::Control, Kind::Timeout, Kind::Host];
}

/// The key of a host's shared lease record in a job: `hosts/` and the host name with every
/// character outside `[A-Za-z0-9._-]` replaced by `_` (two names that differ only there share
/// a lease, which is harmless: the lease only keeps records; each member's silence is judged
/// on its own).
pub fn host_key(job: &str, host: &str) -> String {
    let safe: String =
        host.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') { c } else { '_' }).collect();
    worker_key(job, Kind::Host, &safe)
}

/// `/cohort/v1/jobs/<job>/`
pub fn job_prefix(job: &str) -> String {
    format!("{JOBS}{job}/")
}

/// A per-worker key of a job.
pub fn worker_key(job: &str, kind: Kind, worker: &str) -> String {
    format!("{JOBS}{job}/{}{worker}", kind.dir())
}

/// The prefix of one kind of per-worker key of a job.
pub fn kind_prefix(job: &str, kind: Kind) -> String {
    format!("{JOBS}{job}/{}", kind.dir())
}

/// The job's current generation record.
pub fn generation(job: &str) -> String {
    format!("{JOBS}{job}/generation")
}

/// Prefix of every shard of every generation of a job.
pub fn shards_prefix(job: &str) -> String {
    format!("{JOBS}{job}/shards/")
}

/// Prefix of the shards of one shard set (`<generation>-<nonce>`) of a job.
pub fn shard_set_prefix(job: &str, set: &str) -> String {
    format!("{JOBS}{job}/shards/{set}/")
}

/// One shard of a shard set: its index, zero-padded so that a prefix read returns the
/// shards in order.
pub fn shard(job: &str, set: &str, index: u32) -> String {
    format!("{JOBS}{job}/shards/{set}/{index:06}")
}

/// The job's exclusion guard: rewritten by every transaction that excludes a member (a
/// straggler's exclusion, or a failure that crosses the exclusion threshold), and compared by
/// a straggler's exclusion, which counts the exclusions in force against `min_workers`: two
/// replicas excluding two members at once cannot both pass the count, however large the
/// generation (one compare, where comparing every member's failure record would exceed
/// etcd's limit on a transaction's operations).
pub fn exclusions(job: &str) -> String {
    format!("{JOBS}{job}/exclusions")
}

/// The job's end record.
pub fn ended(job: &str) -> String {
    format!("{JOBS}{job}/ended")
}

/// Prefix of every job's key-value store (`StoreOp`, the c10d store): outside [`JOBS`], so
/// that the replicas following a job's keys never read the store's values.
pub const KV: &str = "/cohort/v1/kv/";

/// `/cohort/v1/kv/<job>/`: every key of a job's key-value store, in every scope. Deleted with
/// the job ([`crate::ops::end_job`]).
pub fn kv_prefix(job: &str) -> String {
    format!("{KV}{job}/")
}

/// `/cohort/v1/kv/<job>/<scope>/`: the keys of one scope (a scope never contains `/`, so two
/// scopes never share a prefix; the empty scope is `<job>//`).
pub fn kv_scope_prefix(job: &str, scope: &str) -> String {
    format!("{KV}{job}/{scope}/")
}

/// `/cohort/v1/kv/<job>/<scope>/<key>`: one key of a job's key-value store (the key is the
/// caller's, any UTF-8).
pub fn kv_key(job: &str, scope: &str, key: &str) -> String {
    format!("{KV}{job}/{scope}/{key}")
}

/// What a key under [`JOBS`] is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Parsed<'a> {
    /// A per-worker key.
    Worker {
        /// The job.
        job: &'a str,
        /// Which kind.
        kind: Kind,
        /// The worker id.
        worker: &'a str,
    },
    /// The generation record.
    Generation {
        /// The job.
        job: &'a str,
    },
    /// The end record.
    Ended {
        /// The job.
        job: &'a str,
    },
    /// One shard of a large generation's members.
    Shard {
        /// The job.
        job: &'a str,
        /// The shard set (`<generation>-<nonce>`).
        set: &'a str,
        /// The shard's index in the set.
        index: u32,
    },
}

/// Parses a key under [`JOBS`]; `None` for anything else.
pub fn parse(key: &str) -> Option<Parsed<'_>> {
    let rest = key.strip_prefix(JOBS)?;
    let (job, rest) = rest.split_once('/')?;
    if job.is_empty() {
        return None;
    }
    match rest {
        "generation" => return Some(Parsed::Generation { job }),
        "ended" => return Some(Parsed::Ended { job }),
        _ => {}
    }
    if let Some(shard) = rest.strip_prefix("shards/") {
        let (set, index) = shard.split_once('/')?;
        if set.is_empty() || index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        return Some(Parsed::Shard { job, set, index: index.parse().ok()? });
    }
    for kind in Kind::ALL {
        if let Some(worker) = rest.strip_prefix(kind.dir()) {
            if !worker.is_empty() && !worker.contains('/') {
                return Some(Parsed::Worker { job, kind, worker });
            }
        }
    }
    None
}

/// The job a key under [`JOBS`] belongs to.
pub fn job_of(key: &str) -> Option<&str> {
    let rest = key.strip_prefix(JOBS)?;
    rest.split_once('/').map(|(job, _)| job).filter(|j| !j.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let k = worker_key("j-1", Kind::Waiting, "w.2");
        assert_eq!(k, "/cohort/v1/jobs/j-1/waiting/w.2");
        assert_eq!(parse(&k), Some(Parsed::Worker { job: "j-1", kind: Kind::Waiting, worker: "w.2" }));
        assert_eq!(parse(&generation("j")), Some(Parsed::Generation { job: "j" }));
        assert_eq!(parse(&ended("j")), Some(Parsed::Ended { job: "j" }));
        let sk = shard("j", "7-ab", 12);
        assert_eq!(sk, "/cohort/v1/jobs/j/shards/7-ab/000012");
        assert_eq!(parse(&sk), Some(Parsed::Shard { job: "j", set: "7-ab", index: 12 }));
        assert!(sk.starts_with(&shard_set_prefix("j", "7-ab")) && sk.starts_with(&shards_prefix("j")));
        assert_eq!(parse("/cohort/v1/jobs/j/shards/7-ab/x1"), None);
        assert_eq!(parse("/cohort/v1/jobs/j/shards//1"), None);
        assert_eq!(parse("/cohort/v1/jobs/j/other"), None);
        assert_eq!(parse(LEADER), None);
        assert_eq!(job_of(&k), Some("j-1"));
        let hk = host_key("j", "node 7/a");
        assert_eq!(hk, "/cohort/v1/jobs/j/hosts/node_7_a");
        assert_eq!(parse(&hk), Some(Parsed::Worker { job: "j", kind: Kind::Host, worker: "node_7_a" }));
        assert!(k.starts_with(&job_prefix("j-1")));
        assert!(!k.starts_with(&job_prefix("j")));
    }
}
