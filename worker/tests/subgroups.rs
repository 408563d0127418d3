//! Subgroups of a generation (a 2-D device mesh, as HSDP uses): a shard group per row and a
//! replica group per column, each a communicator over the generation's links on a channel of
//! its own, with their calls and the generation's own running at the same time on every rank.
//!
//! Over the simulated network (deterministic, and a crash's effect on every communicator) and
//! over the real transports: TCP (full mesh, and links on demand), shared memory, and both.

mod common;

use cohort::{Algorithm, CommConfig, CommError, Communicator, ReduceOp};
use cohort_testkit::sim::SimNetwork;
use cohort_transports::Transport;
use common::meshes::{deadlines, Net};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::timeout;

const LIMIT: Duration = Duration::from_secs(120);
const ROWS: u32 = 2;
const COLS: u32 = 3;
const ROUNDS: u64 = 12;
/// Elements of each shard group's reduce-scatter input (not a multiple of the row: uneven
/// blocks) and of each replica group's allreduce.
const LEN: usize = 1031;

/// Shard group (row) and replica group (column) members of `rank`, by generation rank.
fn row_of(rank: u32) -> Vec<u32> {
    let i = rank / COLS;
    (0..COLS).map(|j| i * COLS + j).collect()
}

fn col_of(rank: u32) -> Vec<u32> {
    let j = rank % COLS;
    (0..ROWS).map(|i| i * COLS + j).collect()
}

/// What generation rank `r` contributes to element `x` of round `k` on `channel`.
fn value(r: u32, k: u64, x: usize, channel: u64) -> i64 {
    ((u64::from(r) * 7919 + k * 104_729 + x as u64 * 31 + channel * 1_000_003) % 10_007) as i64 - 5000
}

/// Every round, on every rank: the shard group's reduce-scatter, the replica group's
/// allreduce and the generation's own allreduce, all three in flight at once; each result is
/// checked against the sum computed here. Returns the generation's communicator, for a
/// caller that checks more.
async fn mesh_rounds<P: Transport, S: Transport>(
    mut world: Communicator<P>,
    mut row: Communicator<S>,
    mut col: Communicator<S>,
) -> Result<Communicator<P>, CommError> {
    let me = world.rank();
    let (row_members, col_members) = (row_of(me), col_of(me));
    assert_eq!((row.rank(), row.size()), (me % COLS, COLS));
    assert_eq!((col.rank(), col.size()), (me / COLS, ROWS));
    for k in 0..ROUNDS {
        let shard_in: Vec<i64> = (0..LEN).map(|x| value(me, k, x, 1)).collect();
        let block = block_of(LEN, COLS as usize, row.rank() as usize);
        let mut shard_out = vec![0i64; block.len()];
        let mut replica: Vec<i64> = (0..LEN).map(|x| value(me, k, x, 2)).collect();
        let mut whole: Vec<i64> = (0..17).map(|x| value(me, k, x, 0)).collect();
        // Every rank of a group calls the same collective (the algorithm changes by round);
        // the order the three are started in differs by rank and round, so no rank waits
        // for another's communicators to go first.
        let algorithm = if k % 2 == 0 { Algorithm::Ring } else { Algorithm::RecursiveDoubling };
        let (a, b, c) = if (u64::from(me) + k) % 2 == 0 {
            tokio::join!(
                row.reduce_scatter(&shard_in, &mut shard_out, ReduceOp::Sum),
                col.allreduce_with(&mut replica, ReduceOp::Sum, algorithm),
                world.allreduce(&mut whole, ReduceOp::Sum)
            )
        } else {
            let (c, b, a) = tokio::join!(
                world.allreduce(&mut whole, ReduceOp::Sum),
                col.allreduce_with(&mut replica, ReduceOp::Sum, algorithm),
                row.reduce_scatter(&shard_in, &mut shard_out, ReduceOp::Sum)
            );
            (a, b, c)
        };
        a?;
        b?;
        c?;
        let want_shard: Vec<i64> =
            block.clone().map(|x| row_members.iter().map(|&r| value(r, k, x, 1)).sum()).collect();
        assert_eq!(shard_out, want_shard, "rank {me} round {k}: shard group reduce-scatter");
        let want_replica: Vec<i64> = (0..LEN).map(|x| col_members.iter().map(|&r| value(r, k, x, 2)).sum()).collect();
        assert_eq!(replica, want_replica, "rank {me} round {k}: replica group allreduce");
        let want_whole: Vec<i64> = (0..17).map(|x| (0..ROWS * COLS).map(|r| value(r, k, x, 0)).sum()).collect();
        assert_eq!(whole, want_whole, "rank {me} round {k}: the generation's allreduce");
    }
    Ok(world)
}

/// Rank `rank`'s block of `len` elements over `n` ranks (the first `len % n` get one more).
fn block_of(len: usize, n: usize, rank: usize) -> std::ops::Range<usize> {
    let (base, extra) = (len / n, len % n);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

#[tokio::test]
async fn a_2d_mesh_runs_its_groups_concurrently_over_the_simulated_network() {
    timeout(LIMIT, async {
        let (_net, ts) = SimNetwork::new(ROWS * COLS, 5, deadlines());
        let handles: Vec<_> = ts
            .into_iter()
            .map(|t| {
                let world = Communicator::new(Arc::new(t), CommConfig { segment_bytes: 512, ..CommConfig::default() });
                let me = world.rank();
                // Disjoint groups of one dimension share its channel.
                let row = world.subgroup(&row_of(me), 1).expect("row");
                let col = world.subgroup(&col_of(me), 2).expect("column");
                tokio::spawn(mesh_rounds(world, row, col))
            })
            .collect();
        for (rank, h) in handles.into_iter().enumerate() {
            h.await.expect("rank task").unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        }
    })
    .await
    .expect("timed out");
}

#[tokio::test(start_paused = true)]
async fn a_crash_fails_every_communicator_of_the_generation_promptly() {
    let (net, ts) = SimNetwork::new(ROWS * COLS, 5, deadlines());
    let handles: Vec<_> = ts
        .into_iter()
        .map(|t| {
            let mut world = Communicator::new(Arc::new(t), CommConfig::default());
            let me = world.rank();
            let mut row = world.subgroup(&row_of(me), 1).expect("row");
            let mut col = world.subgroup(&col_of(me), 2).expect("column");
            tokio::spawn(async move {
                let start = tokio::time::Instant::now();
                let mut a = vec![1i64; 1 << 16];
                let mut b = vec![1i64; 1 << 16];
                let mut c = vec![1i64; 1 << 16];
                let (x, y, z) = tokio::join!(
                    row.allreduce_with(&mut a, ReduceOp::Sum, Algorithm::Ring),
                    col.allreduce_with(&mut b, ReduceOp::Sum, Algorithm::Ring),
                    world.allreduce_with(&mut c, ReduceOp::Sum, Algorithm::Ring)
                );
                (me, x, y, z, start.elapsed())
            })
        })
        .collect();
    // Rank 4's links are slow: it crashes before anything reaches it, so every call that
    // spans it is in flight and needs a message it will never send.
    for p in [0, 1, 2, 3, 5] {
        net.delay(4, p, Duration::from_millis(20));
    }
    // The clock is paused (start_paused): this places the crash at 10 ms of simulated time,
    // deterministically; it synchronises nothing.
    tokio::time::sleep(Duration::from_millis(10)).await;
    net.crash(4);
    for h in handles {
        let (me, x, y, z, elapsed) = timeout(LIMIT, h).await.expect("bounded").expect("rank task");
        // Rank 4's own row and column fail; a row or column without it may have finished
        // before the crash reached it, but the generation's allreduce spans rank 4.
        assert!(z.is_err(), "rank {me}: the generation's allreduce succeeded without rank 4");
        if row_of(me).contains(&4) {
            assert!(x.is_err(), "rank {me}: its row holds rank 4");
        }
        if col_of(me).contains(&4) {
            assert!(y.is_err(), "rank {me}: its column holds rank 4");
        }
        assert!(elapsed < deadlines().no_progress, "rank {me} waited for the deadline: {elapsed:?}");
    }
}

#[tokio::test]
async fn subgroups_refuse_bad_member_lists() {
    let (_net, mut ts) = SimNetwork::new(4, 1, deadlines());
    let world = Communicator::new(Arc::new(ts.remove(1)), CommConfig::default());
    for (members, channel, says) in [
        (vec![0, 2], 1, "leaves out this process"),
        (vec![1, 1], 1, "twice"),
        (vec![1, 4], 1, "not a rank of the generation"),
        (vec![1, 2], 0, "channel 0"),
    ] {
        match world.subgroup(&members, channel) {
            Err(CommError::InvalidArgument(msg)) => assert!(msg.contains(says), "{members:?}: {msg}"),
            other => panic!("{members:?} on channel {channel}: {other:?}"),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Over the real transports.

async fn over_real(net: Net) {
    let n = ROWS * COLS;
    // The rows are the hosts of the mixed mesh: shard groups over shared memory, replica
    // groups over TCP.
    let (_endpoints, meshes) = common::meshes::mesh(net, n, 1, |r| r / COLS).await;
    let handles: Vec<_> = meshes
        .into_iter()
        .map(|t| {
            let world = Communicator::new(Arc::new(t), CommConfig { segment_bytes: 2048, ..CommConfig::default() });
            let me = world.rank();
            let row = world.mesh_subgroup(&row_of(me), 1).expect("row");
            let col = world.mesh_subgroup(&col_of(me), 2).expect("column");
            assert_eq!(row.transport().kind(), world.transport().kind());
            let before = world.transport().linked_peers();
            tokio::spawn(async move {
                let world = mesh_rounds(world, row, col).await?;
                Ok::<_, CommError>((before, world.transport().linked_peers()))
            })
        })
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        let (before, after) = h.await.expect("rank task").unwrap_or_else(|e| panic!("{net:?} rank {rank}: {e}"));
        // The subgroups opened no links of their own: a full mesh has the links it had, and a
        // mesh with links on demand at most one per peer of the generation.
        if matches!(net, Net::TcpPlanned) {
            assert!(after < n as usize, "{net:?} rank {rank}: {after} links");
        } else {
            assert_eq!(after, before, "{net:?} rank {rank}");
        }
    }
}

macro_rules! over {
    ($name:ident, $net:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            timeout(LIMIT, over_real($net)).await.expect("timed out");
        }
    };
}

over!(a_2d_mesh_runs_its_groups_concurrently_over_tcp, Net::Tcp);
over!(a_2d_mesh_runs_its_groups_concurrently_over_tcp_links_on_demand, Net::TcpPlanned);
over!(a_2d_mesh_runs_its_groups_concurrently_over_shm, Net::Shm);
over!(a_2d_mesh_runs_its_groups_concurrently_over_shm_and_tcp, Net::Mixed);
