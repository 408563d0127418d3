//! Real meshes for the transport-level suites: every rank of a generation in this process,
//! each with its own endpoints on loopback (TCP, shared memory, or both).

use cohort::elastic::{MeshTransport, MixedTransport};
use cohort_transports::shm::{ShmAddress, ShmEndpoint, ShmMeshSpec, ShmOptions, ShmTransport};
use cohort_transports::tcp::{MeshSpec, TcpEndpoint, TcpOptions, TcpTransport, Upfront};
use cohort_transports::Deadlines;
use std::net::SocketAddr;
use std::time::Duration;

const JOB: &str = "collectives";
const TOKEN: &[u8] = b"test-token";

/// Generous deadlines: the suites time nothing, and a loaded machine must not fail them.
pub(crate) fn deadlines() -> Deadlines {
    Deadlines { no_progress: Duration::from_secs(20), connect: Duration::from_secs(20), learning: None }
}

/// Which data plane a suite runs over.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Net {
    Tcp,
    /// TCP with only [`cohort::upfront_links`] linked at set-up.
    TcpPlanned,
    Shm,
    /// Shared memory between the ranks of one host, TCP between hosts (which host a rank
    /// plays is the caller's `host_of`).
    Mixed,
}

/// Binds `n` TCP endpoints on loopback and connects them into one generation.
pub(crate) async fn tcp_mesh(n: u32, generation: u64, planned: bool) -> (Vec<TcpEndpoint>, Vec<TcpTransport>) {
    let mut endpoints = Vec::new();
    for _ in 0..n {
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        endpoints.push(TcpEndpoint::bind(addr, TcpOptions::default()).await.expect("bind"));
    }
    let peers: Vec<SocketAddr> = endpoints.iter().map(|e| e.local_addr()).collect();
    let setups = endpoints.iter().enumerate().map(|(rank, e)| {
        e.connect_mesh(MeshSpec {
            job: JOB.into(),
            generation,
            rank: rank as u32,
            peers: peers.clone(),
            token: TOKEN.to_vec(),
            deadlines: deadlines(),
            upfront: if planned {
                Upfront::Only(cohort::upfront_links(rank as u32, &cohort::HostLayout::flat(n)))
            } else {
                Upfront::Every
            },
            carry_links: false,
            resolver: None,
        })
    });
    let transports = futures::future::try_join_all(setups).await.expect("tcp mesh set-up");
    (endpoints, transports)
}

/// Connects `n` shared-memory endpoints; rank `r` links to the ranks `same_host(r, j)` says.
pub(crate) async fn shm_mesh(n: u32, generation: u64, same_host: impl Fn(u32, u32) -> bool) -> Vec<ShmTransport> {
    // Small slots, so that the suites' messages span several slots and wrap the rings.
    let options = ShmOptions { slots: 4, slot_bytes: 8192, ..ShmOptions::default() };
    let endpoints: Vec<ShmEndpoint> = (0..n).map(|_| ShmEndpoint::new(options.clone()).expect("endpoint")).collect();
    let addresses: Vec<ShmAddress> = endpoints.iter().map(|e| e.address().clone()).collect();
    let setups = endpoints.iter().enumerate().map(|(rank, e)| {
        let rank = rank as u32;
        let peers = (0..n).map(|j| same_host(rank, j).then(|| addresses[j as usize].clone())).collect();
        e.connect_mesh(ShmMeshSpec {
            job: JOB.into(),
            generation,
            rank,
            peers,
            token: TOKEN.to_vec(),
            deadlines: deadlines(),
        })
    });
    futures::future::try_join_all(setups).await.expect("shm mesh set-up")
}

/// One generation of `n` ranks over `net` (for [`Net::Mixed`], rank `r` on host
/// `host_of(r)`); the TCP endpoints must outlive the transports.
pub(crate) async fn mesh(
    net: Net,
    n: u32,
    generation: u64,
    host_of: impl Fn(u32) -> u32,
) -> (Vec<TcpEndpoint>, Vec<MeshTransport>) {
    match net {
        Net::Tcp | Net::TcpPlanned => {
            let (endpoints, transports) = tcp_mesh(n, generation, matches!(net, Net::TcpPlanned)).await;
            (endpoints, transports.into_iter().map(MeshTransport::from).collect())
        }
        Net::Shm => {
            (Vec::new(), shm_mesh(n, generation, |_, _| true).await.into_iter().map(MeshTransport::from).collect())
        }
        Net::Mixed => {
            let shm = shm_mesh(n, generation, |a, b| host_of(a) == host_of(b)).await;
            let (endpoints, tcp) = tcp_mesh(n, generation, false).await;
            let mixed = shm
                .into_iter()
                .zip(tcp)
                .map(|(s, t)| MixedTransport::new(s, t).expect("one generation").into())
                .collect();
            (endpoints, mixed)
        }
    }
}
