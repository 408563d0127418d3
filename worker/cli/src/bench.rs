//! `cohort-worker bench`: allreduce bandwidth and latency across local rank processes.
//!
//! The parent spawns N copies of itself (`cohort-worker bench-rank`), one per rank. Each
//! binds a data-plane listener on 127.0.0.1:0 (TCP), makes its shared-memory address
//! (`--transport shm`; both with `auto`, the default, which then plans the mesh as the
//! elastic runtime does: shared memory here, since every rank shares the host) or opens its
//! RDMA device and bootstrap listener (`--transport rdma`) and prints its address; the parent hands the
//! full address list back on every child's stdin; the ranks connect their mesh and, for each
//! size, run warm-up iterations and then the timed ones of the chosen operator (`--op`),
//! verifying every result against [`OpPattern`]'s expected values. Each rank
//! reports its median; the figure for a size is the slowest rank's median, as nccl-tests
//! does. busbw = algbw x 2(n-1)/n.

use cohort::elastic::{connect_members, JobId, LocalEndpoints, MemberInfo, MeshScope, MeshTransport, TransportChoice};
use cohort::{Algorithm, CommConfig, Communicator, HostLayout, ReduceOp};
use cohort_harness::exact::{ExactElement, OpPattern};
use cohort_proto::progress::{Progress, Total};
use cohort_transports::shm::{ShmAddress, ShmEndpoint, ShmMeshSpec, ShmOptions};
use cohort_transports::tcp::{MeshSpec, TcpEndpoint, TcpOptions, Upfront};
use cohort_transports::{Deadlines, Transport};
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Parses sizes like `4K,64K,1M,16M,64M` or `4096` (K, M, G are powers of 1024).
pub(crate) fn parse_sizes(s: &str) -> Result<Vec<usize>, String> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let p = p.trim();
            let (num, mult) = match p.chars().last().map(|c| c.to_ascii_uppercase()) {
                Some('K') => (&p[..p.len() - 1], 1usize << 10),
                Some('M') => (&p[..p.len() - 1], 1 << 20),
                Some('G') => (&p[..p.len() - 1], 1 << 30),
                _ => (p, 1),
            };
            num.parse::<usize>().map(|n| n * mult).map_err(|_| format!("bad size {p:?} (e.g. 4K, 1M, 4096)"))
        })
        .collect()
}

/// What one bench run measures.
#[derive(Clone, Debug)]
pub(crate) struct BenchConfig {
    /// Number of rank processes.
    pub(crate) ranks: u32,
    /// Message sizes in bytes.
    pub(crate) sizes: Vec<usize>,
    /// Timed iterations per size.
    pub(crate) iters: u32,
    /// Untimed warm-up iterations per size.
    pub(crate) warmup: u32,
    /// Allreduce algorithm.
    pub(crate) algo: Algorithm,
    /// Element type name (f32, f64, f16, bf16, i32, i64, u8).
    pub(crate) dtype: String,
    /// The reduction operator (every result is verified for it).
    pub(crate) op: ReduceOp,
    /// Receive busy-poll window of the TCP links ([`TcpOptions::busy_poll`]).
    pub(crate) busy_poll: Duration,
    /// The data-plane transport.
    pub(crate) transport: TransportChoice,
    /// Bind each rank process to its own CPU (see [`bind_to_cpu`]).
    pub(crate) bind: bool,
    /// Emulated hosts: the ranks in `hosts` contiguous groups ([`HostLayout::blocks`]), shared
    /// memory within a group and loopback TCP between groups (`--transport auto`; `tcp` keeps
    /// TCP everywhere), and the communicator told the layout. 1: one host, as it is.
    pub(crate) hosts: u32,
    /// CPU-bound neighbours to run beside the ranks (`--load N`): the sizes are timed quiet,
    /// then again beside N spinning threads ([`CpuLoad`]). 0: quiet only.
    pub(crate) load: u32,
}

/// N CPU-bound threads, standing for DataLoader workers, intra-op threads or another job on
/// the same cores: each spins on arithmetic, never sleeps and never yields, until dropped.
pub(crate) struct CpuLoad {
    stop: Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl CpuLoad {
    /// Starts `n` spinning threads (unbound: the scheduler places them).
    pub(crate) fn start(n: u32) -> Result<Self, String> {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut load = Self { stop: stop.clone(), threads: Vec::new() };
        for i in 0..n {
            let stop = stop.clone();
            let t = std::thread::Builder::new()
                .name(format!("cpu-load-{i}"))
                .spawn(move || {
                    let mut x = 0x9e37_79b9_7f4a_7c15u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        for _ in 0..10_000 {
                            x = std::hint::black_box(x.rotate_left(5) ^ x.wrapping_mul(31));
                        }
                    }
                })
                .map_err(|e| format!("starting load thread {i}: {e}"))?;
            load.threads.push(t);
        }
        Ok(load)
    }
}

impl Drop for CpuLoad {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The CPUs this process may run on, in order.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity fills it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: set is a valid cpu_set_t of the size passed.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return Vec::new();
    }
    // SAFETY: CPU_ISSET reads within the set for every index below CPU_SETSIZE.
    (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect()
}

/// Whether `--bind auto` binds `ranks` rank processes: when each can have a CPU of its own
/// (as Open MPI binds ranks to cores by default when they do not outnumber them).
pub(crate) fn bind_by_default(ranks: u32) -> bool {
    let cpus = allowed_cpus().len();
    cpus > 1 && ranks as usize <= cpus
}

/// Binds the calling process to the `index`-th CPU it may run on. Left to itself, the
/// scheduler often packs two ranks onto one CPU of a 2-CPU machine, and every hand-over
/// between them then waits for the other to be scheduled (measured: 4 KiB allreduce 9 us
/// instead of 2 us; docs/benchmarks-journal.md, "Where the time went (shared memory)").
pub(crate) fn bind_to_cpu(index: usize) -> Result<(), String> {
    let cpus = allowed_cpus();
    let Some(&cpu) = cpus.get(index % cpus.len().max(1)) else { return Err("no CPU to bind to".into()) };
    // SAFETY: a zeroed cpu_set_t is valid; CPU_SET writes within it for cpu < CPU_SETSIZE.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(format!("binding to CPU {cpu}: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// One size's result (slowest rank's median).
#[derive(Clone, Debug)]
pub(crate) struct BenchRow {
    /// Bytes per rank.
    pub(crate) bytes: usize,
    /// Slowest rank's median, in microseconds.
    pub(crate) median_us: f64,
}

impl BenchRow {
    /// Algorithm bandwidth, GB/s (bytes / time).
    pub(crate) fn algbw(&self) -> f64 {
        if self.median_us <= 0.0 {
            return 0.0;
        }
        self.bytes as f64 / (self.median_us * 1e-6) / 1e9
    }
    /// Bus bandwidth, GB/s (algbw x 2(n-1)/n).
    pub(crate) fn busbw(&self, ranks: u32) -> f64 {
        self.algbw() * 2.0 * (ranks as f64 - 1.0) / ranks as f64
    }
}

fn algo_name(a: Algorithm) -> &'static str {
    match a {
        Algorithm::Ring => "ring",
        Algorithm::Bcube => "bcube",
        Algorithm::RecursiveDoubling => "rd",
        Algorithm::Hierarchical => "hierarchical",
        Algorithm::Auto => "auto",
    }
}

/// Kills the children still running when the parent leaves (error or panic).
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Whether the element type named `dtype` holds `op`'s verified values exactly over `ranks`.
pub(crate) fn check_exact(dtype: &str, op: ReduceOp, ranks: u32) -> Result<(), String> {
    let pattern = OpPattern::new(op, 0, ranks);
    match dtype {
        "f32" => pattern.check_exact::<f32>(),
        "f64" => pattern.check_exact::<f64>(),
        "f16" => pattern.check_exact::<half::f16>(),
        "bf16" => pattern.check_exact::<half::bf16>(),
        "i32" => pattern.check_exact::<i32>(),
        "i64" => pattern.check_exact::<i64>(),
        "u8" => pattern.check_exact::<u8>(),
        other => Err(format!("unknown dtype {other:?} (f32, f64, f16, bf16, i32, i64, u8)")),
    }
}

/// Runs the benchmark: spawns the ranks, collects, returns one row per size.
pub(crate) fn run_parent(config: &BenchConfig) -> Result<Vec<BenchRow>, String> {
    check_exact(&config.dtype, config.op, config.ranks)?;
    let exe = std::env::current_exe().map_err(|e| format!("locating cohort-worker: {e}"))?;
    let sizes = config.sizes.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",");
    let token: [u8; 16] = rand::random();
    let token_hex: String = token.iter().map(|b| format!("{b:02x}")).collect();
    let mut children = Children(Vec::new());
    for rank in 0..config.ranks {
        let child = Command::new(&exe)
            .args(["bench-rank", "--rank", &rank.to_string(), "--ranks", &config.ranks.to_string()])
            .args(["--sizes", &sizes, "--iters", &config.iters.to_string(), "--warmup", &config.warmup.to_string()])
            .args(["--algo", algo_name(config.algo), "--dtype", &config.dtype, "--op", config.op.name()])
            .args(["--busy-poll", &format!("{}us", config.busy_poll.as_micros())])
            .args(["--transport", config.transport.name()])
            .args(["--bind", if config.bind { "core" } else { "none" }])
            .args(["--hosts", &config.hosts.to_string()])
            .env("COHORT_BENCH_TOKEN", &token_hex)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("spawning rank {rank}: {e}"))?;
        children.0.push(child);
    }
    let mut readers = Vec::new();
    let mut addresses = Vec::new();
    for (rank, child) in children.0.iter_mut().enumerate() {
        let stdout = child.stdout.take().ok_or("child without stdout")?;
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        reader.read_line(&mut line).map_err(|e| format!("rank {rank}: {e}"))?;
        let addr = line
            .trim()
            .strip_prefix("addr=")
            .ok_or_else(|| format!("rank {rank} said {line:?} instead of its address"))?;
        addresses.push(addr.to_string());
        readers.push(reader);
    }
    let list = addresses.join(",") + "\n";
    for child in &mut children.0 {
        let stdin = child.stdin.as_mut().ok_or("child without stdin")?;
        stdin.write_all(list.as_bytes()).map_err(|e| format!("sending addresses: {e}"))?;
    }
    // Each rank prints `result bytes=B median_us=T` per size, then `done`. The ranks move
    // through the sizes together, so rank 0's results are the sweep's progress (stderr).
    let what = format!("bench {} ranks {} {}", config.ranks, algo_name(config.algo), config.transport.name());
    let progress = Progress::new(what, Total::Items(config.sizes.len() as u64));
    let mut medians = vec![vec![0f64; config.ranks as usize]; config.sizes.len()];
    for (rank, reader) in readers.iter_mut().enumerate() {
        let mut seen = 0;
        if rank == 0 {
            if let Some(first) = config.sizes.first() {
                progress.start(format!("{first} B"));
            }
        }
        for line in std::io::Read::by_ref(reader).lines() {
            let line = line.map_err(|e| format!("rank {rank}: {e}"))?;
            if line == "done" {
                break;
            }
            if let Some(rest) = line.strip_prefix("error ") {
                return Err(format!("rank {rank}: {rest}"));
            }
            let mut bytes = None;
            let mut median = None;
            for kv in line.split_whitespace() {
                if let Some(v) = kv.strip_prefix("bytes=") {
                    bytes = v.parse::<usize>().ok();
                }
                if let Some(v) = kv.strip_prefix("median_us=") {
                    median = v.parse::<f64>().ok();
                }
            }
            if let (Some(b), Some(m)) = (bytes, median) {
                // Ranks report the sizes in the order given (a size may repeat: each
                // repetition is its own row).
                let i = seen;
                if config.sizes.get(i) != Some(&b) {
                    return Err(format!("rank {rank} reported size {b} where size {:?} was next", config.sizes.get(i)));
                }
                medians[i][rank] = m;
                seen += 1;
                if rank == 0 {
                    progress.done("");
                    if let Some(next) = config.sizes.get(seen) {
                        progress.start(format!("{next} B"));
                    }
                }
            }
        }
        if rank == 0 {
            progress.finish();
        }
        if seen != config.sizes.len() {
            return Err(format!("rank {rank} exited after {seen} of {} sizes", config.sizes.len()));
        }
    }
    for (rank, child) in children.0.iter_mut().enumerate() {
        let status = child.wait().map_err(|e| format!("rank {rank}: {e}"))?;
        if !status.success() {
            return Err(format!("rank {rank} exited with {status}"));
        }
    }
    Ok(config
        .sizes
        .iter()
        .zip(medians)
        .map(|(&bytes, per_rank)| BenchRow { bytes, median_us: per_rank.into_iter().fold(0.0, f64::max) })
        .collect())
}

/// Single-thread memcpy bandwidth of this machine in GB/s (bytes copied per second; each
/// byte is read once and written once): the best of a few copies of 64 MiB. This is the
/// limit a shared-memory transport works against (docs/benchmarks-journal.md, "One host").
pub(crate) fn memcpy_bandwidth() -> f64 {
    const LEN: usize = 64 << 20;
    let src = vec![1u8; LEN];
    let mut dst = vec![0u8; LEN];
    dst.copy_from_slice(&src); // fault the pages in
    let mut best = f64::MAX;
    for _ in 0..5 {
        let started = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        best = best.min(started.elapsed().as_secs_f64());
    }
    LEN as f64 / best / 1e9
}

/// Prints the nccl-tests-style table and the parseable lines; with `loaded` (the same sizes
/// timed beside `config.load` CPU-bound threads), the two side by side, and one more
/// parseable line per size for the loaded time (`load=N` at its end).
pub(crate) fn print_rows(config: &BenchConfig, rows: &[BenchRow], loaded: Option<&[BenchRow]>) {
    println!(
        "# cohort allreduce: ranks={} hosts={} dtype={} op={} algo={} transport={} iters={} warmup={} busy_poll={:?} bind={} load={}",
        config.ranks,
        config.hosts,
        config.dtype,
        config.op,
        algo_name(config.algo),
        config.transport.name(),
        config.iters,
        config.warmup,
        config.busy_poll,
        if config.bind { "core" } else { "none" },
        config.load
    );
    println!("# memcpy_GBps={:.2} (one thread, 64 MiB, best of 5)", memcpy_bandwidth());
    match loaded {
        None => {
            println!("#{:>14} {:>12} {:>12} {:>12}", "size(B)", "time(us)", "algbw(GB/s)", "busbw(GB/s)");
            for r in rows {
                println!("{:>15} {:>12.1} {:>12.3} {:>12.3}", r.bytes, r.median_us, r.algbw(), r.busbw(config.ranks));
            }
        }
        Some(loaded) => {
            let load = format!("load={}(us)", config.load);
            println!(
                "#{:>14} {:>12} {:>14} {:>12} {:>14}",
                "size(B)", "quiet(us)", load, "loaded/quiet", "loaded busbw"
            );
            for (q, l) in rows.iter().zip(loaded) {
                let ratio = if q.median_us > 0.0 { l.median_us / q.median_us } else { 0.0 };
                println!(
                    "{:>15} {:>12.1} {:>14.1} {:>12.2} {:>14.3}",
                    q.bytes,
                    q.median_us,
                    l.median_us,
                    ratio,
                    l.busbw(config.ranks)
                );
            }
        }
    }
    // Two decimals, as the ranks report them: at 8 B the time is under 1 us.
    for r in rows {
        println!(
            "peer=cohort ranks={} bytes={} median_us={:.2} algbw_GBps={:.3} busbw_GBps={:.3}",
            config.ranks,
            r.bytes,
            r.median_us,
            r.algbw(),
            r.busbw(config.ranks)
        );
    }
    for r in loaded.unwrap_or_default() {
        println!(
            "peer=cohort ranks={} bytes={} median_us={:.1} algbw_GBps={:.3} busbw_GBps={:.3} load={}",
            config.ranks,
            r.bytes,
            r.median_us,
            r.algbw(),
            r.busbw(config.ranks),
            config.load
        );
    }
}

/// One rank of the benchmark (the `bench-rank` subcommand). Talks to the parent over
/// stdin/stdout as described in the module docs.
pub(crate) async fn run_rank(rank: u32, config: BenchConfig) -> Result<(), String> {
    if config.bind {
        bind_to_cpu(rank as usize)?;
    }
    match config.dtype.as_str() {
        "f32" => rank_typed::<f32>(rank, config).await,
        "f64" => rank_typed::<f64>(rank, config).await,
        "f16" => rank_typed::<half::f16>(rank, config).await,
        "bf16" => rank_typed::<half::bf16>(rank, config).await,
        "i32" => rank_typed::<i32>(rank, config).await,
        "i64" => rank_typed::<i64>(rank, config).await,
        "u8" => rank_typed::<u8>(rank, config).await,
        other => Err(format!("unknown dtype {other:?} (f32, f64, f16, bf16, i32, i64, u8)")),
    }
}

/// Reads the parent's comma-separated address list from stdin.
fn read_peer_list() -> Result<Vec<String>, String> {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).map_err(|e| format!("reading addresses: {e}"))?;
    Ok(line.trim().split(',').map(str::to_string).collect())
}

fn bench_token() -> Vec<u8> {
    std::env::var("COHORT_BENCH_TOKEN").unwrap_or_default().into_bytes()
}

const BENCH_DEADLINES: Deadlines =
    Deadlines { no_progress: Duration::from_secs(30), connect: Duration::from_secs(30), learning: None };

async fn rank_typed<E: ExactElement>(rank: u32, config: BenchConfig) -> Result<(), String> {
    OpPattern::new(config.op, 0, config.ranks).check_exact::<E>()?;
    let comm_config = CommConfig { algorithm: config.algo, ..CommConfig::default() };
    let layout = HostLayout::blocks(config.ranks, config.hosts);
    if config.hosts > 1 && matches!(config.transport, TransportChoice::Shm | TransportChoice::Rdma) {
        return Err(format!("--hosts {} needs --transport auto or tcp", config.hosts));
    }
    match config.transport {
        TransportChoice::Shm => {
            let endpoint = ShmEndpoint::new(shm_options(&config)).map_err(|e| e.to_string())?;
            println!("addr={}", endpoint.address().encode());
            let peers = read_peer_list()?
                .iter()
                .map(|a| ShmAddress::decode(a).map(Some).map_err(|e| format!("bad shm address {a:?}: {e}")))
                .collect::<Result<Vec<_>, _>>()?;
            let spec = ShmMeshSpec {
                job: "bench".into(),
                generation: 1,
                rank,
                peers,
                token: bench_token(),
                deadlines: BENCH_DEADLINES,
            };
            let transport = endpoint.connect_mesh(spec).await.map_err(|e| e.to_string())?;
            measure::<E, _>(rank, &config, communicator(transport, &comm_config, &layout)?).await
        }
        TransportChoice::Auto => {
            let transport = connect_auto(rank, &config, &layout).await?;
            measure::<E, _>(rank, &config, communicator(transport, &comm_config, &layout)?).await
        }
        TransportChoice::Tcp => {
            let options = TcpOptions { busy_poll: config.busy_poll, ..TcpOptions::default() };
            let endpoint =
                TcpEndpoint::bind(SocketAddr::from(([127, 0, 0, 1], 0)), options).await.map_err(|e| e.to_string())?;
            println!("addr={}", endpoint.local_addr());
            let peers = read_peer_list()?
                .iter()
                .map(|a| a.parse::<SocketAddr>().map_err(|e| format!("bad address {a:?}: {e}")))
                .collect::<Result<Vec<_>, _>>()?;
            let spec = MeshSpec {
                job: "bench".into(),
                generation: 1,
                rank,
                peers,
                token: bench_token(),
                deadlines: BENCH_DEADLINES,
                upfront: Upfront::Every,
                carry_links: false,
                resolver: None,
            };
            let transport = endpoint.connect_mesh(spec).await.map_err(|e| e.to_string())?;
            measure::<E, _>(rank, &config, communicator(transport, &comm_config, &layout)?).await
        }
        #[cfg(feature = "rdma")]
        TransportChoice::Rdma => {
            use cohort_transports::rdma::{DeviceConfig, EndpointAddress, RdmaEndpoint, RdmaMeshSpec, RdmaOptions};
            let device = DeviceConfig {
                name: std::env::var("COHORT_RDMA_DEVICE").ok().filter(|d| !d.is_empty()),
                ..DeviceConfig::default()
            };
            let options = RdmaOptions { device, busy_poll: !config.busy_poll.is_zero(), ..RdmaOptions::default() };
            let endpoint = RdmaEndpoint::open(options).await.map_err(|e| e.to_string())?;
            println!("addr={}", endpoint.address().encode());
            let peers = read_peer_list()?
                .iter()
                .map(|a| EndpointAddress::decode(a).map_err(|e| format!("bad rdma address {a:?}: {e}")))
                .collect::<Result<Vec<_>, _>>()?;
            let spec = RdmaMeshSpec {
                job: "bench".into(),
                generation: 1,
                rank,
                peers,
                token: bench_token(),
                deadlines: BENCH_DEADLINES,
            };
            let transport = endpoint.connect_mesh(spec).await.map_err(|e| e.to_string())?;
            measure::<E, _>(rank, &config, communicator(transport, &comm_config, &layout)?).await
        }
        #[cfg(not(feature = "rdma"))]
        TransportChoice::Rdma => Err("this cohort-worker was built without the `rdma` feature".into()),
    }
}

/// A communicator over `transport` that knows the (emulated) host layout.
fn communicator<T: Transport>(
    transport: T,
    config: &CommConfig,
    layout: &HostLayout,
) -> Result<Communicator<T>, String> {
    let mut comm = Communicator::new(Arc::new(transport), config.clone());
    comm.set_layout(layout.clone()).map_err(|e| e.to_string())?;
    Ok(comm)
}

fn shm_options(config: &BenchConfig) -> ShmOptions {
    ShmOptions { busy_poll: config.busy_poll, ..ShmOptions::default() }
}

/// `--transport auto`: each rank publishes `TCP|SHM` addresses and connects what the elastic
/// runtime would plan from them (shared memory between the ranks of one host). With
/// emulated hosts, a rank drops the shared-memory addresses of the ranks on other hosts of
/// `layout`, so it reaches them over TCP.
async fn connect_auto(rank: u32, config: &BenchConfig, layout: &HostLayout) -> Result<MeshTransport, String> {
    let options = TcpOptions { busy_poll: config.busy_poll, ..TcpOptions::default() };
    let tcp = TcpEndpoint::bind(SocketAddr::from(([127, 0, 0, 1], 0)), options).await.map_err(|e| e.to_string())?;
    let shm = ShmEndpoint::new(shm_options(config)).map_err(|e| e.to_string())?;
    println!("addr={}|{}", tcp.local_addr(), shm.address().encode());
    let mut members = Vec::new();
    for (i, entry) in read_peer_list()?.iter().enumerate() {
        let (t, s) = entry.split_once('|').ok_or_else(|| format!("bad auto address {entry:?} (TCP|SHM)"))?;
        members.push(MemberInfo {
            rank: i as u32,
            worker_id: format!("bench-{i}"),
            host: String::new(),
            tcp: t.parse().map_err(|e| format!("bad address {t:?}: {e}"))?,
            rdma: None,
            shm: Some(ShmAddress::decode(s).map_err(|e| format!("bad shm address {s:?}: {e}"))?)
                .filter(|_| layout.host_of(i) == layout.host_of(rank as usize)),
        });
    }
    let job = JobId::new("bench").map_err(|e| e.to_string())?;
    let scope = MeshScope { job, generation: 1, token: bench_token(), deadlines: BENCH_DEADLINES };
    let local = LocalEndpoints::new(&tcp).with_shm(Some(&shm));
    connect_members(&scope, &members, rank, local).await.map_err(|e| e.to_string())
}

/// Warm-up and timed iterations of every size, each result verified; prints the medians.
async fn measure<E: ExactElement, T: Transport>(
    rank: u32,
    config: &BenchConfig,
    mut comm: Communicator<T>,
) -> Result<(), String> {
    let world = comm.size();
    for &bytes in &config.sizes {
        let count = bytes / std::mem::size_of::<E>();
        let mut buf = vec![E::from_small(0); count];
        let mut times = Vec::with_capacity(config.iters as usize);
        for iter in 0..(config.warmup + config.iters) {
            let pattern = OpPattern::new(config.op, iter as u64, world);
            pattern.fill(rank, &mut buf);
            // Line the ranks up so each timed iteration measures the collective alone.
            comm.barrier().await.map_err(|e| e.to_string())?;
            let started = Instant::now();
            comm.allreduce(&mut buf, config.op).await.map_err(|e| e.to_string())?;
            let took = started.elapsed();
            // And again before checking: a rank that finished first must not verify (a pass
            // over the whole buffer) while a rank that shares its CPU is still inside its timed
            // collective. With more ranks than CPUs that overlap took most of the CPU and
            // inflated the slowest rank's time (docs/benchmarks-journal.md); Open MPI's and Gloo's
            // scripts time the collective alone, and so does this loop.
            comm.barrier().await.map_err(|e| e.to_string())?;
            if let Some(j) = pattern.first_mismatch(&buf) {
                let msg = format!("WRONG RESULT of {} at {bytes} bytes, iteration {iter}, element {j}", config.op);
                println!("error {msg}");
                return Err(msg);
            }
            if iter >= config.warmup {
                times.push(took.as_secs_f64() * 1e6);
            }
        }
        times.sort_by(|a, b| a.total_cmp(b));
        let median = if times.is_empty() { 0.0 } else { times[times.len() / 2] };
        println!("result bytes={bytes} median_us={median:.2}");
    }
    println!("done");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_sizes("4K,64K,1M,16M,64M").unwrap(), vec![4096, 65536, 1 << 20, 16 << 20, 64 << 20]);
        assert_eq!(parse_sizes("4096,1").unwrap(), vec![4096, 1]);
        assert!(parse_sizes("4X").is_err());
    }

    #[test]
    fn the_load_threads_spin_until_dropped() {
        let load = CpuLoad::start(2).unwrap();
        assert_eq!(load.threads.len(), 2);
        assert!(load.threads.iter().all(|t| !t.is_finished()));
        drop(load); // joins: a thread that ignored the stop flag would hang the test here
    }

    #[test]
    fn busbw_follows_nccl_tests() {
        let row = BenchRow { bytes: 1_000_000, median_us: 1000.0 };
        assert!((row.algbw() - 1.0).abs() < 1e-9);
        assert!((row.busbw(4) - 1.5).abs() < 1e-9);
    }
}
