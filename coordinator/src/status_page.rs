//! The live status page, served read-only on the metrics listener: `GET /` (or `/status`)
//! is an HTML page, `GET /status.json` its data, `/status.js` and `/status.css` its script
//! and style (all embedded in the binary; no external asset).
//!
//! The data is one snapshot of every job ([`PageSnapshot`]), built from one read of the
//! store's jobs prefix at most once a second whoever asks (the page polls it every second),
//! with this replica's newer progress, as the `Status` RPC answers. Members are summarised by
//! host and the outliers named, so that a job of 16,384 members is a page of a few hundred
//! rows. The failures come from the generation record, which remembers the root cause and
//! the formation, revocation and re-formation times of the last
//! [`HISTORY`](crate::records::HISTORY) revoked generations, whichever replica handled them.
//! The steps-per-second series is sampled by this replica as the snapshots are built.
//!
//! Protected like the gRPC service: when the coordinator has an operator secret, the page
//! and its data need the operator secret or a job credential (which shows that job only),
//! as `authorization: Bearer <token>` or `?token=<token>` (the page keeps a `?token=` in
//! memory, sends it as a header, and removes it from the address bar).

use crate::auth::{AuthError, Caller, TokenCheck};
use crate::records::GenerationRecord;
use crate::service::CoordinatorService;
use crate::status_summary::{self, OutlierKind, Spread};
use crate::status_view::{Ended, ExclusionView, RootCause, SettingsView};
use cohort_proto::v1 as pb;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The page (HTML).
const PAGE_HTML: &str = include_str!("status_page/page.html");
/// The page's script.
const PAGE_JS: &str = include_str!("status_page/page.js");
/// The page's style.
const PAGE_CSS: &str = include_str!("status_page/page.css");

/// A snapshot younger than this is served again instead of reading the store.
pub const REFRESH: Duration = Duration::from_secs(1);
/// The longest a snapshot's store read may take.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Jobs shown at most (by id; the rest are counted).
pub const MAX_JOBS: usize = 200;
/// Hosts listed at most per job (those with outliers first; the rest are added up).
pub const MAX_HOSTS: usize = 256;
/// Outliers named at most per job (the rest are counted).
pub const MAX_OUTLIERS: usize = 50;
/// Step samples kept per job (at one a second: ten minutes).
const MAX_SAMPLES: usize = 600;
/// Points of the steps-per-second series sent.
const MAX_RATE_POINTS: usize = 300;

/// Errors answering a status page request.
#[derive(Debug, thiserror::Error)]
pub enum PageError {
    /// No or a wrong credential.
    #[error("{0}")]
    Unauthorized(String),
    /// The store did not answer.
    #[error("the store did not answer: {0}")]
    Store(String),
    /// No such page.
    #[error("no such page: {0}")]
    NotFound(String),
    /// The snapshot could not be encoded.
    #[error("encoding the snapshot: {0}")]
    Encode(#[from] serde_json::Error),
}

impl From<AuthError> for PageError {
    fn from(e: AuthError) -> Self {
        Self::Unauthorized(e.to_string())
    }
}

/// Counts of a job's members.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemberCounts {
    /// Members listed.
    pub total: usize,
    /// With a rank in the current generation.
    pub ranked: usize,
    /// Waiting in the rendezvous.
    pub waiting: usize,
    /// Whose control stream closed.
    pub control_closed: usize,
    /// Named stragglers.
    pub stragglers: usize,
    /// Distinct hosts.
    pub hosts: usize,
}

/// The members of one host.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HostRow {
    /// The host.
    pub host: String,
    /// Members on it.
    pub members: usize,
    /// Of which ranked.
    pub ranked: usize,
    /// Waiting in the rendezvous.
    pub waiting: usize,
    /// Whose control stream closed.
    pub control_closed: usize,
    /// Named stragglers.
    pub stragglers: usize,
    /// Members of it among the outliers.
    pub outliers: usize,
}

/// The hosts not listed, added up.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HostsHidden {
    /// How many.
    pub hosts: usize,
    /// Their members.
    pub members: usize,
}

/// A member picked out by name.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OutlierRow {
    /// `straggler`, `suspected`, `excluded`, `joining` or `behind`.
    pub kind: &'static str,
    /// Its rank, if it has one.
    pub rank: Option<u32>,
    /// Its worker id.
    pub worker_id: String,
    /// Its host (empty if unknown).
    pub host: String,
    /// Why.
    pub why: String,
}

/// One failure: a revoked generation, its root cause, and what it cost.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FailureRow {
    /// The revoked generation.
    pub generation: u64,
    /// Its size.
    pub size: u32,
    /// The root cause (`null` when the record no longer remembers it).
    pub cause: Option<RootCause>,
    /// When the revoked generation had formed, ms since the epoch.
    pub formed_at_ms: u64,
    /// When the failure was detected and the generation revoked (one step), ms since the
    /// epoch.
    pub revoked_at_ms: u64,
    /// When the next generation formed (`null`: not yet).
    pub reformed_at_ms: Option<u64>,
    /// The next generation's size (`null`: not formed yet).
    pub reformed_size: Option<u32>,
    /// The time it cost: revocation to re-formation, or to now while not re-formed, ms.
    pub cost_ms: u64,
}

/// The job's newest generation, in brief.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GenerationBrief {
    /// Its number.
    pub number: u64,
    /// Its size.
    pub size: usize,
    /// When it formed, ms since the epoch.
    pub formed_at_ms: u64,
    /// When it was revoked, if it was.
    pub revoked_at_ms: Option<u64>,
}

/// One job on the page.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JobPage {
    /// The job.
    pub job: String,
    /// `forming` (no generation yet), `running`, `revoked` (re-forming) or `ended`.
    pub state: &'static str,
    /// How it ended, if it did.
    pub ended: Option<Ended>,
    /// Its settings.
    pub settings: Option<SettingsView>,
    /// Its newest generation.
    pub generation: Option<GenerationBrief>,
    /// Member counts.
    pub members: MemberCounts,
    /// Members per host (at most [`MAX_HOSTS`], hosts with outliers first).
    pub hosts: Vec<HostRow>,
    /// The hosts not listed.
    pub hosts_hidden: HostsHidden,
    /// Steps reported by the ranked members.
    pub step: Spread,
    /// Heartbeat ages, ms.
    pub heartbeat_age_ms: Spread,
    /// Members picked out by name (at most [`MAX_OUTLIERS`]).
    pub outliers: Vec<OutlierRow>,
    /// Members that would be picked out, all told.
    pub outliers_total: usize,
    /// Workers whose joins are refused now.
    pub exclusions: Vec<ExclusionView>,
    /// Failures, newest first (the last few revoked generations).
    pub failures: Vec<FailureRow>,
    /// Steps per second of the furthest member, `[ms since the epoch, rate]`, oldest first.
    pub steps_per_second: Vec<(u64, f64)>,
    /// Steps committed with different state (see `status`).
    pub digest_mismatches: usize,
}

/// Every job as the page shows it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PageSnapshot {
    /// When it was taken, ms since the epoch.
    pub now_ms: u64,
    /// The replica that answered.
    pub replica: String,
    /// The replica that leads (`null`: none).
    pub leader: Option<String>,
    /// Jobs with keys in the store, all told.
    pub jobs_total: usize,
    /// The jobs shown (at most [`MAX_JOBS`], by id).
    pub jobs: Vec<JobPage>,
}

/// One step sample of a job.
#[derive(Clone, Copy, Debug)]
struct Sample {
    at_ms: u64,
    step: u64,
}

#[derive(Default)]
struct Cache {
    built: Option<(Instant, Arc<PageSnapshot>)>,
    samples: HashMap<String, VecDeque<Sample>>,
}

/// The status page of one replica.
pub struct StatusPage {
    service: CoordinatorService,
    tokens: TokenCheck,
    replica: String,
    cache: tokio::sync::Mutex<Cache>,
}

/// An answer to one request.
#[derive(Debug)]
pub struct PageResponse {
    /// HTTP status code.
    pub status: u16,
    /// `Content-Type`.
    pub content_type: &'static str,
    /// The body.
    pub body: Vec<u8>,
}

impl PageResponse {
    fn ok(content_type: &'static str, body: impl Into<Vec<u8>>) -> Self {
        Self { status: 200, content_type, body: body.into() }
    }

    fn error(e: &PageError) -> Self {
        let status = match e {
            PageError::Unauthorized(_) => 401,
            PageError::Store(_) => 503,
            PageError::NotFound(_) => 404,
            PageError::Encode(_) => 500,
        };
        let body = serde_json::json!({ "error": e.to_string() }).to_string();
        Self { status, content_type: "application/json", body: body.into_bytes() }
    }
}

/// The value of `name` in a query string (`a=1&b=2`), percent-decoded.
fn query_value(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == name).then(|| percent_decode(v))
    })
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let hex = |b: u8| (b as char).to_digit(16);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = match (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&h), Some(&l)) => hex(h).zip(hex(l)).map(|(h, l)| (h * 16 + l) as u8),
            _ => None,
        };
        match (escaped, bytes[i]) {
            (Some(b), _) => {
                out.push(b);
                i += 3;
                continue;
            }
            (None, b'+') => out.push(b' '),
            (None, b) => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl StatusPage {
    /// The page of the replica `replica`, reading through `service`, protected by `tokens`.
    pub(crate) fn new(service: CoordinatorService, tokens: TokenCheck, replica: String) -> Self {
        Self { service, tokens, replica, cache: tokio::sync::Mutex::new(Cache::default()) }
    }

    /// Whether a credential is needed.
    pub fn protected(&self) -> bool {
        self.tokens.required()
    }

    /// Whether `path` is one of the page's.
    pub fn serves(path: &str) -> bool {
        matches!(path, "/" | "/status" | "/status.json" | "/status.js" | "/status.css")
    }

    /// Answers `GET path?query` with the `authorization` header `authorization`.
    ///
    /// # Cancel safety
    /// Cancel safe: a snapshot being built when dropped is built again by the next request.
    pub async fn answer(&self, path: &str, query: &str, authorization: Option<&str>) -> PageResponse {
        match self.try_answer(path, query, authorization).await {
            Ok(r) => r,
            Err(e @ PageError::Unauthorized(_)) if path != "/status.json" => {
                let body = format!(
                    "<!doctype html><meta charset=utf-8><title>cohort status: credential needed</title>\
                     <p>This coordinator requires a credential: open <code>/status?token=&lt;operator secret or \
                     job credential&gt;</code>.</p><p>{}</p>",
                    html_escape(&e.to_string())
                );
                PageResponse { status: 401, content_type: "text/html; charset=utf-8", body: body.into_bytes() }
            }
            Err(e) => PageResponse::error(&e),
        }
    }

    async fn try_answer(&self, path: &str, query: &str, authorization: Option<&str>) -> Result<PageResponse, PageError> {
        match path {
            "/status.js" => return Ok(PageResponse::ok("text/javascript; charset=utf-8", PAGE_JS)),
            "/status.css" => return Ok(PageResponse::ok("text/css; charset=utf-8", PAGE_CSS)),
            _ => {}
        }
        let caller = match (authorization, query_value(query, "token")) {
            (Some(header), _) => self.tokens.check_header(Some(header))?,
            (None, Some(token)) => self.tokens.check_token(&token)?,
            (None, None) => self.tokens.check_header(None)?,
        };
        match path {
            "/" | "/status" => Ok(PageResponse::ok("text/html; charset=utf-8", PAGE_HTML)),
            "/status.json" => {
                let snapshot = self.snapshot().await?;
                let body = match caller {
                    Caller::Job(job) => {
                        let jobs: Vec<JobPage> = snapshot.jobs.iter().filter(|j| j.job == job).cloned().collect();
                        let own = PageSnapshot {
                            now_ms: snapshot.now_ms,
                            replica: snapshot.replica.clone(),
                            leader: snapshot.leader.clone(),
                            jobs_total: jobs.len(),
                            jobs,
                        };
                        serde_json::to_vec(&own)
                    }
                    Caller::Anyone | Caller::Operator => serde_json::to_vec(&*snapshot),
                };
                let body = body?;
                Ok(PageResponse::ok("application/json", body))
            }
            other => Err(PageError::NotFound(other.to_string())),
        }
    }

    /// The snapshot, read again when older than [`REFRESH`].
    ///
    /// # Cancel safety
    /// Cancel safe: the cache is only replaced whole.
    pub async fn snapshot(&self) -> Result<Arc<PageSnapshot>, PageError> {
        let mut cache = self.cache.lock().await;
        if let Some((at, snapshot)) = &cache.built {
            if at.elapsed() < REFRESH {
                return Ok(snapshot.clone());
            }
        }
        let read = async {
            let jobs = self.service.all_jobs().await?;
            let leader = self.service.leader_name().await?;
            Ok::<_, crate::store::StoreError>((jobs, leader))
        };
        let (jobs, leader) = match tokio::time::timeout(READ_TIMEOUT, read).await {
            Ok(Ok(read)) => read,
            Ok(Err(e)) => return Err(PageError::Store(e.to_string())),
            Err(_) => return Err(PageError::Store(format!("no answer within {READ_TIMEOUT:?}"))),
        };
        let now = crate::records::now_ms();
        let jobs_total = jobs.len();
        let mut pages = Vec::with_capacity(jobs.len().min(MAX_JOBS));
        for (job, state) in jobs.iter().take(MAX_JOBS) {
            let status = self.service.status_of(job, state, leader.clone());
            let mut page = job_page(&status, state.current(), now);
            let samples = cache.samples.entry(job.clone()).or_default();
            if page.generation.is_some() && page.ended.is_none() {
                samples.push_back(Sample { at_ms: now, step: page.step.max });
                while samples.len() > MAX_SAMPLES {
                    samples.pop_front();
                }
            }
            page.steps_per_second = rates(samples);
            pages.push(page);
        }
        cache.samples.retain(|job, _| pages.iter().any(|p| &p.job == job));
        let snapshot = Arc::new(PageSnapshot {
            now_ms: now,
            replica: self.replica.clone(),
            leader: (!leader.is_empty()).then_some(leader),
            jobs_total,
            jobs: pages,
        });
        cache.built = Some((Instant::now(), snapshot.clone()));
        Ok(snapshot)
    }
}

/// Escapes `text` for HTML.
fn html_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Steps per second between consecutive samples (at least half a second apart; a step count
/// that went back, as after a restore, counts as 0), the newest [`MAX_RATE_POINTS`].
fn rates(samples: &VecDeque<Sample>) -> Vec<(u64, f64)> {
    let mut out = Vec::new();
    let mut last: Option<Sample> = None;
    for s in samples {
        match last {
            Some(l) if s.at_ms >= l.at_ms + 500 => {
                let rate = s.step.saturating_sub(l.step) as f64 * 1000.0 / (s.at_ms - l.at_ms) as f64;
                out.push((s.at_ms, (rate * 100.0).round() / 100.0));
                last = Some(*s);
            }
            Some(_) => {}
            None => last = Some(*s),
        }
    }
    let skip = out.len().saturating_sub(MAX_RATE_POINTS);
    out.drain(..skip);
    out
}

/// The failures the generation record remembers, newest first: the current generation if it
/// is revoked (not re-formed yet), then the recoveries.
fn failures(g: Option<&GenerationRecord>, now_ms: u64) -> Vec<FailureRow> {
    let Some(g) = g else { return Vec::new() };
    let mut rows = Vec::new();
    if let (Some(cause), Some(revoked_at)) = (&g.revoked, g.revoked_at_ms) {
        rows.push(FailureRow {
            generation: g.number,
            size: g.members.len() as u32,
            cause: Some(RootCause::from(&cause.to_proto())),
            formed_at_ms: g.formed_at_ms,
            revoked_at_ms: revoked_at,
            reformed_at_ms: None,
            reformed_size: None,
            cost_ms: now_ms.saturating_sub(revoked_at),
        });
    }
    for r in g.recoveries.iter().rev() {
        rows.push(FailureRow {
            generation: r.generation,
            size: r.size,
            cause: g.cause_of(r.generation).map(|c| RootCause::from(&c.to_proto())),
            formed_at_ms: r.formed_at_ms,
            revoked_at_ms: r.revoked_at_ms,
            reformed_at_ms: Some(r.reformed_at_ms),
            reformed_size: Some(r.reformed_size),
            cost_ms: r.reformed_at_ms.saturating_sub(r.revoked_at_ms),
        });
    }
    rows
}

/// One job's page from its status `s` and generation record `g`, as of `now_ms` (without
/// the steps-per-second series, which the caller keeps).
pub fn job_page(s: &pb::StatusResponse, g: Option<&GenerationRecord>, now_ms: u64) -> JobPage {
    let summary = status_summary::summarize(&s.members, now_ms, MAX_OUTLIERS);
    let mut outliers: Vec<OutlierRow> = Vec::new();
    let mut total = 0usize;
    let mut add = |row: OutlierRow, outliers: &mut Vec<OutlierRow>| {
        if outliers.iter().any(|o| o.worker_id == row.worker_id && o.kind == row.kind) {
            return;
        }
        total += 1;
        if outliers.len() < MAX_OUTLIERS {
            outliers.push(row);
        }
    };
    let mut by_rank: Vec<&pb::MemberStatus> = s.members.iter().collect();
    by_rank.sort_by(|a, b| (a.rank.unwrap_or(u32::MAX), &a.worker_id).cmp(&(b.rank.unwrap_or(u32::MAX), &b.worker_id)));
    if let (true, Some(c)) = (s.current_revoked, &s.revocation_cause) {
        if !c.worker_id.is_empty() {
            let why = format!("root cause of the revocation: {}", c.reason);
            add(
                OutlierRow { kind: "suspected", rank: c.rank, worker_id: c.worker_id.clone(), host: c.host.clone(), why },
                &mut outliers,
            );
        }
    }
    for m in &by_rank {
        if let Some(v) = &m.straggler {
            let why = format!("{} straggler, {:.1}x the median: {}", v.kind, v.ratio, v.reason);
            add(
                OutlierRow { kind: "straggler", rank: m.rank, worker_id: m.worker_id.clone(), host: m.host.clone(), why },
                &mut outliers,
            );
        }
    }
    for o in &summary.outliers {
        let kind = match o.kind {
            OutlierKind::ControlClosed | OutlierKind::StaleHeartbeat => "suspected",
            OutlierKind::NotInGeneration | OutlierKind::Behind => "behind",
        };
        add(
            OutlierRow { kind, rank: o.rank, worker_id: o.worker_id.clone(), host: o.host.clone(), why: o.why.clone() },
            &mut outliers,
        );
    }
    let host_of: HashMap<&str, &str> = s.members.iter().map(|m| (m.worker_id.as_str(), m.host.as_str())).collect();
    for x in &s.exclusions {
        let why = format!("joins refused until {} ms since the epoch: {}", x.until_ms, x.reason);
        let host = host_of.get(x.worker_id.as_str()).map_or_else(String::new, |h| h.to_string());
        add(OutlierRow { kind: "excluded", rank: None, worker_id: x.worker_id.clone(), host, why }, &mut outliers);
    }
    for m in by_rank.iter().filter(|m| m.waiting && m.rank.is_none()) {
        let why = "waiting to join the next generation".to_string();
        add(
            OutlierRow { kind: "joining", rank: None, worker_id: m.worker_id.clone(), host: m.host.clone(), why },
            &mut outliers,
        );
    }

    let mut hosts: BTreeMap<&str, HostRow> = BTreeMap::new();
    for m in &s.members {
        let row = hosts.entry(m.host.as_str()).or_insert_with(|| HostRow { host: m.host.clone(), ..HostRow::default() });
        row.members += 1;
        row.ranked += usize::from(m.rank.is_some());
        row.waiting += usize::from(m.waiting);
        row.control_closed += usize::from(m.control_connected == Some(false));
        row.stragglers += usize::from(m.straggler.is_some());
    }
    for o in &outliers {
        if let Some(row) = hosts.get_mut(o.host.as_str()) {
            row.outliers += 1;
        }
    }
    let mut hosts: Vec<HostRow> = hosts.into_values().collect();
    // Hosts with something to see first (stably: by name within).
    hosts.sort_by_key(|h| std::cmp::Reverse(h.outliers + h.control_closed + h.stragglers));
    let hidden = hosts.split_off(hosts.len().min(MAX_HOSTS));
    let hosts_hidden = HostsHidden { hosts: hidden.len(), members: hidden.iter().map(|h| h.members).sum() };

    let state = if s.ended.is_some() {
        "ended"
    } else if s.current.is_none() {
        "forming"
    } else if s.current_revoked {
        "revoked"
    } else {
        "running"
    };
    JobPage {
        job: s.job.clone(),
        state,
        ended: s.ended.as_ref().map(Ended::from),
        settings: s.settings.as_ref().map(SettingsView::from),
        generation: g.map(|g| GenerationBrief {
            number: g.number,
            size: g.members.len(),
            formed_at_ms: g.formed_at_ms,
            revoked_at_ms: g.revoked_at_ms,
        }),
        members: MemberCounts {
            total: summary.members,
            ranked: summary.ranked,
            waiting: summary.waiting,
            control_closed: summary.control_closed,
            stragglers: s.members.iter().filter(|m| m.straggler.is_some()).count(),
            hosts: summary.hosts,
        },
        hosts,
        hosts_hidden,
        step: summary.step,
        heartbeat_age_ms: summary.heartbeat_age_ms,
        outliers,
        outliers_total: total,
        exclusions: s.exclusions.iter().map(ExclusionView::from).collect(),
        failures: failures(g, now_ms),
        steps_per_second: Vec::new(),
        digest_mismatches: s.digest_mismatches.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(i: u32, host: &str, step: u64, now: u64) -> pb::MemberStatus {
        pb::MemberStatus {
            worker_id: format!("w{i}"),
            host: host.into(),
            rank: Some(i),
            last_heartbeat_ms: now - 100,
            generation: 2,
            step,
            control_connected: Some(true),
            ..Default::default()
        }
    }

    #[test]
    fn sixteen_thousand_members_make_a_bounded_page_naming_the_outliers() {
        let now = 1_000_000;
        let mut members: Vec<pb::MemberStatus> =
            (0..16_384).map(|i| member(i, &format!("node-{:04}", i / 8), 100, now)).collect();
        members[9].control_connected = Some(false);
        members[300].straggler = Some(pb::StragglerVerdict { kind: "compute".into(), ratio: 3.0, ..Default::default() });
        members.push(pb::MemberStatus {
            worker_id: "new<1>".into(),
            host: "node-9999".into(),
            waiting: true,
            last_heartbeat_ms: now,
            ..Default::default()
        });
        let s = pb::StatusResponse {
            job: "big".into(),
            current: Some(pb::Generation { number: 2, ..Default::default() }),
            members,
            exclusions: vec![pb::Exclusion { worker_id: "w77".into(), until_ms: now + 1, reason: "3 failures".into() }],
            ..Default::default()
        };
        let page = job_page(&s, None, now);
        assert_eq!(page.state, "running");
        assert_eq!((page.members.total, page.members.hosts), (16_385, 2049));
        assert_eq!(page.hosts.len(), MAX_HOSTS);
        assert_eq!(page.hosts_hidden.hosts, 2049 - MAX_HOSTS);
        assert_eq!(page.hosts.iter().map(|h| h.members).sum::<usize>() + page.hosts_hidden.members, 16_385);
        let kinds: Vec<(&str, &str)> = page.outliers.iter().map(|o| (o.kind, o.worker_id.as_str())).collect();
        for expected in [("straggler", "w300"), ("suspected", "w9"), ("excluded", "w77"), ("joining", "new<1>")] {
            assert!(kinds.contains(&expected), "{expected:?} in {kinds:?}");
        }
        // The hosts with outliers come first.
        assert!(page.hosts[..3].iter().any(|h| h.host == "node-0001"), "{:?}", &page.hosts[..3]);
        let json = serde_json::to_string(&page).expect("json");
        assert!(json.len() < 64 * 1024, "{} bytes", json.len());
    }

    #[test]
    fn failures_list_the_current_revocation_and_the_recoveries_with_their_cost() {
        let cause = |w: &str| crate::records::Cause::member(Some(1), w, "h1", "lease expired".into(), "coordinator");
        let g = GenerationRecord {
            number: 3,
            members: vec![],
            formed_at_ms: 5_000,
            revoked: Some(cause("w2")),
            revoked_at_ms: Some(9_000),
            departed: vec![],
            below_min_since_ms: None,
            history: vec![(2, cause("w1"))],
            recoveries: vec![crate::records::Recovery {
                generation: 2,
                size: 3,
                formed_at_ms: 1_000,
                revoked_at_ms: 4_000,
                reformed_at_ms: 5_000,
                reformed_size: 2,
            }],
            shards: None,
        };
        let rows = failures(Some(&g), 10_000);
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].generation, rows[0].reformed_at_ms, rows[0].cost_ms), (3, None, 1_000));
        assert_eq!(rows[0].cause.as_ref().map(|c| c.worker_id.as_str()), Some("w2"));
        assert_eq!((rows[1].generation, rows[1].reformed_at_ms, rows[1].cost_ms), (2, Some(5_000), 1_000));
        assert_eq!(rows[1].cause.as_ref().map(|c| c.worker_id.as_str()), Some("w1"));
    }

    #[test]
    fn rates_skip_close_samples_and_clamp_restores() {
        let samples: VecDeque<Sample> = [(0, 0), (1_000, 10), (1_200, 12), (2_000, 30), (3_000, 25)]
            .into_iter()
            .map(|(at_ms, step)| Sample { at_ms, step })
            .collect();
        assert_eq!(rates(&samples), vec![(1_000, 10.0), (2_000, 20.0), (3_000, 0.0)]);
    }

    #[test]
    fn queries_are_decoded_and_html_escaped() {
        assert_eq!(query_value("a=1&token=x%2By+z", "token").as_deref(), Some("x+y z"));
        assert_eq!(query_value("token", "token").as_deref(), Some(""));
        assert_eq!(query_value("a=%", "a").as_deref(), Some("%"));
        assert_eq!(query_value("a=%4", "a").as_deref(), Some("%4"));
        assert_eq!(query_value("a=1", "token"), None);
        assert_eq!(html_escape("<a href=\"x\">'&'</a>"), "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;");
    }
}
