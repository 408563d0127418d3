//! Configuration of an elastic worker.

use super::TransportChoice;
use crate::control::ControlConfig;
use crate::CommConfig;
use cohort_proto::ids::{JobId, WorkerId};
use cohort_transports::shm::ShmOptions;
use cohort_transports::tcp::TcpOptions;
use cohort_transports::Deadlines;
use std::net::SocketAddr;
use std::time::Duration;

/// Everything an [`super::ElasticGroup`] needs to join a job.
#[derive(Clone, Debug)]
pub struct ElasticConfig {
    /// The job id (namespaces everything at the coordinator), checked when it was made.
    pub job: JobId,
    /// This worker's stable id (pod name, host:slot, ...), checked when it was made.
    /// Rejoining with the same id replaces the older incarnation.
    pub worker_id: WorkerId,
    /// Host name shown in status and root causes.
    pub host: String,
    /// Failure domain: what fails together with this worker (a node name; on Kubernetes
    /// `spec.nodeName` through the downward API). Empty: the coordinator takes the host. Ranks
    /// of one domain get adjacent ranks; losing all of them at once is one failure.
    /// [`ElasticConfig::new`] takes it from the environment variable `COHORT_DOMAIN`.
    pub domain: String,
    /// How to reach the coordinator.
    pub control: ControlConfig,
    /// The job's credential, or the operator secret it derives from
    /// (`cohort_proto::credentials`): keys the data-plane handshakes (the control client has
    /// its own copy, in [`ControlConfig`]).
    pub token: Vec<u8>,
    /// Where the data-plane listener binds (e.g. `0.0.0.0:7100`, or port 0 for any).
    pub listen: SocketAddr,
    /// The host (IP or DNS name) peers use to reach this worker; the bound port is added.
    pub advertise: String,
    /// Data-plane deadlines (no-progress per link, mesh connect bound).
    pub deadlines: Deadlines,
    /// Socket options of the data plane.
    pub tcp: TcpOptions,
    /// The data-plane transport this worker asks for (`--transport`): what it publishes at
    /// join (a shared-memory address with `auto` and `shm`, an RDMA endpoint with `rdma`) and
    /// what it accepts a generation to use (see [`TransportChoice`]). [`super::ElasticGroup::join`]
    /// refuses `rdma` in a build without the `rdma` feature with
    /// [`super::ElasticError::TransportUnavailable`]; [`TransportChoice::check`] tells before
    /// anything is bound whether the choice can be used here.
    pub transport: TransportChoice,
    /// Shared-memory options, used when [`ElasticConfig::transport`] publishes a
    /// shared-memory address (`auto`, `shm`).
    pub shm: ShmOptions,
    /// RDMA endpoint options, used with [`TransportChoice::Rdma`]: the endpoint is opened at
    /// join and its address published beside the TCP one (a generation uses RDMA when every
    /// member published one). The bootstrap listener binds on the IP of
    /// [`ElasticConfig::listen`] (the port of `bootstrap_bind` is kept, 0 = any), and unless
    /// `advertise` is set it advertises the host of the TCP advertised address with its bound
    /// port. [`ElasticConfig::new`] takes the device from the environment variable
    /// `COHORT_RDMA_DEVICE` (unset or empty: the first device with an active port) and lets
    /// the progress task sleep on the completion channel (`busy_poll: false`).
    #[cfg(feature = "rdma")]
    pub rdma: cohort_transports::rdma::RdmaOptions,
    /// Collective algorithm settings.
    pub comm: CommConfig,
    /// Longest single rendezvous long poll; the wait itself is unbounded only as long as the
    /// coordinator keeps answering "waiting" (the job's elastic timeout ends it).
    pub rendezvous_poll: Duration,
    /// How long to wait for the coordinator's revocation record after a local failure before
    /// falling back to the local error as the cause.
    pub root_cause_wait: Duration,
    /// Whether heartbeats go through the host's heartbeat relay (two coordinator calls per
    /// host and interval, whatever the ranks per host, [`crate::control::HostRelay`]) and the
    /// job's events through its event relay (one watch stream per host, each worker keeping a
    /// quiet stream of its own, [`crate::control::EventRelay`]); off: each worker sends its
    /// own beats and watches alone.
    /// [`ElasticConfig::new`] turns it on unless the environment variable
    /// `COHORT_HEARTBEAT_RELAY` is `0` or `off`.
    pub heartbeat_relay: bool,
    /// A node-local directory for the host relays' sockets, shared by the processes of one
    /// node whatever their network namespace (on Kubernetes, a `hostPath` mounted into every
    /// worker pod of the node: pods of one rank each then share their node's relays). `None`:
    /// abstract Unix sockets, shared only within one network namespace (one pod). Either way
    /// a relay serves the workers of one [`ElasticConfig::relay_scope`].
    /// [`ElasticConfig::new`] takes it from the environment variable `COHORT_RELAY_DIR`
    /// (unset or empty: `None`); [`super::ElasticGroup::join`] refuses a relative path or
    /// one too long for a socket's name ([`super::ElasticError::InvalidConfig`]).
    pub relay_dir: Option<std::path::PathBuf>,
    /// Longest an excluded worker waits out its exclusion (the coordinator says how long it
    /// has left) before joining fails; zero fails at once. Default one hour (the longest
    /// default exclusion is 30 min).
    pub exclusion_wait: Duration,
}

impl ElasticConfig {
    /// A configuration with default deadlines and options. The ids are checked already: make
    /// them with [`JobId::new`] and [`WorkerId::new`], whose [`cohort_proto::ids::IdError`]
    /// names a bad one (it converts into [`super::ElasticError::InvalidId`]).
    pub fn new(job: JobId, worker_id: WorkerId, control: ControlConfig) -> Self {
        Self {
            job,
            worker_id,
            host: local_hostname(),
            domain: std::env::var("COHORT_DOMAIN").unwrap_or_default(),
            control,
            token: Vec::new(),
            listen: SocketAddr::from(([0, 0, 0, 0], 0)),
            advertise: "127.0.0.1".into(),
            deadlines: Deadlines::default(),
            tcp: TcpOptions::default(),
            transport: TransportChoice::Auto,
            shm: ShmOptions::default(),
            #[cfg(feature = "rdma")]
            rdma: cohort_transports::rdma::RdmaOptions {
                device: cohort_transports::rdma::DeviceConfig {
                    name: std::env::var("COHORT_RDMA_DEVICE").ok().filter(|d| !d.is_empty()),
                    ..Default::default()
                },
                busy_poll: false,
                ..Default::default()
            },
            comm: CommConfig::default(),
            rendezvous_poll: Duration::from_secs(10),
            root_cause_wait: Duration::from_millis(500),
            exclusion_wait: Duration::from_secs(3600),
            heartbeat_relay: !matches!(std::env::var("COHORT_HEARTBEAT_RELAY").as_deref(), Ok("0" | "off")),
            relay_dir: std::env::var_os("COHORT_RELAY_DIR").filter(|d| !d.is_empty()).map(Into::into),
        }
    }

    /// Whom the host relays serve together: the workers of the job with the same failure
    /// domain ([`ElasticConfig::domain`], on Kubernetes the node), or, without one, the same
    /// host name. It is the coordinator's unit for shared leases too (`lease_scope = "host"`).
    pub fn relay_scope(&self) -> &str {
        if self.domain.is_empty() {
            &self.host
        } else {
            &self.domain
        }
    }
}

/// This machine's host name, or "unknown".
pub fn local_hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::{ElasticConfig, JobId, WorkerId};
    use crate::control::ControlConfig;
    use crate::elastic::ElasticError;
    use cohort_proto::ids::IdError;

    /// A configuration is made of checked ids: a bad one is refused with a typed error where
    /// it is made, before a configuration (or anything it would contact) exists.
    #[test]
    fn a_bad_id_is_refused_when_the_config_is_made() {
        let make = |job: &str, worker: &str| -> Result<ElasticConfig, ElasticError> {
            let control = ControlConfig::new(vec!["http://127.0.0.1:9".into()]);
            Ok(ElasticConfig::new(JobId::new(job)?, WorkerId::new(worker)?, control))
        };
        let refused = make("job/1", "w0").map(drop).unwrap_err();
        assert!(
            matches!(refused, ElasticError::InvalidId(IdError::Character { field: "job", found: '/' })),
            "{refused}"
        );
        let refused = make("job", "..").map(drop).unwrap_err();
        assert!(matches!(refused, ElasticError::InvalidId(IdError::Dots { field: "worker_id", value: ".." })));
        assert_eq!(refused.to_string(), "worker_id may not be \"..\"");
        let config = make("job-1", "w.0").expect("good ids");
        assert_eq!((config.job.as_str(), config.worker_id.to_string()), ("job-1", "w.0".to_string()));
    }

    /// The relays serve a failure domain (the node on Kubernetes, where each pod has a host
    /// name of its own), and the host where no domain is named: the coordinator's unit for a
    /// shared lease.
    #[test]
    fn the_relays_serve_the_failure_domain_else_the_host() {
        let control = ControlConfig::new(vec!["http://127.0.0.1:9".into()]);
        let mut config = ElasticConfig::new(JobId::new("j").unwrap(), WorkerId::new("w").unwrap(), control);
        config.host = "pod-3".into();
        config.domain = String::new();
        assert_eq!(config.relay_scope(), "pod-3");
        config.domain = "node-a".into();
        assert_eq!(config.relay_scope(), "node-a");
    }
}
