//! Rooted collectives: binomial-tree broadcast and reduce, direct gather and scatter.
//!
//! Ranks are renumbered so the root is virtual rank 0. In the binomial tree the parent of
//! virtual rank `v` is `v` with its lowest set bit cleared, and its children are `v + 2^j` for
//! every `2^j` below that bit (below the world's next power of two for the root).
//! Both tree schedules work segment by segment, so a long vector streams down (or up) the tree
//! as a pipeline: a rank forwards segment `k` while its parent is already sending `k + 1`.
//!
//! Gather and scatter move one block per rank directly between the root and that rank, all
//! links at once, so no link sits idle (and no rank waits past its deadline) while the root
//! serves the others.

use crate::comm::{check, Call, CallKind, Communicator, Ctx};
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::error::CommError;
use crate::reduce::{finish_avg, ReduceOp};
use cohort_transports::{Transport, TransportError};
use futures::future::try_join_all;

fn vrank(rank: usize, root: usize, n: usize) -> usize {
    (rank + n - root) % n
}

fn real(v: usize, root: usize, n: usize) -> usize {
    (v + root) % n
}

fn parent(v: usize) -> Option<usize> {
    (v != 0).then(|| v & (v - 1))
}

/// Children of virtual rank `v` in a binomial tree of `n`, largest subtree first.
fn children(v: usize, n: usize) -> impl DoubleEndedIterator<Item = usize> {
    let top = if v == 0 { n.next_power_of_two() } else { v & v.wrapping_neg() };
    let bits = top.trailing_zeros();
    (0..bits).rev().map(move |j| v + (1usize << j)).filter(move |&c| c < n)
}

/// Binomial-tree broadcast of `data` from `root`.
pub(crate) async fn broadcast<T: Transport, E: Element>(
    ctx: &Ctx<'_, T>,
    data: &mut [E],
    root: usize,
) -> Result<(), TransportError> {
    let n = ctx.size;
    let v = vrank(ctx.rank, root, n);
    for (k, seg) in data.chunks_mut(ctx.seg).enumerate() {
        let tag = ctx.tag(k as u64)?;
        if let Some(p) = parent(v) {
            ctx.recv(real(p, root, n) as u32, tag, as_bytes_mut(seg)).await?;
        }
        for c in children(v, n) {
            ctx.t.send(real(c, root, n) as u32, tag, as_bytes(seg)).await?;
        }
    }
    Ok(())
}

/// Scratch elements [`reduce`] needs for `len` elements.
pub(crate) fn reduce_scratch(seg: usize, len: usize) -> usize {
    2 * seg.min(len)
}

/// Binomial-tree reduce to `root`: the root's `data` ends with the reduction; other ranks'
/// `data` is left as it was (partial results live in `scratch`, two segments). Each rank
/// combines its own operand first, then its children's, smallest subtree first.
pub(crate) async fn reduce<T: Transport, E: Element>(
    ctx: &Ctx<'_, T>,
    data: &mut [E],
    op: ReduceOp,
    root: usize,
    scratch: &mut [E],
) -> Result<(), TransportError> {
    let n = ctx.size;
    let v = vrank(ctx.rank, root, n);
    let half = scratch.len() / 2;
    let (acc_buf, incoming_buf) = scratch.split_at_mut(half);
    for (k, seg) in data.chunks_mut(ctx.seg).enumerate() {
        let tag = ctx.tag(k as u64)?;
        let len = seg.len();
        let incoming = &mut incoming_buf[..len];
        let acc: &mut [E] = if parent(v).is_some() {
            let acc = &mut acc_buf[..len];
            acc.copy_from_slice(seg);
            acc
        } else {
            seg
        };
        for c in children(v, n).rev() {
            ctx.recv_combine(real(c, root, n) as u32, tag, acc, incoming, op, false).await?;
        }
        match parent(v) {
            Some(p) => ctx.t.send(real(p, root, n) as u32, tag, as_bytes(acc)).await?,
            None => finish_avg(op, acc, n as u32),
        }
    }
    Ok(())
}

/// Gathers every rank's `input` into `output` on `root` (block `i` from rank `i`); `output` is
/// only touched on the root, where it holds `input.len() * n` elements.
pub(crate) async fn gather<T: Transport, E: Element>(
    ctx: &Ctx<'_, T>,
    input: &[E],
    output: &mut [E],
    root: usize,
) -> Result<(), TransportError> {
    let m = input.len();
    if ctx.rank != root {
        return ctx.send_segs(root, 0, input).await;
    }
    if m == 0 {
        return Ok(());
    }
    output[root * m..(root + 1) * m].copy_from_slice(input);
    let recvs = output.chunks_mut(m).enumerate().filter(|(i, _)| *i != root).map(|(i, b)| ctx.recv_segs(i, 0, b));
    try_join_all(recvs).await.map(|_| ())
}

/// Scatters block `i` of `input` (root only, `output.len() * n` elements) to rank `i`'s
/// `output`.
pub(crate) async fn scatter<T: Transport, E: Element>(
    ctx: &Ctx<'_, T>,
    input: &[E],
    output: &mut [E],
    root: usize,
) -> Result<(), TransportError> {
    let m = output.len();
    if ctx.rank != root {
        return ctx.recv_segs(root, 0, output).await;
    }
    if m == 0 {
        return Ok(());
    }
    output.copy_from_slice(&input[root * m..(root + 1) * m]);
    let sends = input.chunks(m).enumerate().filter(|(i, _)| *i != root).map(|(i, b)| ctx.send_segs(i, 0, b));
    try_join_all(sends).await.map(|_| ())
}

impl<T: Transport> Communicator<T> {
    /// Broadcast `data` from `root` to every rank (binomial tree, pipelined by segment).
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn broadcast<E: Element>(&mut self, data: &mut [E], root: u32) -> Result<(), CommError> {
        let n = self.size();
        let valid = check(root < n, || format!("root {root} out of range for {n} ranks"));
        let call = Call {
            dtype: Some(E::DTYPE),
            count: data.len() as u64,
            root: Some(root),
            ..Call::new(CallKind::BROADCAST)
        };
        self.run(call, std::mem::size_of::<E>(), std::mem::size_of_val(data), valid, true, async |ctx, _scratch| {
            broadcast(&ctx, data, root as usize).await
        })
        .await
    }

    /// Reduce to `root`: afterwards the root's `data` holds the element-wise reduction; other
    /// ranks' `data` is left unchanged (binomial tree, pipelined by segment).
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn reduce<E: Element>(&mut self, data: &mut [E], op: ReduceOp, root: u32) -> Result<(), CommError> {
        let n = self.size();
        let valid = check(root < n, || format!("root {root} out of range for {n} ranks"));
        let len = data.len();
        let call = Call {
            dtype: Some(E::DTYPE),
            op: Some(op),
            count: len as u64,
            root: Some(root),
            ..Call::new(CallKind::REDUCE)
        };
        self.run(call, std::mem::size_of::<E>(), std::mem::size_of_val(data), valid, true, async |ctx, scratch| {
            let s = scratch.get::<E>(reduce_scratch(ctx.seg, len));
            reduce(&ctx, data, op, root as usize, s).await
        })
        .await
    }

    /// Gather every rank's `input` (same length everywhere) into `output` on `root`, block `i`
    /// from rank `i`. `output` must hold `input.len() * size` elements on the root and is not
    /// touched (may be empty) elsewhere.
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn gather<E: Element>(&mut self, input: &[E], output: &mut [E], root: u32) -> Result<(), CommError> {
        let (n, m) = (self.size() as usize, input.len());
        let on_root = root == self.rank();
        let valid = check(root < self.size(), || format!("root {root} out of range for {n} ranks")).and_then(|_| {
            check(!on_root || output.len() == m * n, || {
                format!("output has {} elements, expected {m} x {n}", output.len())
            })
        });
        let call = Call { dtype: Some(E::DTYPE), count: m as u64, root: Some(root), ..Call::new(CallKind::GATHER) };
        self.run(call, std::mem::size_of::<E>(), std::mem::size_of_val(input), valid, true, async |ctx, _scratch| {
            gather(&ctx, input, output, root as usize).await
        })
        .await
    }

    /// Scatter block `i` of the root's `input` (`output.len() * size` elements; ignored and may
    /// be empty elsewhere) to rank `i`'s `output`.
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn scatter<E: Element>(&mut self, input: &[E], output: &mut [E], root: u32) -> Result<(), CommError> {
        let (n, m) = (self.size() as usize, output.len());
        let on_root = root == self.rank();
        let valid = check(root < self.size(), || format!("root {root} out of range for {n} ranks")).and_then(|_| {
            check(!on_root || input.len() == m * n, || {
                format!("input has {} elements, expected {m} x {n}", input.len())
            })
        });
        let call = Call { dtype: Some(E::DTYPE), count: m as u64, root: Some(root), ..Call::new(CallKind::SCATTER) };
        self.run(call, std::mem::size_of::<E>(), std::mem::size_of_val(output), valid, true, async |ctx, _scratch| {
            scatter(&ctx, input, output, root as usize).await
        })
        .await
    }

    /// Broadcast raw bytes from `root` (see [`Communicator::broadcast`]).
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn broadcast_bytes(&mut self, data: &mut [u8], root: u32) -> Result<(), CommError> {
        self.broadcast(data, root).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binomial_tree_shape() {
        assert_eq!(children(0, 8).collect::<Vec<_>>(), [4, 2, 1]);
        assert_eq!(children(4, 8).collect::<Vec<_>>(), [6, 5]);
        assert_eq!(children(0, 5).collect::<Vec<_>>(), [4, 2, 1]);
        assert_eq!(children(4, 5).collect::<Vec<_>>(), Vec::<usize>::new());
        assert_eq!(children(2, 3).collect::<Vec<_>>(), Vec::<usize>::new());
        assert_eq!(parent(6), Some(4));
        assert_eq!(parent(5), Some(4));
        assert_eq!(parent(0), None);
        // Every non-root has exactly one parent that lists it as a child.
        for n in 1..20 {
            for v in 1..n {
                let p = parent(v).unwrap();
                assert!(children(p, n).any(|c| c == v), "n={n} v={v}");
            }
        }
    }
}
