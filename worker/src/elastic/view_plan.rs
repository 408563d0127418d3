//! The link plan of a generation this worker holds a sparse view of (see [`super::members`]);
//! a whole member list is planned by [`super::mesh_plan::plan_mesh`].

use super::members::Members;
use super::mesh_plan::{plan_mesh, shm_peer, upfront_in, MeshPlan, TransportChoice};
use super::{ElasticError, MeshKind};
use cohort_transports::shm::ShmAddress;
use cohort_transports::tcp::{Upfront, UNKNOWN_PEER};

/// [`plan_mesh`] over the members this worker knows: the whole list as it is; a sparse view
/// (a generation larger than the job's `whole_answer_up_to`) over TCP, and shared memory to
/// the other members of its host run ([`shm_peer`], as a whole list plans it), with the set-up's links planned from the
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
    if let Some(own) = own {
        for m in view.iter() {
            shm[m.rank as usize] = shm_peer(&layout, rank as usize, m.rank as usize, &own, m.shm.as_ref());
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

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_proto::v1 as pb;

    /// Rank `rank` of 20 on host `h{rank / 4}`, with an shm address on that host when `shm`.
    fn entry(rank: u32, shm: bool) -> pb::Member {
        let mut addresses =
            vec![pb::TransportAddress { transport: "tcp".into(), address: format!("127.0.0.1:{}", 7000 + rank) }];
        if shm {
            let address = ShmAddress { host: format!("h{}", rank / 4), nonce: format!("{rank:08x}") };
            addresses.push(pb::TransportAddress { transport: "shm".into(), address: address.encode() });
        }
        pb::Member {
            rank,
            worker_id: format!("w{rank}"),
            host: format!("h{}", rank / 4),
            addresses,
            ..Default::default()
        }
    }

    /// The sparse view rank `rank` of 20 gets, with its plan's peers fetched.
    fn view(rank: u32, shm: bool) -> Members {
        let all: Vec<pb::Member> = (0..20).map(|r| entry(r, shm)).collect();
        let g = pb::Generation {
            number: 2,
            size: 20,
            rank: Some(rank),
            member: Some(all[rank as usize].clone()),
            host_runs: cohort_proto::host_runs(all.iter().map(|m| {
                let shares = m.addresses.iter().any(|a| a.transport == "shm");
                (shares.then_some(m.host.clone()), if shares { 0 } else { m.rank })
            })),
            members: all.iter().filter(|m| m.rank / 4 == rank / 4 && m.rank != rank).cloned().collect(),
            ..Default::default()
        };
        let mut view = Members::from_answer(&g).unwrap().expect("a sparse view");
        let wanted = super::super::mesh_plan::upfront_ranks(&view.layout(), rank).expect("planned above 16");
        let missing = view.missing(wanted);
        let fetched: Vec<pb::Member> = missing.iter().map(|&r| all[r as usize].clone()).collect();
        view.add(&fetched).unwrap();
        view
    }

    #[test]
    fn a_sparse_view_plans_its_known_peers_and_leaves_the_others_unknown() {
        // Over TCP alone: every rank a host of its own; the plan is the partners, all known.
        let v = view(5, false);
        let MeshPlan::Tcp { peers, upfront: Upfront::Only(planned), without_rdma } =
            plan_view(2, &v, 5, TransportChoice::Tcp).unwrap()
        else {
            panic!("a TCP plan of some peers");
        };
        assert!(without_rdma.is_empty());
        assert!(planned.iter().all(|&p| peers[p as usize] != UNKNOWN_PEER), "planned peers have addresses");
        let unknown = peers.iter().filter(|&&a| a == UNKNOWN_PEER).count();
        assert!(unknown > 0 && unknown + v.known().len() == 20, "the rest is left to first use: {unknown}");
        // RDMA asked for: still TCP, and the worker is told why.
        let MeshPlan::Tcp { without_rdma, .. } = plan_view(2, &v, 5, TransportChoice::Rdma).unwrap() else {
            panic!("tcp");
        };
        assert!(without_rdma[0].contains("whole_answer_up_to"), "{without_rdma:?}");
        // Shared memory within the named hosts: its three host-mates over it, TCP otherwise.
        let v = view(5, true);
        let plan = plan_view(2, &v, 5, TransportChoice::Auto).unwrap();
        let MeshPlan::Mixed { shm, upfront: Upfront::Only(planned), .. } = &plan else {
            panic!("shared memory and TCP: {plan:?}");
        };
        let over_shm: Vec<usize> = shm.iter().enumerate().filter(|(_, a)| a.is_some()).map(|(r, _)| r).collect();
        assert_eq!(over_shm, [4, 5, 6, 7]);
        assert!(planned.iter().all(|p| !(4..8).contains(p)), "host-mates are not planned over TCP: {planned:?}");
        let refused = plan_view(2, &v, 5, TransportChoice::Shm).expect_err("other hosts");
        assert!(refused.to_string().contains("16 of its 20 members"), "{refused}");
    }

    /// Which peers rank `rank`'s plan links over shared memory.
    fn over_shm(plan: &MeshPlan, rank: u32) -> Vec<u32> {
        match plan {
            MeshPlan::Shm { peers } => (0..peers.len() as u32).filter(|&p| p != rank).collect(),
            MeshPlan::Mixed { shm, .. } => {
                (0..shm.len() as u32).filter(|&p| p != rank && shm[p as usize].is_some()).collect()
            }
            _ => Vec::new(),
        }
    }

    #[test]
    fn a_whole_list_and_a_sparse_view_plan_the_same_shared_memory_links() {
        // 20 workers of one process (one shared-memory identity) under five host names, as
        // replicas with different whole_answer_up_to answer them: some ranks whole, some
        // sparse. Both must plan shared memory within the host run only, or a pair plans
        // shared memory at one end and TCP at the other and its set-up fails.
        let all: Vec<pb::Member> = (0..20)
            .map(|r| {
                let mut m = entry(r, false);
                let address = ShmAddress { host: "one-vm".into(), nonce: format!("{r:08x}") };
                m.addresses.push(pb::TransportAddress { transport: "shm".into(), address: address.encode() });
                m
            })
            .collect();
        let whole = Members::whole(all.iter().map(|m| super::super::members::parse_member(m).unwrap()).collect());
        for rank in 0..20u32 {
            let g = pb::Generation {
                number: 2,
                size: 20,
                rank: Some(rank),
                member: Some(all[rank as usize].clone()),
                host_runs: cohort_proto::layout_runs(&all),
                members: all.iter().filter(|m| m.host == all[rank as usize].host && m.rank != rank).cloned().collect(),
                ..Default::default()
            };
            let mut sparse = Members::from_answer(&g).unwrap().expect("a sparse view");
            let wanted = super::super::mesh_plan::upfront_ranks(&sparse.layout(), rank).expect("planned above 16");
            let fetched: Vec<pb::Member> = sparse.missing(wanted).iter().map(|&r| all[r as usize].clone()).collect();
            sparse.add(&fetched).unwrap();
            let from_whole = over_shm(&plan_view(2, &whole, rank, TransportChoice::Auto).unwrap(), rank);
            let from_sparse = over_shm(&plan_view(2, &sparse, rank, TransportChoice::Auto).unwrap(), rank);
            let run: Vec<u32> = (rank / 4 * 4..rank / 4 * 4 + 4).filter(|&p| p != rank).collect();
            assert_eq!(from_whole, run, "rank {rank}, whole list");
            assert_eq!(from_sparse, run, "rank {rank}, sparse view");
        }
    }
}
