//! The transport of a generation's mesh: what the worker asked for ([`TransportChoice`], from
//! `--transport`, Python's `GroupConfig.transport` or [`super::ElasticConfig::transport`]) and
//! what a generation then uses, chosen from its member records alone so that every member
//! makes the same choice: RDMA if and only if every member published an RDMA address;
//! otherwise shared memory between every two members of one host run (consecutive ranks with
//! one `host` name and one shared-memory host identity: [`host_runs_of`]) and TCP between the
//! others.

use super::{ElasticError, MeshKind, TransportUnavailable};
use crate::HostLayout;
use cohort_transports::shm::ShmAddress;
use cohort_transports::tcp::Upfront;
use std::net::SocketAddr;

#[cfg(feature = "rdma")]
use cohort_transports::rdma::EndpointAddress;

/// One member of a generation, as the coordinator formed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberInfo {
    /// Rank in the generation.
    pub rank: u32,
    /// The worker's id.
    pub worker_id: String,
    /// The worker's host name.
    pub host: String,
    /// Its data-plane TCP address.
    pub tcp: SocketAddr,
    /// The RDMA endpoint address it published (`EndpointAddress::encode`), if any.
    pub rdma: Option<String>,
    /// Its shared-memory address (host identity and nonce), if it published a usable one.
    pub shm: Option<ShmAddress>,
}

/// The data-plane transport a worker asks for: what it publishes at join, and what it accepts
/// a generation to use. The one definition behind `cohort-worker --transport`, Python's
/// `GroupConfig.transport` and [`super::ElasticConfig::transport`]; the names are `auto`,
/// `tcp`, `shm` and `rdma`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TransportChoice {
    /// Publish a shared-memory address beside the TCP one: members of one host (one host name
    /// and host identity) link over shared memory, the others over TCP.
    #[default]
    Auto,
    /// TCP only (no shared-memory address is published).
    Tcp,
    /// Shared memory only: a generation with a member this worker cannot reach over it fails
    /// with [`ElasticError::Protocol`].
    Shm,
    /// Also open an RDMA endpoint and publish it (cargo feature `rdma`): a generation runs over
    /// RDMA when every member published one, over TCP otherwise.
    Rdma,
}

impl TransportChoice {
    /// Every choice, in the order `--help` lists them.
    pub const ALL: [TransportChoice; 4] =
        [TransportChoice::Auto, TransportChoice::Tcp, TransportChoice::Shm, TransportChoice::Rdma];

    /// `auto`, `tcp`, `shm` or `rdma`.
    pub fn name(self) -> &'static str {
        match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Tcp => "tcp",
            TransportChoice::Shm => "shm",
            TransportChoice::Rdma => "rdma",
        }
    }

    /// Whether the worker publishes a shared-memory address at join (`auto` and `shm`).
    pub fn publishes_shm(self) -> bool {
        matches!(self, TransportChoice::Auto | TransportChoice::Shm)
    }

    /// Checks, before anything is bound or sent, that this choice can be used here: `shm`
    /// needs this process's host identity, `rdma` a build with the `rdma` feature and an RDMA
    /// device. `auto` and `tcp` always can.
    pub fn check(self) -> Result<(), TransportUnavailable> {
        match self {
            TransportChoice::Auto | TransportChoice::Tcp => Ok(()),
            TransportChoice::Shm => {
                cohort_transports::shm::host_identity().map(|_| ()).map_err(TransportUnavailable::NoHostIdentity)
            }
            TransportChoice::Rdma => rdma_available(),
        }
    }
}

#[cfg(feature = "rdma")]
fn rdma_available() -> Result<(), TransportUnavailable> {
    let devices =
        cohort_transports::rdma::device_names().map_err(|e| TransportUnavailable::RdmaDevices(e.to_string()))?;
    if devices.is_empty() {
        return Err(TransportUnavailable::NoRdmaDevice);
    }
    Ok(())
}

#[cfg(not(feature = "rdma"))]
fn rdma_available() -> Result<(), TransportUnavailable> {
    Err(TransportUnavailable::RdmaNotBuilt)
}

impl std::fmt::Display for TransportChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for TransportChoice {
    type Err = UnknownTransport;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        TransportChoice::ALL.into_iter().find(|c| c.name() == text).ok_or_else(|| UnknownTransport(text.to_string()))
    }
}

/// A transport name that is not one of [`TransportChoice::ALL`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("transport {0:?}: use \"auto\", \"tcp\", \"shm\" or \"rdma\"")]
pub struct UnknownTransport(pub String);

/// What a rank connects for one generation: the transport and every member's address on it,
/// indexed by rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum MeshPlan {
    /// A TCP mesh.
    Tcp {
        /// Every member's data-plane TCP address.
        peers: Vec<SocketAddr>,
        /// The peers linked at set-up; the others on first use.
        upfront: Upfront,
        /// The members that published no RDMA address (`worker (rank r)`), for the log.
        without_rdma: Vec<String>,
    },
    /// Every member on this rank's host: a shared-memory mesh.
    Shm {
        /// Every member's shared-memory address.
        peers: Vec<ShmAddress>,
    },
    /// Shared memory to the members on this rank's host, TCP to (and among) the others.
    Mixed {
        /// Every member's data-plane TCP address.
        tcp: Vec<SocketAddr>,
        /// The peers on other hosts linked over TCP at set-up; the others on first use.
        upfront: Upfront,
        /// `Some` for the members linked over shared memory.
        shm: Vec<Option<ShmAddress>>,
    },
    /// An RDMA mesh.
    #[cfg(feature = "rdma")]
    Rdma {
        /// Every member's decoded RDMA endpoint address.
        peers: Vec<EndpointAddress>,
    },
}

impl MeshPlan {
    /// The transport this plan connects.
    pub(crate) fn kind(&self) -> MeshKind {
        match self {
            MeshPlan::Tcp { .. } => MeshKind::Tcp,
            MeshPlan::Shm { .. } => MeshKind::Shm,
            MeshPlan::Mixed { .. } => MeshKind::ShmTcp,
            #[cfg(feature = "rdma")]
            MeshPlan::Rdma { .. } => MeshKind::Rdma,
        }
    }

    /// The members that published no RDMA address (`worker (rank r)`); empty unless TCP.
    pub(crate) fn without_rdma(&self) -> &[String] {
        match self {
            MeshPlan::Tcp { without_rdma, .. } => without_rdma,
            _ => &[],
        }
    }
}

/// Up to this many members, a generation's TCP mesh links every pair at set-up (at most 15
/// links per rank, and no operation ever waits for a first dial); above it, only the links
/// the schedules use ([`crate::upfront_links`]: O(log N + ranks per host)), the others on
/// first use.
pub const FULL_MESH_UP_TO: usize = 16;

/// The TCP links rank `rank` makes at set-up, leaving out the peers `over_shm` links.
fn tcp_upfront(members: &[MemberInfo], rank: usize, over_shm: impl Fn(usize) -> bool) -> Upfront {
    upfront_in(&host_layout(members), rank, over_shm)
}

/// The links rank `rank` makes at set-up in a generation of `layout`, leaving out the peers
/// `over_shm` links.
pub(crate) fn upfront_in(layout: &HostLayout, rank: usize, over_shm: impl Fn(usize) -> bool) -> Upfront {
    match upfront_ranks(layout, rank as u32) {
        None => Upfront::Every,
        Some(plan) => Upfront::Only(plan.into_iter().filter(|&p| !over_shm(p as usize)).collect()),
    }
}

/// The peers rank `rank` links at set-up in a generation of `layout` (its size and hosts):
/// `None` for every peer (up to [`FULL_MESH_UP_TO`] members), else [`crate::upfront_links`].
/// A worker holding a sparse view fetches the entries of these before it plans.
pub(crate) fn upfront_ranks(layout: &HostLayout, rank: u32) -> Option<Vec<u32>> {
    if layout.world_size() as usize <= FULL_MESH_UP_TO {
        return None;
    }
    Some(crate::upfront_links(rank, layout))
}

/// Splits a TCP-or-shared-memory generation by host: rank `rank` uses shared memory to the
/// other members of its host run ([`host_layout`]), TCP to the rest.
fn local_plan(members: &[MemberInfo], rank: usize, without_rdma: Vec<String>) -> MeshPlan {
    let tcp: Vec<SocketAddr> = members.iter().map(|m| m.tcp).collect();
    let own = members.get(rank).and_then(|m| m.shm.as_ref());
    let tcp_only =
        |tcp, without_rdma| MeshPlan::Tcp { peers: tcp, upfront: tcp_upfront(members, rank, |_| false), without_rdma };
    let Some(own) = own else { return tcp_only(tcp, without_rdma) };
    let layout = host_layout(members);
    let shm: Vec<Option<ShmAddress>> =
        members.iter().enumerate().map(|(j, m)| shm_peer(&layout, rank, j, &own.host, m.shm.as_ref())).collect();
    let linked = shm.iter().enumerate().filter(|(j, a)| *j != rank && a.is_some()).count();
    if linked == 0 {
        tcp_only(tcp, without_rdma)
    } else if shm.iter().all(Option::is_some) {
        MeshPlan::Shm { peers: shm.into_iter().flatten().collect() }
    } else {
        let upfront = tcp_upfront(members, rank, |p| shm[p].is_some());
        MeshPlan::Mixed { tcp, upfront, shm }
    }
}

/// The shared-memory address rank `rank` links rank `peer` with: `Some` only when both are in
/// one host run of `layout` and `peer` published this rank's host identity (`own`). The run,
/// not the identity alone, decides: every member derives the runs of a generation alike,
/// whether it was answered the whole list or a sparse view, so both ends of a pair plan the
/// same transport (by identity alone, a whole list and a sparse view disagreed for members of
/// one identity under several host names).
pub(crate) fn shm_peer(
    layout: &HostLayout,
    rank: usize,
    peer: usize,
    own: &str,
    address: Option<&ShmAddress>,
) -> Option<ShmAddress> {
    let n = layout.world_size() as usize;
    let same_run = rank < n && peer < n && layout.host_of(rank) == layout.host_of(peer);
    address.filter(|a| same_run && a.host == own).cloned()
}

/// The host layout of a generation (the hierarchical allreduce's, and the link plan's): its
/// host runs, as [`host_runs_of`] finds them. Every member computes it from the same records,
/// so all agree.
pub(crate) fn host_layout(members: &[MemberInfo]) -> HostLayout {
    HostLayout::from_runs(&host_runs_of(members))
}

/// The length of every host run of the members `members` (ordered by rank), with the key of
/// [`cohort_proto::layout_runs`], which the coordinator's sparse answers carry: members share
/// a host when they name one `host` and published one shared-memory host identity; one
/// without a (usable) shared-memory address is a host of its own.
pub(crate) fn host_runs_of(members: &[MemberInfo]) -> Vec<u32> {
    let keys = members.iter().map(|m| match &m.shm {
        Some(a) => (Some((m.host.as_str(), a.host.as_str())), 0),
        None => (None, m.rank),
    });
    cohort_proto::host_runs(keys).iter().flat_map(|r| std::iter::repeat_n(r.ranks, r.hosts as usize)).collect()
}

/// Chooses the transport of generation `number` for `rank` from its `members` (ordered by
/// rank), for a worker that asked for `choice`.
///
/// RDMA when every member published an RDMA address; otherwise shared memory between the
/// members of each host run ([`shm_peer`]), TCP between the others (see [`MeshPlan`]). A worker's own
/// record carries an RDMA address exactly when it chose [`TransportChoice::Rdma`] (and so
/// opened an endpoint), so RDMA everywhere for a worker that chose anything else is a protocol
/// violation, as is an RDMA address that does not decode (every member sees the same records,
/// so every member fails the same way instead of half of them dialling RDMA and half TCP).
/// [`TransportChoice::Shm`] refuses, with [`ElasticError::Protocol`] naming them, a generation
/// with members it cannot reach over shared memory.
pub(crate) fn plan_mesh(
    number: u64,
    members: &[MemberInfo],
    rank: u32,
    choice: TransportChoice,
) -> Result<MeshPlan, ElasticError> {
    let without_rdma: Vec<String> =
        members.iter().filter(|m| m.rdma.is_none()).map(|m| format!("{} (rank {})", m.worker_id, m.rank)).collect();
    if members.is_empty() || !without_rdma.is_empty() {
        let plan = local_plan(members, rank as usize, without_rdma);
        if choice == TransportChoice::Shm && plan.kind() != MeshKind::Shm && members.len() > 1 {
            return Err(shm_unreachable(number, members, rank));
        }
        return Ok(plan);
    }
    if choice != TransportChoice::Rdma {
        return Err(ElasticError::Protocol(format!(
            "generation {number}: every member has an rdma address in the record, but this worker has no RDMA endpoint"
        )));
    }
    rdma_plan(number, members)
}

/// The refusal of a generation by a worker that chose shared memory only: the members it
/// cannot reach over shared memory (outside its host run: another host name or identity, or
/// none published; [`shm_peer`]).
fn shm_unreachable(number: u64, members: &[MemberInfo], rank: u32) -> ElasticError {
    let own = members.get(rank as usize).and_then(|m| m.shm.as_ref()).map(|a| a.host.as_str());
    let layout = host_layout(members);
    let reached = |m: &MemberInfo| {
        own.is_some_and(|own| shm_peer(&layout, rank as usize, m.rank as usize, own, m.shm.as_ref()).is_some())
    };
    let elsewhere: Vec<String> = members
        .iter()
        .filter(|m| m.rank != rank && !reached(m))
        .map(|m| format!("{} (rank {}, host {})", m.worker_id, m.rank, m.host))
        .collect();
    ElasticError::Protocol(format!(
        "generation {number}: shared memory only (--transport shm), but these members cannot be reached over it: {}",
        elsewhere.join(", ")
    ))
}

#[cfg(feature = "rdma")]
fn rdma_plan(number: u64, members: &[MemberInfo]) -> Result<MeshPlan, ElasticError> {
    let mut peers = Vec::with_capacity(members.len());
    for m in members {
        let text = m.rdma.as_deref().unwrap_or_default();
        let address = EndpointAddress::decode(text).map_err(|e| {
            ElasticError::Protocol(format!(
                "generation {number}: member {} (rank {}) published an unusable rdma address {text:?}: {e}",
                m.worker_id, m.rank
            ))
        })?;
        peers.push(address);
    }
    Ok(MeshPlan::Rdma { peers })
}

#[cfg(not(feature = "rdma"))]
fn rdma_plan(number: u64, _members: &[MemberInfo]) -> Result<MeshPlan, ElasticError> {
    Err(ElasticError::Protocol(format!(
        "generation {number}: every member has an rdma address, but this worker was built without the `rdma` feature"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    const EP: &str = "rdma-ep1;lid=17;gid=fe80000000000000021a4bfffe001234;mtu=4096;boot=10.0.0.5:45001";

    fn member(rank: u32, rdma: Option<&str>) -> MemberInfo {
        MemberInfo {
            rank,
            worker_id: format!("w{rank}"),
            host: format!("host-{rank}"),
            tcp: SocketAddr::from(([10, 0, 0, rank as u8 + 1], 7100)),
            rdma: rdma.map(str::to_string),
            shm: None,
        }
    }

    /// `m` on host `host`: its name, and the shared-memory identity it publishes.
    fn on_host(mut m: MemberInfo, host: &str) -> MemberInfo {
        m.shm = Some(ShmAddress { host: host.into(), nonce: format!("{:08x}", m.rank) });
        m.host = host.into();
        m
    }

    #[test]
    fn members_on_one_host_use_shared_memory() {
        let members: Vec<MemberInfo> = (0..3).map(|r| on_host(member(r, None), "h1")).collect();
        for rank in 0..3 {
            let plan = plan_mesh(2, &members, rank, TransportChoice::Auto).expect("a plan");
            assert_eq!(plan.kind(), MeshKind::Shm);
            let MeshPlan::Shm { peers } = plan else { panic!("{plan:?}") };
            assert_eq!(peers, members.iter().map(|m| m.shm.clone().unwrap()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn two_hosts_mix_shared_memory_within_and_tcp_across() {
        let members = vec![
            on_host(member(0, None), "a"),
            on_host(member(1, None), "a"),
            on_host(member(2, None), "b"),
            member(3, None),
        ];
        let plan = plan_mesh(2, &members, 0, TransportChoice::Auto).expect("a plan");
        let MeshPlan::Mixed { tcp, shm, .. } = &plan else { panic!("{plan:?}") };
        assert_eq!(tcp.len(), 4);
        assert_eq!(shm.iter().map(Option::is_some).collect::<Vec<_>>(), [true, true, false, false]);
        // Rank 2 is alone on host b, rank 3 published no shm address: TCP only.
        assert_eq!(plan_mesh(2, &members, 2, TransportChoice::Auto).unwrap().kind(), MeshKind::Tcp);
        assert_eq!(plan_mesh(2, &members, 3, TransportChoice::Auto).unwrap().kind(), MeshKind::Tcp);
        assert_eq!(plan_mesh(2, &members, 1, TransportChoice::Auto).unwrap().kind(), MeshKind::ShmTcp);
        // One host's members apart in rank order (the coordinator places them together; an
        // older one may not) are two runs, so two hosts: TCP between them, at both ends.
        let apart = vec![on_host(member(0, None), "a"), on_host(member(1, None), "b"), on_host(member(2, None), "a")];
        for rank in 0..3 {
            assert_eq!(plan_mesh(2, &apart, rank, TransportChoice::Auto).unwrap().kind(), MeshKind::Tcp, "rank {rank}");
        }
        // One identity under two host names (workers of one process in a test): two hosts too.
        let mut named = members.clone();
        named[1].host = "a-too".into();
        assert_eq!(plan_mesh(2, &named, 0, TransportChoice::Auto).unwrap().kind(), MeshKind::Tcp);
    }

    #[test]
    fn shared_memory_only_refuses_a_member_it_cannot_reach_and_names_it() {
        let members = vec![on_host(member(0, None), "a"), on_host(member(1, None), "b"), member(2, None)];
        let e = plan_mesh(7, &members, 0, TransportChoice::Shm).expect_err("ranks 1 and 2 are elsewhere");
        let ElasticError::Protocol(message) = &e else { panic!("not a protocol error: {e}") };
        assert!(message.contains("generation 7") && message.contains("shared memory only"), "{message}");
        assert!(message.contains("w1 (rank 1, host b)") && message.contains("w2 (rank 2, host host-2)"), "{message}");
        assert!(!message.contains("w0"), "{message}");
        // One host: accepted; alone in its generation: accepted (nothing to reach).
        let one_host: Vec<MemberInfo> = (0..2).map(|r| on_host(member(r, None), "a")).collect();
        assert_eq!(plan_mesh(7, &one_host, 1, TransportChoice::Shm).unwrap().kind(), MeshKind::Shm);
        assert_eq!(plan_mesh(7, &members[..1], 0, TransportChoice::Shm).unwrap().kind(), MeshKind::Tcp);
        // auto plans the same generation as a mix, tcp-only ranks stay on TCP.
        assert_eq!(plan_mesh(7, &members, 0, TransportChoice::Auto).unwrap().kind(), MeshKind::Tcp);
    }

    #[test]
    fn transport_choices_parse_from_their_names_and_nothing_else() {
        for choice in TransportChoice::ALL {
            assert_eq!(choice.name().parse::<TransportChoice>(), Ok(choice));
            assert_eq!(choice.to_string(), choice.name());
        }
        assert_eq!(TransportChoice::default(), TransportChoice::Auto);
        for bad in ["", "TCP", "shm+tcp", "carrier-pigeon", " auto"] {
            let e = bad.parse::<TransportChoice>().expect_err(bad);
            assert!(e.to_string().contains("\"auto\", \"tcp\", \"shm\" or \"rdma\""), "{e}");
        }
        assert!(TransportChoice::Auto.publishes_shm() && TransportChoice::Shm.publishes_shm());
        assert!(!TransportChoice::Tcp.publishes_shm() && !TransportChoice::Rdma.publishes_shm());
        assert_eq!(TransportChoice::Tcp.check(), Ok(()));
        assert_eq!(TransportChoice::Auto.check(), Ok(()));
    }

    #[cfg(not(feature = "rdma"))]
    #[test]
    fn rdma_without_the_feature_is_a_clear_error() {
        let e = TransportChoice::Rdma.check().expect_err("no rdma feature");
        assert_eq!(e, TransportUnavailable::RdmaNotBuilt);
        assert!(e.to_string().contains("--features rdma"), "{e}");
    }

    #[test]
    fn the_host_layout_is_the_host_runs_of_members_sharing_memory() {
        // Named as their shared-memory identity says.
        let on = |r: u32, host: &str| MemberInfo { host: host.into(), ..on_host(member(r, None), host) };
        let members = vec![on(0, "a"), on(1, "a"), member(2, None), on(3, "b"), on(4, "b"), on(5, "a")];
        let layout = host_layout(&members);
        // A host whose ranks are not consecutive is two runs, as the coordinator's are.
        assert_eq!(layout.hosts(), vec![vec![0, 1], vec![2], vec![3, 4], vec![5]]);
        assert!(layout.is_hierarchical());
        // One host name without shared memory, or with different identities (containers
        // that cannot share memory), or one identity under different names: apart.
        let apart: Vec<MemberInfo> = (0..3).map(|r| MemberInfo { host: "a".into(), ..member(r, None) }).collect();
        assert_eq!(host_layout(&apart), HostLayout::flat(3));
        let walled: Vec<MemberInfo> =
            (0..3).map(|r| MemberInfo { host: "a".into(), ..on_host(member(r, None), &format!("id{r}")) }).collect();
        assert_eq!(host_layout(&walled), HostLayout::flat(3));
        let renamed: Vec<MemberInfo> =
            (0..3).map(|r| MemberInfo { host: format!("n{r}"), ..on_host(member(r, None), "id") }).collect();
        assert_eq!(host_layout(&renamed), HostLayout::flat(3));
    }

    #[test]
    fn one_member_without_rdma_means_tcp_and_names_it() {
        let members = [member(0, Some(EP)), member(1, None), member(2, Some(EP))];
        let plan = plan_mesh(4, &members, 0, TransportChoice::Rdma).expect("a plan");
        assert_eq!(plan.kind(), MeshKind::Tcp);
        assert_eq!(plan.without_rdma(), ["w1 (rank 1)".to_string()]);
        assert_eq!(
            plan,
            MeshPlan::Tcp {
                peers: members.iter().map(|m| m.tcp).collect(),
                upfront: Upfront::Every,
                without_rdma: vec!["w1 (rank 1)".into()]
            }
        );
    }

    #[test]
    fn no_member_with_rdma_means_tcp() {
        let members = [member(0, None), member(1, None)];
        let plan = plan_mesh(1, &members, 0, TransportChoice::Auto).expect("a plan");
        assert_eq!(plan.kind(), MeshKind::Tcp);
        // A malformed rdma address is never decoded when TCP is chosen anyway.
        let members = [member(0, Some("garbage")), member(1, None)];
        assert_eq!(plan_mesh(1, &members, 0, TransportChoice::Rdma).expect("a plan").kind(), MeshKind::Tcp);
    }

    #[test]
    fn every_member_with_rdma_but_no_local_endpoint_is_a_protocol_error() {
        let members = [member(0, Some(EP)), member(1, Some(EP))];
        let e = plan_mesh(3, &members, 0, TransportChoice::Auto).expect_err("no local endpoint");
        assert!(
            matches!(&e, ElasticError::Protocol(m) if m.contains("generation 3") && m.contains("no RDMA endpoint")),
            "{e}"
        );
    }

    #[cfg(feature = "rdma")]
    #[test]
    fn every_member_with_rdma_means_rdma_in_rank_order() {
        let other = EP.replace("boot=10.0.0.5:45001", "boot=10.0.0.6:45002");
        let members = [member(0, Some(EP)), member(1, Some(&other))];
        let plan = plan_mesh(2, &members, 0, TransportChoice::Rdma).expect("a plan");
        assert_eq!(plan.kind(), MeshKind::Rdma);
        let MeshPlan::Rdma { peers } = plan else { panic!("not an rdma plan: {plan:?}") };
        assert_eq!(peers.len(), 2);
        assert_eq!(peers[0].bootstrap, SocketAddr::from(([10, 0, 0, 5], 45001)));
        assert_eq!(peers[1].bootstrap, SocketAddr::from(([10, 0, 0, 6], 45002)));
        assert_eq!(peers[0].encode(), EP);
    }

    #[cfg(feature = "rdma")]
    #[test]
    fn a_malformed_rdma_address_is_a_clear_error() {
        for bad in [
            "",
            "garbage",
            "rdma-ep1;lid=17",
            "rdma-ep1;lid=17;gid=zz;mtu=4096;boot=10.0.0.5:1",
            &EP.replace("4096", "4000"),
        ] {
            let members = [member(0, Some(EP)), member(1, Some(bad))];
            let e = plan_mesh(5, &members, 0, TransportChoice::Rdma).expect_err(bad);
            let ElasticError::Protocol(message) = &e else { panic!("not a protocol error: {e}") };
            assert!(message.contains("member w1 (rank 1)") && message.contains("unusable rdma address"), "{message}");
        }
    }
}
