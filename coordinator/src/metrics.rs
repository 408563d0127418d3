//! Prometheus metrics in the text exposition format, served by a minimal HTTP/1.1
//! responder (`GET /metrics`) on a tokio listener.
//!
//! Job gauges (`cohort_members`, `cohort_generation`) are kept by the leading replica,
//! which evaluates every job; counters count what this replica did.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Upper bounds (seconds) of the formation latency histogram buckets.
const BUCKETS: [f64; 12] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

#[derive(Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    sum: f64,
    count: u64,
}

/// The coordinator's metrics.
#[derive(Default)]
pub struct Metrics {
    generations_formed: AtomicU64,
    revocations: AtomicU64,
    is_leader: AtomicBool,
    jobs: Mutex<BTreeMap<String, (u64, u64)>>,
    rpcs: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    formation: Mutex<Histogram>,
    digest_mismatches: Mutex<BTreeMap<String, u64>>,
    /// Stragglers named, by job and kind (compute, link).
    stragglers_named: Mutex<BTreeMap<(String, &'static str), u64>>,
    /// Stragglers excluded, by job.
    stragglers_excluded: Mutex<BTreeMap<String, u64>>,
    /// Members named stragglers now, by job (as this replica saw their heartbeats).
    stragglers_now: Mutex<BTreeMap<String, BTreeMap<String, ()>>>,
    /// Keys under the jobs prefix at the last census (`None` before the first).
    store_keys: Mutex<Option<u64>>,
    /// The store whose request batching is rendered (`cohort_etcd_*`), once set.
    store: std::sync::OnceLock<Arc<dyn crate::store::Store>>,
    /// Watch streams open now that carry events, and quiet ones (a member's own, its host's
    /// event relay carrying its events).
    watches_events: AtomicU64,
    watches_quiet: AtomicU64,
    /// Members the leader swept silent off their host's shared lease.
    members_swept: AtomicU64,
    /// Hosts' shared leases this replica granted (`lease_scope = "host"`).
    host_leases_granted: AtomicU64,
}

/// One open watch stream, counted in `cohort_watch_streams` until dropped.
pub struct OpenWatch {
    metrics: Arc<Metrics>,
    quiet: bool,
}

impl Drop for OpenWatch {
    fn drop(&mut self) {
        self.metrics.watch_gauge(self.quiet).fetch_sub(1, Ordering::Relaxed);
    }
}

/// The canonical name of a gRPC code (as in the gRPC spec).
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

impl Metrics {
    /// Counts a watch stream as open (`quiet`: one that carries no events) until the guard
    /// is dropped.
    pub fn watch_opened(self: &Arc<Self>, quiet: bool) -> OpenWatch {
        self.watch_gauge(quiet).fetch_add(1, Ordering::Relaxed);
        OpenWatch { metrics: self.clone(), quiet }
    }

    fn watch_gauge(&self, quiet: bool) -> &AtomicU64 {
        if quiet {
            &self.watches_quiet
        } else {
            &self.watches_events
        }
    }

    /// Watch streams open now: (carrying events, quiet).
    pub fn watch_streams(&self) -> (u64, u64) {
        (self.watches_events.load(Ordering::Relaxed), self.watches_quiet.load(Ordering::Relaxed))
    }

    /// Counts one RPC by method and result code.
    pub fn rpc(&self, method: &'static str, code: tonic::Code) {
        *self.rpcs.lock().unwrap_or_else(PoisonError::into_inner).entry((method, code_name(code))).or_default() += 1;
    }

    /// How many `method` calls were answered with `code` (each beat of a `HostHeartbeat`
    /// also counts as one `Heartbeat`).
    pub fn rpc_count(&self, method: &str, code: tonic::Code) -> u64 {
        let rpcs = self.rpcs.lock().unwrap_or_else(PoisonError::into_inner);
        rpcs.iter().filter(|((m, c), _)| *m == method && *c == code_name(code)).map(|(_, n)| *n).sum()
    }

    /// Counts a formed generation and its latency (first arrival to formation).
    pub fn formed(&self, latency: Duration) {
        self.generations_formed.fetch_add(1, Ordering::Relaxed);
        let s = latency.as_secs_f64();
        let mut h = self.formation.lock().unwrap_or_else(PoisonError::into_inner);
        for (i, bound) in BUCKETS.iter().enumerate() {
            if s <= *bound {
                h.counts[i] += 1;
            }
        }
        h.sum += s;
        h.count += 1;
    }

    /// Counts a revocation.
    pub fn revoked(&self) {
        self.revocations.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a member swept silent off its host's shared lease.
    pub fn member_swept(&self) {
        self.members_swept.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a host's shared lease granted.
    pub fn host_lease_granted(&self) {
        self.host_leases_granted.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a commit whose digest differs from another member's for the same step.
    pub fn digest_mismatch(&self, job: &str) {
        *self.digest_mismatches.lock().unwrap_or_else(PoisonError::into_inner).entry(job.to_string()).or_default() += 1;
    }

    /// Counts a straggler named (`kind`: compute or link) and marks it as one now.
    pub fn straggler_named(&self, job: &str, worker: &str, kind: &'static str) {
        *self
            .stragglers_named
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry((job.to_string(), kind))
            .or_default() += 1;
        self.stragglers_now
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(job.to_string())
            .or_default()
            .insert(worker.to_string(), ());
    }

    /// Records that a member is no longer a straggler (it recovered, or left).
    pub fn straggler_cleared(&self, job: &str, worker: &str) {
        let mut now = self.stragglers_now.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(set) = now.get_mut(job) {
            set.remove(worker);
            if set.is_empty() {
                now.remove(job);
            }
        }
    }

    /// Counts a straggler excluded.
    pub fn straggler_excluded(&self, job: &str) {
        *self.stragglers_excluded.lock().unwrap_or_else(PoisonError::into_inner).entry(job.to_string()).or_default() +=
            1;
    }

    /// Records whether this replica leads.
    pub fn set_leader(&self, leading: bool) {
        self.is_leader.store(leading, Ordering::Relaxed);
    }

    /// Records a job's member count and generation; `None` forgets the job.
    pub fn set_job(&self, job: &str, value: Option<(u64, u64)>) {
        let mut jobs = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        match value {
            Some(v) => {
                jobs.insert(job.to_string(), v);
            }
            None => {
                jobs.remove(job);
            }
        }
    }

    /// Forgets every series of `job` (its gauges and its counters): the job has ended, so a
    /// long-lived coordinator does not keep one series per job it ever served.
    pub fn forget_job(&self, job: &str) {
        self.jobs.lock().unwrap_or_else(PoisonError::into_inner).remove(job);
        self.digest_mismatches.lock().unwrap_or_else(PoisonError::into_inner).remove(job);
        self.stragglers_named.lock().unwrap_or_else(PoisonError::into_inner).retain(|(j, _), _| j != job);
        self.stragglers_excluded.lock().unwrap_or_else(PoisonError::into_inner).remove(job);
        self.stragglers_now.lock().unwrap_or_else(PoisonError::into_inner).remove(job);
    }

    /// Keeps the series of the jobs in `live` only (job → its members now: the jobs with keys
    /// in the store that have not ended), and in the stragglers gauge only members still in
    /// their job. Whatever path a job's end or a member's departure took (a lapsed lease, an
    /// eviction, a replica that was not told), the census sweeps its series away.
    pub fn retain_live(&self, live: &HashMap<String, HashSet<String>>) {
        self.jobs.lock().unwrap_or_else(PoisonError::into_inner).retain(|j, _| live.contains_key(j));
        self.digest_mismatches.lock().unwrap_or_else(PoisonError::into_inner).retain(|j, _| live.contains_key(j));
        self.stragglers_named.lock().unwrap_or_else(PoisonError::into_inner).retain(|(j, _), _| live.contains_key(j));
        self.stragglers_excluded.lock().unwrap_or_else(PoisonError::into_inner).retain(|j, _| live.contains_key(j));
        let mut now = self.stragglers_now.lock().unwrap_or_else(PoisonError::into_inner);
        now.retain(|j, workers| {
            let Some(members) = live.get(j) else { return false };
            workers.retain(|w, _| members.contains(w));
            !workers.is_empty()
        });
    }

    /// Records the number of keys under the jobs prefix (see `cohort_store_keys`).
    pub fn set_store_keys(&self, keys: u64) {
        *self.store_keys.lock().unwrap_or_else(PoisonError::into_inner) = Some(keys);
    }

    /// Renders `store`'s request batching from now on (`cohort_etcd_*`, an etcd store only);
    /// the first store set stays.
    pub fn watch_store(&self, store: Arc<dyn crate::store::Store>) {
        let _ = self.store.set(store);
    }

    /// The generations formed so far by this replica.
    pub fn generations_formed(&self) -> u64 {
        self.generations_formed.load(Ordering::Relaxed)
    }

    /// Renders every metric in the Prometheus text format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let jobs = self.jobs.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let _ = writeln!(out, "# HELP cohort_members Live members of the job.\n# TYPE cohort_members gauge");
        for (job, (members, _)) in &jobs {
            let _ = writeln!(out, "cohort_members{{job=\"{job}\"}} {members}");
        }
        let _ = writeln!(
            out,
            "# HELP cohort_generation The job's newest generation number.\n# TYPE cohort_generation gauge"
        );
        for (job, (_, generation)) in &jobs {
            let _ = writeln!(out, "cohort_generation{{job=\"{job}\"}} {generation}");
        }
        let _ = writeln!(
            out,
            "# HELP cohort_generations_formed_total Generations formed by this replica.\n# TYPE cohort_generations_formed_total counter\ncohort_generations_formed_total {}",
            self.generations_formed.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP cohort_revocations_total Generations revoked by this replica.\n# TYPE cohort_revocations_total counter\ncohort_revocations_total {}",
            self.revocations.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP cohort_members_swept_total Members this replica, leading, found silent on their host's shared lease and removed (lease_scope = host).\n# TYPE cohort_members_swept_total counter\ncohort_members_swept_total {}",
            self.members_swept.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP cohort_host_leases_granted_total Hosts' shared store leases this replica granted (lease_scope = host).\n# TYPE cohort_host_leases_granted_total counter\ncohort_host_leases_granted_total {}",
            self.host_leases_granted.load(Ordering::Relaxed)
        );
        let (events, quiet) = self.watch_streams();
        let _ = writeln!(
            out,
            "# HELP cohort_watch_streams Watch streams open on this replica: kind=\"events\" carry the job's events (a host's event relay, or a member watching alone), kind=\"quiet\" only hold a member's control stream.\n# TYPE cohort_watch_streams gauge\ncohort_watch_streams{{kind=\"events\"}} {events}\ncohort_watch_streams{{kind=\"quiet\"}} {quiet}"
        );
        let _ = writeln!(
            out,
            "# HELP cohort_is_leader 1 if this replica runs the formation timers.\n# TYPE cohort_is_leader gauge\ncohort_is_leader {}",
            u8::from(self.is_leader.load(Ordering::Relaxed))
        );
        {
            let h = self.formation.lock().unwrap_or_else(PoisonError::into_inner);
            let _ = writeln!(
                out,
                "# HELP cohort_formation_latency_seconds From the first waiting arrival to formation.\n# TYPE cohort_formation_latency_seconds histogram"
            );
            for (i, bound) in BUCKETS.iter().enumerate() {
                let _ = writeln!(out, "cohort_formation_latency_seconds_bucket{{le=\"{bound}\"}} {}", h.counts[i]);
            }
            let _ = writeln!(out, "cohort_formation_latency_seconds_bucket{{le=\"+Inf\"}} {}", h.count);
            let _ = writeln!(out, "cohort_formation_latency_seconds_sum {}", h.sum);
            let _ = writeln!(out, "cohort_formation_latency_seconds_count {}", h.count);
        }
        let _ = writeln!(
            out,
            "# HELP cohort_rpcs_total RPCs answered, by method and code.\n# TYPE cohort_rpcs_total counter"
        );
        for ((method, code), n) in self.rpcs.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            let _ = writeln!(out, "cohort_rpcs_total{{method=\"{method}\",code=\"{code}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "# HELP cohort_digest_mismatches_total Commits received by this replica whose state digest differs from another member's for the same step.\n# TYPE cohort_digest_mismatches_total counter"
        );
        for (job, n) in self.digest_mismatches.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            let _ = writeln!(out, "cohort_digest_mismatches_total{{job=\"{job}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "# HELP cohort_stragglers Members named stragglers now (by the heartbeats this replica serves).\n# TYPE cohort_stragglers gauge"
        );
        for (job, set) in self.stragglers_now.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            let _ = writeln!(out, "cohort_stragglers{{job=\"{job}\"}} {}", set.len());
        }
        let _ = writeln!(
            out,
            "# HELP cohort_stragglers_named_total Stragglers named by this replica, by kind (compute: slow steps; link: slow links).\n# TYPE cohort_stragglers_named_total counter"
        );
        for ((job, kind), n) in self.stragglers_named.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            let _ = writeln!(out, "cohort_stragglers_named_total{{job=\"{job}\",kind=\"{kind}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "# HELP cohort_stragglers_excluded_total Stragglers this replica asked to leave (straggler policy exclude).\n# TYPE cohort_stragglers_excluded_total counter"
        );
        for (job, n) in self.stragglers_excluded.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            let _ = writeln!(out, "cohort_stragglers_excluded_total{{job=\"{job}\"}} {n}");
        }
        if let Some(keys) = *self.store_keys.lock().unwrap_or_else(PoisonError::into_inner) {
            let _ = writeln!(
                out,
                "# HELP cohort_store_keys Keys under the store's jobs prefix at the last census (every 10 s).\n# TYPE cohort_store_keys gauge\ncohort_store_keys {keys}"
            );
        }
        if let Some(b) = self.store.get().and_then(|s| s.request_batching()) {
            let rows: [(&str, &str, &str, u64); 6] = [
                ("cohort_etcd_shared_transactions_total", "counter", "etcd transactions that carried two or more of this replica's requests", b.shared_transactions),
                ("cohort_etcd_requests_shared_total", "counter", "Requests that went in such transactions", b.requests_shared),
                ("cohort_etcd_requests_alone_total", "counter", "Requests that found their queue idle and went alone", b.sent_alone),
                ("cohort_etcd_shared_retried_alone_total", "counter", "Shared transactions refused or failed whose requests were run again one by one (a count that grows: check --etcd-max-txn-ops against the cluster's --max-txn-ops)", b.retried_alone),
                ("cohort_etcd_largest_shared_transaction", "gauge", "The most requests one shared transaction carried (at --etcd-max-txn-ops, formations would take larger ones)", b.largest_batch),
                ("cohort_etcd_requests_waiting", "gauge", "Requests queued for etcd now, behind the transactions in flight", b.waiting),
            ];
            for (name, kind, help, value) in rows {
                let _ = writeln!(out, "# HELP {name} {help}.\n# TYPE {name} {kind}\n{name} {value}");
            }
        }
        cohort_proto::process_metrics::render(&mut out);
        out
    }
}

/// The jobs that have keys and have not ended, with their members, in `kvs` (the jobs
/// prefix).
fn live_jobs(kvs: &[crate::store::KeyValue]) -> HashMap<String, HashSet<String>> {
    use crate::keys::{parse, Kind, Parsed};
    let mut live: HashMap<String, HashSet<String>> = HashMap::new();
    let mut ended = HashSet::new();
    for kv in kvs {
        match parse(&kv.key) {
            Some(Parsed::Ended { job }) => {
                ended.insert(job.to_string());
            }
            Some(Parsed::Worker { job, kind: Kind::Member, worker }) => {
                live.entry(job.to_string()).or_default().insert(worker.to_string());
            }
            Some(
                Parsed::Worker { job, .. } | Parsed::Generation { job } | Parsed::Shard { job, .. },
            ) => {
                live.entry(job.to_string()).or_default();
            }
            None => {}
        }
    }
    live.retain(|job, _| !ended.contains(job));
    live
}

/// How often [`store_census`] counts the store's keys.
pub const CENSUS_INTERVAL: Duration = Duration::from_secs(10);

/// Counts the keys under the store's jobs prefix every [`CENSUS_INTERVAL`] into `metrics`
/// (`cohort_store_keys`) until `stop` turns true; a failed count is skipped (the gauge keeps
/// its last value). The key count is what the ended-job expiry (`--ended-ttl`) keeps
/// bounded.
///
/// # Cancel safety
/// Cancel safe: it holds nothing between counts.
pub async fn store_census(
    store: Arc<dyn crate::store::Store>,
    metrics: Arc<Metrics>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        let count = tokio::time::timeout(CENSUS_INTERVAL, store.get_prefix(crate::keys::JOBS)).await;
        match count {
            Ok(Ok((kvs, _))) => {
                metrics.set_store_keys(kvs.len() as u64);
                metrics.retain_live(&live_jobs(&kvs));
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "store census failed"),
            Err(_) => tracing::debug!("store census timed out"),
        }
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            _ = tokio::time::sleep(CENSUS_INTERVAL) => {}
        }
    }
}

/// Serves `GET /metrics` on `listener` until `shutdown` resolves, and the status page
/// (`GET /`, `/status`, `/status.json`, ...; see [`crate::status_page`]) when `page` is given.
///
/// # Cancel safety
/// Cancel safe: dropping it stops accepting; connections in progress are dropped.
pub async fn serve_metrics(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    page: Option<Arc<crate::status_page::StatusPage>>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            _ = &mut shutdown => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, peer)) => {
                let (metrics, page) = (metrics.clone(), page.clone());
                tokio::spawn(async move {
                    if let Err(e) =
                        tokio::time::timeout(REQUEST_TIMEOUT, answer(stream, &metrics, page.as_deref())).await
                    {
                        tracing::debug!(%peer, error = %e, "metrics request timed out");
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "metrics listener accept failed");
                // Back off briefly (e.g. out of file descriptors) instead of spinning.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// The longest one request may take, reading to answering.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest request head (request line and headers) read.
const MAX_HEAD: usize = 8192;

/// One request's head, as far as this responder needs it.
#[derive(Debug, PartialEq, Eq)]
struct Head {
    method: String,
    path: String,
    query: String,
    authorization: Option<String>,
}

/// Why a request head was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
enum HeadError {
    /// Not `METHOD TARGET HTTP/1.x`.
    #[error("malformed request line")]
    Malformed,
    /// The head is over [`MAX_HEAD`] bytes.
    #[error("request head over {MAX_HEAD} bytes")]
    TooLarge,
}

/// Parses a request head (up to the blank line).
fn parse_head(head: &[u8]) -> Result<Head, HeadError> {
    let text = std::str::from_utf8(head).map_err(|_| HeadError::Malformed)?;
    let mut lines = text.split("\r\n");
    let line = lines.next().unwrap_or_default();
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(HeadError::Malformed);
    };
    if method.is_empty() || !target.starts_with('/') || !version.starts_with("HTTP/1.") {
        return Err(HeadError::Malformed);
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let authorization = lines.find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.trim().eq_ignore_ascii_case("authorization").then(|| value.trim().to_string())
    });
    Ok(Head { method: method.to_string(), path: path.to_string(), query: query.to_string(), authorization })
}

/// Reads a request head from `stream`: the bytes up to the blank line (`None`: the peer
/// closed first).
async fn read_head(stream: &mut tokio::net::TcpStream) -> Result<Option<Vec<u8>>, HeadError> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            buf.truncate(end);
            return Ok(Some(buf));
        }
        if buf.len() > MAX_HEAD {
            return Err(HeadError::TooLarge);
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return Ok(None),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Writes one response and closes.
async fn respond(stream: &mut tokio::net::TcpStream, status: u16, content_type: &str, extra: &str, body: &[u8]) {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Error",
    };
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n",
        body.len()
    );
    if stream.write_all(head.as_bytes()).await.is_ok() {
        let _ = stream.write_all(body).await;
    }
    let _ = stream.shutdown().await;
    // Read what the client still sends (the rest of an oversized head, a body) until it
    // closes, bounded: a socket closed with unread input is reset, and the reset can discard
    // the answer before the client reads it.
    let drain = async {
        let mut sink = [0u8; 4096];
        let mut left = 64 * 1024usize;
        while let Ok(n @ 1..) = stream.read(&mut sink).await {
            left = left.saturating_sub(n);
            if left == 0 {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
}

/// What the status page's answers carry besides their body: no caching (live data), no
/// referrer (a `?token=` in the address), and a policy that lets the page load only its own
/// script and style and fetch only its own data.
const PAGE_HEADERS: &str = "Cache-Control: no-store\r\nReferrer-Policy: no-referrer\r\nX-Content-Type-Options: nosniff\r\n\
X-Frame-Options: DENY\r\nContent-Security-Policy: default-src 'none'; script-src 'self'; style-src 'self'; \
connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'\r\n";

async fn answer(mut stream: tokio::net::TcpStream, metrics: &Metrics, page: Option<&crate::status_page::StatusPage>) {
    const TEXT: &str = "text/plain; charset=utf-8";
    let head = match read_head(&mut stream).await {
        Ok(Some(head)) => head,
        Ok(None) => return,
        Err(e) => {
            let status = if e == HeadError::TooLarge { 431 } else { 400 };
            return respond(&mut stream, status, TEXT, "", format!("{e}\n").as_bytes()).await;
        }
    };
    let head = match parse_head(&head) {
        Ok(head) => head,
        Err(e) => return respond(&mut stream, 400, TEXT, "", format!("{e}\n").as_bytes()).await,
    };
    let known = head.path == "/metrics" || (page.is_some() && crate::status_page::StatusPage::serves(&head.path));
    if !known {
        let body = format!("no such page: {} (this listener serves /metrics and the status page at /)\n", head.path);
        return respond(&mut stream, 404, TEXT, "", body.as_bytes()).await;
    }
    if head.method != "GET" {
        let body = format!("{} is read-only: only GET\n", head.path);
        return respond(&mut stream, 405, TEXT, "Allow: GET\r\n", body.as_bytes()).await;
    }
    match page {
        Some(page) if head.path != "/metrics" => {
            let r = page.answer(&head.path, &head.query, head.authorization.as_deref()).await;
            respond(&mut stream, r.status, r.content_type, PAGE_HEADERS, &r.body).await;
        }
        _ => {
            let body = metrics.render();
            respond(&mut stream, 200, "text/plain; version=0.0.4", "", body.as_bytes()).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_heads_are_parsed_or_refused() {
        let head = parse_head(b"GET /status.json?token=a%20b HTTP/1.1\r\nHost: x\r\nAUTHORIZATION:  Bearer t \r\n")
            .expect("a good head");
        assert_eq!(
            head,
            Head {
                method: "GET".into(),
                path: "/status.json".into(),
                query: "token=a%20b".into(),
                authorization: Some("Bearer t".into())
            }
        );
        let bad: [&[u8]; 5] = [b"GET /metrics", b"GET metrics HTTP/1.1", b"GET / HTTP/2 extra", b"\xff / HTTP/1.1", b""];
        for bad in bad {
            assert_eq!(parse_head(bad), Err(HeadError::Malformed), "{bad:?}");
        }
    }

    #[test]
    fn renders_counters_and_histogram() {
        let m = Metrics::default();
        m.rpc("Join", tonic::Code::Ok);
        m.rpc("Join", tonic::Code::Ok);
        m.rpc("Join", tonic::Code::InvalidArgument);
        m.formed(Duration::from_millis(30));
        m.set_job("j", Some((4, 2)));
        m.digest_mismatch("j");
        m.digest_mismatch("j");
        m.straggler_named("j", "w1", "compute");
        m.straggler_named("j", "w2", "link");
        m.straggler_cleared("j", "w2");
        m.straggler_excluded("j");
        let text = m.render();
        assert!(text.contains("cohort_stragglers{job=\"j\"} 1"), "{text}");
        assert!(text.contains("cohort_stragglers_named_total{job=\"j\",kind=\"compute\"} 1"), "{text}");
        assert!(text.contains("cohort_stragglers_named_total{job=\"j\",kind=\"link\"} 1"), "{text}");
        assert!(text.contains("cohort_stragglers_excluded_total{job=\"j\"} 1"), "{text}");
        assert!(text.contains("cohort_digest_mismatches_total{job=\"j\"} 2"), "{text}");
        assert!(text.contains("cohort_rpcs_total{method=\"Join\",code=\"OK\"} 2"), "{text}");
        assert!(text.contains("cohort_rpcs_total{method=\"Join\",code=\"INVALID_ARGUMENT\"} 1"));
        assert!(text.contains("cohort_formation_latency_seconds_bucket{le=\"0.05\"} 1"));
        assert!(text.contains("cohort_formation_latency_seconds_bucket{le=\"0.025\"} 0"));
        assert!(text.contains("cohort_members{job=\"j\"} 4"));
        assert!(text.contains("cohort_generation{job=\"j\"} 2"));
        assert!(text.contains("cohort_generations_formed_total 1"));
        // The memory store batches nothing: no etcd series.
        m.watch_store(Arc::new(crate::store::memory::MemoryStore::new()));
        assert!(!m.render().contains("cohort_etcd_"));
        // The job ends: none of its series is left.
        m.forget_job("j");
        let text = m.render();
        assert!(!text.contains("job=\"j\""), "{text}");
    }

    #[test]
    fn the_census_keeps_live_jobs_and_members_only() {
        let kv = |key: String| crate::store::KeyValue {
            key,
            value: Vec::new(),
            create_revision: 1,
            mod_revision: 1,
            lease: None,
        };
        let m = Metrics::default();
        for job in ["live", "ended", "gone"] {
            m.set_job(job, Some((2, 1)));
            m.digest_mismatch(job);
            m.straggler_named(job, "w1", "compute");
            m.straggler_excluded(job);
        }
        // w2 of the live job was named, then evicted (no member key any more).
        m.straggler_named("live", "w2", "link");
        let kvs = vec![
            kv(crate::keys::generation("live")),
            kv(crate::keys::worker_key("live", crate::keys::Kind::Member, "w1")),
            kv(crate::keys::worker_key("live", crate::keys::Kind::Progress, "w2")),
            kv(crate::keys::generation("ended")),
            kv(crate::keys::ended("ended")),
        ];
        m.retain_live(&live_jobs(&kvs));
        let text = m.render();
        for job in ["ended", "gone"] {
            assert!(!text.contains(&format!("job=\"{job}\"")), "{job}: {text}");
        }
        assert!(text.contains("cohort_stragglers{job=\"live\"} 1"), "only w1 is still a member: {text}");
        assert!(text.contains("cohort_stragglers_named_total{job=\"live\",kind=\"link\"} 1"), "{text}");
        assert!(text.contains("cohort_digest_mismatches_total{job=\"live\"} 1"), "{text}");
        assert!(text.contains("cohort_members{job=\"live\"} 2"), "{text}");
    }
}
