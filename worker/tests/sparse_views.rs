//! Generations larger than the job's `whole_answer_up_to`, end to end in one process: twenty
//! elastic workers on five named hosts and a real coordinator (memory store, loopback gRPC),
//! over loopback TCP alone (each worker a host of its own) or shared memory between the
//! workers of a named host and TCP between hosts. Each worker gets a sparse view of its
//! generation (its partners, its host-mates and the host runs), links only its plan at
//! set-up, runs collectives whose
//! schedules reach ranks outside its view (their addresses asked of the coordinator on first
//! use), and after a rank dies re-forms into a smaller sparse generation, carrying the links
//! whose two ends survived.

mod common;

use cohort::control::ControlConfig;
use cohort::elastic::{ElasticConfig, ElasticGroup, Generation, JobId, MeshKind, TransportChoice, WorkerId};
use cohort::ReduceOp;
use cohort_coordinator::JobSettings;
use cohort_transports::Transport;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// Bound on the test.
const BOUND: Duration = Duration::from_secs(120);
/// Workers, four to a host: more than `FULL_MESH_UP_TO`, so that links are planned.
const WORKERS: usize = 20;
/// The worker that dies after the first generation's collectives.
const VICTIM: &str = "w5";

/// What a worker saw of one generation.
#[derive(Debug)]
struct Seen {
    worker: String,
    number: u64,
    size: u32,
    known: usize,
    whole: bool,
    transport: MeshKind,
    /// Links after the set-up, and after the collectives.
    linked_at_set_up: usize,
    linked_after: usize,
    carried: usize,
}

fn seen(worker: &str, g: &Generation, linked_after: usize, linked_at_set_up: usize) -> Seen {
    Seen {
        worker: worker.into(),
        number: g.number,
        size: g.members.size(),
        known: g.members.known().len(),
        whole: g.members.is_whole(),
        transport: g.transport,
        linked_at_set_up,
        linked_after,
        carried: g.comm.transport().carried_links(),
    }
}

/// Runs the collectives every rank checks: an allreduce (ring and recursive doubling reach
/// partners only) and an alltoall (every pair, most of them outside the view).
async fn collectives(g: &mut Generation) -> Result<(), cohort::CommError> {
    let (rank, size) = (g.comm.rank(), g.comm.size());
    let mut sum = vec![rank as f32 + 1.0; 1000];
    g.comm.allreduce(&mut sum, ReduceOp::Sum).await?;
    let want = (size * (size + 1) / 2) as f32;
    assert!(sum.iter().all(|&x| x == want), "rank {rank}: allreduce gave {} not {want}", sum[0]);
    let input: Vec<i32> = (0..size).map(|to| (rank * 1000 + to) as i32).collect();
    let mut output = vec![0i32; size as usize];
    g.comm.alltoall(&input, &mut output).await?;
    let expected: Vec<i32> = (0..size).map(|from| (from * 1000 + rank) as i32).collect();
    assert_eq!(output, expected, "rank {rank}: alltoall");
    Ok(())
}

/// One worker: joins, runs the first generation's collectives, reports; the victim then
/// vanishes (its group and links dropped, as a killed process's are), the others go on into
/// the next generation when the first fails, run its collectives and report it too.
async fn worker(
    transport: TransportChoice,
    id: String,
    host: String,
    coordinator: String,
    started: mpsc::Sender<Seen>,
    go: oneshot::Receiver<()>,
) {
    let (job, worker) =
        (JobId::new(format!("sparse-{transport}")).expect("job id"), WorkerId::new(id.clone()).expect("worker id"));
    let mut config = ElasticConfig::new(job, worker, ControlConfig::new(vec![coordinator]));
    config.host = host;
    config.transport = transport;
    config.heartbeat_relay = false;
    config.listen = "127.0.0.1:0".parse().unwrap();
    let mut group = ElasticGroup::join(config).await.expect("join");
    let mut g = group.next_generation().await.expect("the first generation");
    let at_set_up = g.comm.transport().linked_peers();
    collectives(&mut g).await.expect("the first generation's collectives");
    started.send(seen(&id, &g, g.comm.transport().linked_peers(), at_set_up)).await.expect("report");
    go.await.expect("go");
    if id == VICTIM {
        drop(g);
        drop(group);
        return;
    }
    // The dead rank fails the next collective (or its revocation aborts it): re-form.
    loop {
        match collectives(&mut g).await {
            Ok(()) => continue,
            Err(e) => {
                let cause = group.on_failure(g.number, &e).await;
                assert_eq!(cause.worker_id, VICTIM, "{id}: the root cause names the victim: {cause:?}");
                break;
            }
        }
    }
    let number = g.number;
    drop(g);
    let mut next = group.next_generation().await.expect("the next generation");
    assert!(next.number > number);
    let at_set_up = next.comm.transport().linked_peers();
    collectives(&mut next).await.expect("the next generation's collectives");
    started.send(seen(&id, &next, next.comm.transport().linked_peers(), at_set_up)).await.expect("report");
    group.leave(true).await.expect("leave");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generations_above_whole_answer_up_to_run_on_sparse_views_over_tcp() {
    sparse_generations(TransportChoice::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generations_above_whole_answer_up_to_run_on_sparse_views_over_shared_memory_and_tcp() {
    sparse_generations(TransportChoice::Auto).await;
}

/// Twenty workers on five named hosts form a sparse generation, run collectives, lose one
/// rank and re-form; what each saw is checked.
async fn sparse_generations(transport: TransportChoice) {
    tokio::time::timeout(BOUND, async {
        let server = common::coordinator::start(JobSettings {
            min_workers: WORKERS as u32 - 1,
            max_workers: WORKERS as u32,
            join_window: Duration::from_secs(10),
            heartbeat_interval: Duration::from_millis(200),
            lease_ttl: Duration::from_secs(5),
            elastic_timeout: Duration::from_secs(30),
            whole_answer_up_to: 4,
            ..Default::default()
        })
        .await;
        let url = format!("http://{}", server.local_addr());
        let (tx, mut rx) = mpsc::channel(2 * WORKERS);
        let mut gos = Vec::new();
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..WORKERS {
            let (go, wait) = oneshot::channel();
            gos.push(go);
            tasks.spawn(worker(transport, format!("w{i}"), format!("h{}", i / 4), url.clone(), tx.clone(), wait));
        }
        drop(tx);
        let mut first = Vec::new();
        while first.len() < WORKERS {
            first.push(rx.recv().await.expect("a worker's first generation"));
        }
        let n = WORKERS as u32;
        // Over TCP alone each worker is a host of its own; with shared memory the workers
        // of a named host are one (in one process every worker has the same shared-memory
        // identity; a worker links over it the other members of its host run, TCP to the others).
        let (kind, host) = match transport {
            TransportChoice::Tcp => (MeshKind::Tcp, 1),
            _ => (MeshKind::ShmTcp, 4),
        };
        for s in &first {
            assert_eq!((s.size, s.whole, s.transport), (n, false, kind), "{s:?}: a sparse view of every member");
            // Its partners (at most 2 ceil(log2 20) = 10), its host-mates and what its plan
            // adds (a host leader's cross-host peers): short of the whole list.
            assert!(s.known < WORKERS, "{s:?}: knows fewer entries than the generation has");
            assert!(s.known >= host, "{s:?}: knows its host-mates");
            // 2 ceil(log2 20) + the ranks on its host.
            assert!(s.linked_at_set_up < 10 + host, "{s:?}: links at set-up within the plan's bound");
            // At set-up it links only peers of its view (it has no other addresses yet): the
            // alltoall's links to the rest were made on first use, their addresses asked of
            // the coordinator.
            assert!(s.linked_at_set_up < s.known, "{s:?}: links at set-up only to peers it knows");
            assert_eq!(s.linked_after, WORKERS - 1, "{s:?}: the alltoall linked every peer");
        }
        for go in gos {
            let _ = go.send(());
        }
        let mut next = Vec::new();
        while next.len() < WORKERS - 1 {
            next.push(rx.recv().await.expect("a survivor's next generation"));
        }
        while let Some(done) = tasks.join_next().await {
            done.expect("a worker task");
        }
        for s in &next {
            assert_eq!((s.size, s.whole), (n - 1, false), "{s:?}: a sparse view of the survivors");
            assert!(s.number > first[0].number);
            assert!(s.known < WORKERS - 1, "{s:?}: knows fewer entries than the generation has");
            assert_eq!(s.linked_after, WORKERS - 2, "{s:?}: the alltoall linked every survivor");
        }
        assert!(next.iter().all(|s| s.worker != VICTIM));
        // Over TCP the survivors carry the links whose two ends survived (with shared memory
        // here every planned peer is linked over it, and shared-memory links are made anew).
        let carried: usize = next.iter().map(|s| s.carried).sum();
        assert!(transport != TransportChoice::Tcp || carried > 0, "survivors carried links: {next:?}");
    })
    .await
    .expect("the test exceeded its bound");
}

/// Workers in the look-up count: enough that `N·log2 N` (160) is far below `N²` (1,024) and
/// below what one look-up per peer made on first use cost (about `N²/2`).
const COUNTED: usize = 32;

/// A worker of the look-up count: forms, reports, runs one alltoall when told, reports again,
/// and leaves when told.
async fn counted_worker(
    id: String,
    coordinator: String,
    formed: mpsc::Sender<()>,
    go: oneshot::Receiver<()>,
    done: mpsc::Sender<()>,
    leave: oneshot::Receiver<()>,
) {
    let (job, worker) = (JobId::new("sparse-lookups").expect("job id"), WorkerId::new(id.clone()).expect("worker id"));
    let mut config = ElasticConfig::new(job, worker, ControlConfig::new(vec![coordinator]));
    config.host = id.clone();
    config.transport = TransportChoice::Tcp;
    config.heartbeat_relay = false;
    config.listen = "127.0.0.1:0".parse().unwrap();
    let mut group = ElasticGroup::join(config).await.expect("join");
    let mut g = group.next_generation().await.expect("the generation");
    assert!(!g.members.is_whole(), "{id}: a sparse view");
    formed.send(()).await.expect("report");
    go.await.expect("go");
    let (rank, size) = (g.comm.rank(), g.comm.size());
    let input: Vec<i32> = (0..size).map(|to| (rank * 1000 + to) as i32).collect();
    let mut output = vec![0i32; size as usize];
    g.comm.alltoall(&input, &mut output).await.expect("the alltoall");
    let expected: Vec<i32> = (0..size).map(|from| (from * 1000 + rank) as i32).collect();
    assert_eq!(output, expected, "rank {rank}: alltoall");
    assert_eq!(g.comm.transport().linked_peers(), size as usize - 1, "{id}: the alltoall linked every peer");
    done.send(()).await.expect("report");
    leave.await.expect("leave");
    drop(g);
    group.leave(true).await.expect("leave");
}

/// One alltoall in a sparse generation (each worker a host of its own, `whole_answer_up_to`
/// 1) asks the coordinator for at most `N·log2 N` addresses in all (`Members` calls counted
/// by the coordinator): look-ups come in batches that double, not one per peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alltoall_in_a_sparse_generation_makes_at_most_n_log_n_lookups() {
    tokio::time::timeout(BOUND, async {
        let server = common::coordinator::start(JobSettings {
            min_workers: COUNTED as u32,
            max_workers: COUNTED as u32,
            join_window: Duration::from_secs(10),
            heartbeat_interval: Duration::from_millis(200),
            lease_ttl: Duration::from_secs(10),
            elastic_timeout: Duration::from_secs(30),
            whole_answer_up_to: 1,
            ..Default::default()
        })
        .await;
        let url = format!("http://{}", server.local_addr());
        let (formed_tx, mut formed) = mpsc::channel(COUNTED);
        let (done_tx, mut done) = mpsc::channel(COUNTED);
        let (mut gos, mut leaves) = (Vec::new(), Vec::new());
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..COUNTED {
            let (go, go_rx) = oneshot::channel();
            let (leave, leave_rx) = oneshot::channel();
            gos.push(go);
            leaves.push(leave);
            tasks.spawn(counted_worker(
                format!("w{i}"),
                url.clone(),
                formed_tx.clone(),
                go_rx,
                done_tx.clone(),
                leave_rx,
            ));
        }
        for _ in 0..COUNTED {
            formed.recv().await.expect("a worker formed");
        }
        let lookups = || server.metrics().rpc_count("Members", tonic::Code::Ok);
        let before = lookups();
        for go in gos {
            let _ = go.send(());
        }
        for _ in 0..COUNTED {
            done.recv().await.expect("a worker's alltoall");
        }
        for leave in leaves {
            let _ = leave.send(());
        }
        while let Some(worker) = tasks.join_next().await {
            worker.expect("a worker task");
        }
        // Counted once every worker dropped its generation: the accepting ends' look-ups (for
        // their probe targets, in the background) are in, done or dropped with their mesh.
        let made = lookups() - before;
        let n = COUNTED as f64;
        eprintln!("one alltoall at {COUNTED} sparse ranks: {made} Members calls (N log2 N = {})", n * n.log2());
        assert!(made > 0, "addresses outside the views were asked for");
        assert!(made as f64 <= n * n.log2(), "{made} look-ups for one alltoall at {COUNTED} ranks");
        assert!(made as f64 <= n * n / 4.0, "{made} look-ups: far fewer than one per pair");
    })
    .await
    .expect("the test exceeded its bound");
}
