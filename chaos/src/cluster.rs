//! A local cluster of real processes: optional etcd, coordinator replicas, workers.

use crate::binaries::Binaries;
use crate::events::{self as ev, Event, EventParseError, WorkerEvent};
use crate::netns::NetLab;
use crate::placement::Placement;
use crate::process::{now_ms, LineHook, ManagedProcess, OutputLine};
use crate::proxy::Proxy;
use cohort_testkit::etcd::EtcdProcess;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::process::Command;
use tokio::sync::mpsc;

/// Which store the coordinators use: the coordinator's own type. The cluster provisions it
/// (starts an etcd for `Etcd`) and passes the coordinators its [`StoreSpec`]; a store that
/// replicas cannot share runs one coordinator.
use cohort_coordinator::announce::Announced;
pub use cohort_coordinator::store::StoreKind;
use cohort_coordinator::store::StoreSpec;

/// When repeated failures exclude a worker (as `serve --exclusion-*` flags).
pub use cohort_coordinator::config::ExclusionPolicy;
/// Job settings passed to the coordinators (as `serve` flags): the coordinator's own type.
pub use cohort_coordinator::config::JobSettings;

/// What every worker of the cluster runs.
#[derive(Clone, Debug)]
pub struct WorkerSpec {
    /// Total steps of the job.
    pub steps: u64,
    /// Gradient bytes per step.
    pub size: String,
    /// Pause between steps.
    pub step_interval: Duration,
    /// Data-plane no-progress deadline (the ceiling of the learned deadlines).
    pub no_progress: Duration,
    /// Workers run with `--fixed-deadlines` (no learned deadlines: every stall waits the
    /// full `no_progress`).
    pub fixed_deadlines: bool,
    /// More `cohort-worker train` arguments (e.g. `--transport tcp`); not used with `command`.
    pub extra_args: Vec<String>,
    /// The worker's command line, when it is not `cohort-worker train`: any program that
    /// speaks train's event protocol (`event=...` lines on stdout; docs/chaos.md), such as a
    /// Python training script on the `cohort` package. See [`expand_command`].
    pub command: Option<Vec<String>>,
}

/// The venv `scripts/python-env.sh` makes, relative to a cargo target directory.
const PYENV_PYTHON: &str = "pyenv/bin/python";

/// The Python interpreter that has the `cohort` package, for `{python}`: `COHORT_PYTHON`
/// (`env`) when set; else the venv `scripts/python-env.sh` makes, `target/pyenv`, found
/// from the harness's own executable (`exe`, in `target/<profile>/` or its `deps/`) or the
/// workspace (`workspace/target`); else `python3` when `python3_has_cohort` says it imports
/// the package (`pip install ./python`). Otherwise an error that says, in one line, what
/// to run.
pub fn find_python(
    env: Option<String>,
    exe: Option<&Path>,
    workspace: &Path,
    python3_has_cohort: impl FnOnce() -> bool,
) -> Result<String, String> {
    if let Some(p) = env.filter(|p| !p.trim().is_empty()) {
        return Ok(p);
    }
    let from_exe = exe.and_then(Path::parent).into_iter().flat_map(|d| d.ancestors().take(3));
    let from_workspace = std::iter::once(workspace.join("target"));
    for dir in from_exe.map(Path::to_path_buf).chain(from_workspace) {
        let python = dir.join(PYENV_PYTHON);
        if python.is_file() {
            return Ok(python.display().to_string());
        }
    }
    if python3_has_cohort() {
        return Ok("python3".into());
    }
    Err("no Python with the cohort package: run `bash scripts/python-env.sh` (it builds target/pyenv, which \
         the harness finds by itself), or set COHORT_PYTHON to an interpreter that imports cohort"
        .into())
}

/// [`find_python`] for this process (its environment, executable and workspace), looked up
/// once.
fn python() -> Result<String, String> {
    static FOUND: std::sync::OnceLock<Result<String, String>> = std::sync::OnceLock::new();
    FOUND
        .get_or_init(|| {
            let exe = std::env::current_exe().ok();
            let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap_or(Path::new("."));
            find_python(std::env::var("COHORT_PYTHON").ok(), exe.as_deref(), workspace, || {
                std::process::Command::new("python3")
                    .args(["-c", "import cohort._native"])
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            })
        })
        .clone()
}

/// The worker command with its placeholders filled: `{coordinator}` (comma-separated
/// endpoints), `{job}`, `{worker_id}`, `{listen}`, `{advertise}`, `{token_file}` (the job's
/// credential), `{steps}`, `{size}`, `{no_progress_ms}`, `{step_interval_ms}`, and `{python}`
/// ([`find_python`]: `$COHORT_PYTHON`, else `target/pyenv`, else a `python3` that has the
/// package, else an error saying what to run). An unknown `{name}` is an error, not a
/// silent literal.
pub fn expand_command(template: &[String], values: &[(&str, String)]) -> Result<Vec<String>, String> {
    if template.is_empty() {
        return Err("worker_command is empty".into());
    }
    template
        .iter()
        .map(|arg| {
            let mut out = String::new();
            let mut rest = arg.as_str();
            while let Some(open) = rest.find('{') {
                out.push_str(&rest[..open]);
                let close =
                    rest[open..].find('}').ok_or_else(|| format!("unclosed {{ in worker_command argument {arg:?}"))?;
                let key = &rest[open + 1..open + close];
                let value = if key == "python" {
                    python()?
                } else {
                    values
                        .iter()
                        .find(|(k, _)| *k == key)
                        .map(|(_, v)| v.clone())
                        .ok_or_else(|| format!("unknown placeholder {{{key}}} in worker_command"))?
                };
                out.push_str(&value);
                rest = &rest[open + close + 1..];
            }
            out.push_str(rest);
            Ok(out)
        })
        .collect()
}

/// How to set a cluster up.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// Job id.
    pub job: String,
    /// Store of the coordinators.
    pub store: StoreKind,
    /// Number of coordinator replicas (1 for memory).
    pub coordinators: usize,
    /// Job settings.
    pub settings: JobSettings,
    /// Where logs go (a fresh temp dir if `None`).
    pub log_dir: Option<PathBuf>,
    /// The coordinators' exclusion policy (`None`: their defaults, 3 failures in 10 min
    /// exclude for 30 s and more).
    pub exclusion: Option<ExclusionPolicy>,
    /// Every coordinator and worker serves Prometheus metrics on a free port of its host
    /// (`--metrics HOST:0`), as the Kubernetes manifests run them; see
    /// [`Cluster::coordinator_metrics`] and [`Cluster::worker_metrics`].
    pub metrics: bool,
}

/// Where the cluster's processes live on the network.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Network {
    /// Everything on this machine's loopback.
    #[default]
    Loopback,
    /// Every worker on a host of its own (a network namespace with its own address), the
    /// coordinators on the hub namespace's bridge; see [`crate::netns`]. Memory store only
    /// (etcd runs on the harness's loopback).
    Namespaces,
}

struct Coordinator {
    process: Option<ManagedProcess>,
    address: String,
    /// Its metrics endpoint (a new port at every start), when the cluster serves metrics.
    metrics: Option<String>,
}

/// A coordinator process that is serving.
struct Started {
    process: ManagedProcess,
    address: String,
    metrics: Option<String>,
}

/// A running local cluster. Dropping it kills every process it started.
pub struct Cluster {
    bins: Binaries,
    config: ClusterConfig,
    log_dir: PathBuf,
    _tempdir: Option<tempfile::TempDir>,
    /// The operator secret (coordinators, `status`).
    token_file: PathBuf,
    /// The job's credential (workers).
    job_credential_file: PathBuf,
    etcd: Option<EtcdProcess>,
    coordinators: Vec<Coordinator>,
    workers: BTreeMap<String, ManagedProcess>,
    lines_tx: mpsc::UnboundedSender<OutputLine>,
    lines_rx: mpsc::UnboundedReceiver<OutputLine>,
    proxy: Option<Proxy>,
    connect_timeout: Option<Duration>,
    /// `--transport` and `--algo` for `cohort-worker train` workers.
    data_plane: DataPlaneFlags,
    /// Which host each worker runs on (network namespaces only).
    placement: Placement,
    /// With nodes of several pods: the nodes' relay directories, one under this per node
    /// (short, under /tmp: a relay directory has at most 42 bytes).
    relay_root: Option<tempfile::TempDir>,
    /// Every worker event seen so far, in arrival order.
    pub events: Vec<WorkerEvent>,
    /// The namespaces, when `netns` is on (last: dropped after every process is killed).
    netlab: Option<NetLab>,
}

/// Data-plane flags of `cohort-worker train` (`None`: the worker's default).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DataPlaneFlags {
    /// `--transport` (auto, tcp, shm, rdma). Proxied workers always get tcp.
    pub transport: Option<String>,
    /// `--algo` (an allreduce algorithm name).
    pub algorithm: Option<String>,
}

/// Errors of the launcher.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// Setting up failed.
    #[error("{0}")]
    Setup(String),
    /// Waiting for something took longer than its deadline.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// The deadline.
        after: Duration,
    },
}

fn ms(d: Duration) -> String {
    format!("{}ms", d.as_millis())
}

impl Cluster {
    /// Starts etcd (if asked) and the coordinators on the loopback; no workers yet.
    ///
    /// # Cancel safety
    /// Cancel safe: as [`Cluster::start_on`].
    pub async fn start(config: ClusterConfig) -> Result<Self, ClusterError> {
        Self::start_on(config, Network::Loopback).await
    }

    /// Starts etcd (if asked) and the coordinators on `network`; no workers yet.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping it drops what it built so far, which kills etcd and the
    /// replicas started, removes the network namespaces and the temporary log directory.
    pub async fn start_on(config: ClusterConfig, network: Network) -> Result<Self, ClusterError> {
        let bins = Binaries::locate().map_err(ClusterError::Setup)?;
        let (tempdir, log_dir) = match &config.log_dir {
            Some(d) => {
                std::fs::create_dir_all(d).map_err(|e| ClusterError::Setup(format!("{}: {e}", d.display())))?;
                (None, d.clone())
            }
            None => {
                let t = tempfile::Builder::new()
                    .prefix("cohort-chaos-")
                    .tempdir()
                    .map_err(|e| ClusterError::Setup(e.to_string()))?;
                let p = t.path().to_path_buf();
                (Some(t), p)
            }
        };
        // The coordinators hold the operator secret; the workers only the job's credential
        // derived from it, as a production deployment hands them out.
        let token_file = log_dir.join("token");
        let token: String = (0..32).map(|_| format!("{:x}", rand::random::<u8>() % 16)).collect();
        std::fs::write(&token_file, &token).map_err(|e| ClusterError::Setup(e.to_string()))?;
        let job_credential_file = log_dir.join("job-credential");
        let credential = cohort_proto::credentials::job_token(token.as_bytes(), &config.job);
        std::fs::write(&job_credential_file, credential).map_err(|e| ClusterError::Setup(e.to_string()))?;
        let netlab = if network == Network::Namespaces {
            if config.store == StoreKind::Etcd {
                return Err(ClusterError::Setup("network namespaces work with the memory store only".into()));
            }
            NetLab::sweep_stale();
            Some(NetLab::create().map_err(|e| ClusterError::Setup(format!("network namespaces: {e}")))?)
        } else {
            None
        };
        let etcd = match config.store {
            StoreKind::Etcd => Some(EtcdProcess::start().map_err(|e| ClusterError::Setup(format!("etcd: {e}")))?),
            StoreKind::Memory => None,
        };
        let (lines_tx, lines_rx) = mpsc::unbounded_channel();
        let mut cluster = Self {
            bins,
            config,
            log_dir,
            _tempdir: tempdir,
            token_file,
            job_credential_file,
            etcd,
            coordinators: Vec::new(),
            workers: BTreeMap::new(),
            lines_tx,
            lines_rx,
            proxy: None,
            connect_timeout: None,
            data_plane: DataPlaneFlags::default(),
            placement: Placement::new(1),
            relay_root: None,
            events: Vec::new(),
            netlab,
        };
        let n = if cluster.config.store.shared_by_replicas() { cluster.config.coordinators.max(1) } else { 1 };
        let listen = match &cluster.netlab {
            Some(lab) => format!("{}:0", lab.hub_address()),
            None => "127.0.0.1:0".into(),
        };
        for i in 0..n {
            let s = cluster.spawn_coordinator(i, &listen).await?;
            cluster.coordinators.push(Coordinator { process: Some(s.process), address: s.address, metrics: s.metrics });
        }
        Ok(cluster)
    }

    /// The directory holding every process's log.
    pub fn log_dir(&self) -> &std::path::Path {
        &self.log_dir
    }

    /// The coordinators' `--store` value: the store this cluster provisioned.
    fn store_arg(&self) -> String {
        let spec = match &self.etcd {
            Some(e) => StoreSpec::Etcd { endpoints: vec![e.endpoint().trim_start_matches("http://").to_string()] },
            None => StoreSpec::Memory,
        };
        spec.to_string()
    }

    /// The host part of a `HOST:PORT` listen address.
    fn host_of(listen: &str) -> &str {
        listen.rsplit_once(':').map_or(listen, |(host, _)| host)
    }

    async fn spawn_coordinator(&mut self, index: usize, listen: &str) -> Result<Started, ClusterError> {
        let mut cmd = self.command(None, &self.bins.coordinator)?;
        let s = &self.config.settings;
        cmd.args(["serve", "--listen", listen, "--store", &self.store_arg(), "--name", &format!("coord{index}")])
            .args(["--min-workers", &s.min_workers.to_string(), "--max-workers", &s.max_workers.to_string()])
            .args(["--join-window", &ms(s.join_window), "--heartbeat-interval", &ms(s.heartbeat_interval)])
            .args(["--lease-ttl", &ms(s.lease_ttl), "--elastic-timeout", &ms(s.elastic_timeout)])
            .args(["--straggler-policy", s.straggler_policy.name(), "--straggler-cooldown", &ms(s.straggler_cooldown)])
            .args(["--lease-scope", s.lease_scope.name()])
            .args(["--whole-answer-up-to", &s.whole_answer_up_to.to_string()])
            .arg("--token-file")
            .arg(&self.token_file)
            .env("RUST_LOG", std::env::var("COHORT_CHAOS_COORDINATOR_LOG").unwrap_or_else(|_| "info".into()));
        if self.config.metrics {
            cmd.args(["--metrics", &format!("{}:0", Self::host_of(listen))]);
        }
        if let Some(p) = &self.config.exclusion {
            cmd.args(["--exclusion-threshold", &p.threshold.to_string(), "--exclusion-window", &ms(p.window)]).args([
                "--exclusion-cooldown",
                &ms(p.base_cooldown),
                "--exclusion-max-cooldown",
                &ms(p.max_cooldown),
            ]);
        }
        let name = format!("coord{index}");
        let mut process = ManagedProcess::spawn(&name, cmd, &self.log_dir, self.lines_tx.clone())
            .map_err(|e| ClusterError::Setup(e.to_string()))?;
        // The coordinator prints `cohort-coordinator listening on ADDR` once serving, after
        // `cohort-coordinator metrics on ADDR` when it serves metrics (`announce`). One that exits first
        // (a bad flag, a port in use) fails the start at once, with its log's last lines.
        let deadline = Duration::from_secs(20);
        let mut metrics = None;
        let mut exited = None;
        let found = tokio::time::timeout(deadline, async {
            let mut poll_exit = tokio::time::interval(Duration::from_millis(100));
            loop {
                let line = tokio::select! {
                    line = self.lines_rx.recv() => line?,
                    _ = poll_exit.tick() => {
                        if let Some(code) = process.try_exit() {
                            exited = Some(code);
                            return None;
                        }
                        continue;
                    }
                };
                if line.name == name {
                    match cohort_coordinator::announce::parse(&line.line) {
                        Some(Announced::Metrics(addr)) => metrics = Some(addr.to_string()),
                        Some(Announced::Listening(addr)) => return Some(addr.to_string()),
                        None => {}
                    }
                } else if let Some(e) = event_of(&line) {
                    self.events.push(e);
                }
            }
        })
        .await
        .ok()
        .flatten();
        match (found, exited) {
            (Some(address), _) => Ok(Started { process, address, metrics }),
            (None, Some(code)) => {
                let log = std::fs::read_to_string(process.log()).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(8).collect::<Vec<_>>().into_iter().rev().collect();
                Err(ClusterError::Setup(format!(
                    "{name} exited ({}) before it listened; {}:\n{}",
                    code.map_or_else(|| "killed by a signal".to_string(), |c| format!("exit code {c}")),
                    process.log().display(),
                    tail.join("\n")
                )))
            }
            (None, None) => Err(ClusterError::Timeout {
                what: format!("{name} to listen (see {})", process.log().display()),
                after: deadline,
            }),
        }
    }

    /// Every coordinator endpoint, comma separated (as workers take them).
    pub fn endpoints(&self) -> String {
        self.coordinators.iter().map(|c| format!("http://{}", c.address)).collect::<Vec<_>>().join(",")
    }

    /// The metrics endpoint (`HOST:PORT`) of coordinator `index` as last started, when the
    /// cluster serves metrics.
    pub fn coordinator_metrics(&self, index: usize) -> Option<&str> {
        self.coordinators.get(index)?.metrics.as_deref()
    }

    /// The metrics endpoint (`HOST:PORT`) of worker `name`, from its `event=metrics` line,
    /// when the cluster serves metrics and the worker has started serving them.
    pub fn worker_metrics(&self, name: &str) -> Option<std::net::SocketAddr> {
        self.events.iter().rev().filter(|e| e.worker == name).find_map(|e| e.get::<ev::Metrics>()).map(|m| m.address)
    }

    /// Number of coordinator replicas (running or not).
    pub fn coordinator_count(&self) -> usize {
        self.coordinators.len()
    }

    /// Kills coordinator `index` with SIGKILL (it can be restarted on the same address).
    ///
    /// # Cancel safety
    /// Cancel safe: the replica's process is taken out of the cluster before the signal, and
    /// dropping it (with the future) kills it, so the replica ends dead either way.
    pub async fn kill_coordinator(&mut self, index: usize) {
        if let Some(c) = self.coordinators.get_mut(index) {
            if let Some(mut p) = c.process.take() {
                p.signal(libc::SIGKILL);
                p.wait(Duration::from_secs(5)).await;
            }
        }
    }

    /// Stops coordinator `index` as the kubelet stops a pod: SIGTERM, then SIGKILL if it is
    /// still running after `grace`. Returns its exit code (`None`: it had to be killed, or
    /// it was not running).
    ///
    /// # Cancel safety
    /// Cancel safe: a replica left running is killed when the cluster is dropped.
    pub async fn stop_coordinator(&mut self, index: usize, grace: Duration) -> Option<i32> {
        let mut p = self.coordinators.get_mut(index)?.process.take()?;
        p.signal(libc::SIGTERM);
        p.wait(grace).await
    }

    /// Restarts coordinator `index` on its old address (SIGKILL, then start).
    ///
    /// # Cancel safety
    /// Not cancel safe as a whole: dropped after the kill, the replica stays down until
    /// [`Cluster::start_coordinator_again`] starts it.
    pub async fn restart_coordinator(&mut self, index: usize) -> Result<(), ClusterError> {
        self.kill_coordinator(index).await;
        self.start_coordinator_again(index).await
    }

    /// Starts coordinator `index` again on its old address, after it was stopped or killed.
    ///
    /// # Cancel safety
    /// Cancel safe: a replica still starting is killed with the future, and its slot stays
    /// empty, so a later call starts it again.
    pub async fn start_coordinator_again(&mut self, index: usize) -> Result<(), ClusterError> {
        let listen = self
            .coordinators
            .get(index)
            .map(|c| c.address.clone())
            .ok_or_else(|| ClusterError::Setup(format!("no coordinator {index}")))?;
        if self.coordinators[index].process.is_some() {
            return Err(ClusterError::Setup(format!("coordinator {index} is still running")));
        }
        let s = self.spawn_coordinator(index, &listen).await?;
        self.coordinators[index] = Coordinator { process: Some(s.process), address: s.address, metrics: s.metrics };
        Ok(())
    }

    /// The etcd process, when the cluster runs on etcd.
    pub fn etcd(&mut self) -> Option<&mut EtcdProcess> {
        self.etcd.as_mut()
    }

    /// The network namespaces, when the cluster runs on them.
    pub fn netlab(&self) -> Option<&NetLab> {
        self.netlab.as_ref()
    }

    /// A command running `program` on worker host `host` (`None`: where the coordinators
    /// run): in its network namespace when the cluster has them, else right here.
    fn command(&self, host: Option<&str>, program: &std::path::Path) -> Result<Command, ClusterError> {
        match &self.netlab {
            Some(lab) => lab.command(host, program).map_err(|e| ClusterError::Setup(e.to_string())),
            None => Ok(Command::new(program)),
        }
    }

    /// Whether coordinator `index` is running.
    pub fn coordinator_running(&mut self, index: usize) -> bool {
        match self.coordinators.get_mut(index).and_then(|c| c.process.as_mut()) {
            Some(p) => p.try_exit().is_none(),
            None => false,
        }
    }

    /// Indices of the coordinators that were started and not killed since, and exited by
    /// themselves (a crash).
    pub fn crashed_coordinators(&mut self) -> Vec<usize> {
        (0..self.coordinators.len())
            .filter(|&i| self.coordinators[i].process.as_mut().is_some_and(|p| p.try_exit().is_some()))
            .collect()
    }

    /// Index of the coordinator replica holding the leader key, asked through
    /// `cohort-coordinator status` (bounded by `timeout`). `None` if nobody answered or no
    /// replica leads.
    ///
    /// # Cancel safety
    /// Cancel safe (the status process is killed when dropped).
    pub async fn leader_index(&self, timeout: Duration) -> Option<usize> {
        let status = self.status_json(timeout).await?;
        let leader = status.get("leader")?.as_str()?;
        (0..self.coordinators.len())
            .find(|i| leader == format!("coord{i}") || leader.starts_with(&format!("coord{i}/")))
    }

    /// The job's status as `cohort-coordinator status --json` prints it (bounded by
    /// `timeout`); `None` if nobody answered or the output did not parse.
    ///
    /// # Cancel safety
    /// Cancel safe (the status process is killed when dropped).
    pub async fn status_json(&self, timeout: Duration) -> Option<serde_json::Value> {
        let mut cmd = self.command(None, &self.bins.coordinator).ok()?;
        cmd.args([
            "status",
            "--json",
            "--job",
            &self.config.job,
            "--endpoints",
            &self.endpoints(),
            "--timeout",
            &ms(timeout),
        ])
        .arg("--token-file")
        .arg(&self.token_file)
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
        let out = tokio::time::timeout(timeout + Duration::from_secs(2), cmd.output()).await.ok()?.ok()?;
        if !out.status.success() {
            return None;
        }
        serde_json::from_slice(&out.stdout).ok()
    }

    /// Bound on connecting one generation's mesh for workers started from now on
    /// (`--connect-timeout`; `None`: the worker's default).
    pub fn set_connect_timeout(&mut self, timeout: Option<Duration>) {
        self.connect_timeout = timeout;
    }

    /// `--transport` and `--algo` for workers started from now on (`cohort-worker train` only;
    /// a custom worker command takes its own flags).
    pub fn set_data_plane(&mut self, flags: DataPlaneFlags) {
        self.data_plane = flags;
    }

    /// Workers per host for workers started from now on (network namespaces only; before the
    /// first worker starts). See [`crate::placement`].
    pub fn set_ranks_per_host(&mut self, per_host: usize) {
        self.placement = Placement::new(per_host);
    }

    /// Groups the hosts (pods of one rank) of workers started from now on into nodes of
    /// `per_node`, each node with a relay directory its pods share (`COHORT_RELAY_DIR`) and
    /// named as their failure domain (`COHORT_DOMAIN`). Network namespaces only, after
    /// [`Cluster::set_ranks_per_host`] and before the first worker starts; 0 or 1: no nodes.
    pub fn set_pods_per_node(&mut self, per_node: usize) -> Result<(), ClusterError> {
        self.placement.set_pods_per_node(per_node);
        if per_node > 1 && self.relay_root.is_none() {
            let root = tempfile::Builder::new()
                .prefix("cohort-r")
                .tempdir_in("/tmp")
                .map_err(|e| ClusterError::Setup(format!("a directory for the nodes' relays: {e}")))?;
            self.relay_root = Some(root);
        }
        Ok(())
    }

    /// The node worker `name` runs on (`None` without nodes).
    pub fn worker_node(&self, name: &str) -> Option<&str> {
        self.placement.node_of(name)
    }

    /// The relay directory of `node`, made on first use.
    fn relay_dir(&self, node: &str) -> Result<PathBuf, ClusterError> {
        let root = self.relay_root.as_ref().ok_or_else(|| ClusterError::Setup("no nodes".into()))?;
        let dir = root.path().join(node);
        std::fs::create_dir_all(&dir)
            .map_err(|e| ClusterError::Setup(format!("relay directory {}: {e}", dir.display())))?;
        Ok(dir)
    }

    /// The running workers that serve their node's heartbeat relay: each holds the relay's
    /// lock file (`cohort-heartbeat-relay-*.lock`) in its node's relay directory open, which
    /// only the relay's server does. Read from `/proc/PID/fd`; empty without nodes.
    pub fn heartbeat_relay_servers(&mut self) -> Vec<String> {
        let Some(root) = self.relay_root.as_ref().map(|r| r.path().to_path_buf()) else { return Vec::new() };
        let mut servers = Vec::new();
        for (name, process) in self.workers.iter_mut() {
            if process.try_exit().is_some() {
                continue;
            }
            let Ok(fds) = std::fs::read_dir(format!("/proc/{}/fd", process.pid())) else { continue };
            let holds_lock = fds.flatten().any(|fd| {
                std::fs::read_link(fd.path()).is_ok_and(|target| {
                    let file = target.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
                    target.starts_with(&root) && file.starts_with("cohort-heartbeat-relay-") && file.ends_with(".lock")
                })
            });
            if holds_lock {
                servers.push(name.clone());
            }
        }
        servers
    }

    /// The host worker `name` runs on: its network namespace's name in the lab (`None` on the
    /// loopback, or for a worker never started).
    pub fn worker_host(&self, name: &str) -> Option<&str> {
        self.netlab.as_ref().and_then(|_| self.placement.host_of(name))
    }

    /// Every worker started so far with its host (empty on the loopback).
    pub fn hosts(&self) -> BTreeMap<String, String> {
        if self.netlab.is_some() {
            self.placement.all().clone()
        } else {
            BTreeMap::new()
        }
    }

    /// Routes the data plane of workers started by [`Cluster::spawn_worker_proxied`] through
    /// a fault-injecting proxy (created on the first call); returns it.
    pub fn enable_proxy(&mut self) -> Proxy {
        self.proxy.get_or_insert_with(Proxy::new).clone()
    }

    /// The proxy, if enabled.
    pub fn proxy(&self) -> Option<&Proxy> {
        self.proxy.as_ref()
    }

    /// Starts a worker whose data plane goes through the proxy: it binds a free port of its
    /// own choosing and advertises the proxy's listener for it; the proxy learns the real
    /// address from the worker's `event=joined ... listen=ADDR` line. Without a proxy it is
    /// [`Cluster::spawn_worker`].
    ///
    /// # Cancel safety
    /// Cancel safe up to the spawn (binding the proxy listener is the only await).
    pub async fn spawn_worker_proxied(&mut self, name: &str, spec: &WorkerSpec) -> Result<(), ClusterError> {
        let Some(proxy) = self.proxy.clone() else { return self.spawn_worker(name, spec) };
        let (advertised, upstream) =
            proxy.listen_for_later(name).await.map_err(|e| ClusterError::Setup(e.to_string()))?;
        // The worker's output reader hands its bound address to the proxy.
        let hook: LineHook = Box::new(move |line| {
            if let Some(addr) = bound_address(line) {
                upstream.set(addr);
            }
        });
        self.spawn_worker_with(name, spec, "127.0.0.1:0", &advertised.to_string(), Some(hook))?;
        if let Some(pid) = self.worker_pid(name) {
            proxy.register_pid(pid, name);
        }
        Ok(())
    }

    /// OS process id of worker `name`.
    pub fn worker_pid(&self, name: &str) -> Option<u32> {
        self.workers.get(name).map(|w| w.pid())
    }

    /// Whether worker `name` has exited (and its exit code; `None` inside: killed by a signal).
    pub fn worker_exit(&mut self, name: &str) -> Option<Option<i32>> {
        self.workers.get_mut(name)?.try_exit()
    }

    /// Starts a worker named `name` running `cohort-worker train`.
    /// With network namespaces, the worker runs on the host [`crate::placement`] gives it (a
    /// host of its own with one rank per host; see [`crate::netns`]).
    pub fn spawn_worker(&mut self, name: &str, spec: &WorkerSpec) -> Result<(), ClusterError> {
        let host = match self.netlab.as_mut() {
            Some(lab) => {
                let live: std::collections::BTreeSet<String> =
                    self.workers.iter_mut().filter_map(|(w, p)| p.try_exit().is_none().then(|| w.clone())).collect();
                let host = self.placement.place(name, |w| live.contains(w));
                lab.add_host(&host).map_err(|e| ClusterError::Setup(e.to_string()))?.to_string()
            }
            None => "127.0.0.1".into(),
        };
        self.spawn_worker_with(name, spec, &format!("{host}:0"), &host, None)
    }

    fn spawn_worker_with(
        &mut self,
        name: &str,
        spec: &WorkerSpec,
        listen: &str,
        advertise: &str,
        hook: Option<LineHook>,
    ) -> Result<(), ClusterError> {
        let placed = self.placement.host_of(name).unwrap_or(name).to_string();
        let host = self.netlab.as_ref().map(|_| placed.as_str());
        let mut cmd = match &spec.command {
            Some(template) => {
                let values = [
                    ("coordinator", self.endpoints()),
                    ("job", self.config.job.clone()),
                    ("worker_id", name.to_string()),
                    ("listen", listen.to_string()),
                    ("advertise", advertise.to_string()),
                    ("token_file", self.job_credential_file.display().to_string()),
                    ("steps", spec.steps.to_string()),
                    ("size", spec.size.clone()),
                    ("no_progress_ms", spec.no_progress.as_millis().to_string()),
                    ("step_interval_ms", spec.step_interval.as_millis().to_string()),
                ];
                let argv = expand_command(template, &values).map_err(ClusterError::Setup)?;
                let mut cmd = self.command(host, std::path::Path::new(&argv[0]))?;
                cmd.args(&argv[1..]);
                cmd
            }
            None => {
                let mut cmd = self.command(host, &self.bins.worker)?;
                cmd.args(["train", "--coordinator", &self.endpoints(), "--job", &self.config.job])
                    .args(["--steps", &spec.steps.to_string(), "--size", &spec.size])
                    .args(["--listen", listen, "--advertise", advertise, "--worker-id", name])
                    .args(["--no-progress-timeout", &ms(spec.no_progress), "--step-interval", &ms(spec.step_interval)])
                    .arg("--token-file")
                    .arg(&self.job_credential_file);
                if spec.fixed_deadlines {
                    cmd.arg("--fixed-deadlines");
                }
                cmd.args(&spec.extra_args);
                if let Some(t) = self.connect_timeout {
                    cmd.args(["--connect-timeout", &ms(t)]);
                }
                if hook.is_some() {
                    // Proxied: the network faults act on TCP links only, and workers on one
                    // host would otherwise link over shared memory, past the proxy.
                    cmd.args(["--transport", "tcp"]);
                } else if let Some(t) = &self.data_plane.transport {
                    cmd.args(["--transport", t]);
                }
                if let Some(a) = &self.data_plane.algorithm {
                    cmd.args(["--algo", a]);
                }
                if self.config.metrics {
                    cmd.args(["--metrics", &format!("{}:0", Self::host_of(listen))]);
                }
                cmd
            }
        };
        cmd.env("RUST_LOG", std::env::var("COHORT_CHAOS_WORKER_LOG").unwrap_or_else(|_| "info".into()));
        if let Some(node) = self.placement.node_of(name) {
            // A pod of a node: the node is its failure domain, and its relays are the node's,
            // through the node's relay directory.
            cmd.env("COHORT_DOMAIN", node);
            cmd.env("COHORT_RELAY_DIR", self.relay_dir(node)?);
        } else if let Some(host) = host {
            // The emulated host is the worker's failure domain (every namespace shares the
            // machine's host name).
            cmd.env("COHORT_DOMAIN", host);
        }
        let process = ManagedProcess::spawn_with_hook(name, cmd, &self.log_dir, self.lines_tx.clone(), hook)
            .map_err(|e| ClusterError::Setup(e.to_string()))?;
        self.workers.insert(name.to_string(), process);
        Ok(())
    }

    /// Sends `signal` to worker `name`; returns when (ms since the epoch) it was sent.
    pub fn signal_worker(&self, name: &str, signal: i32) -> Option<u64> {
        let w = self.workers.get(name)?;
        w.signal(signal);
        Some(now_ms())
    }

    /// Names of the workers started so far.
    pub fn worker_names(&self) -> Vec<String> {
        self.workers.keys().cloned().collect()
    }

    /// Log file of worker `name`.
    pub fn worker_log(&self, name: &str) -> Option<PathBuf> {
        self.workers.get(name).map(|w| w.log().to_path_buf())
    }

    /// Waits for the next worker event (recording it in `events`), up to `timeout`.
    ///
    /// # Cancel safety
    /// Cancel safe: an event is only taken from the channel when it is returned.
    pub async fn next_event(&mut self, timeout: Duration) -> Option<WorkerEvent> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let line = tokio::time::timeout_at(deadline, self.lines_rx.recv()).await.ok()??;
            if let Some(e) = event_of(&line) {
                self.events.push(e.clone());
                return Some(e);
            }
        }
    }

    /// Waits for an event matching `pred`, up to `timeout` (other events are recorded).
    ///
    /// # Cancel safety
    /// Cancel safe, as [`Cluster::next_event`].
    pub async fn wait_for(
        &mut self,
        what: &str,
        timeout: Duration,
        mut pred: impl FnMut(&WorkerEvent) -> bool,
    ) -> Result<WorkerEvent, ClusterError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.next_event(left).await {
                Some(e) if pred(&e) => return Ok(e),
                Some(_) => continue,
                None => return Err(ClusterError::Timeout { what: what.to_string(), after: timeout }),
            }
        }
    }

    /// Waits for every worker to exit (bounded; stragglers are killed) and returns their
    /// exit codes (`None`: killed by a signal). Events printed meanwhile are recorded.
    ///
    /// # Cancel safety
    /// Cancel safe: it only polls the workers and reads their output; dropped, the workers run
    /// on, the events read so far stay recorded and the rest wait in the channel.
    pub async fn wait_workers(&mut self, timeout: Duration) -> BTreeMap<String, Option<i32>> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut codes = BTreeMap::new();
        loop {
            for (name, w) in self.workers.iter_mut() {
                if !codes.contains_key(name) {
                    if let Some(code) = w.try_exit() {
                        codes.insert(name.clone(), code);
                    }
                }
            }
            if codes.len() == self.workers.len() {
                break;
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                for (name, w) in self.workers.iter_mut() {
                    if !codes.contains_key(name) {
                        let code = w.wait(Duration::from_millis(100)).await;
                        codes.insert(name.clone(), code);
                    }
                }
                break;
            }
            // Drain output while waiting; an exit shows up within this poll period.
            let _ = self.next_event(left.min(Duration::from_millis(50))).await;
        }
        // Collect whatever the workers printed last.
        for w in self.workers.values_mut() {
            w.drained(Duration::from_secs(2)).await;
        }
        while let Ok(line) = self.lines_rx.try_recv() {
            if let Some(e) = event_of(&line) {
                self.events.push(e);
            }
        }
        codes
    }
}

/// The data-plane address a worker bound, from its `event=joined ... listen=ADDR` line.
fn bound_address(line: &str) -> Option<std::net::SocketAddr> {
    line.parse::<Event>().ok()?.get::<ev::Joined>()?.listen
}

/// The worker event on an output line, if it is one. Other output (logs) is skipped; a line
/// that claims to be an event but has an unknown kind or does not parse is logged as a warning,
/// since the worker and the harness then disagree on the protocol.
fn event_of(line: &OutputLine) -> Option<WorkerEvent> {
    match WorkerEvent::parse(&line.name, &line.line, line.read_ms) {
        Ok(e) => Some(e),
        Err(EventParseError::NotAnEvent) => None,
        Err(EventParseError::Malformed(_)) if !line.line.trim_start().starts_with("event=") => None,
        Err(error) => {
            tracing::warn!(worker = %line.name, line = %line.line, %error, "skipping an event line the harness cannot read");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::expand_command;

    #[test]
    fn a_worker_command_template_is_filled_and_unknown_placeholders_are_errors() {
        let values = [("coordinator", "http://a:1,http://b:2".to_string()), ("worker_id", "w3".to_string())];
        let template: Vec<String> = ["{python}", "ex.py", "--coordinator={coordinator}", "--id", "{worker_id}"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let argv = expand_command(&template, &values).expect("expands");
        assert_eq!(&argv[1..], ["ex.py", "--coordinator=http://a:1,http://b:2", "--id", "w3"]);
        assert!(!argv[0].is_empty());
        let bad: Vec<String> = vec!["x".into(), "{nope}".into()];
        assert!(expand_command(&bad, &values).unwrap_err().contains("unknown placeholder {nope}"));
        assert!(expand_command(&["{job".to_string()], &values).unwrap_err().contains("unclosed"));
        assert!(expand_command(&[], &values).is_err());
    }

    use super::find_python;
    use std::path::Path;

    #[test]
    fn the_python_venv_is_found_from_the_binary_or_the_workspace_or_named() {
        let root = tempfile::tempdir().expect("tempdir");
        let target = root.path().join("target");
        let release = target.join("release");
        std::fs::create_dir_all(release.join("deps")).expect("dirs");
        let exe = release.join("cohort-chaos");
        let never = || -> bool { panic!("python3 is asked only when no venv is found") };
        // COHORT_PYTHON first.
        assert_eq!(find_python(Some("/opt/py".into()), Some(&exe), root.path(), never), Ok("/opt/py".into()));
        // No venv, and python3 without the package: one line that says what to run.
        let err = find_python(None, Some(&exe), root.path(), || false).unwrap_err();
        assert!(err.contains("bash scripts/python-env.sh") && !err.contains('\n'), "{err}");
        assert_eq!(find_python(None, Some(&exe), root.path(), || true), Ok("python3".into()));
        // target/pyenv, from the release binary, from a test binary in deps/, and from the
        // workspace when the binary lives elsewhere.
        let venv = target.join("pyenv/bin");
        std::fs::create_dir_all(&venv).expect("venv");
        std::fs::write(venv.join("python"), "").expect("python");
        let want = Ok(venv.join("python").display().to_string());
        assert_eq!(find_python(None, Some(&exe), Path::new("/nonexistent"), never), want);
        assert_eq!(find_python(Some(String::new()), Some(&release.join("deps/t")), Path::new("/x"), never), want);
        assert_eq!(find_python(None, Some(Path::new("/usr/bin/cohort-chaos")), root.path(), never), want);
        assert_eq!(find_python(None, None, root.path(), never), want);
    }

    use super::bound_address;

    #[test]
    fn the_bound_address_comes_from_the_joined_line_only() {
        let line = "event=joined worker=w1 incarnation=3 addr=127.0.0.1:4000 listen=127.0.0.1:38073 t_ms=1";
        assert_eq!(bound_address(line), Some("127.0.0.1:38073".parse().unwrap()));
        assert_eq!(bound_address("event=joined worker=w1 addr=127.0.0.1:4000 t_ms=1"), None);
        assert_eq!(bound_address("event=generation listen=127.0.0.1:1 t_ms=1"), None);
        assert_eq!(bound_address("event=joined listen=nonsense"), None);
    }
}
