//! Production's data plane: TCP always, shared memory between members on one host, RDMA when
//! every member published it. Its endpoints are kept across generations, and each
//! generation's TCP links may be carried into the next.

use super::carry_plan::PreviousView;
use super::connect::{connect_planned, Carry, LocalEndpoints, MeshScope};
use super::data_plane::{Connected, DataPlane, Formed};
use super::members::{fetch_members, Members};
use super::mesh_plan::{upfront_ranks, MeshPlan};
use super::resolve::CoordinatorResolver;
use super::view_plan::plan_view;
use super::{ElasticConfig, ElasticError, MeshKind, MeshTransport, TransportChoice};
use crate::{CommConfig, Communicator};
use cohort_proto::ids::{JobId, WorkerId};
use cohort_proto::v1 as pb;
use cohort_transports::shm::ShmEndpoint;
use cohort_transports::tcp::{CarriedLink, ResolvePeer, TcpEndpoint, Upfront};
use cohort_transports::{Transport, TransportError};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;
use tracing::{debug, info, warn, Instrument};

/// Production's data plane (see the module's documentation).
pub struct SocketPlane {
    job: JobId,
    worker_id: WorkerId,
    /// The job's data-plane secret (handshakes).
    token: Vec<u8>,
    deadlines: cohort_transports::Deadlines,
    transport: TransportChoice,
    comm: CommConfig,
    endpoint: TcpEndpoint,
    advertised: String,
    /// The shared-memory identity published at join (`None`: TCP or RDMA only).
    shm: Option<ShmEndpoint>,
    /// The RDMA endpoint (when configured), kept across generations like the TCP listener.
    #[cfg(feature = "rdma")]
    rdma: Option<cohort_transports::rdma::RdmaEndpoint>,
    /// The last generation connected, whose TCP links the next one may carry over.
    previous: Option<Previous>,
}

impl SocketPlane {
    /// Binds the data-plane listener, opens the shared-memory endpoint and, with
    /// [`TransportChoice::Rdma`], the RDMA endpoint (failing when its device cannot be
    /// opened). `config.token` is the job's data-plane secret already.
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is published yet.
    pub async fn open(config: &ElasticConfig) -> Result<Self, ElasticError> {
        let endpoint = TcpEndpoint::bind(config.listen, config.tcp.clone()).await?;
        let port = endpoint.local_addr().port();
        let advertised = advertised_address(&config.advertise, port);
        let shm = if config.transport.publishes_shm() { Some(ShmEndpoint::new(config.shm.clone())?) } else { None };
        #[cfg(feature = "rdma")]
        let rdma = match config.transport {
            TransportChoice::Rdma => Some(open_rdma(&config.rdma, config.listen, &advertised).await?),
            _ => None,
        };
        Ok(Self {
            job: config.job.clone(),
            worker_id: config.worker_id.clone(),
            token: config.token.clone(),
            deadlines: config.deadlines,
            transport: config.transport,
            comm: config.comm.clone(),
            endpoint,
            advertised,
            shm,
            #[cfg(feature = "rdma")]
            rdma,
            previous: None,
        })
    }

    /// This worker's data-plane address as peers see it.
    pub fn advertised_address(&self) -> &str {
        &self.advertised
    }

    /// This worker's encoded RDMA endpoint address (`None` without an RDMA endpoint).
    pub fn rdma_address(&self) -> Option<String> {
        #[cfg(feature = "rdma")]
        if let Some(endpoint) = &self.rdma {
            return Some(endpoint.address().encode());
        }
        None
    }

    /// The address the data-plane listener is bound to.
    pub fn listen_address(&self) -> SocketAddr {
        self.endpoint.local_addr()
    }

    /// This worker's data-plane endpoints.
    fn local_endpoints(&self) -> LocalEndpoints<'_> {
        let local = LocalEndpoints::new(&self.endpoint).with_shm(self.shm.as_ref());
        #[cfg(feature = "rdma")]
        let local = local.with_rdma(self.rdma.as_ref());
        local
    }

    /// The entries of every peer this rank links at set-up that a sparse view lacks, fetched
    /// in one `Members` call (a host leader's plan reaches beyond its partners and host run).
    /// `None` when the generation changed meanwhile.
    async fn complete(&self, formed: &Formed<'_>, members: Members) -> Result<Option<Members>, ElasticError> {
        if members.is_whole() {
            return Ok(Some(members));
        }
        let wanted: Vec<u32> = match upfront_ranks(&members.layout(), formed.rank) {
            None => (0..members.size()).collect(),
            Some(plan) => plan,
        };
        let missing = members.missing(wanted);
        if missing.is_empty() {
            return Ok(Some(members));
        }
        debug!(rank = formed.rank, missing = missing.len(), "fetching the entries of the peers linked at set-up");
        let question = pb::MembersRequest {
            job: self.job.to_string(),
            worker_id: self.worker_id.to_string(),
            incarnation: formed.incarnation,
            generation: formed.generation.number,
            ranks: missing,
            host: String::new(),
        };
        let Some(fetched) = fetch_members(formed.client, question, formed.generation.members_digest).await? else {
            return Ok(None);
        };
        let mut members = members;
        members.add(&fetched)?;
        Ok(Some(members))
    }

    /// Connects this rank's mesh of generation `number` over the planned transport.
    ///
    /// # Cancel safety
    /// Cancel safe, like every transport's mesh set-up: dropping it abandons the set-up.
    async fn connect_mesh(
        &self,
        number: u64,
        rank: u32,
        plan: MeshPlan,
        carried: Vec<(u32, CarriedLink)>,
        resolver: Option<Arc<dyn ResolvePeer>>,
    ) -> Result<MeshTransport, TransportError> {
        let scope = MeshScope {
            job: self.job.clone(),
            generation: number,
            token: self.token.clone(),
            deadlines: self.deadlines,
        };
        // Every generation's TCP links may be carried into the next (an abort leaves them open).
        connect_planned(&scope, rank, plan, self.local_endpoints(), Carry { links: carried, onward: true }, resolver)
            .await
    }
}

impl DataPlane for SocketPlane {
    type Comm = Communicator<MeshTransport>;

    fn published(&self) -> (Vec<pb::TransportAddress>, Vec<String>) {
        let mut addresses =
            vec![pb::TransportAddress { transport: MeshKind::Tcp.name().into(), address: self.advertised.clone() }];
        let mut capabilities = vec![format!("transport:{}", MeshKind::Tcp)];
        if let Some(rdma) = self.rdma_address() {
            addresses.push(pb::TransportAddress { transport: MeshKind::Rdma.name().into(), address: rdma });
            capabilities.push(format!("transport:{}", MeshKind::Rdma));
        }
        if let Some(shm) = &self.shm {
            addresses
                .push(pb::TransportAddress { transport: MeshKind::Shm.name().into(), address: shm.address().encode() });
            capabilities.push(format!("transport:{}", MeshKind::Shm));
        }
        (addresses, capabilities)
    }

    async fn connect(&mut self, formed: Formed<'_>) -> Result<Option<Connected<Self::Comm>>, ElasticError> {
        let span = formed.span.clone();
        let (number, rank, incarnation) = (formed.generation.number, formed.rank, formed.incarnation);
        let Some(members) = self.complete(&formed, formed.members.clone()).instrument(span.clone()).await? else {
            return Ok(None);
        };
        let plan = plan_view(number, &members, rank, self.transport)?;
        let carried = match self.previous.take() {
            Some(previous) => previous.carry_into(number, &members, incarnation, rank, &plan),
            None => Vec::new(),
        };
        // A sparse view leaves the addresses of the peers outside the plan to be asked of the
        // coordinator when a link to one is first made.
        let resolver: Option<Arc<dyn ResolvePeer>> = (!members.is_whole()).then(|| {
            Arc::new(CoordinatorResolver::new(
                formed.client.clone(),
                pb::MembersRequest {
                    job: self.job.to_string(),
                    worker_id: self.worker_id.to_string(),
                    incarnation,
                    generation: number,
                    ranks: Vec::new(),
                    host: String::new(),
                },
                formed.generation.members_digest,
                &members,
            )) as Arc<dyn ResolvePeer>
        });
        let kind = plan.kind();
        if kind == MeshKind::Tcp && self.transport == TransportChoice::Rdma {
            warn!(parent: &span, without_rdma = %plan.without_rdma().join(", "),
                  "not every member published an rdma address: this generation uses tcp");
        }
        let started = Instant::now();
        let transport = match self.connect_mesh(number, rank, plan, carried, resolver).instrument(span.clone()).await {
            Ok(t) => t,
            Err(e) => {
                warn!(parent: &span, error = %e, "mesh connection failed; reporting and re-forming");
                let report = pb::FailureReport {
                    job: self.job.to_string(),
                    worker_id: self.worker_id.to_string(),
                    incarnation,
                    generation: number,
                    failed_rank: e.peer(),
                    reason: format!("mesh connection failed: {e}"),
                    kind: pb::failure_report::FailureKind::Unspecified as i32,
                    progress: None,
                };
                formed.client.report_failure(report).await?;
                return Ok(None);
            }
        };
        debug!(parent: &span, rank, transport = %kind, elapsed_ms = started.elapsed().as_millis() as u64, "mesh connected");
        // Report first, close after: a failed collective leaves the links open until the
        // coordinator has the root cause (on_failure revokes, which aborts the transport), so
        // no peer blames this rank for links it closed because another rank died.
        let comm_config = CommConfig { abort_transport_on_error: false, ..self.comm.clone() };
        let carried = transport.carried_links();
        let transport = Arc::new(transport);
        self.previous =
            Some(Previous { view: PreviousView::of(number, incarnation, &members), mesh: Arc::clone(&transport) });
        let mut comm = Communicator::new(transport, comm_config);
        comm.set_layout(members.layout()).map_err(|e| ElasticError::Protocol(e.to_string()))?;
        let links = comm.transport().linked_peers();
        info!(parent: &span, rank, world = members.size(), known = members.known().len(), transport = %kind, links, carried,
              "generation formed");
        let revoker = comm.revoker();
        Ok(Some(Connected { comm, revoke: Arc::new(move |cause| revoker.revoke(cause)), members, transport: kind }))
    }
}

/// A generation this worker connected, kept until the next one takes what it can of its links
/// (incremental re-formation).
struct Previous {
    /// Who held which rank in it ([`PreviousView`] decides what is carried).
    view: PreviousView,
    mesh: Arc<MeshTransport>,
}

impl Previous {
    /// The links of this generation that the next one, `generation` (this worker's rank
    /// `rank`, under `plan`), links again at set-up: the old link to each planned peer that
    /// was a member here too, if both ends are clean. The other links are shut down.
    fn carry_into(
        self,
        number: u64,
        members: &Members,
        incarnation: u64,
        rank: u32,
        plan: &MeshPlan,
    ) -> Vec<(u32, CarriedLink)> {
        let Some(old) = self.mesh.carry_over() else { return Vec::new() };
        let world = members.size();
        let planned: Vec<u32> = match plan {
            MeshPlan::Tcp { upfront, .. } | MeshPlan::Mixed { upfront, .. } => match upfront {
                Upfront::Every => (0..world).filter(|&p| p != rank).collect(),
                Upfront::Only(peers) => peers.clone(),
            },
            _ => Vec::new(),
        };
        self.view
            .carry_into(number, members, incarnation, planned)
            .into_iter()
            .filter_map(|(new_rank, old_rank)| Some((new_rank, old.take(old_rank, number)?)))
            .collect()
    }
}

/// The address peers dial: `advertise` as is when it carries a port (`HOST:PORT`,
/// `[V6]:PORT`; e.g. a proxy in front of this worker), else `advertise` with the bound port.
fn advertised_address(advertise: &str, port: u16) -> String {
    if advertise.parse::<SocketAddr>().is_ok() {
        return advertise.to_string();
    }
    if let Some((host, p)) = advertise.rsplit_once(':') {
        if !host.contains(':') && p.parse::<u16>().is_ok() {
            return advertise.to_string();
        }
    }
    if advertise.contains(':') {
        format!("[{advertise}]:{port}")
    } else {
        format!("{advertise}:{port}")
    }
}

/// Opens this worker's RDMA endpoint. The bootstrap listener binds on the TCP listener's IP
/// (keeping the port of `options.bootstrap_bind`, 0 = any) and, unless `options.advertise`
/// is set, advertises the host of the TCP advertised address with the bound port.
#[cfg(feature = "rdma")]
async fn open_rdma(
    options: &cohort_transports::rdma::RdmaOptions,
    listen: SocketAddr,
    advertised: &str,
) -> Result<cohort_transports::rdma::RdmaEndpoint, ElasticError> {
    let mut options = options.clone();
    options.bootstrap_bind = SocketAddr::new(listen.ip(), options.bootstrap_bind.port());
    if options.advertise.is_none() {
        let host = super::members::resolve(advertised).ok_or_else(|| {
            ElasticError::DataPlane(TransportError::InvalidArgument(format!(
                "the advertised address {advertised:?} does not resolve to an IP for the rdma bootstrap listener"
            )))
        })?;
        options.advertise = Some(SocketAddr::new(host.ip(), 0));
    }
    let device = options.device.name.clone().unwrap_or_else(|| "the first device with an active port".into());
    let endpoint = cohort_transports::rdma::RdmaEndpoint::open(options)
        .await
        .map_err(|source| ElasticError::RdmaEndpoint { device, source })?;
    info!(device = endpoint.device_name(), address = %endpoint.address().encode(), "rdma endpoint open");
    Ok(endpoint)
}

#[cfg(test)]
mod tests {
    use super::advertised_address;

    /// Without a usable device (none on this machine, or none by that name), join fails
    /// before contacting the coordinator, naming the device.
    #[cfg(feature = "rdma")]
    #[tokio::test]
    async fn join_fails_at_once_when_the_rdma_device_cannot_be_opened() {
        use super::super::{ElasticConfig, ElasticError, ElasticGroup};
        use crate::control::ControlConfig;
        use cohort_transports::rdma::{DeviceConfig, RdmaOptions};
        // Nothing listens on port 1: a join that got as far as the coordinator would fail otherwise.
        let (job, worker) = (super::super::JobId::new("job").unwrap(), super::super::WorkerId::new("w0").unwrap());
        let mut config = ElasticConfig::new(job, worker, ControlConfig::new(vec!["http://127.0.0.1:1".into()]));
        config.listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
        let device = DeviceConfig { name: Some("cohort-no-such-device".into()), ..DeviceConfig::default() };
        config.transport = super::TransportChoice::Rdma;
        config.rdma = RdmaOptions { device, ..RdmaOptions::default() };
        let started = std::time::Instant::now();
        let error = match ElasticGroup::join(config).await {
            Ok(_) => panic!("joined with a device that does not exist"),
            Err(e) => e,
        };
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "took {:?}", started.elapsed());
        assert!(
            matches!(&error, ElasticError::RdmaEndpoint { device, .. } if device == "cohort-no-such-device"),
            "{error}"
        );
        let message = error.to_string();
        assert!(message.contains("cohort-no-such-device") && message.contains("RDMA device"), "{message}");
    }

    #[test]
    fn advertise_takes_the_bound_port_unless_given_one() {
        assert_eq!(advertised_address("10.0.0.5", 7100), "10.0.0.5:7100");
        assert_eq!(advertised_address("10.0.0.5:9000", 7100), "10.0.0.5:9000");
        assert_eq!(advertised_address("pod-a.svc", 7100), "pod-a.svc:7100");
        assert_eq!(advertised_address("pod-a.svc:81", 7100), "pod-a.svc:81");
        assert_eq!(advertised_address("::1", 7100), "[::1]:7100");
        assert_eq!(advertised_address("[::1]:81", 7100), "[::1]:81");
    }
}
