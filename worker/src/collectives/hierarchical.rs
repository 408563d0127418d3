//! Hierarchical allreduce for worlds spread over several hosts with several ranks each
//! (after NCCL's and Open MPI's two-level schemes): the links within a host (shared memory)
//! carry most of the bytes, the links between hosts only each rank's share.
//!
//! With the same number `L` of ranks on each of `m` hosts (the usual case: one rank per GPU
//! or socket, the same on every node):
//! 1. reduce-scatter within each host (a ring over its `L` ranks): local rank `p` ends owning
//!    block `p` of the vector, reduced over its host;
//! 2. allreduce of block `p` across hosts, on the ring of the `m` ranks with local index `p`
//!    (the `L` lanes run at once, each moving `1/L` of the vector between hosts);
//! 3. allgather within each host.
//!
//! Each host sends `2(m-1)/m` of the vector to the other hosts, split over its `L` lanes; a
//! flat ring over the `n = mL` ranks ordered host by host sends `2(n-1)/n` of it from each
//! host over one link (1.5x the bytes for 2 hosts of 2, 1.75x for 2 of 4), and a flat ring
//! whose neighbours alternate between hosts crosses hosts at every hop. The hierarchical
//! schedule also needs `2(L-1) + 2(m-1)` rounds instead of `2(n-1)`.
//!
//! With unequal hosts: reduce-scatter within each host, gather the host's sum at its lowest
//! rank (the leader), ring allreduce among the leaders, then scatter and allgather within
//! each host.
//!
//! Steps: a pair of ranks on one host and a pair on two hosts never coincide, so the
//! cross-host phase numbers its steps from 0 and the host phases continue one numbering.
//!
//! Bit-exactness: every element's final value is computed once (by the rank that owns it in
//! the cross-host ring) and copied everywhere else; `Avg` divides there, by the world size.

use super::ring::{allgather_inplace, reduce_scatter_inplace, RingOrder};
use crate::blocks::block_range;
use crate::comm::Ctx;
use crate::dtype::Element;
use crate::reduce::{finish_avg, ReduceOp};
use cohort_transports::{Transport, TransportError};
use std::ops::Range;

/// Scratch elements [`allreduce`] needs for `len` elements: one segment.
pub(crate) fn allreduce_scratch(seg: usize, len: usize) -> usize {
    seg.min(len.max(1))
}

/// Hierarchical allreduce of `data` in place; `hosts` lists the ranks of every host (the
/// world's [`crate::topology::HostLayout::hosts`]); `scratch` holds [`allreduce_scratch`]
/// elements.
pub(crate) async fn allreduce<T: Transport, E: Element>(
    ctx: &Ctx<'_, T>,
    data: &mut [E],
    op: ReduceOp,
    hosts: &[Vec<usize>],
    scratch: &mut [E],
) -> Result<(), TransportError> {
    let Some((host, pos)) =
        hosts.iter().enumerate().find_map(|(h, r)| r.iter().position(|&x| x == ctx.rank).map(|p| (h, p)))
    else {
        return Err(TransportError::InvalidArgument(format!("rank {} is on no host of the layout", ctx.rank)));
    };
    let place = Place { hosts, host, pos };
    if hosts.iter().all(|h| h.len() == hosts[host].len()) {
        two_level(ctx, data, op, place, scratch).await
    } else {
        through_leaders(ctx, data, op, place, scratch).await
    }
}

/// Where this rank sits: every host's ranks, its host, its index there.
#[derive(Clone, Copy)]
struct Place<'h> {
    hosts: &'h [Vec<usize>],
    host: usize,
    pos: usize,
}

/// Blocks of `len` elements split over `parts` (see [`block_range`]).
fn blocks(len: usize, parts: usize) -> impl Fn(usize) -> Range<usize> + Copy {
    move |i| block_range(len, parts, i)
}

/// Ring allreduce of `data` over `ring` (reduce-scatter, `Avg` divided by `world` at the
/// owner, allgather), with steps from `step_base`.
async fn ring_allreduce<T: Transport, E: Element>(
    ctx: &Ctx<'_, T>,
    ring: RingOrder<'_>,
    data: &mut [E],
    op: ReduceOp,
    world: usize,
    scratch: &mut [E],
    step_base: u64,
) -> Result<(), TransportError> {
    let (len, n) = (data.len(), ring.len());
    let stride = ctx.nsegs(len.div_ceil(n));
    reduce_scatter_inplace(ctx, ring, data, blocks(len, n), op, scratch, step_base, stride).await?;
    finish_avg(op, &mut data[block_range(len, n, ring.pos())], world as u32);
    allgather_inplace(ctx, ring, data, blocks(len, n), step_base + (n as u64 - 1) * stride, stride).await
}

/// Every host has the same number of ranks: within, across by lanes, within.
async fn two_level<T: Transport, E: Element>(
    ctx: &Ctx<'_, T>,
    data: &mut [E],
    op: ReduceOp,
    Place { hosts, host, pos }: Place<'_>,
    scratch: &mut [E],
) -> Result<(), TransportError> {
    let (len, local) = (data.len(), hosts[host].len());
    let within = RingOrder::over(&hosts[host], pos);
    let stride = ctx.nsegs(len.div_ceil(local));
    reduce_scatter_inplace(ctx, within, data, blocks(len, local), op, scratch, 0, stride).await?;

    let lane: Vec<usize> = hosts.iter().map(|h| h[pos]).collect();
    let mine = block_range(len, local, pos);
    ring_allreduce(ctx, RingOrder::over(&lane, host), &mut data[mine], op, ctx.size, scratch, 0).await?;

    allgather_inplace(ctx, within, data, blocks(len, local), (local as u64 - 1) * stride, stride).await
}

/// Hosts of different sizes: within, gather at the leader, across among leaders, scatter
/// from the leader, within.
async fn through_leaders<T: Transport, E: Element>(
    ctx: &Ctx<'_, T>,
    data: &mut [E],
    op: ReduceOp,
    Place { hosts, host, pos }: Place<'_>,
    scratch: &mut [E],
) -> Result<(), TransportError> {
    let (len, members) = (data.len(), &hosts[host]);
    let local = members.len();
    let within = RingOrder::over(members, pos);
    let block = blocks(len, local);
    let stride = ctx.nsegs(len.div_ceil(local));
    reduce_scatter_inplace(ctx, within, data, block, op, scratch, 0, stride).await?;

    let (gather, scatter, gather_back) =
        ((local as u64 - 1) * stride, (local as u64 - 1) * stride + stride, (local as u64 - 1) * stride + 2 * stride);
    let leader = members[0];
    if pos == 0 {
        for (p, &rank) in members.iter().enumerate().skip(1) {
            ctx.recv_segs(rank, gather, &mut data[block(p)]).await?;
        }
        let leaders: Vec<usize> = hosts.iter().map(|h| h[0]).collect();
        ring_allreduce(ctx, RingOrder::over(&leaders, host), data, op, ctx.size, scratch, 0).await?;
        for (p, &rank) in members.iter().enumerate().skip(1) {
            ctx.send_segs(rank, scatter, &data[block(p)]).await?;
        }
    } else {
        ctx.send_segs(leader, gather, &data[block(pos)]).await?;
        ctx.recv_segs(leader, scatter, &mut data[block(pos)]).await?;
    }
    allgather_inplace(ctx, within, data, block, gather_back, stride).await
}

/// The ranks on other hosts that `rank` exchanges with in a hierarchical allreduce over
/// `hosts`: its lane's ring neighbours (equal hosts), or, for a host's leader, the leaders'
/// ring neighbours (unequal hosts). At most two; the rest of its partners share its host.
pub(crate) fn cross_host_partners(rank: usize, hosts: &[Vec<usize>]) -> Vec<usize> {
    let Some((host, pos)) =
        hosts.iter().enumerate().find_map(|(h, r)| r.iter().position(|&x| x == rank).map(|p| (h, p)))
    else {
        return Vec::new();
    };
    let m = hosts.len();
    if m < 2 {
        return Vec::new();
    }
    let equal = hosts.iter().all(|h| h.len() == hosts[host].len());
    let lane = if equal {
        pos
    } else if pos == 0 {
        0
    } else {
        return Vec::new();
    };
    let (left, right) = ((host + m - 1) % m, (host + 1) % m);
    let mut out = vec![hosts[left][lane], hosts[right][lane]];
    out.dedup();
    out
}
