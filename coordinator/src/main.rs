//! `cohort-coordinator`: run a coordinator replica (`serve`, the default), print a job's
//! status (`status`), or print a job's credential (`credential`).

use clap::{Args, Parser, Subcommand};
use cohort_coordinator::config::{parse_duration, Overrides, Settings};
use cohort_coordinator::server::{ServeConfig, TlsFiles};
use cohort_coordinator::store::etcd::{EtcdSecurity, EtcdTuning};
use cohort_coordinator::store::{OpenStoreError, StoreSpec};
use cohort_proto::v1 as pb;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// The coordinator allocates and frees many small objects per request (answers, member
/// entries, watch events) on every runtime thread at once; glibc's allocator spent a third
/// of the coordinator's CPU on that at 16,384 members (docs/benchmarks-journal.md, "The
/// coordinator's allocator"). Built without transparent huge pages (the `no_thp` feature,
/// coordinator/Cargo.toml).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "cohort-coordinator",
    version,
    about = "cohort control plane: membership, rendezvous and revocation for elastic jobs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a coordinator replica (the default when the first argument is a flag).
    Serve(Box<ServeArgs>),
    /// Print a job's members, generation and progress.
    Status(StatusArgs),
    /// Print the credential of one job, derived from the operator secret: give it to that
    /// job's workers (their --token-file) instead of the operator secret.
    Credential(CredentialArgs),
}

#[derive(Args)]
struct CredentialArgs {
    /// The job id.
    #[arg(long)]
    job: String,
    /// File holding the operator secret (the coordinators' --token-file; also accepted: env
    /// COHORT_TOKEN).
    #[arg(long)]
    token_file: Option<PathBuf>,
}

fn duration(text: &str) -> Result<Duration, String> {
    parse_duration(text)
}

#[derive(Args)]
struct ServeArgs {
    /// gRPC listen address (port 0 picks a free port; the bound address is printed).
    #[arg(long, default_value = "127.0.0.1:7470")]
    listen: String,
    /// `memory` (embedded, one replica) or `etcd://HOST:PORT[,HOST:PORT...]`.
    #[arg(long, default_value = "memory")]
    store: StoreSpec,
    /// PEM file of the CA that signed etcd's client certificates: speak TLS to etcd.
    #[arg(long)]
    etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for an etcd that runs with --client-cert-auth (needs --etcd-ca).
    #[arg(long, requires_all = ["etcd_key", "etcd_ca"])]
    etcd_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, requires = "etcd_cert")]
    etcd_key: Option<PathBuf>,
    /// etcd user name, for an etcd with authentication enabled (password: --etcd-password-file).
    #[arg(long, requires = "etcd_password_file")]
    etcd_user: Option<String>,
    /// File holding the etcd user's password.
    #[arg(long, requires = "etcd_user")]
    etcd_password_file: Option<PathBuf>,
    /// Most operations in one shared etcd transaction: set it to the cluster's
    /// `--max-txn-ops` when that is not etcd's default of 128 (etcd store only).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    etcd_max_txn_ops: Option<u32>,
    /// TOML settings file (`[defaults]`, `[jobs.<id>]`).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Fewest workers per generation.
    #[arg(long)]
    min_workers: Option<u32>,
    /// Most workers per generation.
    #[arg(long)]
    max_workers: Option<u32>,
    /// Join window after the last arrival (e.g. 500ms, 2s).
    #[arg(long, value_parser = duration)]
    join_window: Option<Duration>,
    /// Heartbeat interval the members use.
    #[arg(long, value_parser = duration)]
    heartbeat_interval: Option<Duration>,
    /// Time without heartbeat after which a member is dead.
    #[arg(long, value_parser = duration)]
    lease_ttl: Option<Duration>,
    /// How long a job below min_workers waits before it fails.
    #[arg(long, value_parser = duration)]
    elastic_timeout: Option<Duration>,
    /// What to do about a straggler (a member persistently slower than the others):
    /// `report` (name it in status, metrics and logs) or `exclude` (also make it leave at
    /// its next commit point and refuse its join for --straggler-cooldown).
    #[arg(long)]
    straggler_policy: Option<String>,
    /// How long an excluded straggler's join is refused (e.g. 60s).
    #[arg(long, value_parser = duration)]
    straggler_cooldown: Option<Duration>,
    /// Whose store lease a member's records are on: `member` (its own; every heartbeat renews
    /// it) or `host` (one lease per host of the job, or per failure domain where workers name
    /// one, renewed by any of its members' heartbeats; a member silent while its host-mates beat is swept by the leader). `host`
    /// cuts etcd's lease grants and renewals by the ranks per host: for jobs of thousands.
    #[arg(long)]
    lease_scope: Option<String>,
    /// The largest generation answered with the whole member list to workers that ask for a
    /// sparse view (default 256); above it each worker gets its partners' and host's entries
    /// and the host layout, and resolves other peers on first use. RDMA meshes need the
    /// whole list.
    #[arg(long)]
    whole_answer_up_to: Option<u32>,
    /// Leader lease TTL (replicas on etcd).
    #[arg(long, value_parser = duration, default_value = "3s")]
    leader_ttl: Duration,
    /// Failures of one worker within --exclusion-window that exclude it.
    #[arg(long, default_value_t = 3)]
    exclusion_threshold: usize,
    /// The sliding window failures are counted in.
    #[arg(long, value_parser = duration, default_value = "10m")]
    exclusion_window: Duration,
    /// The first exclusion's length (each further one doubles it).
    #[arg(long, value_parser = duration, default_value = "30s")]
    exclusion_cooldown: Duration,
    /// The longest exclusion.
    #[arg(long, value_parser = duration, default_value = "30m")]
    exclusion_max_cooldown: Duration,
    /// How long an ended job's record is kept, so that late callers are told how it ended;
    /// after it, the job leaves no key in the store.
    #[arg(long, value_parser = duration, default_value = "10m")]
    ended_ttl: Duration,
    /// Serve Prometheus metrics on this address (`GET /metrics`).
    #[arg(long)]
    metrics: Option<String>,
    /// File holding the operator secret (also accepted: env COHORT_TOKEN). Requests must carry
    /// it or a job credential derived from it (`cohort-coordinator credential`).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Files holding operator secrets being rotated out: still accepted, with their job
    /// credentials, until removed (repeatable).
    #[arg(long)]
    previous_token_file: Vec<PathBuf>,
    /// Server certificate (PEM) for TLS.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Server private key (PEM) for TLS.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// This replica's name in the leader key (default host/pid/address).
    #[arg(long)]
    name: Option<String>,
}

#[derive(Args)]
struct StatusArgs {
    /// The job id.
    #[arg(long)]
    job: String,
    /// Coordinator endpoints (`http://HOST:PORT`, comma separated; any replica answers).
    #[arg(long, value_delimiter = ',', default_value = "http://127.0.0.1:7470")]
    endpoints: Vec<String>,
    /// File holding the job token (also accepted: env COHORT_TOKEN).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// PEM file of the CA that signed the coordinators' certificates, for `https://`
    /// endpoints (a bare HOST:PORT then means https).
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    /// How long to wait for an answer.
    #[arg(long, value_parser = duration, default_value = "5s")]
    timeout: Duration,
    /// Print one JSON object (for scripts) instead of the table.
    #[arg(long)]
    json: bool,
    /// Above this many members, print a summary (counts, spreads, and the outliers by name)
    /// instead of one row per member.
    #[arg(long, default_value_t = 64)]
    rows: usize,
    /// How many outliers the summary names.
    #[arg(long, default_value_t = 20)]
    outliers: usize,
    /// One row per member whatever the job's size.
    #[arg(long)]
    all: bool,
}

#[derive(Debug, thiserror::Error)]
enum CliError {
    #[error("{0}")]
    Config(#[from] cohort_coordinator::config::ConfigError),
    #[error("reading {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("etcd password: {0}")]
    Secret(String),
    #[error("{0}")]
    Flags(String),
    #[error("job {0} does not exist here: no worker has joined it (or it ended and its record expired)")]
    UnknownJob(String),
    #[error("{0}")]
    Store(#[from] OpenStoreError),
    #[error("{0}")]
    Serve(#[from] cohort_coordinator::ServeError),
    #[error("binding {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error("no coordinator answered ({0})")]
    Unreachable(String),
    #[error("the coordinator refused: {0}")]
    Refused(String),
    #[error("{0}")]
    Exclusion(String),
}

fn read_token(file: Option<&PathBuf>) -> Result<Option<String>, CliError> {
    if let Some(path) = file {
        let text = std::fs::read_to_string(path)
            .map_err(|source| CliError::Read { path: path.display().to_string(), source })?;
        return Ok(Some(text.trim().to_string()).filter(|t| !t.is_empty()));
    }
    Ok(std::env::var("COHORT_TOKEN").ok().map(|t| t.trim().to_string()).filter(|t| !t.is_empty()))
}

fn read(path: &PathBuf) -> Result<Vec<u8>, CliError> {
    std::fs::read(path).map_err(|source| CliError::Read { path: path.display().to_string(), source })
}

/// TLS and credentials for etcd, from the `--etcd-*` flags.
fn etcd_security(args: &ServeArgs) -> Result<EtcdSecurity, CliError> {
    let client_identity = match (&args.etcd_cert, &args.etcd_key) {
        (Some(c), Some(k)) => Some((read(c)?, read(k)?)),
        _ => None,
    };
    let user = match (&args.etcd_user, &args.etcd_password_file) {
        (Some(name), Some(file)) => {
            let password = String::from_utf8(read(file)?)
                .map_err(|_| CliError::Secret(format!("{} is not UTF-8", file.display())))?
                .trim_end_matches(['\r', '\n'])
                .to_string();
            if password.is_empty() {
                return Err(CliError::Secret(format!("{} is empty", file.display())));
            }
            Some((name.clone(), password))
        }
        _ => None,
    };
    Ok(EtcdSecurity { ca_pem: args.etcd_ca.as_ref().map(read).transpose()?, client_identity, user })
}

/// Connections the listener queues before it accepts them. A job's workers connect at once
/// when it starts (or restarts), thousands of them; tokio's default of 1,024 drops the SYNs
/// past it, and those workers then wait out TCP's retransmission (1 s, then 3 s) and their
/// connect timeout. The kernel caps it at `net.core.somaxconn` (4,096 by default).
const LISTEN_BACKLOG: u32 = 16_384;

async fn bind(addr: &str) -> Result<tokio::net::TcpListener, CliError> {
    let error = |source| CliError::Bind { addr: addr.into(), source };
    let mut last = None;
    for resolved in tokio::net::lookup_host(addr).await.map_err(error)? {
        let socket = if resolved.is_ipv4() { tokio::net::TcpSocket::new_v4() } else { tokio::net::TcpSocket::new_v6() }
            .map_err(error)?;
        socket.set_reuseaddr(true).map_err(error)?;
        match socket.bind(resolved).and_then(|()| socket.listen(LISTEN_BACKLOG)) {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some(e),
        }
    }
    Err(error(last.unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "no address to bind"))))
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = term => tracing::info!("SIGTERM: shutting down"),
        r = tokio::signal::ctrl_c() => match r {
            Ok(()) => tracing::info!("SIGINT: shutting down"),
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGINT");
                std::future::pending::<()>().await;
            }
        },
    }
}

async fn serve(args: ServeArgs) -> Result<(), CliError> {
    let cli = Overrides {
        min_workers: args.min_workers,
        max_workers: args.max_workers,
        join_window_ms: args.join_window.map(|d| d.as_millis() as u64),
        heartbeat_interval_ms: args.heartbeat_interval.map(|d| d.as_millis() as u64),
        lease_ttl_ms: args.lease_ttl.map(|d| d.as_millis() as u64),
        elastic_timeout_ms: args.elastic_timeout.map(|d| d.as_millis() as u64),
        straggler_policy: args.straggler_policy.clone(),
        straggler_cooldown_ms: args.straggler_cooldown.map(|d| d.as_millis() as u64),
        lease_scope: args.lease_scope.clone(),
        whole_answer_up_to: args.whole_answer_up_to,
    };
    let settings = Settings::from_file(args.config.as_deref(), &cli)?;
    let exclusion = cohort_coordinator::ExclusionPolicy {
        threshold: args.exclusion_threshold,
        window: args.exclusion_window,
        base_cooldown: args.exclusion_cooldown,
        max_cooldown: args.exclusion_max_cooldown,
    };
    exclusion.validate().map_err(CliError::Exclusion)?;
    let token = read_token(args.token_file.as_ref())?;
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(c), Some(k)) => Some(TlsFiles { cert_pem: read(c)?, key_pem: read(k)? }),
        _ => None,
    };
    let tuning = args.etcd_max_txn_ops.map(|n| EtcdTuning { max_txn_ops: n as usize });
    let store = args.store.open_tuned(&etcd_security(&args)?, tuning).await?;
    let listener = bind(&args.listen).await?;
    let metrics = match &args.metrics {
        Some(a) => Some(bind(a).await?),
        None => None,
    };
    let mut config = ServeConfig::new(store, settings);
    config.token = token;
    for file in &args.previous_token_file {
        match read_token(Some(file))? {
            Some(t) => config.previous_tokens.push(t),
            None => return Err(CliError::Flags(format!("--previous-token-file {} is empty", file.display()))),
        }
    }
    if config.token.is_none() && !config.previous_tokens.is_empty() {
        return Err(CliError::Flags("--previous-token-file needs the current secret (--token-file)".into()));
    }
    config.tls = tls;
    config.metrics = metrics;
    config.replica_name = args.name.clone();
    config.leader_ttl = args.leader_ttl;
    config.exclusion = exclusion;
    if args.ended_ttl < Duration::from_secs(1) {
        return Err(CliError::Flags("--ended-ttl must be at least 1s (leases have a resolution of 1 s)".into()));
    }
    config.ended_ttl = args.ended_ttl;
    let handle = cohort_coordinator::start(config, listener).await?;
    if let Some(m) = handle.metrics_addr() {
        tracing::info!(address = %m, "metrics at /metrics");
        // Machine-readable, like the line below (launchers learn a port-0 address from it).
        println!("{}", cohort_coordinator::announce::metrics_line(m));
    }
    println!("{}", cohort_coordinator::announce::listening_line(handle.local_addr()));
    let _ = std::io::stdout().flush();
    shutdown_signal().await;
    handle.shutdown().await?;
    Ok(())
}

fn ago(now_ms: u64, then_ms: u64) -> String {
    if then_ms == 0 {
        return "-".into();
    }
    let d = now_ms.saturating_sub(then_ms);
    if d < 10_000 {
        format!("{:.1}s", d as f64 / 1000.0)
    } else {
        format!("{}s", d / 1000)
    }
}

/// Milliseconds since the Unix epoch, now (the ages `status` prints are relative to it).
fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Prints the status: one row per member, or with `summary_outliers` a summary naming at most
/// that many outliers (see `status_summary`).
fn print_status(s: &pb::StatusResponse, summary_outliers: Option<usize>) {
    let now = now_ms();
    println!("job: {}", s.job);
    if let Some(set) = &s.settings {
        println!(
            "settings: min {} max {} join window {} ms heartbeat {} ms lease {} ms elastic timeout {} ms",
            set.min_workers,
            set.max_workers,
            set.join_window_ms,
            set.heartbeat_interval_ms,
            set.lease_ttl_ms,
            set.elastic_timeout_ms
        );
        println!(
            "straggler policy: {} (cool-down {} ms)",
            if set.straggler_policy.is_empty() { "report" } else { &set.straggler_policy },
            set.straggler_cooldown_ms
        );
    }
    match &s.current {
        Some(g) => println!(
            "generation: {} ({} members, formed {} ago){}",
            g.number,
            g.members.len(),
            ago(now, g.formed_at_ms),
            if s.current_revoked { ", REVOKED" } else { "" }
        ),
        None => println!("generation: none yet"),
    }
    if let Some(c) = &s.revocation_cause {
        println!(
            "revoked by: rank {} worker {} host {} reason {:?} (reported by {})",
            c.rank.map_or_else(|| "?".to_string(), |r| r.to_string()),
            if c.worker_id.is_empty() { "?" } else { &c.worker_id },
            if c.host.is_empty() { "?" } else { &c.host },
            c.reason,
            c.reported_by
        );
    }
    if let Some(e) = &s.ended {
        let outcome = pb::job_ended::Outcome::try_from(e.outcome).map(|o| o.as_str_name()).unwrap_or("UNKNOWN");
        println!("ended: {outcome}: {}", e.reason);
    }
    println!("leader: {}", if s.leader.is_empty() { "(none)" } else { &s.leader });
    println!();
    if let Some(limit) = summary_outliers {
        print!("{}", cohort_coordinator::status_summary::summarize(&s.members, now, limit));
        println!("(a summary of {} members: --all for one row each, --json for everything)", s.members.len());
    } else {
        print_member_rows(s, now);
    }
    print_notes(s, now);
}

/// One row per member, by rank.
fn print_member_rows(s: &pb::StatusResponse, now: u64) {
    println!(
        "{:>5}  {:<24} {:<20} {:<20} {:>10} {:>6} {:>10} {:<16} {:>11} {:>7} {:>7}  {:<8}",
        "RANK",
        "WORKER",
        "HOST",
        "DOMAIN",
        "HEARTBEAT",
        "GEN",
        "STEP",
        "ACTIVITY",
        "LAST COMMIT",
        "WAITING",
        "CONTROL",
        "DEADLINE"
    );
    let mut members = s.members.clone();
    members.sort_by_key(|m| (m.rank.unwrap_or(u32::MAX), m.worker_id.clone()));
    for m in &members {
        println!(
            "{:>5}  {:<24} {:<20} {:<20} {:>10} {:>6} {:>10} {:<16} {:>11} {:>7} {:>7}  {}",
            m.rank.map_or_else(|| "-".to_string(), |r| r.to_string()),
            m.worker_id,
            m.host,
            if m.domain.is_empty() { "-" } else { &m.domain },
            ago(now, m.last_heartbeat_ms),
            m.generation,
            m.step,
            m.activity,
            m.last_commit_step,
            if m.waiting { "yes" } else { "no" },
            match m.control_connected {
                Some(true) => "open",
                Some(false) => "CLOSED",
                None => "-",
            },
            if m.deadlines.is_empty() { "-" } else { &m.deadlines }
        );
    }
}

/// The stragglers, exclusions and digest mismatches, by name (few, whatever the job's size).
fn print_notes(s: &pb::StatusResponse, now: u64) {
    let mut members: Vec<&pb::MemberStatus> = s.members.iter().filter(|m| m.straggler.is_some()).collect();
    members.sort_by_key(|m| (m.rank.unwrap_or(u32::MAX), m.worker_id.clone()));
    for m in members {
        if let Some(v) = &m.straggler {
            println!(
                "STRAGGLER: rank {} worker {} ({} slow, {:.1}x, {} reports, named {} ago): {}; action: {}",
                m.rank.map_or_else(|| "-".to_string(), |r| r.to_string()),
                m.worker_id,
                v.kind,
                v.ratio,
                v.reports,
                ago(now, v.since_ms),
                v.reason,
                v.action
            );
        }
    }
    for x in &s.exclusions {
        println!(
            "EXCLUDED: worker {} until {} ({:.1}s from now): {}",
            x.worker_id,
            x.until_ms,
            x.until_ms.saturating_sub(now) as f64 / 1000.0,
            if x.reason.is_empty() { "-" } else { &x.reason }
        );
    }
    for m in &s.digest_mismatches {
        let commits: Vec<String> =
            m.commits.iter().map(|c| format!("{} {}", c.worker_id, c.digest.get(..12).unwrap_or(&c.digest))).collect();
        println!(
            "DIGEST MISMATCH: generation {} step {} committed with different state by: {}",
            m.generation,
            m.step,
            commits.join(", ")
        );
    }
}

/// The status as one JSON object (`cohort_coordinator::status_view::JobStatus`, the types
/// the status page's JSON shares).
fn status_json(s: &pb::StatusResponse) -> String {
    let view = cohort_coordinator::status_view::JobStatus::new(s, now_ms());
    serde_json::to_string(&view).unwrap_or_else(|e| format!("{{\"error\":\"cannot encode the status: {e}\"}}"))
}

enum Attempt {
    /// This endpoint could not be reached: try the next.
    Unreachable(String),
    /// The coordinator answered with an error: stop.
    Refused(String),
    /// The coordinator answered NOT_FOUND: the job does not exist (with the leader's name,
    /// empty when none leads).
    UnknownJob(String),
}

async fn status_once(
    url: String,
    args: &StatusArgs,
    token: Option<&str>,
    ca: Option<&[u8]>,
) -> Result<pb::StatusResponse, Attempt> {
    let mut endpoint = tonic::transport::Endpoint::from_shared(url.clone())
        .map_err(|e| Attempt::Unreachable(e.to_string()))?
        .connect_timeout(args.timeout)
        .timeout(args.timeout);
    if url.starts_with("https://") {
        let ca = ca.ok_or_else(|| Attempt::Refused(format!("{url} is https: give the CA certificate (--tls-ca)")))?;
        let tls = tonic::transport::ClientTlsConfig::new().ca_certificate(tonic::transport::Certificate::from_pem(ca));
        endpoint = endpoint.tls_config(tls).map_err(|e| Attempt::Refused(format!("TLS for {url}: {e}")))?;
    } else if ca.is_some() {
        return Err(Attempt::Refused(format!(
            "{url} is http:// but a CA certificate is given (--tls-ca): use https://"
        )));
    }
    let channel = endpoint.connect().await.map_err(|e| Attempt::Unreachable(e.to_string()))?;
    let mut client = pb::coordinator_client::CoordinatorClient::new(channel);
    let mut request = tonic::Request::new(pb::StatusRequest { job: args.job.clone() });
    if let Some(t) = token {
        let value =
            format!("Bearer {t}").parse().map_err(|_| Attempt::Refused("the token is not valid metadata".into()))?;
        request.metadata_mut().insert(cohort_proto::AUTHORIZATION_HEADER, value);
    }
    match client.status(request).await {
        Ok(r) => Ok(r.into_inner()),
        Err(s)
            if matches!(
                s.code(),
                tonic::Code::Unavailable
                    | tonic::Code::Unknown
                    | tonic::Code::DeadlineExceeded
                    | tonic::Code::Cancelled
            ) =>
        {
            Err(Attempt::Unreachable(format!("{:?}: {}", s.code(), s.message())))
        }
        Err(s) if s.code() == tonic::Code::NotFound => Err(Attempt::UnknownJob(
            s.metadata().get(cohort_proto::LEADER_HEADER).and_then(|v| v.to_str().ok()).unwrap_or_default().to_string(),
        )),
        Err(s) => Err(Attempt::Refused(format!("{:?}: {}", s.code(), s.message()))),
    }
}

async fn status(args: StatusArgs) -> Result<(), CliError> {
    let token = read_token(args.token_file.as_ref())?;
    let ca = match &args.tls_ca {
        Some(path) => {
            Some(std::fs::read(path).map_err(|source| CliError::Read { path: path.display().to_string(), source })?)
        }
        None => None,
    };
    let mut errors = Vec::new();
    for raw in &args.endpoints {
        let url = if raw.contains("://") {
            raw.clone()
        } else if ca.is_some() {
            format!("https://{raw}")
        } else {
            format!("http://{raw}")
        };
        match tokio::time::timeout(args.timeout, status_once(url, &args, token.as_deref(), ca.as_deref())).await {
            Ok(Err(Attempt::UnknownJob(leader))) => {
                // Said plainly (exit 1), with the leader, which is known regardless.
                if args.json {
                    let unknown = cohort_coordinator::status_view::UnknownJob {
                        job: args.job.clone(),
                        exists: false,
                        leader: (!leader.is_empty()).then(|| leader.clone()),
                    };
                    println!("{}", serde_json::to_string(&unknown).unwrap_or_default());
                } else {
                    println!("leader: {}", if leader.is_empty() { "(none)" } else { &leader });
                }
                return Err(CliError::UnknownJob(args.job.clone()));
            }
            Ok(Ok(s)) => {
                if args.json {
                    println!("{}", status_json(&s));
                } else {
                    print_status(&s, (!args.all && s.members.len() > args.rows).then_some(args.outliers));
                }
                return Ok(());
            }
            Ok(Err(Attempt::Refused(e))) => return Err(CliError::Refused(format!("{raw}: {e}"))),
            Ok(Err(Attempt::Unreachable(e))) => errors.push(format!("{raw}: {e}")),
            Err(_) => errors.push(format!("{raw}: no answer within {:?}", args.timeout)),
        }
    }
    Err(CliError::Unreachable(errors.join("; ")))
}

/// Prints the credential of `args.job`.
fn credential(args: CredentialArgs) -> Result<(), CliError> {
    cohort_coordinator::check_id("job", &args.job).map_err(|s| CliError::Flags(s.message().to_string()))?;
    let Some(secret) = read_token(args.token_file.as_ref())? else {
        return Err(CliError::Flags("no operator secret: give --token-file (or COHORT_TOKEN)".into()));
    };
    println!("{}", cohort_proto::credentials::job_token(secret.as_bytes(), &args.job));
    Ok(())
}

fn main() -> ExitCode {
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Some(first) = args.get(1).and_then(|a| a.to_str()) {
        if first.starts_with('-') && !matches!(first, "-h" | "--help" | "-V" | "--version") {
            args.insert(1, "serve".into());
        }
    }
    let cli = Cli::parse_from(args);
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cohort-coordinator: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Serve(a) => serve(*a).await,
            Command::Status(a) => status(a).await,
            Command::Credential(a) => credential(a),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cohort-coordinator: {e}");
            ExitCode::FAILURE
        }
    }
}
