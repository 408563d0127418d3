//! Shared harness of the collective tests: deterministic inputs, a straightforward reference
//! for every collective, and a driver that runs a list of cases on every rank of a world.

#![allow(dead_code)]

pub(crate) mod coordinator;
pub(crate) mod meshes;
pub(crate) mod slow_link;
pub(crate) mod squatter;

use cohort::reduce::{finish_avg, reduce};
use cohort::{counts_for, Algorithm, CommError, Communicator, DType, Element, ReduceOp};
use cohort_transports::Transport;
use half::{bf16, f16};

/// Test-only constructors for every element type.
pub(crate) trait TestElem: Element {
    fn small(x: i32) -> Self;
}

impl TestElem for f32 {
    fn small(x: i32) -> Self {
        x as f32
    }
}
impl TestElem for f64 {
    fn small(x: i32) -> Self {
        x as f64
    }
}
impl TestElem for f16 {
    fn small(x: i32) -> Self {
        f16::from_f32(x as f32)
    }
}
impl TestElem for bf16 {
    fn small(x: i32) -> Self {
        bf16::from_f32(x as f32)
    }
}
impl TestElem for i32 {
    fn small(x: i32) -> Self {
        x
    }
}
impl TestElem for i64 {
    fn small(x: i32) -> Self {
        x as i64
    }
}
impl TestElem for u8 {
    fn small(x: i32) -> Self {
        x.rem_euclid(256) as u8
    }
}

/// One collective call of a test.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Coll {
    Allreduce(Algorithm),
    ReduceScatter,
    Allgather,
    Allgatherv,
    Broadcast(u32),
    Reduce(u32),
    Gather(u32),
    Scatter(u32),
    Alltoall,
    Alltoallv,
    Barrier,
    SendRecvRing,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Case {
    pub coll: Coll,
    pub op: ReduceOp,
    pub len: usize,
    pub salt: u32,
}

fn mix(a: u32, b: u32, c: u32) -> u32 {
    let mut h = a.wrapping_mul(0x9e37_79b9) ^ b.wrapping_mul(0x85eb_ca6b) ^ c.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 15;
    h = h.wrapping_mul(0x2c1b_3c6d);
    h ^ (h >> 12)
}

/// Rank `rank`'s `len` input elements for `case`: small integers chosen so that every
/// reduction is exact in every dtype (sums stay below 2^8 in magnitude, products are powers of
/// two), hence comparable bit for bit with the reference whatever the combination order.
pub(crate) fn input<E: TestElem>(rank: u32, case: &Case, len: usize) -> Vec<E> {
    (0..len as u32)
        .map(|i| {
            let h = mix(rank, i, case.salt);
            let x = match case.op {
                ReduceOp::Prod => [1, 2, -1, 1, -2][(h % 5) as usize],
                _ => (h % 17) as i32 - 8,
            };
            let x = if E::DTYPE == DType::U8 { x.abs() } else { x };
            E::small(x)
        })
        .collect()
}

/// Counts of an allgatherv: rank `i` contributes `(len + 3 i) % 5 + (i % 2) * len`.
pub(crate) fn gatherv_counts(n: u32, len: usize) -> Vec<usize> {
    (0..n as usize).map(|i| (len + 3 * i) % 5 + (i % 2) * len).collect()
}

/// Alltoallv: elements rank `i` sends to rank `j`.
pub(crate) fn a2av_count(i: usize, j: usize, len: usize) -> usize {
    (i + 2 * j + len) % 4 + if (i + j) % 3 == 0 { len } else { 0 }
}

fn reduced<E: TestElem>(n: u32, case: &Case, len: usize) -> Vec<E> {
    let mut acc = input::<E>(0, case, len);
    for r in 1..n {
        reduce(case.op, &mut acc, &input::<E>(r, case, len));
    }
    finish_avg(case.op, &mut acc, n);
    acc
}

/// What rank `rank` of `n` must hold after `case`.
pub(crate) fn expected<E: TestElem>(n: u32, rank: u32, case: &Case) -> Vec<E> {
    let len = case.len;
    let nn = n as usize;
    let r = rank as usize;
    match case.coll {
        Coll::Allreduce(_) => reduced(n, case, len),
        Coll::ReduceScatter => {
            let all = reduced::<E>(n, case, len);
            let counts = counts_for(len, n);
            let start: usize = counts[..r].iter().sum();
            all[start..start + counts[r]].to_vec()
        }
        Coll::Allgather => (0..n).flat_map(|i| input::<E>(i, case, len)).collect(),
        Coll::Allgatherv => {
            let counts = gatherv_counts(n, len);
            (0..n).flat_map(|i| input::<E>(i, case, counts[i as usize])).collect()
        }
        Coll::Broadcast(root) => input(root, case, len),
        Coll::Reduce(root) => {
            if rank == root {
                reduced(n, case, len)
            } else {
                input(rank, case, len)
            }
        }
        Coll::Gather(root) => {
            if rank == root {
                (0..n).flat_map(|i| input::<E>(i, case, len)).collect()
            } else {
                Vec::new()
            }
        }
        Coll::Scatter(root) => input::<E>(root, case, len * nn)[r * len..(r + 1) * len].to_vec(),
        Coll::Alltoall => {
            (0..nn).flat_map(|i| input::<E>(i as u32, case, len * nn)[r * len..(r + 1) * len].to_vec()).collect()
        }
        Coll::Alltoallv => (0..nn)
            .flat_map(|i| {
                let sc: Vec<usize> = (0..nn).map(|j| a2av_count(i, j, len)).collect();
                let total: usize = sc.iter().sum();
                let start: usize = sc[..r].iter().sum();
                input::<E>(i as u32, case, total)[start..start + sc[r]].to_vec()
            })
            .collect(),
        Coll::Barrier => Vec::new(),
        Coll::SendRecvRing => input((rank + n - 1) % n, case, len),
    }
}

/// Runs `case` on this rank and returns what it must be compared with [`expected`].
pub(crate) async fn run_case<E: TestElem, T: Transport>(
    comm: &mut Communicator<T>,
    case: &Case,
) -> Result<Vec<E>, CommError> {
    let (n, rank) = (comm.size(), comm.rank());
    let nn = n as usize;
    let len = case.len;
    let mine = || input::<E>(rank, case, len);
    match case.coll {
        Coll::Allreduce(algo) => {
            let mut d = mine();
            comm.allreduce_with(&mut d, case.op, algo).await?;
            Ok(d)
        }
        Coll::ReduceScatter => {
            let mut out = vec![E::default(); counts_for(len, n)[rank as usize]];
            comm.reduce_scatter(&mine(), &mut out, case.op).await?;
            Ok(out)
        }
        Coll::Allgather => {
            let mut out = vec![E::default(); len * nn];
            comm.allgather(&mine(), &mut out).await?;
            Ok(out)
        }
        Coll::Allgatherv => {
            let counts = gatherv_counts(n, len);
            let mut out = vec![E::default(); counts.iter().sum()];
            comm.allgatherv(&input::<E>(rank, case, counts[rank as usize]), &mut out, &counts).await?;
            Ok(out)
        }
        Coll::Broadcast(root) => {
            let mut d = if rank == root { mine() } else { vec![E::default(); len] };
            comm.broadcast(&mut d, root).await?;
            Ok(d)
        }
        Coll::Reduce(root) => {
            let mut d = mine();
            comm.reduce(&mut d, case.op, root).await?;
            Ok(d)
        }
        Coll::Gather(root) => {
            let mut out = if rank == root { vec![E::default(); len * nn] } else { Vec::new() };
            comm.gather(&mine(), &mut out, root).await?;
            Ok(out)
        }
        Coll::Scatter(root) => {
            let inp = if rank == root { input::<E>(rank, case, len * nn) } else { Vec::new() };
            let mut out = vec![E::default(); len];
            comm.scatter(&inp, &mut out, root).await?;
            Ok(out)
        }
        Coll::Alltoall => {
            let mut out = vec![E::default(); len * nn];
            comm.alltoall(&input::<E>(rank, case, len * nn), &mut out).await?;
            Ok(out)
        }
        Coll::Alltoallv => {
            let r = rank as usize;
            let sc: Vec<usize> = (0..nn).map(|j| a2av_count(r, j, len)).collect();
            let rc: Vec<usize> = (0..nn).map(|i| a2av_count(i, r, len)).collect();
            let mut out = vec![E::default(); rc.iter().sum()];
            comm.alltoallv(&input::<E>(rank, case, sc.iter().sum()), &sc, &mut out, &rc).await?;
            Ok(out)
        }
        Coll::Barrier => {
            comm.barrier().await?;
            Ok(Vec::new())
        }
        Coll::SendRecvRing => {
            if n == 1 {
                return Ok(mine());
            }
            let right = (rank + 1) % n;
            let left = (rank + n - 1) % n;
            let mut got = vec![E::default(); len];
            // Even ranks send first, odd ranks receive first: works on any transport.
            if rank % 2 == 0 {
                comm.send(&mine(), right).await?;
                comm.recv(&mut got, left).await?;
            } else {
                comm.recv(&mut got, left).await?;
                comm.send(&mine(), right).await?;
            }
            Ok(got)
        }
    }
}

/// The full matrix of cases for one dtype: every collective, op and algorithm, for the
/// element counts `lens`.
pub(crate) fn matrix(n: u32, lens: &[usize], ops: &[ReduceOp], algos: &[Algorithm]) -> Vec<Case> {
    let mut cases = Vec::new();
    let mut salt = 0;
    let mut push = |coll, op, len| {
        salt += 1;
        cases.push(Case { coll, op, len, salt });
    };
    for &len in lens {
        for &op in ops {
            for &a in algos {
                push(Coll::Allreduce(a), op, len);
            }
            push(Coll::ReduceScatter, op, len);
            push(Coll::Reduce(n - 1), op, len);
            push(Coll::Reduce(0), op, len);
        }
        for root in [0, n / 2, n - 1] {
            push(Coll::Broadcast(root), ReduceOp::Sum, len);
        }
        push(Coll::Gather(n / 2), ReduceOp::Sum, len);
        push(Coll::Scatter(n - 1), ReduceOp::Sum, len);
        push(Coll::Allgather, ReduceOp::Sum, len);
        push(Coll::Allgatherv, ReduceOp::Sum, len);
        push(Coll::Alltoall, ReduceOp::Sum, len);
        push(Coll::Alltoallv, ReduceOp::Sum, len);
        push(Coll::SendRecvRing, ReduceOp::Sum, len);
        push(Coll::Barrier, ReduceOp::Sum, len);
    }
    cases
}

/// Runs all `cases` in order on one rank, returning the results (or the first error, with the
/// case that failed).
pub(crate) async fn run_all<E: TestElem, T: Transport>(
    mut comm: Communicator<T>,
    cases: Vec<Case>,
) -> Result<Vec<Vec<E>>, (Case, CommError)> {
    let mut out = Vec::with_capacity(cases.len());
    for c in &cases {
        out.push(run_case::<E, T>(&mut comm, c).await.map_err(|e| (*c, e))?);
    }
    Ok(out)
}

/// Checks every rank's results against the reference.
pub(crate) fn check_results<E: TestElem>(n: u32, cases: &[Case], results: &[Vec<Vec<E>>]) {
    for (rank, per_rank) in results.iter().enumerate() {
        for (case, got) in cases.iter().zip(per_rank) {
            let want = expected::<E>(n, rank as u32, case);
            assert!(
                cohort::as_bytes(got) == cohort::as_bytes(&want),
                "{:?} n={n} rank={rank} {case:?}: got {:?}, want {:?}",
                E::DTYPE,
                &got[..got.len().min(12)],
                &want[..want.len().min(12)]
            );
        }
    }
}
