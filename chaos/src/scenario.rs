//! Scenarios as data: one TOML file each (`chaos/scenarios/*.toml`), with a seed.
//!
//! A scenario names a cluster (store, coordinators, workers, job settings), the job every
//! worker runs, and an ordered list of faults. Every random choice (which rank, which
//! step) is drawn from a generator seeded with the scenario's seed, so
//! `cohort-chaos run SCENARIO --seed S` replays a failed run's choices.
//!
//! ```toml
//! name = "kills"
//! seed = 7
//! workers = 4
//! steps = 200
//! size = "4M"
//! no_progress = "2s"        # ceiling of the learned no-progress deadlines
//! fixed_deadlines = false    # true: workers run with --fixed-deadlines
//!
//! [[fault]]
//! kind = "kill"          # see FaultKind
//! random_ranks = 1       # or: ranks = [0]
//! after_steps = 10       # verified steps after the previous fault settled
//! mid_allreduce = true   # strike while the (first) target is inside an allreduce
//! respawn = true         # start a replacement worker once the job has recovered
//! ```
//!
//! Durations are written `500ms`, `2s`, `1m`; sizes `4096`, `64K`, `4M`.

use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::Duration;

/// Errors reading or checking a scenario.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// The file could not be read.
    #[error("reading scenario {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The TOML did not parse or has unknown/mistyped fields.
    #[error("scenario {name}: {message}")]
    Parse {
        /// File or scenario name.
        name: String,
        /// The parser's message.
        message: String,
    },
    /// The values parse but cannot work together.
    #[error("scenario {name}: {message}")]
    Invalid {
        /// Scenario name.
        name: String,
        /// What is wrong.
        message: String,
    },
}

/// Which store the coordinators use (`store = "memory"` or `"etcd"`): the coordinator's own
/// type, which says whether replicas can share it.
pub use cohort_coordinator::store::StoreKind;

/// How the job must end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Expect {
    /// Every worker that was not killed or did not leave finishes all steps and exits 0.
    #[default]
    Finish,
    /// The job fails (below `min_workers`): every remaining worker exits non-zero with a
    /// fatal error that gives the reason.
    Fail,
}

/// Where the cluster's processes live on the network.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum NetworkChoice {
    /// Everything on the loopback; link faults go through the fault-injecting proxy.
    #[default]
    Loopback,
    /// Every worker on a host of its own (a network namespace with its own address);
    /// blackhole and partition cut routes, isolate pulls a host's cable. Needs root; the
    /// memory store; no proxy faults (reset, latency, bandwidth).
    Netns,
}

/// The kinds of fault.
///
/// Every place that treats kinds differently matches on this enum without a catch-all arm
/// (the runner's injection, settling and per-fault checks), so a new kind does not compile
/// until each of them says what it does with it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, Hash, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// SIGKILL of the target ranks (all at once). (The default only so that a
    /// [`crate::report::FaultRecord`] can be built field by field.)
    #[default]
    Kill,
    /// SIGSTOP of the target ranks, SIGCONT after `duration` (a hung rank that comes back).
    Stop,
    /// SIGTERM of the target ranks: a graceful leave at the next commit point.
    Term,
    /// CPU starvation: SIGSTOP for `stop_for`, SIGCONT for `run_for`, repeated for `duration`.
    Slow,
    /// A straggler: the same duty cycle as `slow` on a rank that computes (scenario
    /// `compute`), which the coordinator must name within `name_within_steps` steps, and
    /// under the job's `straggler_policy = "exclude"` make leave at a commit point (no
    /// collective fails) and take back after its cool-down.
    Straggler,
    /// `count` new workers started at once.
    JoinStorm,
    /// SIGKILL of the coordinator replica holding the leader key; restarted after `duration`.
    CoordinatorLeaderKill,
    /// SIGKILL of every coordinator replica; all restarted after `duration`.
    CoordinatorsDown,
    /// SIGKILL of etcd; restarted (same data) after `duration`.
    EtcdRestart,
    /// Packets between the targets and `peers` vanish both ways (no RST) until healed.
    Blackhole,
    /// Every connection between the targets and `peers` is reset (RST).
    Reset,
    /// `latency` added to every chunk between the targets and `peers`, for `duration`.
    Latency,
    /// Traffic between the targets and `peers` capped at `bandwidth` bytes/s, for `duration`.
    Bandwidth,
    /// Packets from the targets to `peers` vanish (one way only) until healed.
    Partition,
    /// The targets' hosts are cut off the network: every packet to and from them vanishes,
    /// heartbeats included, until the survivors have re-formed (or `duration`); then they
    /// are plugged back and must rejoin. Needs `network = "netns"`.
    Isolate,
}

impl FaultKind {
    /// Whether the fault is expected to revoke the generation (survivors get errors and the
    /// job re-forms).
    pub fn disruptive(self) -> bool {
        matches!(self, Self::Kill | Self::Stop | Self::Blackhole | Self::Reset | Self::Partition | Self::Isolate)
    }

    /// Whether the job must go on undisturbed through it (no collective fails): its
    /// measurement is the job's step rate while it lasts.
    pub fn quiet(self) -> bool {
        matches!(
            self,
            Self::Slow
                | Self::Straggler
                | Self::Latency
                | Self::Bandwidth
                | Self::CoordinatorLeaderKill
                | Self::CoordinatorsDown
                | Self::EtcdRestart
        )
    }

    /// The kind named `name` (as in scenarios and reports).
    pub fn from_name(name: &str) -> Option<Self> {
        serde_json::from_value(serde_json::Value::String(name.to_string())).ok()
    }

    /// Whether it acts on data-plane links (needs the proxy).
    pub fn link(self) -> bool {
        matches!(self, Self::Blackhole | Self::Reset | Self::Latency | Self::Bandwidth | Self::Partition)
    }

    /// Whether it acts on the control plane (needs the etcd store).
    pub fn control_plane(self) -> bool {
        matches!(self, Self::CoordinatorLeaderKill | Self::CoordinatorsDown | Self::EtcdRestart)
    }

    /// The name used in scenarios and reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Kill => "kill",
            Self::Stop => "stop",
            Self::Term => "term",
            Self::Slow => "slow",
            Self::Straggler => "straggler",
            Self::JoinStorm => "join_storm",
            Self::CoordinatorLeaderKill => "coordinator_leader_kill",
            Self::CoordinatorsDown => "coordinators_down",
            Self::EtcdRestart => "etcd_restart",
            Self::Blackhole => "blackhole",
            Self::Reset => "reset",
            Self::Latency => "latency",
            Self::Bandwidth => "bandwidth",
            Self::Partition => "partition",
            Self::Isolate => "isolate",
        }
    }
}

/// A duration written as text (`500ms`, `2s`, `1m`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Dur(pub Duration);

impl Serialize for Dur {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{}ms", self.0.as_millis()))
    }
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        parse_duration(&text).map(Dur).map_err(serde::de::Error::custom)
    }
}

/// Parses `500ms`, `2s`, `1m`, `250us` (a bare number is milliseconds).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let n: u64 = number.parse().map_err(|_| format!("{text:?} is not a duration (like 500ms, 2s, 1m)"))?;
    match unit.trim() {
        "us" => Ok(Duration::from_micros(n)),
        "" | "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        "m" | "min" => Ok(Duration::from_secs(n.saturating_mul(60))),
        u => Err(format!("{text:?}: unknown unit {u:?} (use us, ms, s or m)")),
    }
}

/// Parses a byte count with an optional K/M/G suffix (powers of 1024).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let n: u64 = number.parse().map_err(|_| format!("{text:?} is not a size (like 4096, 64K, 4M)"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" | "k" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        u => return Err(format!("{text:?}: unknown unit {u:?} (use K, M or G)")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("{text:?} is too large"))
}

fn d(ms: u64) -> Dur {
    Dur(Duration::from_millis(ms))
}
fn default_workers() -> u32 {
    4
}
fn default_steps() -> u64 {
    200
}
fn default_size() -> String {
    "1M".into()
}
fn default_step_interval() -> Dur {
    d(10)
}
fn default_no_progress() -> Dur {
    d(2000)
}
fn default_min() -> u32 {
    2
}
fn default_max() -> u32 {
    8
}
fn default_join_window() -> Dur {
    d(300)
}
fn default_heartbeat() -> Dur {
    d(200)
}
fn default_lease() -> Dur {
    d(2000)
}
fn default_elastic() -> Dur {
    d(10_000)
}
fn default_timeout() -> Dur {
    d(180_000)
}
fn default_one() -> u32 {
    1
}
fn default_true() -> bool {
    true
}
fn default_settle() -> Dur {
    d(30_000)
}

/// One scenario file.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Name (defaults to the file stem).
    #[serde(default)]
    pub name: String,
    /// What it exercises.
    #[serde(default)]
    pub description: String,
    /// Seed of every random choice (`--seed` overrides it).
    #[serde(default)]
    pub seed: u64,
    /// Part of `suite --quick`.
    #[serde(default)]
    pub quick: bool,
    /// Coordinator store.
    #[serde(default)]
    pub store: StoreKind,
    /// Coordinator replicas (etcd store only; memory runs one).
    #[serde(default = "default_one")]
    pub coordinators: u32,
    /// Initial workers.
    #[serde(default = "default_workers")]
    pub workers: u32,
    /// Total steps of the job.
    #[serde(default = "default_steps")]
    pub steps: u64,
    /// Gradient bytes per step (`4M`).
    #[serde(default = "default_size")]
    pub size: String,
    /// Pause between steps.
    #[serde(default = "default_step_interval")]
    pub step_interval: Dur,
    /// Data-plane no-progress deadline of the workers (the ceiling of the learned ones).
    #[serde(default = "default_no_progress")]
    pub no_progress: Dur,
    /// Workers run with `--fixed-deadlines`: no learned deadlines, every stall waits the
    /// full `no_progress` (default false: learned).
    #[serde(default)]
    pub fixed_deadlines: bool,
    /// Smallest world.
    #[serde(default = "default_min")]
    pub min_workers: u32,
    /// Largest world.
    #[serde(default = "default_max")]
    pub max_workers: u32,
    /// Join window.
    #[serde(default = "default_join_window")]
    pub join_window: Dur,
    /// Heartbeat interval.
    #[serde(default = "default_heartbeat")]
    pub heartbeat_interval: Dur,
    /// Lease TTL.
    #[serde(default = "default_lease")]
    pub lease_ttl: Dur,
    /// How long a job below min_workers waits before failing.
    #[serde(default = "default_elastic")]
    pub elastic_timeout: Dur,
    /// CPU time each step burns (`cohort-worker train --compute`; 0: none).
    #[serde(default)]
    pub compute: Dur,
    /// The job's straggler policy (`report`, the default, or `exclude`).
    #[serde(default)]
    pub straggler_policy: Option<String>,
    /// How long an excluded straggler's join is refused (default: the coordinator's, 60 s).
    #[serde(default)]
    pub straggler_cooldown: Option<Dur>,
    /// Whose store lease a member's records are on: `member` (the default) or `host` (the
    /// coordinators' `--lease-scope`).
    #[serde(default)]
    pub lease_scope: Option<String>,
    /// The largest generation whose members get the whole member list (the coordinators'
    /// `--whole-answer-up-to`, default 256); larger ones run on sparse views.
    #[serde(default)]
    pub whole_answer_up_to: Option<u32>,
    /// Route every data-plane link through the fault-injecting proxy (implied by link faults
    /// on the loopback).
    #[serde(default)]
    pub proxy: bool,
    /// Loopback (default) or network namespaces ("hosts").
    #[serde(default)]
    pub network: NetworkChoice,
    /// With `network = "netns"`: workers per host (one namespace shared by this many worker
    /// processes, so that they share a host identity and link over shared memory, and reach
    /// the other hosts over TCP). Workers are placed by name, not rank: see
    /// [`crate::placement`]. Host faults (`isolate`) cut every worker of the target's host;
    /// route faults (`blackhole`, `partition`) cut the routes between the targets' hosts
    /// and the peers' hosts.
    #[serde(default = "default_one")]
    pub ranks_per_host: u32,
    /// With `network = "netns"` and one rank per host: hosts per node, as pods of one rank on
    /// a Kubernetes node (deploy/overlays/node-relays). The pods of a node each have a network
    /// namespace of their own, share a relay directory (`--relay-dir`, a fresh one per node)
    /// and name the node as their failure domain (`COHORT_DOMAIN`), so they share the node's
    /// heartbeat and event relays through its socket files. A new pod goes to the first node
    /// with room among the live ones. 1 (the default): no nodes, every host its own domain.
    #[serde(default = "default_one")]
    pub pods_per_node: u32,
    /// `cohort-worker train --transport` (auto, tcp, shm, rdma); `None`: the worker's default
    /// (auto), or tcp where the data plane goes through the proxy.
    #[serde(default)]
    pub transport: Option<String>,
    /// `cohort-worker train --algo` (an allreduce algorithm name the worker accepts).
    #[serde(default)]
    pub algorithm: Option<String>,
    /// `cohort-worker train --alltoall-every`: every this many steps an alltoall, checked by
    /// every rank (it links every pair); a finished job's workers must each have run one.
    #[serde(default)]
    pub alltoall_every: Option<u64>,
    /// Kill faults: every survivor's error must come within this bound of the SIGKILL.
    #[serde(default)]
    pub kill_errors_within: Option<Dur>,
    /// The workers' command line instead of `cohort-worker train` (placeholders: see
    /// [`crate::cluster::expand_command`]); the program must print train's events.
    #[serde(default)]
    pub worker_command: Option<Vec<String>>,
    /// How the job must end.
    #[serde(default)]
    pub expect: Expect,
    /// Bound on the whole run.
    #[serde(default = "default_timeout")]
    pub timeout: Dur,
    /// The fault list is played this many times in a row.
    #[serde(default = "default_one")]
    pub repeat: u32,
    /// The faults, in order.
    #[serde(default, rename = "fault")]
    pub faults: Vec<FaultSpec>,
}

/// One fault of a scenario.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    /// What to do.
    pub kind: FaultKind,
    /// Target ranks in the generation current at the fault.
    #[serde(default)]
    pub ranks: Vec<u32>,
    /// Instead of (or in addition to) `ranks`: this many distinct random ranks.
    #[serde(default)]
    pub random_ranks: u32,
    /// Link faults: the ranks on the other side (empty: every other rank).
    #[serde(default)]
    pub peers: Vec<u32>,
    /// Verified steps (of the job, any rank) after the previous fault settled, before this
    /// fault is armed.
    #[serde(default)]
    pub after_steps: u64,
    /// If set, the number of steps is drawn uniformly from `after_steps..=after_steps_max`.
    #[serde(default)]
    pub after_steps_max: Option<u64>,
    /// Strike while the first target is inside an allreduce (its `event=allreduce` seen).
    #[serde(default = "default_true")]
    pub mid_allreduce: bool,
    /// How long the fault lasts (stop, slow, latency, bandwidth, coordinators, etcd); for
    /// blackhole/partition, the longest it lasts (it is healed once the survivors saw it).
    #[serde(default)]
    pub duration: Option<Dur>,
    /// Slow: stopped part of each cycle.
    #[serde(default)]
    pub stop_for: Option<Dur>,
    /// Slow: running part of each cycle.
    #[serde(default)]
    pub run_for: Option<Dur>,
    /// Straggler: the coordinator must name the target within this many verified steps of
    /// the fault.
    #[serde(default)]
    pub name_within_steps: Option<u64>,
    /// Latency added per chunk.
    #[serde(default)]
    pub latency: Option<Dur>,
    /// Bandwidth cap (`10M` = 10 MiB/s).
    #[serde(default)]
    pub bandwidth: Option<String>,
    /// Join storm: how many workers.
    #[serde(default)]
    pub count: u32,
    /// Kill: start as many replacement workers once the job has recovered.
    #[serde(default)]
    pub respawn: bool,
    /// Kill, term or stop: the target is a worker serving its node's heartbeat relay (it
    /// holds the relay's lock in the node's relay directory), drawn at random among them,
    /// instead of `ranks`/`random_ranks`. Needs `pods_per_node` > 1.
    #[serde(default)]
    pub relay_server: bool,
    /// Route faults on hosts of several ranks (`ranks_per_host`): instead of every host of
    /// the `peers`, this many of them, drawn at random (0: all).
    #[serde(default)]
    pub random_peer_hosts: u32,
    /// Bound on waiting for the job to recover (or to progress) after the fault.
    #[serde(default = "default_settle")]
    pub settle: Dur,
}

impl Scenario {
    /// Reads and checks a scenario file; the name defaults to the file stem.
    pub fn load(path: &Path) -> Result<Self, ScenarioError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ScenarioError::Read { path: path.display().to_string(), source })?;
        let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "scenario".into());
        Self::parse(&stem, &text)
    }

    /// Parses and checks scenario text; `default_name` is used when it names none.
    pub fn parse(default_name: &str, text: &str) -> Result<Self, ScenarioError> {
        let mut s: Scenario = toml::from_str(text)
            .map_err(|e| ScenarioError::Parse { name: default_name.to_string(), message: e.to_string() })?;
        if s.name.is_empty() {
            s.name = default_name.to_string();
        }
        s.validate()?;
        Ok(s)
    }

    /// Whether the data plane must go through the proxy.
    pub fn needs_proxy(&self) -> bool {
        self.network == NetworkChoice::Loopback && (self.proxy || self.faults.iter().any(|f| f.kind.link()))
    }

    /// Gradient bytes per step.
    pub fn size_bytes(&self) -> u64 {
        parse_bytes(&self.size).unwrap_or(0)
    }

    /// Checks that the values can work together.
    pub fn validate(&self) -> Result<(), ScenarioError> {
        let bad = |message: String| Err(ScenarioError::Invalid { name: self.name.clone(), message });
        if self.name.is_empty() || !self.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
            return bad(format!("name {:?} must be non-empty ASCII letters, digits, - or _", self.name));
        }
        if let Err(e) = parse_bytes(&self.size) {
            return bad(format!("size: {e}"));
        }
        if self.size_bytes() < 4 || self.size_bytes() > 1 << 30 {
            return bad(format!("size {} must be between 4 bytes and 1G", self.size));
        }
        if self.workers == 0 || self.workers > 64 {
            return bad(format!("workers {} must be 1..=64", self.workers));
        }
        if self.min_workers == 0 || self.min_workers > self.max_workers {
            return bad(format!("min_workers {} must be 1..=max_workers {}", self.min_workers, self.max_workers));
        }
        if self.workers > self.max_workers {
            return bad(format!("workers {} exceed max_workers {}", self.workers, self.max_workers));
        }
        if self.steps == 0 {
            return bad("steps must be at least 1".into());
        }
        if self.no_progress.0 < Duration::from_millis(100) {
            return bad("no_progress must be at least 100ms".into());
        }
        if self.repeat == 0 || self.repeat > 1000 {
            return bad(format!("repeat {} must be 1..=1000", self.repeat));
        }
        if !self.store.shared_by_replicas() && self.coordinators != 1 {
            return bad(format!("the {} store runs exactly one coordinator", self.store));
        }
        if self.coordinators == 0 || self.coordinators > 5 {
            return bad(format!("coordinators {} must be 1..=5", self.coordinators));
        }
        if self.network == NetworkChoice::Netns && (self.store != StoreKind::Memory || self.proxy) {
            return bad("network = \"netns\" works with the memory store and without the proxy".into());
        }
        if self.ranks_per_host == 0 || self.ranks_per_host > 16 {
            return bad(format!("ranks_per_host {} must be 1..=16", self.ranks_per_host));
        }
        if self.ranks_per_host > 1 && self.network != NetworkChoice::Netns {
            return bad(
                "ranks_per_host needs network = \"netns\" (on the loopback every worker shares one host)".into()
            );
        }
        if self.pods_per_node == 0 || self.pods_per_node > 16 {
            return bad(format!("pods_per_node {} must be 1..=16", self.pods_per_node));
        }
        if self.pods_per_node > 1 && (self.network != NetworkChoice::Netns || self.ranks_per_host != 1) {
            return bad("pods_per_node needs network = \"netns\" and one rank per host (a pod of one rank)".into());
        }
        if let Some(t) = &self.transport {
            if !["auto", "tcp", "shm", "rdma"].contains(&t.as_str()) {
                return bad(format!("transport {t:?} must be auto, tcp, shm or rdma"));
            }
            if self.needs_proxy() && t != "tcp" {
                return bad(format!("transport {t:?}: the proxy carries TCP only (use tcp or leave it out)"));
            }
        }
        if let Some(a) = &self.algorithm {
            if let Err(e) = a.parse::<cohort::Algorithm>() {
                return bad(format!("algorithm: {e}"));
            }
        }
        if let Some(p) = &self.straggler_policy {
            if let Err(e) = cohort_coordinator::config::StragglerPolicy::parse(p) {
                return bad(e);
            }
        }
        if let Some(p) = &self.lease_scope {
            if let Err(e) = cohort_coordinator::config::LeaseScope::parse(p) {
                return bad(e);
            }
        }
        if self.worker_command.is_some() && (self.transport.is_some() || self.algorithm.is_some()) {
            return bad("transport and algorithm are cohort-worker train flags; put them in worker_command".into());
        }
        for (i, f) in self.faults.iter().enumerate() {
            let at = format!("fault {} ({})", i + 1, f.kind.name());
            if f.kind.control_plane() && !self.store.shared_by_replicas() {
                return bad(format!(
                    "{at}: needs a store the replicas share, such as store = \"etcd\" (the {} store loses its state with its coordinator)", self.store
                ));
            }
            let needs_targets = matches!(
                f.kind,
                FaultKind::Kill
                    | FaultKind::Stop
                    | FaultKind::Term
                    | FaultKind::Slow
                    | FaultKind::Straggler
                    | FaultKind::Blackhole
                    | FaultKind::Reset
                    | FaultKind::Latency
                    | FaultKind::Bandwidth
                    | FaultKind::Partition
                    | FaultKind::Isolate
            );
            let netns = self.network == NetworkChoice::Netns;
            if f.kind == FaultKind::Isolate && !netns {
                return bad(format!("{at}: needs network = \"netns\" (a host of its own to cut off)"));
            }
            if netns && matches!(f.kind, FaultKind::Reset | FaultKind::Latency | FaultKind::Bandwidth) {
                return bad(format!("{at}: needs the proxy, which network = \"netns\" does not use"));
            }
            if f.relay_server {
                if self.pods_per_node < 2 {
                    return bad(format!("{at}: relay_server needs pods_per_node > 1 (nodes sharing relays)"));
                }
                if !matches!(f.kind, FaultKind::Kill | FaultKind::Term | FaultKind::Stop) {
                    return bad(format!("{at}: relay_server targets kill, term and stop only"));
                }
                if !f.ranks.is_empty() || f.random_ranks > 0 {
                    return bad(format!("{at}: relay_server chooses the target; leave ranks and random_ranks out"));
                }
            }
            let targets = f.ranks.len() as u32 + f.random_ranks + u32::from(f.relay_server);
            if needs_targets && targets == 0 {
                return bad(format!("{at}: name its targets (ranks = [..] or random_ranks = N)"));
            }
            if targets > self.max_workers {
                return bad(format!("{at}: {targets} targets for at most {} workers", self.max_workers));
            }
            if f.random_peer_hosts > 0 && !(f.kind.link() && self.ranks_per_host > 1) {
                return bad(format!("{at}: random_peer_hosts is for blackhole and partition with ranks_per_host > 1"));
            }
            if let Some(max) = f.after_steps_max {
                if max < f.after_steps {
                    return bad(format!("{at}: after_steps_max {max} < after_steps {}", f.after_steps));
                }
            }
            match f.kind {
                FaultKind::Stop
                | FaultKind::CoordinatorsDown
                | FaultKind::EtcdRestart
                | FaultKind::Latency
                | FaultKind::Bandwidth
                    if f.duration.is_none() =>
                {
                    return bad(format!("{at}: needs a duration"));
                }
                FaultKind::Slow if f.duration.is_none() || f.stop_for.is_none() || f.run_for.is_none() => {
                    return bad(format!("{at}: needs duration, stop_for and run_for"));
                }
                FaultKind::Straggler
                    if f.duration.is_none()
                        || f.stop_for.is_none()
                        || f.run_for.is_none()
                        || f.name_within_steps.is_none() =>
                {
                    return bad(format!("{at}: needs duration, stop_for, run_for and name_within_steps"));
                }
                // A stop as long as the learned deadlines' floor would be a hang, not a
                // straggler: the duty cycle must stay well under it.
                FaultKind::Straggler if f.stop_for.is_some_and(|d| d.0 > Duration::from_millis(100)) => {
                    return bad(format!("{at}: stop_for must be at most 100ms (well under the 250 ms deadline floor)"));
                }
                FaultKind::Straggler if self.compute.0.is_zero() => {
                    return bad(format!("{at}: needs compute > 0 (a rank that computes, to slow down)"));
                }
                FaultKind::Latency if f.latency.is_none() => return bad(format!("{at}: needs latency")),
                FaultKind::Bandwidth => match f.bandwidth.as_deref().map(parse_bytes) {
                    Some(Ok(b)) if b >= 1024 => {}
                    Some(Ok(_)) => return bad(format!("{at}: bandwidth must be at least 1K (bytes/s)")),
                    Some(Err(e)) => return bad(format!("{at}: bandwidth: {e}")),
                    None => return bad(format!("{at}: needs bandwidth")),
                },
                FaultKind::JoinStorm if f.count == 0 => return bad(format!("{at}: needs count >= 1")),
                _ => {}
            }
            if let Some(Dur(t)) = f.duration {
                if t > Duration::from_secs(600) {
                    return bad(format!("{at}: duration over 10 minutes"));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_full_scenario_with_defaults() {
        let s = Scenario::parse(
            "x",
            r#"
            seed = 3
            workers = 4
            size = "4M"
            [[fault]]
            kind = "kill"
            random_ranks = 2
            after_steps = 5
            after_steps_max = 9
            respawn = true
            [[fault]]
            kind = "latency"
            ranks = [0]
            peers = [1]
            latency = "20ms"
            duration = "1s"
            "#,
        )
        .unwrap();
        assert_eq!(s.name, "x");
        assert_eq!(s.seed, 3);
        assert_eq!(s.size_bytes(), 4 << 20);
        assert_eq!(s.no_progress.0, Duration::from_secs(2));
        assert_eq!(s.faults.len(), 2);
        assert!(s.faults[0].mid_allreduce);
        assert_eq!(s.faults[1].latency, Some(Dur(Duration::from_millis(20))));
        assert!(s.needs_proxy());
    }

    #[test]
    fn rejects_bad_input_with_a_clear_message() {
        let unknown = Scenario::parse("x", "wrokers = 3").unwrap_err().to_string();
        assert!(unknown.contains("wrokers"), "{unknown}");
        let kind = Scenario::parse("x", "[[fault]]\nkind = \"explode\"").unwrap_err().to_string();
        assert!(kind.contains("explode"), "{kind}");
        let dur = Scenario::parse("x", "no_progress = \"2 parsecs\"").unwrap_err().to_string();
        assert!(dur.contains("unknown unit"), "{dur}");
        let targets = Scenario::parse("x", "[[fault]]\nkind = \"kill\"").unwrap_err().to_string();
        assert!(targets.contains("targets"), "{targets}");
        let etcd =
            Scenario::parse("x", "[[fault]]\nkind = \"etcd_restart\"\nduration = \"1s\"").unwrap_err().to_string();
        assert!(etcd.contains("etcd"), "{etcd}");
        let bw = Scenario::parse("x", "[[fault]]\nkind = \"bandwidth\"\nranks=[0]\nduration=\"1s\"\nbandwidth=\"1\"")
            .unwrap_err();
        assert!(bw.to_string().contains("at least 1K"), "{bw}");
        let isolate = Scenario::parse("x", "[[fault]]\nkind = \"isolate\"\nranks = [1]").unwrap_err().to_string();
        assert!(isolate.contains("netns"), "{isolate}");
        let proxied = Scenario::parse("x", "network = \"netns\"\n[[fault]]\nkind = \"reset\"\nranks = [1]")
            .unwrap_err()
            .to_string();
        assert!(proxied.contains("proxy"), "{proxied}");
        let etcd = Scenario::parse("x", "network = \"netns\"\nstore = \"etcd\"").unwrap_err().to_string();
        assert!(etcd.contains("memory store"), "{etcd}");
        let ok = Scenario::parse("x", "network = \"netns\"\n[[fault]]\nkind = \"isolate\"\nranks = [1]\n[[fault]]\nkind = \"partition\"\nranks = [0]\npeers = [1]").unwrap();
        assert!(!ok.needs_proxy(), "route faults need no proxy");
        let hosts = Scenario::parse("x", "ranks_per_host = 2").unwrap_err().to_string();
        assert!(hosts.contains("netns"), "{hosts}");
        let hosts = Scenario::parse("x", "network = \"netns\"\nranks_per_host = 0").unwrap_err().to_string();
        assert!(hosts.contains("1..=16"), "{hosts}");
        let shm =
            Scenario::parse("x", "network = \"netns\"\nranks_per_host = 2\ntransport = \"auto\"\nalgorithm = \"ring\"");
        assert_eq!(shm.expect("several ranks per host").ranks_per_host, 2);
        let nodes = Scenario::parse("x", "pods_per_node = 3").unwrap_err().to_string();
        assert!(nodes.contains("pods_per_node needs network"), "{nodes}");
        let nodes = Scenario::parse("x", "network = \"netns\"\nranks_per_host = 2\npods_per_node = 3");
        assert!(nodes.unwrap_err().to_string().contains("one rank per host"));
        let relay = "network = \"netns\"\n[[fault]]\nkind = \"kill\"\nrelay_server = true";
        let alone = Scenario::parse("x", relay).unwrap_err().to_string();
        assert!(alone.contains("relay_server needs pods_per_node"), "{alone}");
        let node_relays = Scenario::parse("x", &format!("pods_per_node = 3\n{relay}")).expect("a relay's server");
        assert!(node_relays.faults[0].relay_server && node_relays.pods_per_node == 3);
        let both = Scenario::parse("x", &format!("pods_per_node = 3\n{relay}\nranks = [1]")).unwrap_err().to_string();
        assert!(both.contains("leave ranks and random_ranks out"), "{both}");
        let isolate = "pods_per_node = 3\nnetwork = \"netns\"\n[[fault]]\nkind = \"isolate\"\nrelay_server = true";
        let isolate = Scenario::parse("x", isolate).unwrap_err().to_string();
        assert!(isolate.contains("kill, term and stop only"), "{isolate}");
        let peer_hosts = Scenario::parse(
            "x",
            "network = \"netns\"\n[[fault]]\nkind = \"blackhole\"\nranks = [0]\nrandom_peer_hosts = 1",
        )
        .unwrap_err()
        .to_string();
        assert!(peer_hosts.contains("ranks_per_host > 1"), "{peer_hosts}");
        let transport = Scenario::parse("x", "transport = \"carrier-pigeon\"").unwrap_err().to_string();
        assert!(transport.contains("auto, tcp, shm or rdma"), "{transport}");
        let proxied = Scenario::parse("x", "proxy = true\ntransport = \"shm\"").unwrap_err().to_string();
        assert!(proxied.contains("proxy carries TCP only"), "{proxied}");
        let algo = Scenario::parse("x", "algorithm = \"bogo\"").unwrap_err().to_string();
        assert!(algo.contains("bogo"), "{algo}");
        let custom = Scenario::parse("x", "worker_command = [\"x\"]\ntransport = \"tcp\"").unwrap_err().to_string();
        assert!(custom.contains("worker_command"), "{custom}");
        let straggler =
            "compute = \"10ms\"\n[[fault]]\nkind = \"straggler\"\nranks = [1]\nduration = \"2s\"\nrun_for = \"10ms\"";
        let missing = Scenario::parse("x", &format!("{straggler}\nstop_for = \"20ms\"")).unwrap_err().to_string();
        assert!(missing.contains("name_within_steps"), "{missing}");
        let long = Scenario::parse("x", &format!("{straggler}\nstop_for = \"300ms\"\nname_within_steps = 50"))
            .unwrap_err()
            .to_string();
        assert!(long.contains("250 ms deadline floor"), "{long}");
        let ok = format!("{straggler}\nstop_for = \"20ms\"\nname_within_steps = 50");
        assert!(Scenario::parse("x", &ok).is_ok());
        let idle = Scenario::parse("x", &ok.replace("compute = \"10ms\"", "")).unwrap_err().to_string();
        assert!(idle.contains("compute"), "{idle}");
        let policy = Scenario::parse("x", "straggler_policy = \"kill\"").unwrap_err().to_string();
        assert!(policy.contains("report"), "{policy}");
        assert!(Scenario::parse("x", "workers = 9").is_err());
        assert!(Scenario::parse("x", "min_workers = 0").is_err());
        assert!(Scenario::parse("x", "size = \"3\"").is_err());
        assert!(Scenario::parse("bad name", "").is_err());
    }

    #[test]
    fn durations_and_sizes() {
        assert_eq!(parse_duration("250us").unwrap(), Duration::from_micros(250));
        assert_eq!(parse_duration("7").unwrap(), Duration::from_millis(7));
        assert_eq!(parse_duration("1m").unwrap(), Duration::from_secs(60));
        assert!(parse_duration("").is_err());
        assert!(parse_duration("-1s").is_err());
        assert_eq!(parse_bytes("64K").unwrap(), 65536);
        assert!(parse_bytes("99999999999999G").is_err());
    }

    #[test]
    fn shipped_scenarios_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                Scenario::load(&path).unwrap_or_else(|e| panic!("{e}"));
                n += 1;
            }
        }
        assert!(n >= 5, "only {n} scenarios in {}", dir.display());
    }
}
