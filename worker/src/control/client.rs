//! The retrying, failing-over coordinator client.

use super::unreached::Unreached;
use super::ControlError;
use cohort_proto::v1::coordinator_client::CoordinatorClient;
use cohort_proto::v1::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tonic::metadata::MetadataValue;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Request, Status};

/// How to reach the coordinator.
#[derive(Clone, Debug)]
pub struct ControlConfig {
    /// Coordinator endpoints (`http://HOST:PORT`, `https://...`, or bare `HOST:PORT`); any
    /// replica serves any request.
    pub endpoints: Vec<String>,
    /// The job token, sent as `authorization: Bearer <token>`.
    pub token: Option<String>,
    /// PEM file of the CA that signed the coordinators' certificates (for `https://`).
    pub tls_ca: Option<std::path::PathBuf>,
    /// Bound on establishing a connection to one endpoint.
    pub connect_timeout: Duration,
    /// Bound on one unary request (long polls add their own wait to it).
    pub request_timeout: Duration,
    /// How long to keep retrying unreachable coordinators before giving up.
    pub retry_budget: Duration,
    /// How long to keep retrying while no coordinator has ever answered this client and every
    /// endpoint fails as a wrong address does (default 3 s): the connection refused, the host
    /// name not resolving, the TCP connect not answered within `connect_timeout`. That is
    /// said in a few seconds (the wait, plus the attempt in flight and its backoff) instead of
    /// after the whole `retry_budget`; an endpoint that answers but does not speak gRPC over
    /// HTTP/2 fails the first call at once ([`ControlError::NotACoordinator`]). Raise it for
    /// coordinators that start after their workers (`cohort-worker train
    /// --coordinator-wait`). Once a coordinator has answered, an outage is retried for
    /// `retry_budget`, as are other failures from the start (a connection accepted and never
    /// answered, a replica that is not ready).
    pub first_contact_wait: Duration,
    /// Bound on one heartbeat request (default 1 s, at most `request_timeout`): a heartbeat
    /// stuck on a replica that died must fail over before the member's lease (3 s by
    /// default) lapses; the deterministic simulation found healthy workers evicted when
    /// heartbeats waited the whole request timeout (5 s) on a crashed replica.
    pub heartbeat_timeout: Duration,
    /// Randomisation of the retry backoff, 0.0..=1.0 (default 0.5: each wait is drawn from
    /// 50% to 150% of the nominal one, so that clients do not retry in step). The
    /// deterministic simulation sets 0 (the backoff's randomness is not seeded).
    pub retry_jitter: f64,
    /// The endpoint requests start at (an index into `endpoints`); `None` (the default)
    /// draws one at random, so that a job's workers spread over the replicas.
    pub first_endpoint: Option<usize>,
}

impl ControlConfig {
    /// A configuration with the given endpoints and default timeouts: connect 2 s,
    /// request 5 s, retry budget 30 s, 3 s while every endpoint refuses the first contact.
    pub fn new(endpoints: Vec<String>) -> Self {
        Self {
            endpoints,
            token: None,
            tls_ca: None,
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(5),
            retry_budget: Duration::from_secs(30),
            first_contact_wait: Duration::from_secs(3),
            heartbeat_timeout: Duration::from_secs(1),
            retry_jitter: 0.5,
            first_endpoint: None,
        }
    }
}

/// A coordinator client that fails over between endpoints and retries with backoff.
///
/// Cheap to clone (the channels are shared); safe to use from several tasks at once.
#[derive(Clone)]
pub struct ControlClient {
    inner: Arc<Inner>,
}

struct Inner {
    config: ControlConfig,
    channels: Vec<Channel>,
    auth: Option<MetadataValue<tonic::metadata::Ascii>>,
    /// Index of the endpoint that answered last; requests start there. It starts at a
    /// random endpoint, so that a job's workers spread over the replicas (as they do behind
    /// one Kubernetes Service) instead of all loading the first one.
    preferred: AtomicUsize,
    /// Whether any coordinator has answered this client (a response or a status of its
    /// own): from then on, connection failures are an outage to wait out, not a wrong address.
    contacted: AtomicBool,
}

/// The URL of an endpoint: as given when it names a scheme, else `https://` when a CA is
/// configured (TLS is what a CA is for), `http://` otherwise.
fn normalise(endpoint: &str, tls: bool) -> String {
    if endpoint.contains("://") {
        endpoint.to_string()
    } else if tls {
        format!("https://{endpoint}")
    } else {
        format!("http://{endpoint}")
    }
}

/// The error for a status that is not retried: [`ControlError::Excluded`] or
/// [`ControlError::IdInUse`] when the coordinator says when to come back, else
/// [`ControlError::Rejected`].
fn refusal(rpc: &'static str, status: &Status) -> ControlError {
    let retry_after = status
        .metadata()
        .get(cohort_proto::RETRY_AFTER_MS_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    match retry_after {
        Some(ms) if status.code() == Code::FailedPrecondition => {
            ControlError::Excluded { message: status.message().to_string(), retry_after: Duration::from_millis(ms) }
        }
        Some(ms) if status.code() == Code::AlreadyExists => {
            ControlError::IdInUse { message: status.message().to_string(), retry_after: Duration::from_millis(ms) }
        }
        _ => ControlError::Rejected { rpc, code: status.code(), message: status.message().to_string() },
    }
}

/// Whether a status means "this endpoint is not serving now": retry elsewhere.
fn is_transient(status: &Status) -> bool {
    match status.code() {
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Aborted => true,
        // Connection-level failures surface as Unknown with a transport error message.
        Code::Unknown => {
            let m = status.message();
            m.contains("transport error") || m.contains("connection") || m.contains("h2 protocol")
        }
        // The server closed the whole HTTP/2 connection with ENHANCE_YOUR_CALM (its flood
        // protection: too many streams reset by this side before it accepted them, as a busy
        // coordinator sees when the calls of many workers sharing a connection give up at
        // once). Every call on it fails so, whatever it asked; the next connection serves it.
        // The coordinator itself never answers RESOURCE_EXHAUSTED.
        Code::ResourceExhausted => status.message().contains("h2 protocol"),
        // The HTTP/2 connection broke under the call (tonic names h2's own errors so: a replica
        // killed mid-call resets its connections). The next endpoint serves it; the
        // coordinator's own INTERNAL answers never carry this prefix.
        Code::Internal => status.message().starts_with("h2 protocol error"),
        _ => false,
    }
}

impl ControlClient {
    /// Prepares channels to every endpoint (connections are made lazily, on first use).
    ///
    /// Fails only on a malformed configuration; unreachable coordinators are found out (and
    /// retried) per request.
    pub fn new(config: ControlConfig) -> Result<Self, ControlError> {
        Self::with_connector(config, Endpoint::connect_lazy)
    }

    /// As [`Self::new`], with `connect` turning each endpoint (timeouts, keep-alive and TLS
    /// set from `config`) into a channel: [`Endpoint::connect_lazy`] over TCP, or
    /// [`Endpoint::connect_with_connector_lazy`] over another network (the simulation's).
    pub fn with_connector(config: ControlConfig, connect: impl Fn(&Endpoint) -> Channel) -> Result<Self, ControlError> {
        if config.endpoints.is_empty() {
            return Err(ControlError::Config("no coordinator endpoint given".into()));
        }
        let tls = match &config.tls_ca {
            Some(path) => {
                let pem = std::fs::read(path)
                    .map_err(|e| ControlError::Config(format!("reading CA {}: {e}", path.display())))?;
                Some(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)))
            }
            None => None,
        };
        let mut channels = Vec::with_capacity(config.endpoints.len());
        for raw in &config.endpoints {
            let url = normalise(raw, tls.is_some());
            if tls.is_some() && url.starts_with("http://") {
                // A CA with a plain-text endpoint would be silently ignored: say so instead.
                return Err(ControlError::Config(format!(
                    "{raw:?} is http:// but a CA certificate is given (--tls-ca): the connection would not be \
                     encrypted; use https://"
                )));
            }
            let mut endpoint = Endpoint::from_shared(url.clone())
                .map_err(|e| ControlError::Config(format!("bad coordinator endpoint {raw:?}: {e}")))?
                .connect_timeout(config.connect_timeout)
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(5))
                .keep_alive_timeout(Duration::from_secs(5));
            if url.starts_with("https://") {
                let tls = tls.clone().ok_or_else(|| {
                    ControlError::Config(format!("{raw:?} is https: give the CA certificate (--tls-ca)"))
                })?;
                endpoint =
                    endpoint.tls_config(tls).map_err(|e| ControlError::Config(format!("TLS for {raw:?}: {e}")))?;
            }
            channels.push(connect(&endpoint));
        }
        let auth = match &config.token {
            Some(token) => Some(
                MetadataValue::try_from(format!("Bearer {token}"))
                    .map_err(|_| ControlError::Config("the job token is not valid ASCII metadata".into()))?,
            ),
            None => None,
        };
        let first = config.first_endpoint.unwrap_or_else(|| rand::random::<u32>() as usize);
        let preferred = AtomicUsize::new(first % channels.len());
        let contacted = AtomicBool::new(false);
        Ok(Self { inner: Arc::new(Inner { config, channels, auth, preferred, contacted }) })
    }

    /// The configuration this client was built with.
    pub fn config(&self) -> &ControlConfig {
        &self.inner.config
    }

    fn request<T>(&self, message: T, timeout: Duration) -> Request<T> {
        let mut request = Request::new(message);
        request.set_timeout(timeout);
        if let Some(auth) = &self.inner.auth {
            request.metadata_mut().insert(cohort_proto::AUTHORIZATION_HEADER, auth.clone());
        }
        request
    }

    /// Runs one unary call with failover and backoff. `extra` is added to the per-request
    /// timeout (for long polls).
    async fn call<Req, Resp, F, Fut>(
        &self,
        rpc: &'static str,
        message: Req,
        extra: Duration,
        f: F,
    ) -> Result<Resp, ControlError>
    where
        Req: Clone,
        F: Fn(CoordinatorClient<Channel>, Request<Req>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<Resp>, Status>>,
    {
        self.call_within(rpc, message, self.inner.config.request_timeout + extra, f).await
    }

    /// As [`Self::call`], each attempt bounded by `timeout`.
    async fn call_within<Req, Resp, F, Fut>(
        &self,
        rpc: &'static str,
        message: Req,
        timeout: Duration,
        f: F,
    ) -> Result<Resp, ControlError>
    where
        Req: Clone,
        F: Fn(CoordinatorClient<Channel>, Request<Req>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<Resp>, Status>>,
    {
        let n = self.inner.channels.len();
        let mut backoff = backoff::ExponentialBackoffBuilder::new()
            .with_initial_interval(Duration::from_millis(50))
            .with_max_interval(Duration::from_secs(1))
            .with_multiplier(2.0)
            .with_randomization_factor(self.inner.config.retry_jitter.clamp(0.0, 1.0))
            .with_max_elapsed_time(Some(self.inner.config.retry_budget))
            .build();
        let mut attempts = 0u32;
        let started = tokio::time::Instant::now();
        // Why each endpoint failed this call last, while every failure was a wrong address's.
        let mut wrong_address: Option<Vec<Option<(Unreached, String)>>> = Some(vec![None; n]);
        // Endpoints already warned about in this call.
        let mut warned = vec![false; n];
        loop {
            let index = self.inner.preferred.load(Ordering::Relaxed) % n;
            let endpoint = &self.inner.config.endpoints[index];
            let client = CoordinatorClient::new(self.inner.channels[index].clone());
            let request = self.request(message.clone(), timeout);
            attempts += 1;
            // tonic enforces the request's deadline only once the channel is ready; a
            // channel reconnecting to a host that died (nothing answers, not even the
            // connect) never is, so the whole attempt is bounded here.
            let answer = match tokio::time::timeout(timeout, f(client, request)).await {
                Ok(answer) => answer,
                Err(_) => Err(Status::deadline_exceeded(format!("{rpc}: no answer within {timeout:?}"))),
            };
            let status = match answer {
                Ok(response) => {
                    self.inner.contacted.store(true, Ordering::Relaxed);
                    return Ok(response.into_inner());
                }
                Err(status) => status,
            };
            let unreached = Unreached::of(&status);
            let contacted = self.inner.contacted.load(Ordering::Relaxed);
            if unreached == Unreached::NotGrpc && !contacted {
                // Nothing at this address will turn into a coordinator by waiting.
                return Err(ControlError::NotACoordinator { endpoint: endpoint.clone(), detail: status.to_string() });
            }
            if unreached != Unreached::NotGrpc && !is_transient(&status) {
                self.inner.contacted.store(true, Ordering::Relaxed);
                return Err(refusal(rpc, &status));
            }
            if !contacted && !std::mem::replace(&mut warned[index], true) {
                tracing::warn!(rpc, endpoint = %endpoint, why = unreached.describe(), %status,
                               "cannot reach the coordinator at {endpoint}: {}; retrying", unreached.describe());
            } else if unreached == Unreached::NotGrpc {
                tracing::warn!(rpc, endpoint = %endpoint, %status, "{endpoint}: {}; failing over", unreached.describe());
            } else {
                tracing::debug!(rpc, endpoint = %endpoint, %status, "coordinator unreachable, failing over");
            }
            if !unreached.is_wrong_address() {
                wrong_address = None;
            }
            if let Some(reasons) = wrong_address.as_mut() {
                reasons[index] = Some((unreached, status.message().to_string()));
                let waited = started.elapsed();
                if !contacted && waited >= self.inner.config.first_contact_wait && reasons.iter().all(Option::is_some) {
                    return Err(self.wrong_address(reasons, waited));
                }
            }
            // Try the next endpoint next time.
            let _ = self.inner.preferred.compare_exchange(index, (index + 1) % n, Ordering::Relaxed, Ordering::Relaxed);
            match backoff::backoff::Backoff::next_backoff(&mut backoff) {
                Some(wait) => tokio::time::sleep(wait).await,
                None => {
                    return Err(ControlError::Unreachable {
                        endpoints: self.inner.config.endpoints.join(","),
                        attempts,
                        last: format!("{endpoint}: {status}"),
                    })
                }
            }
        }
    }

    /// The error of a first contact that found only wrong addresses: `reasons` holds each
    /// endpoint's last failure.
    fn wrong_address(&self, reasons: &[Option<(Unreached, String)>], waited: Duration) -> ControlError {
        let endpoints = self.inner.config.endpoints.join(",");
        let reasons: Vec<(Unreached, &str)> = reasons.iter().flatten().map(|(u, m)| (*u, m.as_str())).collect();
        if reasons.iter().all(|(u, _)| *u == Unreached::Refused) {
            let last = reasons.last().map_or("", |(_, m)| m).to_string();
            return ControlError::NothingListening { endpoints, waited, last };
        }
        let why = self
            .inner
            .config
            .endpoints
            .iter()
            .zip(&reasons)
            .map(|(e, (u, m))| format!("{e}: {} ({m})", u.describe()))
            .collect::<Vec<_>>()
            .join("; ");
        ControlError::NoCoordinator { endpoints, waited, why }
    }

    /// Joins the job (one new incarnation of this worker).
    ///
    /// # Cancel safety
    /// Cancel safe in that dropping it leaves at most an unused incarnation behind, which
    /// the coordinator expires with its lease.
    pub async fn join(&self, request: JoinRequest) -> Result<JoinResponse, ControlError> {
        self.call("Join", request, Duration::ZERO, |mut c, r| async move { c.join(r).await }).await
    }

    /// Sends one heartbeat.
    ///
    /// # Cancel safety
    /// Cancel safe (a heartbeat is idempotent).
    pub async fn heartbeat(&self, request: HeartbeatRequest) -> Result<HeartbeatResponse, ControlError> {
        let timeout = self.inner.config.heartbeat_timeout.min(self.inner.config.request_timeout);
        self.call_within("Heartbeat", request, timeout, |mut c, r| async move { c.heartbeat(r).await }).await
    }

    /// Sends several members' heartbeats in one call (the host's heartbeat relay does),
    /// under the heartbeat timeout; the coordinator answers each beat in order.
    ///
    /// # Cancel safety
    /// Cancel safe (heartbeats are idempotent).
    pub async fn host_heartbeat(&self, request: HostHeartbeatRequest) -> Result<HostHeartbeatResponse, ControlError> {
        let timeout = self.inner.config.heartbeat_timeout.min(self.inner.config.request_timeout);
        self.call_within("HostHeartbeat", request, timeout, |mut c, r| async move { c.host_heartbeat(r).await }).await
    }

    /// Waits (long poll of `request.wait_ms`) for the next generation.
    ///
    /// # Cancel safety
    /// Cancel safe: calling again resumes the wait.
    pub async fn rendezvous(&self, request: RendezvousRequest) -> Result<RendezvousResponse, ControlError> {
        let extra = Duration::from_millis(request.wait_ms);
        self.call("Rendezvous", request, extra, |mut c, r| async move { c.rendezvous(r).await }).await
    }

    /// Waits (long poll of `request.wait_ms`) for the next generation, asking for the compact
    /// answer whatever `request.compact` says: the formed generation carries no member list
    /// but its `size`, the caller's `rank` and own entry (`member`) and `members_digest`.
    /// With `request.partners` its `members` are the caller's partners' entries
    /// ([`cohort_proto::partner_ranks`], ascending), one round trip fewer; fetch any other
    /// peer with [`Self::fetch_members`] (and the partners too when a coordinator older than
    /// `partners` leaves `members` empty). Against a coordinator older than the compact
    /// answer, the whole list comes back (`members` not empty, `size` 0).
    ///
    /// # Cancel safety
    /// Cancel safe: calling again resumes the wait.
    pub async fn rendezvous_compact(&self, request: RendezvousRequest) -> Result<RendezvousResponse, ControlError> {
        self.rendezvous(RendezvousRequest { compact: true, ..request }).await
    }

    /// One `Members` call: entries of the job's newest generation by rank and/or by host, as
    /// the coordinator answers them (at most [`cohort_proto::MAX_MEMBERS_PER_CALL`] ranks).
    /// Bounded and retried like every unary call; a refusal (stale generation, rank out of
    /// range, not a member) is [`ControlError::Rejected`].
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    pub async fn members(&self, request: MembersRequest) -> Result<MembersResponse, ControlError> {
        self.call("Members", request, Duration::ZERO, |mut c, r| async move { c.members(r).await }).await
    }

    /// The members of generation `request.generation` at `request.ranks` and on
    /// `request.host`, each once, in rank order: as many `Members` calls as the ranks need
    /// ([`cohort_proto::MAX_MEMBERS_PER_CALL`] each, the host asked in the first), each
    /// checked against `digest` (the compact answer's `members_digest`). An answer about
    /// another generation or member list is [`ControlError::Rejected`] with
    /// `FailedPrecondition`: the generation changed, rendezvous again.
    ///
    /// # Cancel safety
    /// Cancel safe (read only): dropping it drops the calls in flight.
    pub async fn fetch_members(&self, request: MembersRequest, digest: u64) -> Result<Vec<Member>, ControlError> {
        let mut ranks = request.ranks.clone();
        ranks.sort_unstable();
        ranks.dedup();
        let mut chunks: Vec<Vec<u32>> = ranks.chunks(cohort_proto::MAX_MEMBERS_PER_CALL).map(<[u32]>::to_vec).collect();
        if chunks.is_empty() {
            // A host alone (an empty request is refused by the coordinator, with its reason).
            chunks.push(Vec::new());
        }
        let mut out: Vec<Member> = Vec::with_capacity(ranks.len());
        for (i, chunk) in chunks.into_iter().enumerate() {
            let host = if i == 0 { request.host.clone() } else { String::new() };
            let answer = self.members(MembersRequest { ranks: chunk, host, ..request.clone() }).await?;
            if answer.generation != request.generation || answer.members_digest != digest {
                return Err(ControlError::Rejected {
                    rpc: "Members",
                    code: Code::FailedPrecondition,
                    message: format!(
                        "the answer is about generation {} with member digest {:016x}, not generation {} with \
                         {digest:016x}: the generation changed; rendezvous again",
                        answer.generation, answer.members_digest, request.generation
                    ),
                });
            }
            out.extend(answer.members);
        }
        out.sort_by_key(|m| m.rank);
        out.dedup_by_key(|m| m.rank);
        Ok(out)
    }

    /// Reports a failure of a generation.
    ///
    /// # Cancel safety
    /// Cancel safe (reports are idempotent).
    pub async fn report_failure(&self, request: FailureReport) -> Result<FailureReportResponse, ControlError> {
        self.call("ReportFailure", request, Duration::ZERO, |mut c, r| async move { c.report_failure(r).await }).await
    }

    /// Leaves the job.
    ///
    /// # Cancel safety
    /// Cancel safe (leaving twice is harmless).
    pub async fn leave(&self, request: LeaveRequest) -> Result<LeaveResponse, ControlError> {
        self.call("Leave", request, Duration::ZERO, |mut c, r| async move { c.leave(r).await }).await
    }

    /// Reports a commit point; answers whether a re-formation is pending.
    ///
    /// # Cancel safety
    /// Cancel safe (a commit report is idempotent).
    pub async fn commit(&self, request: CommitRequest) -> Result<CommitResponse, ControlError> {
        self.call("Commit", request, Duration::ZERO, |mut c, r| async move { c.commit(r).await }).await
    }

    /// Reads the job's status.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    pub async fn status(&self, request: StatusRequest) -> Result<StatusResponse, ControlError> {
        self.call("Status", request, Duration::ZERO, |mut c, r| async move { c.status(r).await }).await
    }

    /// One operation on the job's key-value store (`StoreOp`, the c10d store): bounded like
    /// every unary call, plus the operation's own `wait_ms` for a `get` or `wait`, and retried
    /// across endpoints while none answers. [`super::JobStore`] wraps it per operation.
    ///
    /// # Cancel safety
    /// Cancel safe in that dropping it drops the call in flight; whether a write that was
    /// in flight got applied is then unknown (a retried `add` may add twice).
    pub async fn store_op(&self, request: StoreRequest) -> Result<StoreResponse, ControlError> {
        use store_request::Op;
        let extra = match &request.op {
            Some(Op::Get(g)) => Duration::from_millis(g.wait_ms),
            Some(Op::Wait(w)) => Duration::from_millis(w.wait_ms),
            _ => Duration::ZERO,
        };
        self.call("StoreOp", request, extra, |mut c, r| async move { c.store_op(r).await }).await
    }

    /// Opens the job's event stream on the first endpoint that answers.
    ///
    /// The stream has no overall deadline (it lives as long as the membership); the caller
    /// reopens it when it ends or errs.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn watch(&self, request: WatchRequest) -> Result<tonic::Streaming<JobEvent>, ControlError> {
        let n = self.inner.channels.len();
        let mut last = String::new();
        for attempt in 0..n {
            let index = (self.inner.preferred.load(Ordering::Relaxed) + attempt) % n;
            let mut client = CoordinatorClient::new(self.inner.channels[index].clone());
            let mut req = Request::new(request.clone());
            if let Some(auth) = &self.inner.auth {
                req.metadata_mut().insert(cohort_proto::AUTHORIZATION_HEADER, auth.clone());
            }
            match tokio::time::timeout(self.inner.config.request_timeout, client.watch(req)).await {
                Ok(Ok(stream)) => return Ok(stream.into_inner()),
                Ok(Err(status)) if Unreached::of(&status) == Unreached::NotGrpc => {
                    let endpoint = &self.inner.config.endpoints[index];
                    tracing::warn!(endpoint = %endpoint, %status, "{endpoint}: {}", Unreached::NotGrpc.describe());
                    last = format!("{endpoint}: {}: {status}", Unreached::NotGrpc.describe());
                }
                Ok(Err(status)) if !is_transient(&status) => {
                    return Err(ControlError::Rejected {
                        rpc: "Watch",
                        code: status.code(),
                        message: status.message().to_string(),
                    })
                }
                Ok(Err(status)) => last = status.to_string(),
                Err(_) => last = format!("no answer within {:?}", self.inner.config.request_timeout),
            }
        }
        Err(ControlError::Unreachable { endpoints: self.inner.config.endpoints.join(","), attempts: n as u32, last })
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_ca_with_a_plain_text_endpoint_is_an_error_not_ignored() {
        let dir = std::env::temp_dir().join(format!("cohort-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let ca = dir.join("ca.pem");
        std::fs::write(&ca, b"-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n").expect("write");
        let mut config = ControlConfig::new(vec!["http://127.0.0.1:7470".into()]);
        config.tls_ca = Some(ca.clone());
        let err = ControlClient::new(config).err().expect("http:// with a CA must be refused");
        assert!(err.to_string().contains("is http:// but a CA certificate is given"), "{err}");
        // A bare HOST:PORT with a CA means TLS; without one, plain text.
        assert_eq!(normalise("h:1", true), "https://h:1");
        assert_eq!(normalise("h:1", false), "http://h:1");
        assert_eq!(normalise("http://h:1", true), "http://h:1");
        let _ = std::fs::remove_dir_all(&dir);
    }

    use super::*;

    fn with_retry_after(code: Code, value: &str) -> Status {
        let mut status = Status::new(code, "worker w1 is excluded");
        status.metadata_mut().insert(cohort_proto::RETRY_AFTER_MS_HEADER, value.parse().expect("ascii"));
        status
    }

    /// A replica that accepts connections and then never answers must not hold a call past
    /// its bounds (here tonic's own deadline fires; the client's bound covers a channel that
    /// never becomes ready, which the control-plane simulation in sim/ exercises: a replica
    /// host that died and answers nothing, not even the reconnect).
    #[tokio::test]
    async fn a_replica_that_never_answers_does_not_hold_a_call_past_its_timeout() {
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = silent.local_addr().expect("address");
        // Accept and keep the connections open without ever answering.
        let holder = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = silent.accept().await {
                held.push(stream);
            }
        });
        let mut config = ControlConfig::new(vec![format!("http://{address}")]);
        config.request_timeout = Duration::from_millis(300);
        config.heartbeat_timeout = Duration::from_millis(200);
        config.retry_budget = Duration::from_millis(600);
        let client = ControlClient::new(config).expect("client");
        let started = tokio::time::Instant::now();
        let heartbeat = pb_heartbeat();
        let outcome = tokio::time::timeout(Duration::from_secs(20), client.heartbeat(heartbeat)).await;
        let error = outcome.expect("the heartbeat returned within its bounds").expect_err("nobody answered");
        assert!(matches!(error, ControlError::Unreachable { .. }), "{error:?}");
        assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
        holder.abort();
    }

    /// A port nothing listens on: bound, noted, closed.
    fn closed_port() -> std::net::SocketAddr {
        std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("address")
    }

    /// A wrong address (every connection refused from the start) fails after
    /// `first_contact_wait`, not the whole retry budget, naming the address and the knob.
    #[tokio::test]
    async fn a_refused_first_contact_fails_fast_naming_the_address() {
        let address = closed_port();
        let mut config = ControlConfig::new(vec![format!("http://{address}")]);
        config.first_contact_wait = Duration::from_millis(300);
        assert_eq!(config.retry_budget, Duration::from_secs(30), "the default budget stays long");
        let client = ControlClient::new(config).expect("client");
        let join = JoinRequest { job: "j".into(), worker_id: "w".into(), ..Default::default() };
        let error = tokio::time::timeout(Duration::from_secs(20), client.join(join))
            .await
            .expect("the join returned within its bounds")
            .expect_err("nothing listens");
        match &error {
            ControlError::NothingListening { endpoints, waited, .. } => {
                assert_eq!(endpoints, &format!("http://{address}"));
                assert!(*waited >= Duration::from_millis(300), "{waited:?}");
            }
            other => panic!("not NothingListening: {other:?}"),
        }
        let text = error.to_string();
        assert!(text.contains(&format!("nothing listens at http://{address}")), "{text}");
        assert!(text.contains("--coordinator-wait"), "{text}");
    }

    /// A first-contact wait at least as long as the retry budget leaves the budget in charge:
    /// coordinators that start after their workers are waited for as before.
    #[tokio::test]
    async fn a_long_first_contact_wait_keeps_retrying_for_the_budget() {
        let address = closed_port();
        let mut config = ControlConfig::new(vec![format!("http://{address}")]);
        config.retry_budget = Duration::from_millis(400);
        config.first_contact_wait = Duration::from_secs(60);
        let client = ControlClient::new(config).expect("client");
        let error = tokio::time::timeout(Duration::from_secs(20), client.heartbeat(pb_heartbeat()))
            .await
            .expect("the heartbeat returned within its bounds")
            .expect_err("nothing listens");
        assert!(matches!(error, ControlError::Unreachable { .. }), "{error:?}");
    }

    fn join_request() -> JoinRequest {
        JoinRequest { job: "j".into(), worker_id: "w".into(), ..Default::default() }
    }

    /// A misspelt host name (`.invalid` never resolves) fails after `first_contact_wait`,
    /// not the whole retry budget, naming the address and that its name does not resolve.
    #[tokio::test]
    async fn a_name_that_does_not_resolve_fails_fast_naming_it() {
        let endpoint = "http://no-such-host.invalid:7000".to_string();
        let mut config = ControlConfig::new(vec![endpoint.clone()]);
        config.first_contact_wait = Duration::from_millis(300);
        let client = ControlClient::new(config).expect("client");
        let error = tokio::time::timeout(Duration::from_secs(20), client.join(join_request()))
            .await
            .expect("the join gave up within its bounds, not the 30 s budget")
            .expect_err("the name does not resolve");
        assert!(matches!(error, ControlError::NoCoordinator { .. }), "{error:?}");
        let text = error.to_string();
        assert!(text.contains(&format!("{endpoint}: the host name does not resolve")), "{text}");
        assert!(text.contains("--coordinator-wait"), "{text}");
    }

    /// A black-holed address (a listener whose accept queue is full drops the SYNs: the
    /// connect is never answered) fails once `first_contact_wait` has passed and the attempt
    /// in flight timed out, naming the address and why.
    #[tokio::test]
    async fn an_unanswered_connect_fails_fast_naming_it() {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.bind("127.0.0.1:0".parse().expect("address")).expect("bind");
        let listener = socket.listen(0).expect("listen");
        let address = listener.local_addr().expect("address");
        // Fill the accept queue (nothing accepts) until a connect goes unanswered.
        let mut queued = Vec::new();
        loop {
            assert!(queued.len() < 16, "the accept queue never filled");
            match tokio::time::timeout(Duration::from_millis(300), tokio::net::TcpStream::connect(address)).await {
                Ok(stream) => queued.push(stream.expect("connect")),
                Err(_) => break,
            }
        }
        let endpoint = format!("http://{address}");
        let mut config = ControlConfig::new(vec![endpoint.clone()]);
        config.connect_timeout = Duration::from_millis(200);
        config.first_contact_wait = Duration::from_millis(500);
        let client = ControlClient::new(config).expect("client");
        let error = tokio::time::timeout(Duration::from_secs(20), client.join(join_request()))
            .await
            .expect("the join gave up within its bounds, not the 30 s budget")
            .expect_err("nothing answers");
        let text = error.to_string();
        assert!(matches!(error, ControlError::NoCoordinator { .. }), "{error:?}");
        assert!(text.contains(&format!("{endpoint}: the connect was not answered")), "{text}");
        drop(listener);
    }

    /// A plain HTTP/1.1 server at the address: the first call fails at once, naming the
    /// address and saying that it is not a coordinator (it does not speak gRPC over HTTP/2),
    /// not "coordinator refused Join: Internal: h2 protocol error".
    #[tokio::test]
    async fn a_plain_http_server_is_named_as_not_a_coordinator() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = server.local_addr().expect("address");
        let serving = tokio::spawn(async move {
            while let Ok((mut stream, _)) = server.accept().await {
                tokio::spawn(async move {
                    let mut scratch = [0u8; 1024];
                    let _ = stream.read(&mut scratch).await;
                    let _ = stream.write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n").await;
                    while matches!(stream.read(&mut scratch).await, Ok(n) if n > 0) {}
                });
            }
        });
        let endpoint = format!("http://{address}");
        let client = ControlClient::new(ControlConfig::new(vec![endpoint.clone()])).expect("client");
        let error = tokio::time::timeout(Duration::from_secs(20), client.join(join_request()))
            .await
            .expect("the join returned within its bounds")
            .expect_err("not a coordinator");
        assert!(matches!(&error, ControlError::NotACoordinator { endpoint: e, .. } if *e == endpoint), "{error:?}");
        let text = error.to_string();
        assert!(text.contains(&format!("{endpoint} is not a cohort coordinator")), "{text}");
        assert!(text.contains("does not speak gRPC over HTTP/2"), "{text}");
        serving.abort();
    }

    fn pb_heartbeat() -> HeartbeatRequest {
        HeartbeatRequest { job: "j".into(), worker_id: "w".into(), incarnation: 1, ..Default::default() }
    }

    #[test]
    fn an_exclusion_refusal_says_when_to_come_back() {
        match refusal("Join", &with_retry_after(Code::FailedPrecondition, "2500")) {
            ControlError::Excluded { retry_after, message } => {
                assert_eq!(retry_after, Duration::from_millis(2500));
                assert!(message.contains("excluded"), "{message}");
            }
            other => panic!("not Excluded: {other:?}"),
        }
        // Anything else is a plain refusal: no hint, a malformed hint, another code.
        for status in [
            Status::failed_precondition("job ended"),
            with_retry_after(Code::FailedPrecondition, "soon"),
            with_retry_after(Code::InvalidArgument, "2500"),
        ] {
            let e = refusal("Join", &status);
            assert!(matches!(e, ControlError::Rejected { rpc: "Join", .. }), "{e:?}");
        }
    }

    #[test]
    fn a_connection_closed_by_the_servers_flood_protection_is_retried_elsewhere() {
        // What tonic makes of a GOAWAY with ENHANCE_YOUR_CALM.
        assert!(is_transient(&Status::resource_exhausted("h2 protocol error: http2 error")));
        // A refusal with that code and any other message stays one.
        assert!(!is_transient(&Status::resource_exhausted("too many keys")));
        // A connection broken under the call by a replica killed mid-call, as tonic reports it
        // (seen in job_store.rs's `the_store_outlives_a_replica_on_etcd`).
        assert!(is_transient(&Status::internal("h2 protocol error: http2 error")));
        assert!(!is_transient(&Status::internal("store: etcd said no")));
        assert!(!is_transient(&Status::invalid_argument("h2 protocol error")));
    }
}
