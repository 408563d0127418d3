//! `cohort-worker`: the elastic training worker (`train`) and the allreduce benchmark
//! (`bench`, which spawns one `bench-rank` process per rank).

mod bench;
mod train;

use bench::BenchConfig;
use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::{Args, Parser, Subcommand, ValueEnum};
use cohort::control::ControlConfig;
use cohort::elastic::{ElasticConfig, JobId, TransportChoice, WorkerId};
use cohort::Algorithm;
use cohort_harness::events;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use train::{TrainConfig, TrainError, TrainSummary};

#[derive(Parser)]
#[command(name = "cohort-worker", version, about = "cohort worker: elastic training loop and allreduce benchmark")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a synthetic data-parallel training loop on the elastic runtime: every step's
    /// allreduce is verified; survives failures and joins by re-forming.
    Train(Box<TrainArgs>),
    /// Benchmark allreduce across N local rank processes (every result verified).
    Bench(BenchArgs),
    /// One rank of `bench` (spawned by it; talks to the parent over stdin/stdout).
    #[command(hide = true)]
    BenchRank(BenchRankArgs),
}

/// `--transport`: the names of the library's [`TransportChoice`], each listed in `--help`
/// with what it does.
fn transport() -> impl TypedValueParser<Value = TransportChoice> {
    let values = TransportChoice::ALL.map(|choice| {
        PossibleValue::new(choice.name()).help(match choice {
            TransportChoice::Auto => {
                "Shared memory between workers on one host (same boot id and namespaces), TCP between hosts \
                 (RDMA when every member published an RDMA address, which only `rdma` does)"
            }
            TransportChoice::Tcp => "TCP (tokio + socket2) only",
            TransportChoice::Shm => "Shared memory only: a generation with a member on another host is refused",
            TransportChoice::Rdma => "RDMA over libibverbs (cargo feature `rdma`)",
        })
    });
    PossibleValuesParser::new(values).try_map(|name| name.parse::<TransportChoice>())
}

/// Element type of the gradient / benchmark buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DTypeArg {
    F32,
    F64,
    F16,
    Bf16,
    I32,
    I64,
    U8,
}

impl DTypeArg {
    fn name(self) -> &'static str {
        match self {
            DTypeArg::F32 => "f32",
            DTypeArg::F64 => "f64",
            DTypeArg::F16 => "f16",
            DTypeArg::Bf16 => "bf16",
            DTypeArg::I32 => "i32",
            DTypeArg::I64 => "i64",
            DTypeArg::U8 => "u8",
        }
    }
}

fn duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let n: u64 = number.parse().map_err(|_| format!("{text:?} is not a duration (like 500ms, 2s, 1m)"))?;
    match unit {
        "us" => Ok(Duration::from_micros(n)),
        "" | "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        "m" | "min" => Ok(Duration::from_secs(n.saturating_mul(60))),
        "h" => Ok(Duration::from_secs(n.saturating_mul(3600))),
        _ => Err(format!("{text:?}: unknown unit {unit:?} (use us, ms, s, m or h)")),
    }
}

fn byte_size(text: &str) -> Result<usize, String> {
    match bench::parse_sizes(text)?.as_slice() {
        [one] => Ok(*one),
        _ => Err(format!("{text:?} is not one size (like 4096, 64K, 16M)")),
    }
}

fn on_off(text: &str) -> Result<bool, String> {
    match text {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{text:?}: on or off")),
    }
}

fn algorithm(text: &str) -> Result<Algorithm, String> {
    text.parse::<Algorithm>().map_err(|e| e.to_string())
}

#[derive(Args)]
struct TrainArgs {
    /// Coordinator endpoints, comma separated (any replica serves).
    #[arg(long, value_delimiter = ',', required = true)]
    coordinator: Vec<String>,
    /// Job id.
    #[arg(long)]
    job: String,
    /// Total steps of the job.
    #[arg(long)]
    steps: u64,
    /// Gradient size per step in bytes (K, M, G suffixes).
    #[arg(long, value_parser = byte_size)]
    size: usize,
    /// Element type of the gradient.
    #[arg(long, value_enum, default_value = "f32")]
    dtype: DTypeArg,
    /// Data-plane transport. auto: shared memory to workers on this host, TCP to the others.
    /// rdma: also open an RDMA endpoint (COHORT_RDMA_DEVICE, else the first active port) and
    /// publish it; a generation runs over RDMA when every member published one, over TCP
    /// otherwise.
    #[arg(long, value_parser = transport(), default_value = "auto")]
    transport: TransportChoice,
    /// This worker's stable id (default: HOSTNAME-PID).
    #[arg(long)]
    worker_id: Option<String>,
    /// Failure domain: what fails together with this worker, e.g. the node name (on
    /// Kubernetes, spec.nodeName through the downward API; also accepted: env COHORT_DOMAIN).
    /// Default: the host name.
    #[arg(long, default_value = "")]
    domain: String,
    /// Data-plane listen address (port 0: any free port).
    #[arg(long, default_value = "0.0.0.0:0")]
    listen: SocketAddr,
    /// Host or IP that peers use to reach this worker (the bound port is added).
    #[arg(long, default_value = "127.0.0.1")]
    advertise: String,
    /// File holding the job token (also accepted: env COHORT_TOKEN).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// PEM of the CA that signed the coordinators' certificates (for https:// endpoints).
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    /// How long to retry while every coordinator endpoint fails the first contact as a wrong
    /// address does (connection refused, a host name that does not resolve, a connect not
    /// answered). Raise it when the coordinators may start after the workers; once a
    /// coordinator has answered, outages are retried for 30 s.
    #[arg(long, value_parser = duration, default_value = "3s")]
    coordinator_wait: Duration,
    /// No-progress deadline per data-plane link (e.g. 5s): the ceiling of the learned
    /// deadlines, or the deadline itself with --fixed-deadlines.
    #[arg(long, value_parser = duration, default_value = "10s")]
    no_progress_timeout: Duration,
    /// Turn deadline learning off: every link waits the full --no-progress-timeout before it
    /// fails, whatever the peer's process does.
    #[arg(long)]
    fixed_deadlines: bool,
    /// Floor of the learned no-progress deadlines (a link is never suspected sooner).
    #[arg(long, value_parser = duration, default_value = "250ms")]
    no_progress_floor: Duration,
    /// How long a link waits on a peer whose process runs but is late to the collective
    /// (it computes its step, writes a checkpoint, or waits behind such a rank). The
    /// no-progress ceiling does not cut such a peer; this bound catches one that never comes
    /// (an endless loop or a deadlock in user code). Not used with --fixed-deadlines.
    #[arg(long, value_parser = duration, default_value = "30m")]
    late_rank_timeout: Duration,
    /// Bound on connecting one generation's mesh.
    #[arg(long, value_parser = duration, default_value = "30s")]
    connect_timeout: Duration,
    /// Longest this worker waits out an exclusion (its failures repeated) before it gives up
    /// (0 = at once).
    #[arg(long, value_parser = duration, default_value = "1h")]
    exclusion_wait: Duration,
    /// Heartbeats and events through the host's relays (`on`: two coordinator calls per host
    /// and interval, and one watch stream per host, the first worker of the job on the host
    /// serving each) or each worker's own (`off`). Default: on, unless COHORT_HEARTBEAT_RELAY
    /// is 0 or off.
    #[arg(long, value_parser = on_off)]
    heartbeat_relay: Option<bool>,
    /// A node-local directory (absolute) for the host relays' sockets, shared by the node's
    /// processes whatever their network namespace: on Kubernetes a hostPath mounted into every
    /// worker pod, so that pods of one rank each share their node's relays (their failure
    /// domain, --domain, names the node). Default: env COHORT_RELAY_DIR, else abstract Unix
    /// sockets, shared within one network namespace (one pod).
    #[arg(long)]
    relay_dir: Option<PathBuf>,
    /// Allreduce algorithm.
    #[arg(long, value_parser = algorithm, default_value = "auto")]
    algo: Algorithm,
    /// Pause between steps (0 = none).
    #[arg(long, value_parser = duration, default_value = "0ms")]
    step_interval: Duration,
    /// CPU time each step burns before its allreduce (the model's compute; 0 = none).
    #[arg(long, value_parser = duration, default_value = "0ms")]
    compute: Duration,
    /// Every this many steps, also an alltoall (2 elements a pair, every block checked)
    /// after the step's allreduce: it links every pair of ranks (0 = never).
    #[arg(long, default_value_t = 0)]
    alltoall_every: u64,
    /// Serve Prometheus metrics on this address (`GET /metrics`).
    #[arg(long)]
    metrics: Option<SocketAddr>,
    /// Receive busy-poll window: spin this long for the next frame before parking (0 = off).
    #[arg(long, value_parser = duration, default_value = "50us")]
    busy_poll: Duration,
}

#[derive(Args)]
struct BenchArgs {
    /// Number of rank processes.
    #[arg(long, default_value_t = 2)]
    ranks: u32,
    /// Message sizes (K, M, G suffixes), comma separated.
    #[arg(long, default_value = "4K,64K,1M,16M,64M")]
    sizes: String,
    /// Timed iterations per size.
    #[arg(long, default_value_t = 20)]
    iters: u32,
    /// Untimed warm-up iterations per size.
    #[arg(long, default_value_t = 3)]
    warmup: u32,
    /// Allreduce algorithm.
    #[arg(long, value_parser = algorithm, default_value = "auto")]
    algo: Algorithm,
    /// Element type.
    #[arg(long, value_enum, default_value = "f32")]
    dtype: DTypeArg,
    /// Reduction operator: sum, prod, min, max or avg (every result verified).
    #[arg(long, default_value = "sum")]
    op: cohort::ReduceOp,
    /// Data-plane transport (auto: shared memory, as every rank runs on this host).
    #[arg(long, value_parser = transport(), default_value = "auto")]
    transport: TransportChoice,
    /// Bind rank r to the r-th allowed CPU: auto does when the ranks do not outnumber the
    /// CPUs (as Open MPI binds to cores by default), core always, none never.
    #[arg(long, value_enum, default_value = "auto")]
    bind: BindArg,
    /// Receive busy-poll window: spin this long for the next frame before parking (0 = off).
    #[arg(long, value_parser = duration, default_value = "50us")]
    busy_poll: Duration,
    /// Emulate this many hosts: the ranks in contiguous groups, shared memory within a group
    /// and loopback TCP between groups, and the layout given to the hierarchical allreduce.
    #[arg(long, default_value_t = 1)]
    hosts: u32,
    /// Time every size twice, quiet and then beside N CPU-bound threads (as DataLoader
    /// workers or intra-op threads would run), and print the two side by side (0 = quiet only).
    #[arg(long, default_value_t = 0)]
    load: u32,
}

#[derive(Args)]
struct BenchRankArgs {
    #[arg(long)]
    rank: u32,
    #[arg(long)]
    ranks: u32,
    #[arg(long)]
    sizes: String,
    #[arg(long)]
    iters: u32,
    #[arg(long)]
    warmup: u32,
    #[arg(long, value_parser = algorithm)]
    algo: Algorithm,
    #[arg(long)]
    dtype: String,
    #[arg(long, default_value = "sum")]
    op: cohort::ReduceOp,
    #[arg(long, value_parser = duration)]
    busy_poll: Duration,
    #[arg(long, value_parser = transport(), default_value = "tcp")]
    transport: TransportChoice,
    #[arg(long, value_enum, default_value = "none")]
    bind: BindArg,
    #[arg(long, default_value_t = 1)]
    hosts: u32,
}

/// CPU binding of the benchmark's rank processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum BindArg {
    /// Bind when the ranks do not outnumber the CPUs.
    Auto,
    /// Bind rank r to the r-th allowed CPU.
    Core,
    /// Leave placement to the scheduler.
    None,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    match cli.command {
        Command::Train(args) => run_train(*args),
        Command::Bench(args) => run_bench(args),
        Command::BenchRank(args) => run_bench_rank(args),
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Logs go to stderr: stdout carries the event lines and the bench protocol.
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(false).try_init();
}

/// One rank per process, one thread per rank: a current-thread runtime. Measured on 2 cores
/// with 2 ranks (docs/benchmarks-journal.md), it cuts 4 KiB allreduce latency from ~55 us to ~23 us
/// against a 2-worker multi-thread runtime, because every message wake-up stays on the thread
/// that polls the socket instead of hopping between workers. Heartbeats, the watch stream
/// and revocation run as tasks on the same thread and make progress whenever a collective
/// awaits its sockets; nothing long may run on it (`train --compute` burns its CPU on a
/// blocking-pool thread). `COHORT_RUNTIME=multi` selects a 2-worker multi-thread runtime.
fn runtime() -> Result<tokio::runtime::Runtime, String> {
    let mut builder = if std::env::var("COHORT_RUNTIME").as_deref() == Ok("multi") {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(2);
        b
    } else {
        tokio::runtime::Builder::new_current_thread()
    };
    builder.enable_all().build().map_err(|e| format!("starting the runtime: {e}"))
}

/// Fails at once, with a clear message, when the chosen transport cannot be used here (no
/// host identity for `shm`; for `rdma` the feature missing or no device present), `train`
/// and `bench` alike.
fn check_transport(choice: TransportChoice) -> Result<(), String> {
    choice.check().map_err(|e| format!("--{e}"))
}

fn read_token(file: Option<&PathBuf>) -> Result<Option<String>, String> {
    let text = match file {
        Some(path) => {
            std::fs::read_to_string(path).map_err(|e| format!("reading the token file {}: {e}", path.display()))?
        }
        None => std::env::var("COHORT_TOKEN").unwrap_or_default(),
    };
    Ok(Some(text.trim().to_string()).filter(|t| !t.is_empty()))
}

fn run_train(args: TrainArgs) -> ExitCode {
    match train_main(args) {
        Ok(summary) => {
            let lost: Vec<String> = summary.failures.iter().map(|d| d.as_millis().to_string()).collect();
            events::Summary {
                verified_steps: summary.verified_steps,
                final_step: summary.final_step,
                failures: summary.failures.len() as u64,
                lost_ms: if lost.is_empty() { "-".into() } else { lost.join(",") },
                cooperative_reforms: summary.cooperative_reforms,
                left: summary.left,
                alltoalls: Some(summary.verified_alltoalls).filter(|&n| n > 0),
                params_digest: summary.params_digest.unwrap_or_else(|| "-".into()),
                expected_digest: summary.expected_digest.unwrap_or_else(|| "-".into()),
                t_ms: train::now_ms(),
            }
            .print();
            ExitCode::SUCCESS
        }
        Err(e) => {
            events::Fatal { error: e.as_str().into(), t_ms: train::now_ms() }.print();
            eprintln!("cohort-worker train: {e}");
            ExitCode::FAILURE
        }
    }
}

fn train_main(args: TrainArgs) -> Result<TrainSummary, String> {
    check_transport(args.transport)?;
    let token = read_token(args.token_file.as_ref())?;
    let mut control = ControlConfig::new(args.coordinator.clone());
    control.token = token.clone();
    control.tls_ca = args.tls_ca.clone();
    control.first_contact_wait = args.coordinator_wait;
    let worker_id = args
        .worker_id
        .clone()
        .unwrap_or_else(|| format!("{}-{}", cohort::elastic::local_hostname(), std::process::id()));
    let job = JobId::new(args.job.clone()).map_err(|e| e.to_string())?;
    let worker_id = WorkerId::new(worker_id).map_err(|e| e.to_string())?;
    let mut config = ElasticConfig::new(job, worker_id, control);
    config.token = token.unwrap_or_default().into_bytes();
    if !args.domain.is_empty() {
        config.domain = args.domain.clone();
    }
    config.listen = args.listen;
    config.advertise = args.advertise.clone();
    config.deadlines.no_progress = args.no_progress_timeout;
    config.deadlines.learning = (!args.fixed_deadlines)
        .then_some(cohort_transports::Learning { floor: args.no_progress_floor, late_rank: args.late_rank_timeout });
    config.deadlines.connect = args.connect_timeout;
    config.exclusion_wait = args.exclusion_wait;
    if let Some(relay) = args.heartbeat_relay {
        config.heartbeat_relay = relay;
    }
    if let Some(dir) = &args.relay_dir {
        config.relay_dir = Some(dir.clone());
    }
    config.comm.algorithm = args.algo;
    config.tcp.busy_poll = args.busy_poll;
    config.transport = args.transport;
    config.shm.busy_poll = args.busy_poll;
    // With rdma, the worker publishes an RDMA endpoint beside its TCP address; a generation
    // uses RDMA when every member did (docs/rdma.md). ElasticConfig's defaults are train's:
    // the device from COHORT_RDMA_DEVICE, the bootstrap listener on the --listen IP, any port,
    // and a progress task that sleeps on the completion channel (a training process computes
    // between collectives, and a CQ polled forever would spin a core it needs; bench polls,
    // for latency).
    let train_config = TrainConfig {
        steps: args.steps,
        size_bytes: args.size,
        step_interval: args.step_interval,
        compute: args.compute,
        alltoall_every: args.alltoall_every,
    };

    let rt = runtime()?;
    rt.block_on(async move {
        if let Some(addr) = args.metrics {
            let bound = cohort::metrics::serve(addr).await.map_err(|e| format!("metrics endpoint {addr}: {e}"))?;
            tracing::info!(%bound, "serving metrics");
            events::Metrics { address: bound, t_ms: train::now_ms() }.print();
        }
        // SIGTERM: finish the current step, leave gracefully, let the others re-form (or, not
        // yet a member, stop joining).
        let (sigterm, leaving) = tokio::sync::watch::channel(false);
        {
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .map_err(|e| format!("installing the SIGTERM handler: {e}"))?;
            tokio::spawn(async move {
                if term.recv().await.is_some() {
                    events::Sigterm { t_ms: train::now_ms() }.print();
                    let _ = sigterm.send(true);
                }
            });
        }
        let result = match args.dtype {
            DTypeArg::F32 => train::run::<f32>(config, train_config, leaving.clone()).await,
            DTypeArg::F64 => train::run::<f64>(config, train_config, leaving.clone()).await,
            DTypeArg::F16 => train::run::<half::f16>(config, train_config, leaving.clone()).await,
            DTypeArg::Bf16 => train::run::<half::bf16>(config, train_config, leaving.clone()).await,
            DTypeArg::I32 => train::run::<i32>(config, train_config, leaving.clone()).await,
            DTypeArg::I64 => train::run::<i64>(config, train_config, leaving.clone()).await,
            DTypeArg::U8 => train::run::<u8>(config, train_config, leaving.clone()).await,
        };
        result.map_err(|e: TrainError| e.to_string())
    })
}

fn run_bench(args: BenchArgs) -> ExitCode {
    let result = (|| {
        check_transport(args.transport)?;
        if args.ranks == 0 {
            return Err("--ranks must be at least 1".to_string());
        }
        let config = BenchConfig {
            ranks: args.ranks,
            sizes: bench::parse_sizes(&args.sizes)?,
            iters: args.iters.max(1),
            warmup: args.warmup,
            algo: args.algo,
            dtype: args.dtype.name().to_string(),
            op: args.op,
            busy_poll: args.busy_poll,
            transport: args.transport,
            bind: match args.bind {
                BindArg::Auto => bench::bind_by_default(args.ranks),
                BindArg::Core => true,
                BindArg::None => false,
            },
            hosts: args.hosts.max(1),
            load: args.load,
        };
        let rows = bench::run_parent(&config)?;
        let loaded = if config.load > 0 {
            let _load = bench::CpuLoad::start(config.load)?;
            Some(bench::run_parent(&config)?)
        } else {
            None
        };
        bench::print_rows(&config, &rows, loaded.as_deref());
        Ok(())
    })();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cohort-worker bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run_bench_rank(args: BenchRankArgs) -> ExitCode {
    let result = (|| {
        let config = BenchConfig {
            ranks: args.ranks,
            sizes: bench::parse_sizes(&args.sizes)?,
            iters: args.iters,
            warmup: args.warmup,
            algo: args.algo,
            dtype: args.dtype.clone(),
            op: args.op,
            busy_poll: args.busy_poll,
            transport: args.transport,
            bind: args.bind == BindArg::Core,
            hosts: args.hosts.max(1),
            load: 0,
        };
        runtime()?.block_on(bench::run_rank(args.rank, config))
    })();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            println!("error {e}");
            eprintln!("cohort-worker bench-rank {}: {e}", args.rank);
            ExitCode::FAILURE
        }
    }
}
