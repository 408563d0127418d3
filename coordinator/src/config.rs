//! Job settings: built-in defaults, a TOML file with per-job overrides, and validation.
//!
//! The defaults and why they are what they are:
//! - `min_workers = 1`: a job can make progress with a single worker; jobs that need more
//!   say so.
//! - `max_workers = 64`: bounds one generation's mesh (every pair connects) unless raised.
//! - `join_window = 1 s`: long enough for a burst of workers started together (one pod
//!   scheduling wave) to land in one generation, short enough not to be felt at start-up.
//! - `heartbeat_interval = 500 ms` and `lease_ttl = 3 s`: six missed heartbeats before a
//!   silent member is declared dead, which rides out a GC pause or a short network hiccup
//!   but still catches a hung (SIGSTOP, partitioned) worker within seconds.
//! - `elastic_timeout = 60 s`: how long a job below `min_workers` waits for replacements
//!   (a rescheduled pod typically needs tens of seconds) before it fails with a clear error.
//! - `straggler_policy = "report"`: a straggler is named (status, metrics, logs), never acted
//!   on unless the job asks for `"exclude"` (see [`StragglerPolicy`]).
//! - `straggler_cooldown = 60 s`: how long an excluded straggler's join is refused; long
//!   enough that a job does not re-form every few seconds around a rank that stays slow.
//! - `lease_scope = "member"`: each member's records live on a store lease of its own, which
//!   every heartbeat renews; `"host"` puts a host's members on one lease (see [`LeaseScope`]),
//!   for jobs of thousands of ranks on etcd.
//! - `whole_answer_up_to = 256`: a worker asks for a sparse view of its generation (its
//!   partners, its host and the host layout); a generation of at most this many members is
//!   still answered whole (about 100 bytes a member: 25 KB to each of 256), above it sparsely, so
//!   that a formation moves O(N log N) bytes across the job instead of O(N^2). An RDMA mesh
//!   links every pair and needs the whole list: raise it for RDMA jobs larger than this.
//!
//! File format (every field optional):
//! ```toml
//! [defaults]
//! min_workers = 2
//! join_window_ms = 500
//!
//! [jobs.resnet-7]
//! max_workers = 8
//! elastic_timeout_ms = 120000
//! ```
//! Precedence, lowest first: built-in defaults, the file's `[defaults]`, command-line flags,
//! the file's `[jobs.<id>]` section for that job.

pub use crate::exclusion::ExclusionPolicy;
pub use crate::stragglers::StragglerPolicy;
use serde::Deserialize;
use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

/// Whose store lease a member's records are on.
///
/// Under `Member`, each member is granted a lease at its join, every heartbeat renews it and a
/// member whose heartbeats stop is gone when it lapses: one lease grant per member per
/// formation, one renewal per member per heartbeat. Under `Host`, the members of one host share
/// one lease (granted by the first of them to join; "host" is the failure domain the worker
/// names, else its host): any of their heartbeats renews it, at most
/// once per half heartbeat interval per replica, and it lapses when the whole host falls
/// silent, deleting its members' records at once. A member that stops heartbeating while its
/// host-mates go on is found by the leader's sweep (`coordinator/src/sweep.rs`): its progress
/// record unchanged for the lease TTL and the record's period, its records are deleted, which
/// is a lapse to every other rule. Etcd's lease work falls by the ranks per host (8 on a common GPU node).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LeaseScope {
    /// A lease per member (the default).
    #[default]
    Member,
    /// A lease per host of the job.
    Host,
}

impl LeaseScope {
    /// `member` or `host`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Member => "member",
            Self::Host => "host",
        }
    }

    /// Parses `member` or `host` (an empty string is the default, `member`).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "" | "member" => Ok(Self::Member),
            "host" => Ok(Self::Host),
            other => Err(format!("lease_scope must be \"member\" or \"host\", not {other:?}")),
        }
    }
}

/// Errors in settings or the settings file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid TOML or has unknown fields.
    #[error("parsing {path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// What the parser said.
        message: String,
    },
    /// A setting is out of range.
    #[error("invalid settings{scope}: {message}")]
    Invalid {
        /// `""` for the defaults, ` for job X` for a job section.
        scope: String,
        /// What is wrong.
        message: String,
    },
}

/// The rendezvous and liveness settings of one job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JobSettings {
    /// Fewest workers a generation may have.
    pub min_workers: u32,
    /// Most workers a generation may have; extra joiners wait.
    pub max_workers: u32,
    /// Time after the last arrival before a generation forms with fewer than `max_workers`.
    pub join_window: Duration,
    /// How often members heartbeat.
    pub heartbeat_interval: Duration,
    /// Time without a heartbeat after which a member is dead.
    pub lease_ttl: Duration,
    /// How long a job below `min_workers` waits before it fails.
    pub elastic_timeout: Duration,
    /// What is done about a straggler: report it, or also exclude it.
    pub straggler_policy: StragglerPolicy,
    /// How long an excluded straggler's join is refused.
    pub straggler_cooldown: Duration,
    /// Whose store lease a member's records are on: its own or its host's.
    pub lease_scope: LeaseScope,
    /// The largest generation whose members get the whole member list when they ask for a
    /// sparse view (`RendezvousRequest.layout`); larger ones get their partners, host and
    /// host layout only.
    pub whole_answer_up_to: u32,
}

impl Default for JobSettings {
    fn default() -> Self {
        Self {
            min_workers: 1,
            max_workers: 64,
            join_window: Duration::from_secs(1),
            heartbeat_interval: Duration::from_millis(500),
            lease_ttl: Duration::from_secs(3),
            elastic_timeout: Duration::from_secs(60),
            straggler_policy: StragglerPolicy::Report,
            straggler_cooldown: Duration::from_secs(60),
            lease_scope: LeaseScope::Member,
            whole_answer_up_to: 256,
        }
    }
}

/// Largest group the coordinator will form, whatever the settings say.
pub const MAX_WORKERS_LIMIT: u32 = 65_536;

impl JobSettings {
    /// Checks the settings for consistency.
    pub fn validate(&self) -> Result<(), String> {
        if self.min_workers < 1 {
            return Err("min_workers must be at least 1".into());
        }
        if self.max_workers < self.min_workers {
            return Err(format!("max_workers ({}) must be >= min_workers ({})", self.max_workers, self.min_workers));
        }
        if self.max_workers > MAX_WORKERS_LIMIT {
            return Err(format!("max_workers must be <= {MAX_WORKERS_LIMIT}"));
        }
        if self.heartbeat_interval < Duration::from_millis(10) {
            return Err("heartbeat_interval must be at least 10ms".into());
        }
        if self.lease_ttl <= self.heartbeat_interval * 2 {
            return Err(format!(
                "lease_ttl ({:?}) must be more than twice heartbeat_interval ({:?}) so that one lost heartbeat is not a death",
                self.lease_ttl, self.heartbeat_interval
            ));
        }
        if self.lease_ttl > Duration::from_secs(3600) {
            return Err("lease_ttl must be at most 1h".into());
        }
        if self.join_window > Duration::from_secs(3600) {
            return Err("join_window must be at most 1h".into());
        }
        if self.elastic_timeout < self.join_window {
            return Err("elastic_timeout must be at least join_window".into());
        }
        if self.elastic_timeout > Duration::from_secs(7 * 24 * 3600) {
            return Err("elastic_timeout must be at most 7 days".into());
        }
        if self.straggler_cooldown < Duration::from_secs(1) || self.straggler_cooldown > Duration::from_secs(24 * 3600)
        {
            return Err("straggler_cooldown must be between 1s and 24h".into());
        }
        Ok(())
    }

    /// The settings as the protocol carries them.
    pub fn to_proto(&self) -> cohort_proto::v1::JobSettings {
        cohort_proto::v1::JobSettings {
            min_workers: self.min_workers,
            max_workers: self.max_workers,
            join_window_ms: ms(self.join_window),
            heartbeat_interval_ms: ms(self.heartbeat_interval),
            lease_ttl_ms: ms(self.lease_ttl),
            elastic_timeout_ms: ms(self.elastic_timeout),
            straggler_policy: self.straggler_policy.name().into(),
            straggler_cooldown_ms: ms(self.straggler_cooldown),
        }
    }

    /// The store lease TTL for a member: `lease_ttl` rounded up to whole seconds (stores
    /// count leases in seconds).
    pub fn lease_ttl_for_store(&self) -> Duration {
        Duration::from_secs(self.lease_ttl.as_millis().div_ceil(1000).max(1) as u64)
    }

    fn apply(&mut self, o: &Overrides) -> Result<(), String> {
        if let Some(v) = o.min_workers {
            self.min_workers = v;
        }
        if let Some(v) = o.max_workers {
            self.max_workers = v;
        }
        if let Some(v) = o.join_window_ms {
            self.join_window = Duration::from_millis(v);
        }
        if let Some(v) = o.heartbeat_interval_ms {
            self.heartbeat_interval = Duration::from_millis(v);
        }
        if let Some(v) = o.lease_ttl_ms {
            self.lease_ttl = Duration::from_millis(v);
        }
        if let Some(v) = o.elastic_timeout_ms {
            self.elastic_timeout = Duration::from_millis(v);
        }
        if let Some(v) = &o.straggler_policy {
            self.straggler_policy = StragglerPolicy::parse(v)?;
        }
        if let Some(v) = o.straggler_cooldown_ms {
            self.straggler_cooldown = Duration::from_millis(v);
        }
        if let Some(v) = &o.lease_scope {
            self.lease_scope = LeaseScope::parse(v)?;
        }
        if let Some(v) = o.whole_answer_up_to {
            self.whole_answer_up_to = v;
        }
        Ok(())
    }
}

fn ms(d: Duration) -> u64 {
    d.as_millis().min(u64::MAX as u128) as u64
}

/// Optional overrides of [`JobSettings`] (a TOML section, or command-line flags).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Overrides {
    /// See [`JobSettings::min_workers`].
    pub min_workers: Option<u32>,
    /// See [`JobSettings::max_workers`].
    pub max_workers: Option<u32>,
    /// See [`JobSettings::join_window`], in milliseconds.
    pub join_window_ms: Option<u64>,
    /// See [`JobSettings::heartbeat_interval`], in milliseconds.
    pub heartbeat_interval_ms: Option<u64>,
    /// See [`JobSettings::lease_ttl`], in milliseconds.
    pub lease_ttl_ms: Option<u64>,
    /// See [`JobSettings::elastic_timeout`], in milliseconds.
    pub elastic_timeout_ms: Option<u64>,
    /// See [`JobSettings::straggler_policy`]: `report` or `exclude`.
    pub straggler_policy: Option<String>,
    /// See [`JobSettings::straggler_cooldown`], in milliseconds.
    pub straggler_cooldown_ms: Option<u64>,
    /// See [`JobSettings::lease_scope`]: `member` or `host`.
    pub lease_scope: Option<String>,
    /// See [`JobSettings::whole_answer_up_to`].
    pub whole_answer_up_to: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileFormat {
    #[serde(default)]
    defaults: Overrides,
    #[serde(default)]
    jobs: HashMap<String, Overrides>,
}

/// Settings for every job: defaults plus per-job overrides.
#[derive(Clone, Debug, Default)]
pub struct Settings {
    defaults: JobSettings,
    jobs: HashMap<String, JobSettings>,
}

impl Settings {
    /// Settings with the same values for every job.
    pub fn uniform(defaults: JobSettings) -> Result<Self, ConfigError> {
        defaults.validate().map_err(|message| ConfigError::Invalid { scope: String::new(), message })?;
        Ok(Self { defaults, jobs: HashMap::new() })
    }

    /// Builds settings from an optional TOML text (`[defaults]`, `[jobs.<id>]`) and
    /// command-line overrides of the defaults. `origin` names the text in errors.
    pub fn from_toml(text: Option<(&str, &str)>, cli: &Overrides) -> Result<Self, ConfigError> {
        let file: FileFormat = match text {
            Some((origin, text)) => toml::from_str(text)
                .map_err(|e| ConfigError::Parse { path: origin.to_string(), message: e.to_string() })?,
            None => FileFormat::default(),
        };
        let mut defaults = JobSettings::default();
        let invalid = |message| ConfigError::Invalid { scope: String::new(), message };
        defaults.apply(&file.defaults).map_err(invalid)?;
        defaults.apply(cli).map_err(invalid)?;
        defaults.validate().map_err(invalid)?;
        let mut jobs = HashMap::new();
        for (job, overrides) in &file.jobs {
            crate::validate::id("jobs.<id>", job).map_err(|s| ConfigError::Invalid {
                scope: format!(" for job {job:?}"),
                message: s.message().to_string(),
            })?;
            let mut settings = defaults;
            let invalid = |message| ConfigError::Invalid { scope: format!(" for job {job}"), message };
            settings.apply(overrides).map_err(invalid)?;
            settings.validate().map_err(invalid)?;
            jobs.insert(job.clone(), settings);
        }
        Ok(Self { defaults, jobs })
    }

    /// Reads a TOML settings file (see [`Settings::from_toml`]).
    pub fn from_file(path: Option<&Path>, cli: &Overrides) -> Result<Self, ConfigError> {
        match path {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|source| ConfigError::Read { path: path.display().to_string(), source })?;
                Self::from_toml(Some((&path.display().to_string(), &text)), cli)
            }
            None => Self::from_toml(None, cli),
        }
    }

    /// The settings that apply to `job`.
    pub fn for_job(&self, job: &str) -> JobSettings {
        self.jobs.get(job).copied().unwrap_or(self.defaults)
    }

    /// The defaults.
    pub fn defaults(&self) -> JobSettings {
        self.defaults
    }
}

/// Parses a duration as the command line writes it: `500ms`, `2s`, `1m`, `1h`, or a bare
/// number of milliseconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let (number, unit) = match t.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => t.split_at(i),
        None => (t, "ms"),
    };
    let n: u64 = number.parse().map_err(|_| format!("{text:?} is not a duration (like 500ms, 2s, 1m)"))?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" | "min" => Duration::from_secs(n.saturating_mul(60)),
        "h" => Duration::from_secs(n.saturating_mul(3600)),
        _ => return Err(format!("{text:?}: unknown unit {unit:?} (use ms, s, m or h)")),
    };
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        JobSettings::default().validate().expect("defaults validate");
    }

    #[test]
    fn file_cli_and_job_precedence() {
        let text = "[defaults]\nmin_workers = 2\njoin_window_ms = 700\n[jobs.big]\nmax_workers = 8\nmin_workers = 4\n";
        let cli = Overrides { join_window_ms: Some(300), ..Default::default() };
        let s = Settings::from_toml(Some(("t.toml", text)), &cli).expect("valid");
        assert_eq!(s.defaults().min_workers, 2);
        assert_eq!(s.defaults().join_window, Duration::from_millis(300));
        let big = s.for_job("big");
        assert_eq!((big.min_workers, big.max_workers), (4, 8));
        assert_eq!(big.join_window, Duration::from_millis(300));
        assert_eq!(s.for_job("other"), s.defaults());
    }

    #[test]
    fn the_straggler_policy_is_set_per_job() {
        let text = "[jobs.big]\nstraggler_policy = \"exclude\"\nstraggler_cooldown_ms = 5000\n";
        let s = Settings::from_toml(Some(("t.toml", text)), &Overrides::default()).expect("valid");
        assert_eq!(s.defaults().straggler_policy, StragglerPolicy::Report);
        assert_eq!(s.for_job("big").straggler_policy, StragglerPolicy::Exclude);
        assert_eq!(s.for_job("big").straggler_cooldown, Duration::from_secs(5));
        assert_eq!(s.for_job("big").to_proto().straggler_policy, "exclude");
    }

    #[test]
    fn invalid_settings_are_refused() {
        for text in [
            "[defaults]\nmin_workers = 0\n",
            "[defaults]\nmin_workers = 5\nmax_workers = 4\n",
            "[defaults]\nheartbeat_interval_ms = 1000\nlease_ttl_ms = 1500\n",
            "[defaults]\nbogus = 1\n",
            "[jobs.\"bad/id\"]\nmin_workers = 1\n",
            "[defaults]\nstraggler_policy = \"kill\"\n",
            "[jobs.a]\nstraggler_cooldown_ms = 10\n",
        ] {
            assert!(Settings::from_toml(Some(("t", text)), &Overrides::default()).is_err(), "{text}");
        }
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("250"), Ok(Duration::from_millis(250)));
        assert!(parse_duration("2 days").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn store_ttl_rounds_up() {
        let s = JobSettings { lease_ttl: Duration::from_millis(1500), ..JobSettings::default() };
        assert_eq!(s.lease_ttl_for_store(), Duration::from_secs(2));
    }
}
