//! The coordinators and the store under measurement: `cohort-coordinator` processes, a private
//! etcd's metrics, and the CPU time of a process.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

/// Bound on starting a coordinator or etcd.
pub(crate) const START_BOUND: Duration = Duration::from_secs(60);

/// A `cohort-coordinator` process; killed when dropped.
pub(crate) struct Coordinator {
    child: std::process::Child,
    pub(crate) addr: SocketAddr,
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Coordinator {
    pub(crate) fn start(
        store: &str,
        members: usize,
        index: usize,
        max_txn_ops: Option<u32>,
        lease_scope: &str,
        whole_answer_up_to: Option<u32>,
        heartbeat: Option<Duration>,
    ) -> Result<Self, String> {
        let max = members.to_string();
        // COHORT_SCALE_LOG=PREFIX keeps each replica's log (RUST_LOG=info) in PREFIX.<index>.
        let (log, stderr) = match std::env::var("COHORT_SCALE_LOG") {
            Ok(prefix) => {
                let file = std::fs::File::create(format!("{prefix}.{index}")).map_err(|e| format!("log file: {e}"))?;
                ("info", std::process::Stdio::from(file))
            }
            Err(_) => ("warn", std::process::Stdio::null()),
        };
        // COHORT_SCALE_COORDINATOR=PATH runs another build of the coordinator (an older commit's,
        // to compare before and after on one machine in one sitting).
        let binary = std::env::var("COHORT_SCALE_COORDINATOR")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_cohort-coordinator").into());
        let mut command = std::process::Command::new(binary);
        command.args(["serve", "--listen", "127.0.0.1:0", "--store", store]);
        if lease_scope != "member" {
            command.args(["--lease-scope", lease_scope]);
        }
        if let Some(n) = max_txn_ops {
            command.args(["--etcd-max-txn-ops", &n.to_string()]);
        }
        if let Some(n) = whole_answer_up_to {
            command.args(["--whole-answer-up-to", &n.to_string()]);
        }
        if let Some(interval) = heartbeat {
            // A lease of six intervals, as the defaults (500 ms, 3 s) have.
            let (interval, lease) = (interval.as_millis(), (interval * 6).as_millis());
            command.args(["--heartbeat-interval", &format!("{interval}ms"), "--lease-ttl", &format!("{lease}ms")]);
        }
        let mut child = command
            .args(["--min-workers", "1", "--max-workers", &max, "--join-window", "60s"])
            .args(["--elastic-timeout", "300s"])
            .env("RUST_LOG", log)
            .stdout(std::process::Stdio::piped())
            .stderr(stderr)
            .spawn()
            .map_err(|e| format!("starting cohort-coordinator: {e}"))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        // Its `listening on` line (after a `metrics on` one, when it serves metrics).
        let addr = cohort_coordinator::announce::await_listening(stdout, START_BOUND)?;
        Ok(Self { child, addr })
    }

    /// CPU time used so far (user + system), from `/proc/PID/stat`.
    pub(crate) fn cpu(&self) -> Duration {
        cpu_of(self.child.id())
    }

    /// Peak resident memory, bytes (`VmHWM` of `/proc/PID/status`).
    pub(crate) fn peak_rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    }
}

/// CPU time a process has used (user + system).
pub(crate) fn cpu_of(pid: u32) -> Duration {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return Duration::ZERO };
    let Some(close) = stat.rfind(')') else { return Duration::ZERO };
    let fields: Vec<u64> = stat[close + 2..].split_whitespace().map(|f| f.parse().unwrap_or(0)).collect();
    // SAFETY: sysconf with a valid name has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Duration::from_micros((fields.get(11).unwrap_or(&0) + fields.get(12).unwrap_or(&0)) * 1_000_000 / ticks)
}

/// etcd's `/metrics` text (plain HTTP on its client port).
pub(crate) fn etcd_metrics(endpoint: &str) -> Result<String, String> {
    let hostport = endpoint.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(hostport).map_err(|e| format!("etcd metrics: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {hostport}\r\n\r\n").map_err(|e| e.to_string())?;
    let mut body = String::new();
    s.read_to_string(&mut body).map_err(|e| format!("etcd metrics: {e}"))?;
    Ok(body)
}

/// The metrics of interest from etcd's `/metrics` (plain HTTP on its client port).
pub(crate) fn etcd_counters(endpoint: &str) -> Result<Vec<(String, f64)>, String> {
    let body = etcd_metrics(endpoint)?;
    const WANTED: [&str; 4] = [
        "etcd_disk_wal_write_bytes_total",
        "etcd_mvcc_put_total",
        "etcd_server_proposals_committed_total",
        "etcd_network_client_grpc_received_bytes_total",
    ];
    Ok(WANTED
        .iter()
        .map(|name| {
            let v = body
                .lines()
                .filter_map(|l| l.strip_prefix(name))
                .filter_map(|rest| rest.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            (name.to_string(), v)
        })
        .collect())
}

/// The etcd requests of interest, by gRPC method, as etcd's `grpc_server_started_total`
/// counts them (unary calls; for the lease keep-alive and watch streams, messages received).
pub(crate) const ETCD_METHODS: [(&str, &str); 8] = [
    ("put", "Put"),
    ("txn", "Txn"),
    ("range", "Range"),
    ("delete", "DeleteRange"),
    ("grant", "LeaseGrant"),
    ("revoke", "LeaseRevoke"),
    ("ttl", "LeaseTimeToLive"),
    ("keepalive", "LeaseKeepAlive"),
];

/// etcd's request counts by method (see [`ETCD_METHODS`]), read from its `/metrics`.
pub(crate) fn etcd_requests(endpoint: &str) -> Result<Vec<f64>, String> {
    let body = etcd_metrics(endpoint)?;
    let count = |family: &str, method: &str| -> f64 {
        let label = format!("grpc_method=\"{method}\"");
        body.lines()
            .filter(|l| l.starts_with(family) && l.contains(&label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    Ok(ETCD_METHODS
        .iter()
        .map(|(_, m)| {
            if *m == "LeaseKeepAlive" {
                count("grpc_server_msg_received_total{", m)
            } else {
                count("grpc_server_started_total{", m)
            }
        })
        .collect())
}

/// What etcd served between two [`etcd_requests`] snapshots, per member: ` etcd_PHASE=put:..,txn:..`.
pub(crate) fn etcd_phase(phase: &str, before: &[f64], after: &[f64], members: usize) -> String {
    let parts: Vec<String> = ETCD_METHODS
        .iter()
        .zip(after.iter().zip(before))
        .map(|((name, _), (a, b))| format!("{name}:{:.2}", (a - b) / members as f64))
        .collect();
    format!(" etcd_{phase}_per_member={}", parts.join(","))
}
