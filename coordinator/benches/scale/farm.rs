//! A farm: one process holding a range of the members (whole hosts), each the shipped worker's
//! `ElasticGroup`, driven by the conductor's commands ([`crate::wire`]). The members are
//! spread over farms because each holds descriptors here: its coordinator connection and, with
//! relays, both ends of its two relay connections (five at 8 ranks a host), and a process of
//! this machine may hold 20,000. A host's members share one farm, as they share one node.
//!
//! Commands, each answered with one line: `form` (`formed`), `watch` (`watched`), `drop`
//! (`dropped`), `arm` (`armed`, and `reformed` when its members have re-formed), `report`
//! (`reported`), `steady` (`steadying`), `calm` (`calm`), `finish` (`finished`), and `status`,
//! `beats` and `stats`, which the stdin reader answers at once from the [`Book`], whatever the
//! farm is doing. A farm says `straggler` on its own when its members first hear one named,
//! `error` when a command fails (then it ends), and ends when its stdin closes.

use crate::plan::Plan;
use crate::wire::{mono_ns, say, summarize, Fields};
use cohort::control::{ControlClient, ControlConfig};
use cohort::elastic::{
    Connected, DataPlane, ElasticConfig, ElasticError, ElasticGroup, FailureReporter, Formed, Generation, JobId,
    MeshKind, Observed, WorkerId, World,
};
use cohort::CommError;
use cohort_proto::v1 as pb;
use pb::job_event::Event;
use std::collections::HashMap;
use std::io::BufRead;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, PoisonError};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// The job.
pub(crate) const JOB: &str = "scale";

/// Which members a farm holds, and where the coordinators are: its command line, `--farm
/// FIRST,COUNT,FARMS --endpoints URL,URL`, after the conductor's own arguments.
pub(crate) struct FarmSpec {
    pub(crate) first: usize,
    pub(crate) count: usize,
    /// Farms in all (they share the joins in flight).
    pub(crate) farms: usize,
    pub(crate) endpoints: Vec<String>,
}

impl FarmSpec {
    /// The farm's spec from the command line, if it is a farm's.
    pub(crate) fn from_args() -> Result<Option<Self>, String> {
        let args: Vec<String> = std::env::args().collect();
        let after = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1));
        let Some(farm) = after("--farm") else { return Ok(None) };
        let numbers: Vec<usize> =
            farm.split(',').map(str::parse).collect::<Result<_, _>>().map_err(|e| format!("--farm: {e}"))?;
        let [first, count, farms] = numbers[..] else { return Err("--farm FIRST,COUNT,FARMS".into()) };
        let endpoints: Vec<String> =
            after("--endpoints").ok_or("--farm needs --endpoints")?.split(',').map(str::to_string).collect();
        Ok(Some(Self { first, count, farms, endpoints }))
    }

    /// The arguments that make a farm of this spec (after the conductor's own).
    pub(crate) fn args(&self) -> Vec<String> {
        vec![
            "--farm".into(),
            format!("{},{},{}", self.first, self.count, self.farms),
            "--endpoints".into(),
            self.endpoints.join(","),
        ]
    }
}

/// What the farm hears from its members' shells (through [`Seen`]), by local index (member
/// index minus the farm's first).
pub(crate) struct Book {
    first: usize,
    /// Whether member `i` has heard generation 1 formed on its events.
    heard_formed: Vec<AtomicBool>,
    /// Members that have.
    heard_formed_count: AtomicUsize,
    /// When member `i` heard generation 1 revoked (from its events), [`mono_ns`].
    revoked_at: Vec<OnceLock<u64>>,
    /// Whether a straggler has been named (the farm says so once).
    straggler: OnceLock<()>,
    beats_answered: AtomicU64,
    beats_failed: AtomicU64,
    /// Coordinator calls that outlasted every bound of their client.
    overran: AtomicU64,
    /// Members whose revoked generation's wait (`FailureReporter::revoked`) ended, and
    /// members that hold generation 2.
    woke: AtomicUsize,
    reformed: AtomicUsize,
    /// Whether member `i` holds generation 2 (or died meanwhile, or was the failed one).
    done: Vec<AtomicBool>,
    /// Calls that failed (and that the shell does not act on), by call and error.
    failures: std::sync::Mutex<HashMap<String, usize>>,
    /// Woken on every change the farm waits for.
    changed: Notify,
}

impl Book {
    fn new(first: usize, n: usize) -> Self {
        Self {
            first,
            heard_formed: (0..n).map(|_| AtomicBool::new(false)).collect(),
            heard_formed_count: AtomicUsize::new(0),
            revoked_at: (0..n).map(|_| OnceLock::new()).collect(),
            straggler: OnceLock::new(),
            beats_answered: AtomicU64::new(0),
            beats_failed: AtomicU64::new(0),
            overran: AtomicU64::new(0),
            woke: AtomicUsize::new(0),
            reformed: AtomicUsize::new(0),
            done: (0..n).map(|_| AtomicBool::new(false)).collect(),
            failures: std::sync::Mutex::new(HashMap::new()),
            changed: Notify::new(),
        }
    }

    /// Counts a failed call by call and error (its first 60 characters).
    fn failed(&self, rpc: &str, error: &(dyn std::error::Error + Send + Sync)) {
        // The start of the text: what went wrong, without the member it went wrong for.
        let text: String = error.to_string().chars().take(60).collect();
        let key = format!("{rpc}:_{text}").replace([' ', '"', '\n', ',', '=', '@'], "_");
        *self.failures.lock().unwrap_or_else(PoisonError::into_inner).entry(key).or_default() += 1;
    }

    /// Waits until `done` holds (checked at every change).
    async fn until(&self, done: impl Fn(&Self) -> bool) {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if done(self) {
                return;
            }
            notified.await;
        }
    }

    /// The answer to `status`: where the farm's members are (for the conductor's errors).
    fn status(&self) -> String {
        let heard = self.revoked_at.iter().filter(|t| t.get().is_some()).count();
        let not: Vec<String> = (0..self.done.len())
            .filter(|&i| !self.done[i].load(Ordering::Relaxed))
            .take(8)
            .map(|i| format!("m{:05}", self.first + i))
            .collect();
        format!(
            "status heard_formed={} beats={} heard_revoked={heard} woke={} reformed={} not_done={}",
            self.heard_formed_count.load(Ordering::Relaxed),
            self.beats_answered.load(Ordering::Relaxed),
            self.woke.load(Ordering::Relaxed),
            self.reformed.load(Ordering::Relaxed),
            not.join(",")
        )
    }

    /// The answer to `stats`: beats failed, calls overrun, and the calls that failed
    /// (`COUNT@CALL:_ERROR,...`).
    fn stats(&self) -> String {
        let failures: Vec<String> = self
            .failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(key, n)| format!("{n}@{key}"))
            .collect();
        format!(
            "stats beats_failed={} overran={} failures={}",
            self.beats_failed.load(Ordering::Relaxed),
            self.overran.load(Ordering::Relaxed),
            failures.join(",")
        )
    }
}

/// One member's world: production's (it runs at once, thread randomness), with an observer
/// that writes what its shell hears into the [`Book`].
struct Seen {
    /// The member's local index.
    local: usize,
    book: Arc<Book>,
}

impl World for Seen {
    fn observe(&self, seen: Observed<'_>) {
        let book = &self.book;
        match seen {
            Observed::Event(pb::JobEvent { event: Some(Event::GenerationFormed(g)) })
                if g.number == 1 && !book.heard_formed[self.local].swap(true, Ordering::Relaxed) =>
            {
                book.heard_formed_count.fetch_add(1, Ordering::Relaxed);
                book.changed.notify_waiters();
            }
            Observed::Event(pb::JobEvent { event: Some(Event::StragglerNamed(s)) })
                if book.straggler.set(()).is_ok() =>
            {
                say(&format!("straggler id={} at={}", s.worker_id, mono_ns()));
            }
            Observed::RevocationHeard { generation: 1, .. } => {
                let _ = book.revoked_at[self.local].set(mono_ns());
            }
            Observed::Heartbeat { error: None } => {
                book.beats_answered.fetch_add(1, Ordering::Relaxed);
                book.changed.notify_waiters();
            }
            Observed::Heartbeat { error: Some(error) } => {
                book.beats_failed.fetch_add(1, Ordering::Relaxed);
                book.failed("Heartbeat", error);
            }
            Observed::CallFailed { rpc, error } => book.failed(rpc, error),
            Observed::Overran { .. } => {
                book.overran.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
    }
}

/// A data plane that publishes what a worker with `--transport auto` publishes (a TCP and a
/// shared-memory address; the members of a host share memory in the sparse answer's host
/// runs) and connects nothing: the harness measures the control plane.
struct NullPlane {
    index: usize,
    host: String,
}

impl DataPlane for NullPlane {
    type Comm = ();

    fn published(&self) -> (Vec<pb::TransportAddress>, Vec<String>) {
        let i = self.index;
        let addresses = vec![
            pb::TransportAddress {
                transport: "tcp".into(),
                address: format!("127.{}.{}.{}:{}", (i >> 16) & 255, (i >> 8) & 255, i & 255, 40000 + i % 1000),
            },
            pb::TransportAddress {
                transport: "shm".into(),
                address: format!("shm1;host={};nonce={i:016x}", self.host),
            },
        ];
        (addresses, vec!["transport:tcp".into()])
    }

    async fn connect(&mut self, formed: Formed<'_>) -> Result<Option<Connected<()>>, ElasticError> {
        Ok(Some(Connected { comm: (), revoke: Arc::new(|_| {}), members: formed.members, transport: MeshKind::Tcp }))
    }
}

/// One member: the shipped worker's group, and its indices.
struct Member {
    index: usize,
    local: usize,
    id: String,
    group: ElasticGroup<NullPlane>,
    /// How long its join took (`ElasticGroup::join_with`: the Join call and its retries).
    joined: Duration,
}

/// Joins member `index` through `client` (at most `admit`'s permits in flight) and waits for
/// its first generation.
async fn member(
    (index, local): (usize, usize),
    plan: &Plan,
    control: ControlConfig,
    client: ControlClient,
    book: Arc<Book>,
    admit: &tokio::sync::Semaphore,
) -> Result<(Member, Generation<()>), String> {
    let id = format!("m{index:05}");
    let host = format!("host{:05}", index / plan.ranks_per_host);
    let job = JobId::new(JOB).map_err(|e| e.to_string())?;
    let mut config = ElasticConfig::new(job, WorkerId::new(id.clone()).map_err(|e| e.to_string())?, control);
    config.host = host.clone();
    config.domain = String::new();
    config.heartbeat_relay = plan.ranks_per_host > 1;
    config.relay_dir = None;
    let plane = NullPlane { index, host };
    let (group, joined) = {
        let _permit = admit.acquire().await.map_err(|e| e.to_string())?;
        let asked = Instant::now();
        let group = ElasticGroup::join_with(config, client, plane, Arc::new(Seen { local, book }))
            .await
            .map_err(|e| format!("join {id}: {e}"))?;
        (group, asked.elapsed())
    };
    let mut member = Member { index, local, id, group, joined };
    let generation = member.group.next_generation().await.map_err(|e| format!("{}: {e}", member.id))?;
    Ok((member, generation))
}

/// Step timings as a worker of a ring job records them: a slow member computes three times as
/// long and waits little in the collectives; the others wait for it there. Each waits briefly
/// on its ring neighbours.
fn record_step(group: &ElasticGroup<NullPlane>, rank: u32, size: u32, slow: bool) {
    let (compute_ms, collective_ms) = if slow { (300, 10) } else { (100, 210) };
    let neighbours = [(rank + 1) % size, (rank + size - 1) % size];
    group.record_step(
        Duration::from_millis(compute_ms),
        Duration::from_millis(collective_ms),
        neighbours.iter().map(|&r| (r, Duration::from_millis(1))).collect(),
    );
}

/// Collects the results of every task of `set`, in the order they finish; the first error or
/// panic ends it (dropping the set aborts the rest).
async fn all<T: 'static>(mut set: tokio::task::JoinSet<Result<T, String>>) -> Result<Vec<T>, String> {
    let mut out = Vec::with_capacity(set.len());
    while let Some(joined) = set.join_next().await {
        out.push(joined.map_err(|e| format!("member task: {e}"))??);
    }
    Ok(out)
}

/// The members that hold generation 2, when the farm's re-formation is over.
type Survivors = Vec<(Member, Generation<()>)>;

/// Where the farm's members are between commands.
enum Stage {
    /// Not joined yet.
    Idle,
    /// Holding generation 1, by local index (`None`: dropped).
    Formed(Vec<Option<(Member, Generation<()>)>>),
    /// Re-forming: the survivors when it is over.
    Reforming(tokio::sync::oneshot::Receiver<Result<Survivors, String>>),
    /// Holding generation 2; with a recorder of step timings while the steady phase runs.
    Reformed(Arc<Survivors>, Option<tokio::task::JoinHandle<()>>),
    /// Left.
    Done,
}

/// Runs a farm until its stdin closes or a command fails: answers `error` then.
pub(crate) async fn serve(plan: Plan, spec: FarmSpec) {
    if let Err(e) = farm(plan, spec).await {
        say(&format!("error {}", e.replace('\n', " ")));
    }
}

async fn farm(plan: Plan, spec: FarmSpec) -> Result<(), String> {
    let n = spec.count;
    let book = Arc::new(Book::new(spec.first, n));
    let (tx, mut commands) = tokio::sync::mpsc::unbounded_channel::<String>();
    std::thread::spawn({
        let book = book.clone();
        move || {
            for line in std::io::stdin().lock().lines().map_while(Result::ok) {
                match line.trim() {
                    "status" => say(&book.status()),
                    "beats" => say(&format!("beats answered={}", book.beats_answered.load(Ordering::Relaxed))),
                    "stats" => say(&book.stats()),
                    _ => {
                        if tx.send(line).is_err() {
                            break;
                        }
                    }
                }
            }
        }
    });
    // One client per `members_per_connection` members, on the replicas in turn (a client fails
    // over to the others as a worker's does).
    let per = plan.members_per_connection;
    let clients = (0..n.div_ceil(per))
        .map(|c| {
            let mut control = ControlConfig::new(spec.endpoints.clone());
            control.first_endpoint = Some((spec.first / per + c) % spec.endpoints.len());
            let client = ControlClient::new(control.clone()).map_err(|e| format!("client: {e}"))?;
            Ok((control, client))
        })
        .collect::<Result<Vec<_>, String>>()?;
    say(&format!("ready connections={}", clients.len()));
    let mut stage = Stage::Idle;
    let mut reporter: Option<FailureReporter> = None;
    while let Some(line) = commands.recv().await {
        let command = Fields::parse(&line);
        stage = match (command.verb, stage) {
            ("form", Stage::Idle) => {
                let admit = Arc::new(tokio::sync::Semaphore::new((plan.join_concurrency / spec.farms).max(1)));
                let mut joining = tokio::task::JoinSet::new();
                for local in 0..n {
                    let (control, client) = clients[local / per].clone();
                    let (plan, book, admit) = (plan.clone(), book.clone(), admit.clone());
                    let index = spec.first + local;
                    joining.spawn(async move { member((index, local), &plan, control, client, book, &admit).await });
                }
                let mut formed = all(joining).await?;
                let at = mono_ns();
                formed.sort_by_key(|(m, _)| m.local);
                let joins: Vec<String> = formed.iter().map(|(m, _)| m.joined.as_micros().to_string()).collect();
                let views = summarize(formed.iter().map(|(m, g)| (m.index, g)), 1, plan.members)?;
                say(&format!("formed at={at} joins={} {views}", joins.join(",")));
                Stage::Formed(formed.into_iter().map(Some).collect())
            }
            ("watch", stage @ Stage::Formed(_)) => {
                book.until(|b| {
                    b.heard_formed_count.load(Ordering::Relaxed) == n
                        && b.beats_answered.load(Ordering::Relaxed) >= n as u64
                })
                .await;
                say(&format!("watched at={}", mono_ns()));
                stage
            }
            ("drop", Stage::Formed(mut members)) => {
                let rank: u32 = command.num("rank")?;
                let slot = members.iter_mut().find(|m| m.as_ref().is_some_and(|(_, g)| g.rank == rank));
                let (gone, _) = slot.and_then(Option::take).ok_or(format!("no member of rank {rank} here"))?;
                book.done[gone.local].store(true, Ordering::Relaxed);
                // Its process is gone: its heartbeats, watch and relays stop.
                drop(gone);
                say("dropped");
                Stage::Formed(members)
            }
            ("arm", Stage::Formed(members)) => {
                let (dies, reporting, size): (u32, u32, usize) =
                    (command.num("dies")?, command.num("reporter")?, command.num("size")?);
                reporter = members.iter().flatten().find(|(_, g)| g.rank == reporting).map(|(m, _)| m.group.reporter());
                stage_reforming(members, dies, size, &book)
            }
            ("report", stage) => {
                let failed: u32 = command.num("failed")?;
                let reporter = reporter.take().ok_or("`report` to a farm without the reporting member")?;
                let sent = mono_ns();
                let cause = reporter
                    .on_failure(1, &CommError::PeerFailed { rank: failed, detail: "scale harness: peer failed".into() })
                    .await;
                let answered = mono_ns();
                let rank = cause.rank.map_or("-".to_string(), |r| r.to_string());
                say(&format!("reported sent={sent} answered={answered} cause_rank={rank} text={cause}"));
                stage
            }
            ("steady", stage) => {
                let (slow, size): (u32, u32) = (command.num("slow")?, command.num("size")?);
                let survivors = survivors(stage).await?;
                let recorder = tokio::spawn({
                    let survivors = survivors.clone();
                    let interval = plan.interval() / 2;
                    async move {
                        // Every survivor records a step per half interval (each heartbeat
                        // carries one or two).
                        let mut tick = tokio::time::interval(interval);
                        loop {
                            tick.tick().await;
                            for (m, g) in survivors.iter() {
                                record_step(&m.group, g.rank, size, g.rank == slow);
                            }
                        }
                    }
                });
                say("steadying");
                Stage::Reformed(survivors, Some(recorder))
            }
            ("calm", Stage::Reformed(survivors, recorder)) => {
                if let Some(recorder) = recorder {
                    recorder.abort();
                    let _ = recorder.await;
                }
                say("calm");
                Stage::Reformed(survivors, None)
            }
            ("finish", stage) => {
                let survivors = survivors(stage).await?;
                let survivors = Arc::try_unwrap(survivors).map_err(|_| "the survivors are still shared")?;
                let start = mono_ns();
                let mut leaving = tokio::task::JoinSet::new();
                for (m, _) in survivors {
                    leaving.spawn(async move {
                        let id = m.id.clone();
                        Ok(m.group.leave(true).await.err().map(|e| format!("{id}: {e}")))
                    });
                }
                let refusals: Vec<String> = all(leaving).await?.into_iter().flatten().collect();
                let end = mono_ns();
                let first = refusals.first().map(|r| r.replace('\n', " ")).unwrap_or_default();
                say(&format!("finished start={start} end={end} refused={} text={first}", refusals.len()));
                Stage::Done
            }
            ("quit", _) => break,
            (verb, _) => return Err(format!("`{verb}` out of order")),
        };
    }
    Ok(())
}

/// Arms the re-formation: every member still here waits to hear generation 1 revoked, and
/// then calls `next_generation`, except the one of rank `dies`, which dies on hearing it (its
/// control stream closes). When all are done the farm says `reformed`, with the generation 2
/// they hold, checked to be of `size` members.
fn stage_reforming(members: Vec<Option<(Member, Generation<()>)>>, dies: u32, size: usize, book: &Arc<Book>) -> Stage {
    let mut reforming = tokio::task::JoinSet::new();
    for (mut m, g) in members.into_iter().flatten() {
        let book = book.clone();
        let rank = g.rank;
        reforming.spawn(async move {
            m.group.reporter().revoked(1).await;
            let woke = mono_ns();
            book.woke.fetch_add(1, Ordering::Relaxed);
            if rank == dies {
                // This process dies too: its control stream closes.
                book.done[m.local].store(true, Ordering::Relaxed);
                let local = m.local;
                drop(m);
                return Ok((local, woke, None));
            }
            let g = m.group.next_generation().await.map_err(|e| format!("{}: {e}", m.id))?;
            book.reformed.fetch_add(1, Ordering::Relaxed);
            book.done[m.local].store(true, Ordering::Relaxed);
            Ok((m.local, woke, Some((mono_ns(), m, g))))
        });
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    let book = book.clone();
    tokio::spawn(async move {
        let outcome = async {
            let results = all(reforming).await?;
            let mut heard = Vec::with_capacity(results.len());
            let mut last = 0u64;
            let mut survivors = Vec::with_capacity(results.len());
            for (local, woke, formed) in results {
                // When its shell heard the revocation (the reporter knew it at once).
                heard.push(book.revoked_at[local].get().copied().unwrap_or(woke).to_string());
                if let Some((at, m, g)) = formed {
                    last = last.max(at);
                    survivors.push((m, g));
                }
            }
            survivors.sort_by_key(|(m, _): &(Member, Generation<()>)| m.local);
            let views = summarize(survivors.iter().map(|(m, g)| (m.index, g)), 2, size)?;
            say(&format!("reformed at={last} heard={} {views}", heard.join(",")));
            Ok(survivors)
        }
        .await;
        if let Err(e) = &outcome {
            say(&format!("error {e}"));
        }
        let _ = tx.send(outcome);
    });
    say("armed");
    Stage::Reforming(rx)
}

/// The survivors, once the re-formation is over.
async fn survivors(stage: Stage) -> Result<Arc<Survivors>, String> {
    match stage {
        Stage::Reforming(rx) => Ok(Arc::new(rx.await.map_err(|_| "the re-formation's task is gone")??)),
        Stage::Reformed(survivors, None) => Ok(survivors),
        _ => Err("a command for the survivors before the re-formation".into()),
    }
}
