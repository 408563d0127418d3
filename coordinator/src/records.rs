//! The values stored under the keys of [`crate::keys`] (JSON), and [`JobState`], a job's
//! whole state decoded from one prefix read and kept current by applying watch events.

use crate::exclusion::FailureHistory;
use crate::keys::{self, Kind, Parsed};
use crate::store::{KeyValue, WatchEvent};
use cohort_proto::v1 as pb;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The wall clock the coordinator reads, when not the system's: see [`set_wall_clock`].
static WALL_CLOCK: std::sync::OnceLock<fn() -> u64> = std::sync::OnceLock::new();

/// Replaces, for this whole process, the wall clock behind [`now_ms`] with `clock`
/// (milliseconds since the Unix epoch). The deterministic simulation (`sim/`) sets it to the
/// simulated clock; nothing else should. Returns `false` (and changes nothing) when a clock
/// was already set.
pub fn set_wall_clock(clock: fn() -> u64) -> bool {
    WALL_CLOCK.set(clock).is_ok()
}

/// Milliseconds since the Unix epoch, now (the system clock unless [`set_wall_clock`]
/// replaced it).
pub fn now_ms() -> u64 {
    if let Some(clock) = WALL_CLOCK.get() {
        return clock();
    }
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Encodes a record.
pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Serialising these plain structs to JSON cannot fail (no maps with non-string keys,
    // no custom serialisers); an empty value would be refused on decode.
    serde_json::to_vec(value).unwrap_or_default()
}

/// Decodes a record; `None` (and a warning) for a value this version cannot read.
pub fn decode<T: for<'de> Deserialize<'de>>(key: &str, value: &[u8]) -> Option<T> {
    match serde_json::from_slice(value) {
        Ok(v) => Some(v),
        Err(e) => {
            tracing::warn!(%key, error = %e, "ignoring an undecodable store value");
            None
        }
    }
}

/// One data-plane address.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Address {
    /// `tcp` or `rdma`.
    pub transport: String,
    /// The transport's address.
    pub address: String,
}

impl From<&pb::TransportAddress> for Address {
    fn from(a: &pb::TransportAddress) -> Self {
        Self { transport: a.transport.clone(), address: a.address.clone() }
    }
}

impl From<&Address> for pb::TransportAddress {
    fn from(a: &Address) -> Self {
        Self { transport: a.transport.clone(), address: a.address.clone() }
    }
}

/// `members/<worker>`: one live incarnation of a worker, on its lease: the member's own (whose
/// id is the incarnation) or, under [`crate::config::LeaseScope::Host`], its host's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    /// The worker id.
    pub worker_id: String,
    /// The incarnation: the store lease id of a member on a lease of its own; a number unique
    /// to this incarnation of the worker id on a host's lease (see [`MemberRecord::lease`]).
    pub incarnation: u64,
    /// Host name for humans.
    pub host: String,
    /// Data-plane addresses.
    pub addresses: Vec<Address>,
    /// Capabilities.
    pub capabilities: Vec<String>,
    /// Join time, ms since the epoch.
    pub joined_at_ms: u64,
    /// Failure domain as published (empty: the host; see [`effective_domain`]).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub domain: String,
    /// The host's lease the member's records are on; 0 (absent): the member's own lease, whose
    /// id is the incarnation.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub host_lease: i64,
}

fn is_zero(v: &i64) -> bool {
    *v == 0
}

impl MemberRecord {
    /// The store lease the member's records are on: its host's, or its own (the incarnation).
    pub fn lease(&self) -> crate::store::LeaseId {
        if self.host_lease != 0 {
            self.host_lease
        } else {
            self.incarnation as crate::store::LeaseId
        }
    }

    /// Whether the member's lease is its own (revoking it ends only this member's records).
    pub fn owns_lease(&self) -> bool {
        self.host_lease == 0
    }
}

/// `waiting/<worker>`: the member waits for a generation newer than `after_generation`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaitingRecord {
    /// The incarnation that waits.
    pub incarnation: u64,
    /// It wants a generation newer than this.
    pub after_generation: u64,
    /// Arrival time, ms since the epoch (kept across re-polls: it orders joiners).
    pub since_ms: u64,
}

/// `progress/<worker>`: what the member last said it was doing.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProgressRecord {
    /// The incarnation this describes.
    pub incarnation: u64,
    /// Last heartbeat, ms since the epoch.
    pub last_heartbeat_ms: u64,
    /// The generation the member is in.
    pub generation: u64,
    /// Its step.
    pub step: u64,
    /// Its activity (e.g. `allreduce`, `rendezvous`).
    pub activity: String,
    /// The no-progress deadline in force on its links, in brief (empty: not said).
    #[serde(default)]
    pub deadlines: String,
    /// Step of its last commit.
    pub last_commit_step: u64,
    /// Generation of its last commit.
    pub last_commit_generation: u64,
    /// Hex digest of its last commit.
    pub last_commit_digest: String,
    /// Time of its last commit, ms since the epoch (0: none).
    pub last_commit_ms: u64,
    /// Its last reported step timing (`None`: none yet).
    #[serde(default)]
    pub timing: Option<crate::stragglers::Timing>,
    /// Its standing as a straggler (kept by the replica that serves its heartbeats).
    #[serde(default)]
    pub straggler: crate::stragglers::Standing,
    /// What was done about it while named (`reported`, `excluded until ...`, or why not).
    #[serde(default)]
    pub straggler_action: String,
    /// The end of its exclusion as a straggler, once excluded (it is asked to leave).
    #[serde(default)]
    pub straggler_excluded_until_ms: Option<u64>,
}

impl ProgressRecord {
    /// The straggler verdict `status` and the event stream show (`None`: not named).
    pub fn straggler_verdict(&self) -> Option<cohort_proto::v1::StragglerVerdict> {
        let since_ms = self.straggler.named_since_ms?;
        let finding = self.straggler.last.as_ref()?;
        Some(cohort_proto::v1::StragglerVerdict {
            kind: finding.kind.name().into(),
            ratio: finding.ratio_pct as f64 / 100.0,
            reports: self.straggler.streak,
            reason: format!("{}; rule: {}", finding.reason, crate::stragglers::StragglerRule::default()),
            since_ms,
            action: self.straggler_action.clone(),
        })
    }
}

/// `control/<worker>`: the state of the member's control stream (its Watch), written by
/// the replica that serves the stream. Written `connected` when the stream opens; replaced
/// by `connected: false` when the client side goes away while the replica is not shutting
/// down (a compare-and-swap on the revision the replica wrote, so a stream reopened
/// meanwhile, on any replica, wins). A worker process that dies closes its connection at
/// once (the kernel sends FIN or RST), long before its lease lapses, so this is the
/// coordinator's fast, though not certain, sign of death: the rendezvous stops waiting for
/// such a member (see `crate::rendezvous`). A live worker whose connection broke reopens
/// its watch and is `connected` again.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControlRecord {
    /// The incarnation whose stream this describes.
    pub incarnation: u64,
    /// Whether the stream is open.
    pub connected: bool,
    /// When it opened or closed, ms since the epoch.
    pub since_ms: u64,
}

/// `timeouts/<worker>`: the member's latest timeout report, kept in the store so that every
/// replica reads a cascade whole, whichever replica each report reached (see
/// `crate::revocation::cascade_root`). On the member's lease; one per member, replaced by
/// its next report. Nothing else reads it: it decides no rendezvous.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimeoutRecord {
    /// The reporter's incarnation.
    pub incarnation: u64,
    /// The generation reported.
    pub generation: u64,
    /// The reporter's rank in it.
    pub reporter: u32,
    /// The rank it timed out waiting on.
    pub suspect: u32,
    /// How far the reporter got in the failed operation, `(op seq, messages received)`.
    pub progress: Option<(u32, u64)>,
}

/// One member of a generation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placed {
    /// The worker id.
    pub worker_id: String,
    /// Its incarnation.
    pub incarnation: u64,
    /// Host name.
    pub host: String,
    /// Data-plane addresses.
    pub addresses: Vec<Address>,
    /// Failure domain (never empty once placed: the host when none was published).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub domain: String,
}

impl Placed {
    /// Its failure domain: the published one, else the host.
    pub fn domain(&self) -> &str {
        effective_domain(&self.domain, &self.host)
    }
}

/// A worker's failure domain: `domain` if it published one, else its `host`.
pub fn effective_domain<'a>(domain: &'a str, host: &'a str) -> &'a str {
    if domain.is_empty() {
        host
    } else {
        domain
    }
}

/// The root cause of a revocation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cause {
    /// Rank of the failed member in the revoked generation, if known.
    pub rank: Option<u32>,
    /// Its worker id (empty if unknown).
    pub worker_id: String,
    /// Its host (empty if unknown).
    pub host: String,
    /// What happened.
    pub reason: String,
    /// Who reported it (`coordinator` for lease expiry).
    pub reported_by: String,
    /// Set when every rank of `rank`'s failure domain was lost at once: the domain.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub domain: String,
    /// With [`Cause::domain`]: every rank of the domain in the revoked generation.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lost_ranks: Vec<u32>,
}

impl Cause {
    /// A cause naming one member (no domain loss).
    pub fn member(rank: Option<u32>, worker_id: &str, host: &str, reason: String, reported_by: &str) -> Self {
        Self {
            rank,
            worker_id: worker_id.to_string(),
            host: host.to_string(),
            reason,
            reported_by: reported_by.to_string(),
            domain: String::new(),
            lost_ranks: Vec::new(),
        }
    }

    /// As the protocol carries it.
    pub fn to_proto(&self) -> pb::RootCause {
        pb::RootCause {
            rank: self.rank,
            worker_id: self.worker_id.clone(),
            host: self.host.clone(),
            reason: self.reason.clone(),
            reported_by: self.reported_by.clone(),
            domain: self.domain.clone(),
            lost_ranks: self.lost_ranks.clone(),
        }
    }
}

/// A member of the current generation that left it without failing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Departure {
    /// The worker id.
    pub worker_id: String,
    /// Its incarnation.
    pub incarnation: u64,
    /// `true`: it finished the work; `false`: a graceful leave.
    pub finished: bool,
}

/// A generation's departures by `(worker, incarnation)` ([`GenerationRecord::departures`]).
#[derive(Debug)]
pub struct Departures<'a>(std::collections::HashMap<(&'a str, u64), &'a Departure>);

impl Departures<'_> {
    /// Whether `(worker, incarnation)` left the generation without failing.
    pub fn get(&self, worker: &str, incarnation: u64) -> Option<&Departure> {
        self.0.get(&(worker, incarnation)).copied()
    }

    /// Whether it left.
    pub fn contains(&self, worker: &str, incarnation: u64) -> bool {
        self.0.contains_key(&(worker, incarnation))
    }
}

/// How many revocations of older generations the record remembers (for late reports).
pub const HISTORY: usize = 8;

/// One revoked generation's recovery: when it was formed, revoked, and replaced by the next
/// generation (the status page's failure timeline).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recovery {
    /// The revoked generation.
    pub generation: u64,
    /// Its size.
    pub size: u32,
    /// When it was formed, ms since the epoch.
    pub formed_at_ms: u64,
    /// When it was revoked (the coordinator revokes in the step that detects the failure),
    /// ms since the epoch.
    pub revoked_at_ms: u64,
    /// When the next generation was formed, ms since the epoch.
    pub reformed_at_ms: u64,
    /// The next generation's size.
    pub reformed_size: u32,
}

/// A generation whose members encode to more than this many bytes keeps them in shards
/// (see [`ShardSet`]); a smaller one keeps them inline, in the generation record itself.
pub const INLINE_MEMBERS_MAX_BYTES: usize = 256 * 1024;

/// A shard holds members until it reaches this many bytes (a member encodes to 5 KiB at
/// most, see `crate::validate`), so every shard stays far below etcd's 1.5 MiB request limit.
pub const SHARD_MAX_BYTES: usize = 512 * 1024;

/// Where a large generation's members are: shards `shards/<set>/<index>` (index
/// `0..count`), each a JSON array of [`Placed`] in rank order, written before the generation
/// record that names them. The set is named `<generation>-<nonce>`, unique per formation
/// attempt, so an attempt that loses the compare-and-swap on the generation key never
/// touches the winner's shards: publishing a generation stays one compare-and-swap of one
/// small record, whatever its size.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardSet {
    /// The set's name, `<generation>-<nonce>`.
    pub set: String,
    /// How many shards.
    pub count: u32,
    /// How many members in all.
    pub members: u32,
}

/// The shards of `members` under set `set`, or `None` when they fit inline (at most
/// [`INLINE_MEMBERS_MAX_BYTES`]). Members are packed in rank order, a shard closing once it
/// reaches [`SHARD_MAX_BYTES`].
pub fn shard_members(set: &str, members: &[Placed]) -> Option<(ShardSet, Vec<Vec<u8>>)> {
    let encoded: Vec<Vec<u8>> = members.iter().map(encode).collect();
    let total: usize = encoded.iter().map(|e| e.len() + 1).sum();
    if total <= INLINE_MEMBERS_MAX_BYTES {
        return None;
    }
    let mut shards = Vec::new();
    let mut shard = b"[".to_vec();
    for e in encoded {
        if shard.len() > 1 && shard.len() + e.len() + 1 > SHARD_MAX_BYTES {
            shard.push(b']');
            shards.push(std::mem::replace(&mut shard, b"[".to_vec()));
        }
        if shard.len() > 1 {
            shard.push(b',');
        }
        shard.extend_from_slice(&e);
    }
    shard.push(b']');
    shards.push(shard);
    let set = ShardSet { set: set.to_string(), count: shards.len() as u32, members: members.len() as u32 };
    Some((set, shards))
}

/// The members of shard set `set` from its decoded shards (index to members), in rank
/// order; `None` unless every shard is there and the count of members matches.
pub fn assemble(set: &ShardSet, shards: &BTreeMap<u32, Vec<Placed>>) -> Option<Vec<Placed>> {
    let mut members = Vec::with_capacity(set.members as usize);
    for index in 0..set.count {
        members.extend(shards.get(&index)?.iter().cloned());
    }
    (members.len() == set.members as usize).then_some(members)
}

/// Encodes a generation record for its key: without its members when they live in shards.
/// Such a record is a large job's, and its departures of members are written as ranks
/// ([`encode_departed_ranks`]): about 7 bytes each instead of about 70, so that a job of 65,536
/// members all of which left still fits etcd's request limit. Read back with
/// [`decode_generation`] and, once the members are known, [`restore_departures`].
pub fn encode_generation(g: &GenerationRecord) -> Vec<u8> {
    if g.shards.is_none() {
        return encode(g);
    }
    let (departed_ranks, unplaced) = encode_departed_ranks(&g.members, &g.departed);
    let record = GenerationRecord {
        number: g.number,
        members: Vec::new(),
        formed_at_ms: g.formed_at_ms,
        revoked: g.revoked.clone(),
        revoked_at_ms: g.revoked_at_ms,
        departed: unplaced,
        below_min_since_ms: g.below_min_since_ms,
        history: g.history.clone(),
        recoveries: g.recoveries.clone(),
        shards: g.shards.clone(),
    };
    encode(&GenerationHead { record, departed_ranks })
}

/// A sharded generation record as stored: the record without members, and its members'
/// departures as ranks.
#[derive(Serialize)]
struct GenerationHead {
    #[serde(flatten)]
    record: GenerationRecord,
    #[serde(skip_serializing_if = "String::is_empty")]
    departed_ranks: String,
}

/// The departures of a stored generation record written as ranks (read apart from the
/// record: an older coordinator's record has none).
#[derive(Deserialize)]
struct DepartedRanks {
    #[serde(default)]
    departed_ranks: String,
}

/// Decodes a generation record as stored: the record (members still to fill in when it names
/// shards) and its departures written as ranks, for [`restore_departures`]. `None` (logged) if
/// the value does not decode.
pub fn decode_generation(key: &str, value: &[u8]) -> Option<(GenerationRecord, String)> {
    let g = decode::<GenerationRecord>(key, value)?;
    let ranks = decode::<DepartedRanks>(key, value)?.departed_ranks;
    Some((g, ranks))
}

/// Adds the departures written as ranks (`ranks`, from [`decode_generation`]) to `g`, whose
/// members are known. `None` if they do not fit its members.
pub fn restore_departures(g: &mut GenerationRecord, ranks: &str) -> Option<()> {
    if ranks.is_empty() {
        return Some(());
    }
    let mut restored = Vec::new();
    for item in ranks.split(',') {
        let (span, finished) = match item.as_bytes().last()? {
            b'f' => (&item[..item.len() - 1], true),
            b'l' => (&item[..item.len() - 1], false),
            _ => return None,
        };
        let (first, last) = match span.split_once('-') {
            Some((a, b)) => (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?),
            None => {
                let r = span.parse::<usize>().ok()?;
                (r, r)
            }
        };
        if first > last || last >= g.members.len() {
            return None;
        }
        restored.extend(g.members[first..=last].iter().map(|m| Departure {
            worker_id: m.worker_id.clone(),
            incarnation: m.incarnation,
            finished,
        }));
    }
    restored.append(&mut g.departed);
    g.departed = restored;
    Some(())
}

/// The departures of members of `members` as ranks: runs of consecutive ranks that left alike,
/// `first-last` or `rank`, each followed by `f` (finished) or `l` (left), comma-separated, in
/// rank order. Departures of no member (none are recorded so) are answered apart, as records.
pub fn encode_departed_ranks(members: &[Placed], departed: &[Departure]) -> (String, Vec<Departure>) {
    if departed.is_empty() {
        return (String::new(), Vec::new());
    }
    let rank_of: std::collections::HashMap<(&str, u64), usize> =
        members.iter().enumerate().map(|(r, m)| ((m.worker_id.as_str(), m.incarnation), r)).collect();
    let mut ranks: Vec<(usize, bool)> = Vec::with_capacity(departed.len());
    let mut unplaced = Vec::new();
    for d in departed {
        match rank_of.get(&(d.worker_id.as_str(), d.incarnation)) {
            Some(&r) => ranks.push((r, d.finished)),
            None => unplaced.push(d.clone()),
        }
    }
    ranks.sort_unstable();
    ranks.dedup_by_key(|(r, _)| *r);
    let mut out = String::new();
    let mut i = 0;
    while i < ranks.len() {
        let (first, finished) = ranks[i];
        let mut last = first;
        while i + 1 < ranks.len() && ranks[i + 1] == (last + 1, finished) {
            i += 1;
            last += 1;
        }
        if !out.is_empty() {
            out.push(',');
        }
        if first == last {
            out.push_str(&first.to_string());
        } else {
            out.push_str(&format!("{first}-{last}"));
        }
        out.push(if finished { 'f' } else { 'l' });
        i += 1;
    }
    (out, unplaced)
}

/// `generation`: the job's newest generation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GenerationRecord {
    /// Generation number (1, 2, ...).
    pub number: u64,
    /// Members in rank order.
    pub members: Vec<Placed>,
    /// Formation time, ms since the epoch.
    pub formed_at_ms: u64,
    /// The root cause, once revoked.
    pub revoked: Option<Cause>,
    /// Revocation time, ms since the epoch.
    pub revoked_at_ms: Option<u64>,
    /// Members that left gracefully or finished.
    pub departed: Vec<Departure>,
    /// Since when the job has had fewer live workers than `min_workers` (elastic timeout).
    pub below_min_since_ms: Option<u64>,
    /// Root causes of the most recent older revoked generations, newest last.
    pub history: Vec<(u64, Cause)>,
    /// When the most recent older revoked generations were formed, revoked and replaced
    /// (at most [`HISTORY`], newest last): what each failure cost. Absent in records written
    /// before it existed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recoveries: Vec<Recovery>,
    /// Where the members are stored when not inline (a large generation); `members` is then
    /// filled in from the shards when the record is read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards: Option<ShardSet>,
}

impl GenerationRecord {
    /// The rank of `(worker, incarnation)`, if a member.
    pub fn rank_of(&self, worker: &str, incarnation: u64) -> Option<u32> {
        self.members.iter().position(|m| m.worker_id == worker && m.incarnation == incarnation).map(|r| r as u32)
    }

    /// Whether `(worker, incarnation)` left this generation without failing. A scan of the
    /// departures: for one lookup. A pass over the members asks [`Self::departures`].
    pub fn departed(&self, worker: &str, incarnation: u64) -> Option<&Departure> {
        self.departed.iter().find(|d| d.worker_id == worker && d.incarnation == incarnation)
    }

    /// The departures indexed, for a pass that asks about many members: at a large job's end
    /// nearly every member has departed, and [`Self::departed`] per member would be
    /// O(members x departures).
    pub fn departures(&self) -> Departures<'_> {
        Departures(self.departed.iter().map(|d| ((d.worker_id.as_str(), d.incarnation), d)).collect())
    }

    /// The root cause of revoked generation `number`, if remembered.
    pub fn cause_of(&self, number: u64) -> Option<&Cause> {
        if number == self.number {
            return self.revoked.as_ref();
        }
        self.history.iter().rev().find(|(n, _)| *n == number).map(|(_, c)| c)
    }

    /// As the protocol carries it: the whole member list, its size and digest
    /// ([`cohort_proto::members_digest`]). O(members).
    pub fn to_proto(&self) -> pb::Generation {
        let members: Vec<pb::Member> = self
            .members
            .iter()
            .enumerate()
            .map(|(rank, m)| pb::Member {
                rank: rank as u32,
                worker_id: m.worker_id.clone(),
                incarnation: m.incarnation,
                host: m.host.clone(),
                addresses: m.addresses.iter().map(Into::into).collect(),
                domain: m.domain().to_string(),
            })
            .collect();
        pb::Generation {
            number: self.number,
            size: members.len() as u32,
            members_digest: cohort_proto::members_digest(&members),
            members,
            formed_at_ms: self.formed_at_ms,
            rank: None,
            member: None,
            host_runs: Vec::new(),
        }
    }
}

/// How a job ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Every member finished.
    Finished,
    /// The job failed (below `min_workers` for longer than the elastic timeout).
    Failed,
}

/// `ended`: the job is over.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndedRecord {
    /// How.
    pub outcome: Outcome,
    /// Why, for humans.
    pub reason: String,
    /// When, ms since the epoch.
    pub ended_at_ms: u64,
}

impl EndedRecord {
    /// As the protocol carries it.
    pub fn to_proto(&self) -> pb::JobEnded {
        let outcome = match self.outcome {
            Outcome::Finished => pb::job_ended::Outcome::Finished,
            Outcome::Failed => pb::job_ended::Outcome::Failed,
        };
        pb::JobEnded { outcome: outcome as i32, reason: self.reason.clone() }
    }
}

/// Everything stored about one job, decoded.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JobState {
    /// The job id.
    pub job: String,
    /// The store revision this state reflects.
    pub revision: i64,
    /// Live members by worker id.
    pub members: BTreeMap<String, MemberRecord>,
    /// Waiting members by worker id.
    pub waiting: BTreeMap<String, WaitingRecord>,
    /// Progress by worker id.
    pub progress: BTreeMap<String, ProgressRecord>,
    /// Failure histories by worker id.
    pub failures: BTreeMap<String, FailureHistory>,
    /// Control-stream states by worker id.
    pub control: BTreeMap<String, ControlRecord>,
    /// The newest generation and its key's `mod_revision` (for CAS).
    pub generation: Option<(GenerationRecord, i64)>,
    /// The end record, once the job ended.
    pub ended: Option<EndedRecord>,
    /// Shards of large generations not yet assembled into a generation record, by set and
    /// index (a set's shards are written before the record naming it, and dropped from here
    /// once assembled).
    pub shards: BTreeMap<String, BTreeMap<u32, Vec<Placed>>>,
}

impl JobState {
    /// Decodes a job's keys (from a prefix read at `revision`).
    pub fn from_kvs(job: &str, kvs: &[KeyValue], revision: i64) -> Self {
        let mut state = JobState { job: job.to_string(), revision, ..Default::default() };
        // The generation record last: a prefix read lists it before its shards.
        let is_generation = |kv: &&KeyValue| matches!(keys::parse(&kv.key), Some(Parsed::Generation { .. }));
        for kv in kvs.iter().filter(|kv| !is_generation(kv)) {
            state.put(kv);
        }
        for kv in kvs.iter().filter(is_generation) {
            state.put(kv);
        }
        state.revision = revision;
        state
    }

    /// Applies the write (at `revision`) of `worker`'s progress record, already decoded: what
    /// [`JobState::apply`] does with that write.
    pub fn put_progress(&mut self, worker: &str, record: ProgressRecord, revision: i64) {
        match self.progress.get_mut(worker) {
            Some(held) => *held = record,
            None => {
                self.progress.insert(worker.to_string(), record);
            }
        }
        self.revision = self.revision.max(revision);
    }

    /// Applies one watch event.
    pub fn apply(&mut self, event: &WatchEvent) {
        match event {
            WatchEvent::Put(kv) => {
                self.put(kv);
                self.revision = self.revision.max(kv.mod_revision);
            }
            WatchEvent::Delete { key, revision } => {
                self.delete(key);
                self.revision = self.revision.max(*revision);
            }
        }
    }

    fn put(&mut self, kv: &KeyValue) {
        match keys::parse(&kv.key) {
            Some(Parsed::Worker { job, kind, worker }) if job == self.job => {
                let w = worker.to_string();
                match kind {
                    Kind::Member => match decode(&kv.key, &kv.value) {
                        Some(v) => {
                            self.members.insert(w, v);
                        }
                        None => {
                            self.members.remove(&w);
                        }
                    },
                    Kind::Waiting => match decode(&kv.key, &kv.value) {
                        Some(v) => {
                            self.waiting.insert(w, v);
                        }
                        None => {
                            self.waiting.remove(&w);
                        }
                    },
                    Kind::Progress => match decode(&kv.key, &kv.value) {
                        Some(v) => {
                            self.progress.insert(w, v);
                        }
                        None => {
                            self.progress.remove(&w);
                        }
                    },
                    Kind::Failures => match decode(&kv.key, &kv.value) {
                        Some(v) => {
                            self.failures.insert(w, v);
                        }
                        None => {
                            self.failures.remove(&w);
                        }
                    },
                    Kind::Control => match decode(&kv.key, &kv.value) {
                        Some(v) => {
                            self.control.insert(w, v);
                        }
                        None => {
                            self.control.remove(&w);
                        }
                    },
                    // Read only by failure reports, straight from the store; a host's lease
                    // record only by joins.
                    Kind::Timeout | Kind::Host => {}
                }
            }
            Some(Parsed::Generation { job }) if job == self.job => {
                let previous = self.generation.take();
                self.generation = decode_generation(&kv.key, &kv.value).and_then(|(mut g, ranks)| {
                    if let Some(set) = g.shards.clone() {
                        g.members = self.members_of(&set, previous)?;
                    }
                    restore_departures(&mut g, &ranks)?;
                    Some((g, kv.mod_revision))
                });
            }
            Some(Parsed::Shard { job, set, index }) if job == self.job => {
                if let Some(members) = decode::<Vec<Placed>>(&kv.key, &kv.value) {
                    self.shards.entry(set.to_string()).or_default().insert(index, members);
                }
            }
            Some(Parsed::Ended { job }) if job == self.job => {
                self.ended = decode(&kv.key, &kv.value);
            }
            _ => {}
        }
    }

    fn delete(&mut self, key: &str) {
        match keys::parse(key) {
            Some(Parsed::Worker { job, kind, worker }) if job == self.job => {
                match kind {
                    Kind::Member => self.members.remove(worker).map(|_| ()),
                    Kind::Waiting => self.waiting.remove(worker).map(|_| ()),
                    Kind::Progress => self.progress.remove(worker).map(|_| ()),
                    Kind::Failures => self.failures.remove(worker).map(|_| ()),
                    Kind::Control => self.control.remove(worker).map(|_| ()),
                    Kind::Timeout | Kind::Host => None,
                };
            }
            Some(Parsed::Generation { job }) if job == self.job => self.generation = None,
            Some(Parsed::Ended { job }) if job == self.job => self.ended = None,
            Some(Parsed::Shard { job, set, index }) if job == self.job => {
                if let Some(shards) = self.shards.get_mut(set) {
                    shards.remove(&index);
                    if shards.is_empty() {
                        self.shards.remove(set);
                    }
                }
            }
            _ => {}
        }
    }

    /// The members of a sharded generation record: the previous record's when it named the
    /// same set (a revocation or departure rewrites the record, not the members), else
    /// assembled from the shards (then dropped from [`JobState::shards`]). `None`, with a
    /// warning, when shards are missing.
    fn members_of(&mut self, set: &ShardSet, previous: Option<(GenerationRecord, i64)>) -> Option<Vec<Placed>> {
        if let Some((g, _)) = previous.filter(|(g, _)| g.shards.as_ref().is_some_and(|s| s.set == set.set)) {
            return Some(g.members);
        }
        let members = self.shards.get(&set.set).and_then(|shards| assemble(set, shards));
        match members {
            Some(m) => {
                self.shards.remove(&set.set);
                Some(m)
            }
            None => {
                tracing::warn!(job = %self.job, set = %set.set, "a generation record names shards that are not all there");
                None
            }
        }
    }

    /// The generation record, without its revision.
    pub fn current(&self) -> Option<&GenerationRecord> {
        self.generation.as_ref().map(|(g, _)| g)
    }

    /// The newest generation number (0 if none).
    pub fn current_number(&self) -> u64 {
        self.current().map(|g| g.number).unwrap_or(0)
    }

    /// Whether `(worker, incarnation)` is a live member.
    pub fn is_live(&self, worker: &str, incarnation: u64) -> bool {
        self.members.get(worker).is_some_and(|m| m.incarnation == incarnation)
    }

    /// Whether `(worker, incarnation)`'s control stream closed and was not reopened (see
    /// [`ControlRecord`]). `false` when nothing is known (no stream opened yet).
    pub fn is_disconnected(&self, worker: &str, incarnation: u64) -> bool {
        self.control.get(worker).is_some_and(|c| c.incarnation == incarnation && !c.connected)
    }

    /// Whether the job holds no state worth keeping (no keys at all).
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
            && self.waiting.is_empty()
            && self.progress.is_empty()
            && self.failures.is_empty()
            && self.control.is_empty()
            && self.generation.is_none()
            && self.ended.is_none()
            && self.shards.is_empty()
    }
}

/// Lower-case hex of bytes (commit digests).
pub fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(key: String, value: Vec<u8>, rev: i64) -> KeyValue {
        KeyValue { key, value, create_revision: rev, mod_revision: rev, lease: None }
    }

    fn placed(n: usize) -> Vec<Placed> {
        (0..n)
            .map(|i| Placed {
                worker_id: format!("w{i}"),
                incarnation: 1000 + i as u64,
                host: String::new(),
                addresses: vec![],
                domain: String::new(),
            })
            .collect()
    }

    fn sharded(members: Vec<Placed>, departed: Vec<Departure>) -> GenerationRecord {
        GenerationRecord {
            number: 3,
            members,
            formed_at_ms: 1,
            revoked: None,
            revoked_at_ms: None,
            departed,
            below_min_since_ms: None,
            history: vec![],
            recoveries: vec![],
            shards: Some(ShardSet { set: "3-x".into(), count: 1, members: 0 }),
        }
    }

    fn left(m: &Placed, finished: bool) -> Departure {
        Departure { worker_id: m.worker_id.clone(), incarnation: m.incarnation, finished }
    }

    #[test]
    fn departures_are_written_as_runs_of_ranks() {
        let members = placed(10);
        let departed = vec![
            left(&members[3], true),
            left(&members[0], true),
            left(&members[1], true),
            left(&members[2], true),
            left(&members[5], false),
            left(&members[6], true),
            Departure { worker_id: "stranger".into(), incarnation: 9, finished: false },
        ];
        let (ranks, unplaced) = encode_departed_ranks(&members, &departed);
        assert_eq!(ranks, "0-3f,5l,6f");
        assert_eq!(unplaced, vec![departed[6].clone()]);
        // Round trip through the stored form: the same departures (in rank order).
        let g = sharded(members.clone(), departed.clone());
        let bytes = encode_generation(&g);
        let (mut back, ranks) = decode_generation("k", &bytes).expect("decodes");
        assert!(back.members.is_empty() && back.departed == vec![departed[6].clone()]);
        back.members = members.clone();
        restore_departures(&mut back, &ranks).expect("fits");
        let mut want = departed.clone();
        want.sort_by_key(|d| g.rank_of(&d.worker_id, d.incarnation).unwrap_or(u32::MAX));
        assert_eq!(back.departed, want);
        // Nonsense is refused, not guessed at.
        for bad in ["10f", "2-1f", "3x", "f", "-1f", "1-f"] {
            let mut g = sharded(members.clone(), vec![]);
            assert!(restore_departures(&mut g, bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn a_job_of_65536_members_that_all_left_fits_one_request() {
        let members = placed(crate::config::MAX_WORKERS_LIMIT as usize);
        // The worst case for runs: every other member finished, the others left.
        let departed: Vec<Departure> = members.iter().enumerate().map(|(r, m)| left(m, r % 2 == 0)).collect();
        let inline = encode(&departed);
        assert!(inline.len() > 1536 * 1024, "as records they would not fit: {} bytes", inline.len());
        let bytes = encode_generation(&sharded(members.clone(), departed.clone()));
        assert!(bytes.len() < 1024 * 1024, "the stored record is {} bytes", bytes.len());
        let (mut back, ranks) = decode_generation("k", &bytes).expect("decodes");
        back.members = members.clone();
        restore_departures(&mut back, &ranks).expect("fits");
        assert_eq!(back.departed, departed);
        // A whole job finishing is one run.
        let finished: Vec<Departure> = members.iter().map(|m| left(m, true)).collect();
        assert_eq!(encode_departed_ranks(&members, &finished).0, "0-65535f");
    }

    #[test]
    fn state_follows_events() {
        let m = MemberRecord {
            worker_id: "w".into(),
            incarnation: 7,
            host: "h".into(),
            addresses: vec![],
            capabilities: vec![],
            joined_at_ms: 1,
            domain: String::new(),
            host_lease: 0,
        };
        let mk = keys::worker_key("j", Kind::Member, "w");
        let mut s = JobState::from_kvs("j", &[kv(mk.clone(), encode(&m), 3)], 3);
        assert!(s.is_live("w", 7));
        assert!(!s.is_live("w", 8));
        let g = GenerationRecord {
            number: 1,
            members: vec![],
            formed_at_ms: 0,
            revoked: None,
            revoked_at_ms: None,
            departed: vec![],
            below_min_since_ms: None,
            history: vec![],
            recoveries: vec![],
            shards: None,
        };
        s.apply(&WatchEvent::Put(kv(keys::generation("j"), encode(&g), 4)));
        assert_eq!(s.generation.as_ref().map(|(g, r)| (g.number, *r)), Some((1, 4)));
        s.apply(&WatchEvent::Delete { key: mk, revision: 5 });
        assert!(s.members.is_empty());
        assert_eq!(s.revision, 5);
        // Another job's keys and garbage are ignored.
        s.apply(&WatchEvent::Put(kv(keys::worker_key("k", Kind::Member, "x"), encode(&m), 6)));
        s.apply(&WatchEvent::Put(kv(keys::worker_key("j", Kind::Member, "y"), b"not json".to_vec(), 7)));
        assert!(s.members.is_empty());
    }

    #[test]
    fn hex_digest() {
        assert_eq!(hex(&[0, 0xab, 0x10]), "00ab10");
    }
}
