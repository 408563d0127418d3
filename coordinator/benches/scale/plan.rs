//! What a run measures: the harness's command line.

use std::time::Duration;

/// Joins in flight at once, by default (`--join-concurrency`), over all farms.
pub(crate) const JOIN_CONCURRENCY: usize = 256;
/// Ranks per host, by default (hosts of 8, as GPU nodes have).
pub(crate) const RANKS_PER_HOST: usize = 8;
/// The coordinators' default heartbeat interval (`JobSettings::default`).
pub(crate) const DEFAULT_HEARTBEAT: Duration = Duration::from_millis(500);
/// Descriptors a farm may use for its members: under the 20,000 a process gets on a machine
/// that does not let it raise its hard limit, with room for the runtime's own.
const FARM_DESCRIPTORS: f64 = 15_000.0;

/// What to run.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    pub(crate) members: usize,
    pub(crate) stores: Vec<String>,
    pub(crate) replicas: usize,
    pub(crate) steady: Duration,
    pub(crate) bound: Duration,
    /// etcd's `--max-txn-ops` and the coordinators' `--etcd-max-txn-ops` (`None`: etcd's
    /// default, 128, and no flag).
    pub(crate) max_txn_ops: Option<u32>,
    /// Members per host: with more than one, they share the host's heartbeat and event relays.
    pub(crate) ranks_per_host: usize,
    /// The coordinators' `--lease-scope` (`member`, the default, or `host`: one store lease
    /// per host).
    pub(crate) lease_scope: String,
    /// Joins in flight at once.
    pub(crate) join_concurrency: usize,
    /// Members that share one coordinator client.
    pub(crate) members_per_connection: usize,
    /// The coordinators' `--whole-answer-up-to` (`None`: no flag, their default of 256).
    pub(crate) whole_answer_up_to: Option<u32>,
    /// The coordinators' `--heartbeat-interval` (`None`: no flag, their default of 500 ms),
    /// with a lease of six intervals.
    pub(crate) heartbeat: Option<Duration>,
    /// Processes the members are spread over (`--farms`; `None`: as many as their descriptors
    /// need, see [`Plan::farms`]).
    pub(crate) farms: Option<usize>,
}

impl Plan {
    /// Reads the command line (`--bench` picks the full run's defaults, without it the smoke run's).
    pub(crate) fn from_args() -> Result<Self, String> {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let full = args.iter().any(|a| a == "--bench");
        let mut plan = if full {
            Plan {
                members: 1024,
                stores: vec!["memory".into(), "etcd".into()],
                replicas: 2,
                steady: Duration::ZERO,
                bound: Duration::from_secs(300),
                max_txn_ops: None,
                ranks_per_host: RANKS_PER_HOST,
                lease_scope: "member".into(),
                join_concurrency: JOIN_CONCURRENCY,
                members_per_connection: 1,
                whole_answer_up_to: None,
                heartbeat: None,
                farms: None,
            }
        } else {
            Plan {
                members: 96,
                stores: vec!["memory".into()],
                replicas: 1,
                steady: Duration::from_secs(2),
                bound: Duration::from_secs(60),
                max_txn_ops: None,
                ranks_per_host: RANKS_PER_HOST,
                lease_scope: "member".into(),
                join_concurrency: JOIN_CONCURRENCY,
                members_per_connection: 1,
                // The smoke run's 96 members get sparse views, as a large job's do.
                whole_answer_up_to: Some(16),
                heartbeat: None,
                // Two farms: the smoke run crosses between processes as a large run does.
                farms: Some(2),
            }
        };
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let mut value = |name: &str| it.next().cloned().ok_or_else(|| format!("{name} needs a value"));
            match a.as_str() {
                "--members" => plan.members = value(a)?.parse().map_err(|e| format!("--members: {e}"))?,
                "--stores" => plan.stores = value(a)?.split(',').map(str::to_string).collect(),
                "--replicas" => plan.replicas = value(a)?.parse().map_err(|e| format!("--replicas: {e}"))?,
                "--steady-secs" => {
                    plan.steady = Duration::from_secs(value(a)?.parse().map_err(|e| format!("--steady-secs: {e}"))?)
                }
                "--bound-secs" => {
                    plan.bound = Duration::from_secs(value(a)?.parse().map_err(|e| format!("--bound-secs: {e}"))?)
                }
                "--ranks-per-host" => {
                    plan.ranks_per_host = value(a)?.parse().map_err(|e| format!("--ranks-per-host: {e}"))?;
                    if plan.ranks_per_host == 0 || plan.ranks_per_host > cohort_proto::MAX_BEATS_PER_CALL {
                        return Err("--ranks-per-host: 1 to 1024".into());
                    }
                }
                "--etcd-max-txn-ops" => {
                    plan.max_txn_ops = Some(value(a)?.parse().map_err(|e| format!("--etcd-max-txn-ops: {e}"))?)
                }
                "--join-concurrency" => {
                    plan.join_concurrency = value(a)?.parse().map_err(|e| format!("--join-concurrency: {e}"))?;
                    if plan.join_concurrency == 0 {
                        return Err("--join-concurrency: at least 1".into());
                    }
                }
                "--members-per-connection" => {
                    plan.members_per_connection =
                        value(a)?.parse().map_err(|e| format!("--members-per-connection: {e}"))?;
                    if plan.members_per_connection == 0 {
                        return Err("--members-per-connection: at least 1".into());
                    }
                }
                "--whole-answer-up-to" => {
                    plan.whole_answer_up_to = Some(value(a)?.parse().map_err(|e| format!("--whole-answer-up-to: {e}"))?)
                }
                "--heartbeat-ms" => {
                    let ms: u64 = value(a)?.parse().map_err(|e| format!("--heartbeat-ms: {e}"))?;
                    if !(50..=60_000).contains(&ms) {
                        return Err("--heartbeat-ms: 50 to 60000".into());
                    }
                    plan.heartbeat = Some(Duration::from_millis(ms));
                }
                "--farms" => {
                    let farms: usize = value(a)?.parse().map_err(|e| format!("--farms: {e}"))?;
                    if farms == 0 {
                        return Err("--farms: at least 1".into());
                    }
                    plan.farms = Some(farms);
                }
                "--lease-scope" => {
                    plan.lease_scope = value(a)?;
                    if !matches!(plan.lease_scope.as_str(), "member" | "host") {
                        return Err("--lease-scope: member or host".into());
                    }
                }
                _ => {}
            }
        }
        if plan.members < 4 {
            return Err("--members must be at least 4".into());
        }
        if plan.replicas == 0 {
            return Err("--replicas must be at least 1".into());
        }
        for s in &plan.stores {
            if s != "memory" && s != "etcd" {
                return Err(format!("unknown store {s:?}: memory or etcd"));
            }
        }
        Ok(plan)
    }

    /// The members' heartbeat interval.
    pub(crate) fn interval(&self) -> Duration {
        self.heartbeat.unwrap_or(DEFAULT_HEARTBEAT)
    }

    /// How many farm processes hold the members: `--farms`, or as many as keep each under
    /// [`FARM_DESCRIPTORS`]. A member holds its coordinator connection (or a share of one),
    /// and with relays both ends of its two relay connections (a host's members are in one
    /// farm); never more farms than hosts.
    pub(crate) fn farms(&self) -> usize {
        let hosts = self.members.div_ceil(self.ranks_per_host);
        let relays = if self.ranks_per_host > 1 { 4.0 } else { 0.0 };
        let per_member = 1.0 / self.members_per_connection as f64 + relays + 0.5;
        let needed = (self.members as f64 * per_member / FARM_DESCRIPTORS).ceil() as usize;
        self.farms.unwrap_or(needed).clamp(1, hosts)
    }

    /// The members of farm `farm` of `farms`: a range of indices, whole hosts only.
    pub(crate) fn farm_members(&self, farm: usize, farms: usize) -> std::ops::Range<usize> {
        let hosts = self.members.div_ceil(self.ranks_per_host);
        let at = |f: usize| (hosts * f / farms * self.ranks_per_host).min(self.members);
        at(farm)..at(farm + 1)
    }
}
