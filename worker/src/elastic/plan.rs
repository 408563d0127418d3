//! The link plan of a generation this worker holds a sparse view of (see [`super::members`]);
//! a whole member list is planned by [`super::choice::plan_mesh`].

use super::choice::{plan_mesh, upfront_in, MeshPlan, TransportChoice};
use super::members::Members;
use super::{ElasticError, MeshKind};
use cohort_transports::shm::ShmAddress;
use cohort_transports::tcp::{Upfront, UNKNOWN_PEER};

/// [`plan_mesh`] over the members this worker knows: the whole list as it is; a sparse view
/// (a generation larger than the job's `whole_answer_up_to`) over TCP, and shared memory to
/// its host-mates that published its host identity, with the set-up's links planned from the
/// view's host runs and every other peer's address left to be found on first use
/// ([`UNKNOWN_PEER`]). Its upfront peers' entries must be known. An RDMA mesh links every
/// pair and needs the whole list: a sparse generation runs over TCP.
pub(crate) fn plan_view(
    number: u64,
    view: &Members,
    rank: u32,
    choice: TransportChoice,
) -> Result<MeshPlan, ElasticError> {
    if view.is_whole() {
        return plan_mesh(number, view.known(), rank, choice);
    }
    let n = view.size() as usize;
    let layout = view.layout();
    let mut tcp = vec![UNKNOWN_PEER; n];
    for m in view.iter() {
        tcp[m.rank as usize] = m.tcp;
    }
    let own = view.get(rank).and_then(|m| m.shm.as_ref()).map(|a| a.host.clone());
    let mut shm: Vec<Option<ShmAddress>> = vec![None; n];
    for m in view.iter() {
        if let Some(a) = m.shm.as_ref().filter(|a| Some(&a.host) == own.as_ref()) {
            shm[m.rank as usize] = Some(a.clone());
        }
    }
    let upfront = upfront_in(&layout, rank as usize, |p| shm[p].is_some());
    let unknown = match &upfront {
        Upfront::Every => (0..n as u32).find(|&p| p != rank && tcp[p as usize] == UNKNOWN_PEER),
        Upfront::Only(peers) => peers.iter().copied().find(|&p| tcp[p as usize] == UNKNOWN_PEER),
    };
    if let Some(p) = unknown {
        return Err(ElasticError::Protocol(format!(
            "generation {number}: rank {p} is linked at set-up but its entry was not fetched"
        )));
    }
    let linked = shm.iter().enumerate().filter(|(j, a)| *j != rank as usize && a.is_some()).count();
    let plan = if linked == 0 {
        let without_rdma = if choice == TransportChoice::Rdma {
            vec![format!(
                "every member (a sparse view of {n} members: an rdma mesh links every pair and needs the whole \
                 member list; raise the job's whole_answer_up_to)"
            )]
        } else {
            Vec::new()
        };
        MeshPlan::Tcp { peers: tcp, upfront, without_rdma }
    } else if shm.iter().all(Option::is_some) {
        MeshPlan::Shm { peers: shm.into_iter().flatten().collect() }
    } else {
        MeshPlan::Mixed { tcp, upfront, shm }
    };
    if choice == TransportChoice::Shm && plan.kind() != MeshKind::Shm && n > 1 {
        return Err(ElasticError::Protocol(format!(
            "generation {number}: shared memory only (--transport shm), but {} of its {n} members are not on this \
             worker's host",
            n - linked - 1
        )));
    }
    Ok(plan)
}
