//! `cohort-worker train`: a synthetic data-parallel training loop on the elastic runtime.
//!
//! Each step allreduces a deterministic, integer-valued gradient (so sums are exact) whose sum
//! depends on the parameters and the step ([`cohort_harness::trajectory`]), checks every element
//! against that target, adds it to the parameters, checks the parameters against the ones
//! every worker expects after that many steps, commits, and agrees with the other ranks (one
//! tiny allreduce) whether to re-form at this commit point (joiners waiting, or a member
//! leaving on SIGTERM, or a straggler asked to leave by the coordinator). Each step can also
//! burn a fixed amount of CPU time (`compute`, standing for the model's forward and backward
//! pass), so that a rank whose CPU is slowed computes longer, as a slow GPU would. The
//! parameters are also checked after every sync and restore and at the end, so a wrong
//! restore, a wrong sync or a lost step stops the worker. A SIGTERM before the worker is a
//! member (while it joins, or waits out an exclusion) ends it at once.
//!
//! Output: one `key=value` line per event on stdout, printed through the structs of
//! [`cohort_harness::events`] (the chaos harness and the integration tests parse them into the same
//! structs), each with `t_ms` (wall clock, ms since the Unix epoch). `finished` and `summary` carry
//! `params_digest` (SHA-256 of the final parameters' bytes) and `expected_digest` (of the
//! parameters expected after that many steps).

use cohort::elastic::{
    Checkpoint, CommitError, ElasticConfig, ElasticError, ElasticGroup, Generation, SyncError, WorkerId,
};
use cohort::{CommError, ReduceOp};
use cohort_harness::events;
use cohort_harness::exact::ExactElement;
use cohort_harness::trajectory::{params_digest, StepMismatch, Trajectory};
use cohort_transports::Transport;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::watch;
use tracing::{info_span, Instrument};

/// Settings of the synthetic loop.
#[derive(Clone, Debug)]
pub(crate) struct TrainConfig {
    /// Steps to run in all (the job's total, shared by every member).
    pub(crate) steps: u64,
    /// Gradient size in bytes.
    pub(crate) size_bytes: usize,
    /// Pause between steps (0 = none), to make long demos readable.
    pub(crate) step_interval: Duration,
    /// CPU time each step burns before its allreduce (0 = none): a fixed amount of work,
    /// which takes longer in wall time on a slowed CPU.
    pub(crate) compute: Duration,
    /// Every this many steps (0 = never), an alltoall after the step's allreduce, whose blocks
    /// every rank checks: it links every pair of ranks, so in a sparse generation it makes
    /// the links (and resolves the addresses) the partners' schedules never need.
    pub(crate) alltoall_every: u64,
}

/// What the loop did, printed at the end.
#[derive(Clone, Debug, Default)]
pub(crate) struct TrainSummary {
    /// Steps this worker ran and verified.
    pub(crate) verified_steps: u64,
    /// The last committed step.
    pub(crate) final_step: u64,
    /// Re-formations after failures, with the time lost to each (error to next verified step).
    pub(crate) failures: Vec<Duration>,
    /// Cooperative re-formations (scale-up, leaves).
    pub(crate) cooperative_reforms: u64,
    /// Whether this worker left early (SIGTERM).
    pub(crate) left: bool,
    /// Alltoalls this worker ran and verified (`--alltoall-every`).
    pub(crate) verified_alltoalls: u64,
    /// SHA-256 (hex) of the parameters at the end (`None`: never a member).
    pub(crate) params_digest: Option<String>,
    /// SHA-256 (hex) of the parameters expected after `final_step` steps.
    pub(crate) expected_digest: Option<String>,
}

/// Milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Prints `event=joined` for the member `group` just became.
fn print_joined(worker: &WorkerId, group: &ElasticGroup) {
    events::Joined {
        worker: worker.to_string(),
        incarnation: group.incarnation(),
        addr: group.advertised_address().to_string(),
        listen: Some(group.listen_address()),
        t_ms: now_ms(),
    }
    .print();
}

fn kind_of(e: &CommError) -> &'static str {
    match e {
        CommError::PeerFailed { .. } => "PeerFailed",
        CommError::Timeout { .. } => "Timeout",
        CommError::Revoked { .. } => "Revoked",
        CommError::Transport(_) => "Transport",
        CommError::InvalidArgument(_) => "InvalidArgument",
        CommError::Mismatch { .. } => "Mismatch",
    }
}

/// The parameters and the exact number of steps that made them, as an
/// [`cohort::elastic::ElasticState`]: the snapshot is the step (8 bytes, little endian) then the
/// parameters' bytes.
///
/// The step travels inside the snapshot because the parameters alone cannot name it: their
/// modulus is small for the narrow types (32 values for bf16, 256 for u8 and f16), so the
/// parameters of two steps can be equal (for bf16 a commit 32 steps old often equals the
/// current one), and a stale snapshot restored or synced under a newer step would pass the
/// parameter check. [`check_params`] compares this counter first.
struct Params<E> {
    /// Steps applied to `values` (0 for the initial parameters).
    step: u64,
    values: Vec<E>,
}

impl<E: ExactElement> Params<E> {
    fn new(step: u64, values: Vec<E>) -> Self {
        Self { step, values }
    }
}

impl<E: ExactElement> cohort::elastic::ElasticState for Params<E> {
    fn save(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.step.to_le_bytes());
        out.extend_from_slice(cohort::dtype::as_bytes(&self.values));
    }
    fn load(&mut self, snapshot: &[u8]) -> Result<(), String> {
        let width = std::mem::size_of::<E>();
        let want = 8 + self.values.len() * width;
        let (Some(step), true) = (snapshot.get(..8), snapshot.len() == want) else {
            return Err(format!(
                "snapshot of {} bytes for a step counter and {} elements of {} bytes ({want} bytes)",
                snapshot.len(),
                self.values.len(),
                width
            ));
        };
        let mut counter = [0u8; 8];
        counter.copy_from_slice(step);
        self.step = u64::from_le_bytes(counter);
        cohort::dtype::as_bytes_mut(&mut self.values).copy_from_slice(&snapshot[8..]);
        Ok(())
    }
}

/// Runs the loop until the job's steps are done, the job ends, or SIGTERM makes this worker
/// leave. `Err` on a wrong result or an unrecoverable error.
///
/// # Cancel safety
/// Not cancel safe: dropping it abandons the membership (the lease expires).
pub(crate) async fn run<E: ExactElement>(
    config: ElasticConfig,
    train: TrainConfig,
    mut leaving: watch::Receiver<bool>,
) -> Result<TrainSummary, TrainError> {
    let width = std::mem::size_of::<E>();
    let count = train.size_bytes / width;
    let worker = config.worker_id.clone();
    // A straggler asked to leave joins again with the same settings after its cool-down.
    let rejoin_config = config.clone();
    // SIGTERM while joining (which includes waiting out an exclusion, possibly minutes): not
    // a member yet, so nobody waits on this worker and it stops at once. Later, inside a
    // generation or a re-formation, it leaves at the next commit point.
    events::Joining { worker: worker.to_string(), t_ms: now_ms() }.print();
    let mut group = tokio::select! {
        joined = ElasticGroup::join(config) => joined?,
        () = sigterm(&mut leaving) => {
            events::Leave {
                gen: 0,
                rank: None,
                step: 0,
                params_digest: None,
                expected_digest: None,
                joined: Some(false),
                t_ms: now_ms(),
            }
            .print();
            return Ok(TrainSummary { left: true, ..TrainSummary::default() });
        }
    };
    print_joined(&worker, &group);

    let trajectory = Trajectory::new::<E>(count);
    let mut params = Params::new(0, vec![E::from_small(0); count]);
    let mut grad = vec![E::from_small(0); count];
    let mut checkpoint = Checkpoint::new();
    let mut summary = TrainSummary::default();
    let mut failed_at: Option<Instant> = None;
    let mut last_generation = 0;

    'generations: loop {
        // Between generations (waiting at the rendezvous, joining again after an eviction,
        // connecting) this worker is in no generation that needs it: SIGTERM leaves at once,
        // gracefully, with the last commit's parameters.
        let next = tokio::select! {
            next = group.next_generation() => Some(next),
            () = sigterm(&mut leaving) => None,
        };
        let Some(next) = next else {
            let step = checkpoint.step().unwrap_or(0);
            let (digest, expected) = digests(&trajectory, &params.values, step);
            events::Leave {
                gen: last_generation,
                rank: None,
                step,
                params_digest: Some(digest.clone()),
                expected_digest: Some(expected.clone()),
                joined: Some(false),
                t_ms: now_ms(),
            }
            .print();
            summary.params_digest = Some(digest);
            summary.expected_digest = Some(expected);
            summary.final_step = step;
            summary.left = true;
            // Best effort and bounded: an unfinished leave expires with the lease.
            match tokio::time::timeout(LEAVE_BOUND, group.leave(false)).await {
                Ok(Err(e)) => tracing::warn!(error = %e, "leaving on SIGTERM failed; the lease expires by itself"),
                Err(_) => tracing::warn!("leaving on SIGTERM took too long; the lease expires by itself"),
                Ok(Ok(())) => {}
            }
            return Ok(summary);
        };
        let mut generation: Generation = match next {
            Ok(g) => g,
            Err(ElasticError::JobEnded { outcome: "finished", reason }) => {
                events::JobEnded { outcome: "finished".into(), reason: reason.into(), t_ms: now_ms() }.print();
                break 'generations;
            }
            Err(e) => return Err(e.into()),
        };
        let g = generation.number;
        last_generation = g;
        let world = generation.comm.size();
        let rank = generation.comm.rank();
        let span = info_span!("train", job = %group.job(), generation = g, rank);
        Trajectory::check_exact::<E>(world).map_err(TrainError::Setup)?;
        events::Generation {
            gen: g,
            world: world as u64,
            rank,
            transport: generation.transport.to_string(),
            links: Some(generation.comm.transport().linked_peers() as u64),
            carried: Some(generation.comm.transport().carried_links() as u64),
            known: Some(generation.members.known().len() as u64),
            t_ms: now_ms(),
        }
        .print();
        cohort::metrics::GENERATION.store(g, Ordering::Relaxed);
        cohort::metrics::WORLD_SIZE.store(world as u64, Ordering::Relaxed);
        cohort::metrics::LINKS.store(generation.comm.transport().linked_peers() as u64, Ordering::Relaxed);

        // Every member (joiners included) takes the newest commit.
        group.set_progress(g, checkpoint.step().unwrap_or(0), "sync");
        match checkpoint.sync(&mut generation.comm, &mut params).instrument(span.clone()).await {
            Ok(outcome) => events::Restored {
                gen: g,
                rank,
                step: outcome.step.map_or(-1, |s| s as i64),
                source: outcome.source,
                changed: outcome.changed,
                t_ms: now_ms(),
            }
            .print(),
            Err(SyncError::Comm(e)) => {
                failed(
                    &group,
                    Failed { generation: g, rank, step: None, phase: Some("sync"), detail: false },
                    &e,
                    None,
                )
                .await;
                failed_at.get_or_insert_with(Instant::now);
                continue 'generations;
            }
            Err(SyncError::Diverged(detail)) => {
                return Err(TrainError::Diverged(format!("state diverged after restore: {detail}")))
            }
        }
        let mut step = checkpoint.step().unwrap_or(0);
        check_params(&trajectory, &params, g, rank, step, "sync")?;

        loop {
            if step >= train.steps {
                check_params(&trajectory, &params, g, rank, step, "end")?;
                let (digest, expected) = digests(&trajectory, &params.values, step);
                events::Finished {
                    gen: g,
                    rank,
                    step,
                    params_digest: Some(digest.clone()),
                    expected_digest: Some(expected.clone()),
                    t_ms: now_ms(),
                }
                .print();
                summary.params_digest = Some(digest);
                summary.expected_digest = Some(expected);
                summary.final_step = step;
                group.leave(true).await?;
                return Ok(summary);
            }
            let step_started = Instant::now();
            trajectory.fill(&params.values, step, rank, world, &mut grad);
            compute(train.compute).await?;
            group.set_progress(g, step, "allreduce");
            let started = Instant::now();
            events::Allreduce { gen: g, rank, step, t_ms: now_ms() }.print();
            let result = generation.comm.allreduce(&mut grad, ReduceOp::Sum).instrument(span.clone()).await;
            if let Err(e) = result {
                let errored_ms = now_ms();
                let what = Failed { generation: g, rank, step: Some(step), phase: None, detail: true };
                failed(&group, what, &e, Some(errored_ms)).await;
                roll_back(&checkpoint, &mut params, &trajectory, g, rank)?;
                failed_at.get_or_insert_with(Instant::now);
                continue 'generations;
            }
            // One pass: every element of the sum against its target, added, and the new
            // parameter against the one expected after step + 1 (the commit's check).
            match trajectory.apply(&mut params.values, &grad, step) {
                Ok(()) => {}
                Err(StepMismatch::Sum { index: j, expected }) => {
                    events::WrongResult {
                        gen: g,
                        rank,
                        step,
                        index: j as u64,
                        got: grad.get(j).map_or_else(|| "-".to_string(), |x| format!("{x:?}")),
                        expected: format!("{expected:?}"),
                        t_ms: now_ms(),
                    }
                    .print();
                    return Err(TrainError::WrongResult { generation: g, step, index: j });
                }
                Err(StepMismatch::Params { index, expected }) => {
                    return Err(wrong_params(g, rank, step + 1, "commit", index, params.values.get(index), expected));
                }
            }
            if train.alltoall_every > 0 && step % train.alltoall_every == 0 {
                group.set_progress(g, step, "alltoall");
                let exchanged = exchange(&mut generation.comm, g, step).instrument(span.clone()).await?;
                if let Err(e) = exchanged {
                    let what = Failed { generation: g, rank, step: Some(step), phase: Some("alltoall"), detail: true };
                    failed(&group, what, &e, None).await;
                    // The step's sum is in the parameters but not committed: back to the commit.
                    roll_back(&checkpoint, &mut params, &trajectory, g, rank)?;
                    failed_at.get_or_insert_with(Instant::now);
                    continue 'generations;
                }
                summary.verified_alltoalls += 1;
            }
            step += 1;
            params.step = step;
            checkpoint.commit(&params, step);
            summary.verified_steps += 1;
            cohort::metrics::STEPS_VERIFIED.fetch_add(1, Ordering::Relaxed);
            cohort::metrics::LINKS.store(generation.comm.transport().linked_peers() as u64, Ordering::Relaxed);
            let elapsed = started.elapsed();
            let mut collective = elapsed;
            if step % DEADLINES_EVERY == 0 {
                report_deadlines(g, rank, step, generation.comm.transport().as_ref(), &group);
            }

            // Commit point: report, then agree with every rank on whether to re-form here.
            group.set_progress(g, step, "commit");
            let pending = group.commit(g, step, &checkpoint.digest());
            let straggler = group.straggler_leave();
            let mut flags = [u8::from(pending), u8::from(*leaving.borrow() || straggler.is_some())];
            let flags_started = Instant::now();
            // The flags' allreduce also checks, in-band, that every member committed this
            // step with the same state: a divergence stops every rank here.
            let agreed = match checkpoint.agree(&mut generation.comm, &mut flags).await {
                Ok(()) => Ok(()),
                Err(CommitError::Comm(e)) => Err(e),
                Err(e @ CommitError::Diverged { .. }) => return Err(TrainError::Diverged(e.to_string())),
            };
            collective += flags_started.elapsed();
            if agreed.is_ok() {
                let waits = cohort_transports::Transport::deadlines_in_force(generation.comm.transport().as_ref());
                let peer_waits = waits.iter().filter(|(_, d)| d.samples > 0).map(|(p, d)| (*p, d.smoothed)).collect();
                group.record_step(step_started.elapsed().saturating_sub(collective), collective, peer_waits);
            }
            if let Err(e) = agreed {
                let what = Failed { generation: g, rank, step: Some(step), phase: Some("commit"), detail: false };
                failed(&group, what, &e, None).await;
                // Not agreed, so not committed: the checkpoint rolled back to the last agreed
                // commit, and the parameters go back with it (as after a failed allreduce).
                roll_back(&checkpoint, &mut params, &trajectory, g, rank)?;
                failed_at.get_or_insert_with(Instant::now);
                continue 'generations;
            }
            // The step is committed once the members agreed on it: only then is it announced
            // (`event=step`, which the chaos harness takes as committed).
            if let Some(t) = failed_at.take() {
                summary.failures.push(t.elapsed());
                cohort::metrics::FAILURES.fetch_add(1, Ordering::Relaxed);
                cohort::metrics::LOST_MS.fetch_add(t.elapsed().as_millis() as u64, Ordering::Relaxed);
                events::Recovered { gen: g, rank, step, lost_ms: t.elapsed().as_millis() as u64, t_ms: now_ms() }
                    .print();
            }
            events::Step { gen: g, world: world as u64, rank, step, ms: elapsed.as_secs_f64() * 1e3, t_ms: now_ms() }
                .print();
            if flags[1] != 0 && *leaving.borrow() {
                let (digest, expected) = digests(&trajectory, &params.values, step);
                events::Leave {
                    gen: g,
                    rank: Some(rank),
                    step,
                    params_digest: Some(digest.clone()),
                    expected_digest: Some(expected.clone()),
                    joined: None,
                    t_ms: now_ms(),
                }
                .print();
                summary.params_digest = Some(digest);
                summary.expected_digest = Some(expected);
                summary.final_step = step;
                summary.left = true;
                drop(generation);
                group.leave(false).await?;
                return Ok(summary);
            }
            if let (true, Some(why)) = (flags[1] != 0, &straggler) {
                // Asked to leave as a straggler: a graceful leave at this commit point (the
                // others re-form without it, nothing lost), then a join again, which waits
                // out the cool-down (the coordinator refuses the join until it ends).
                events::StragglerLeave { gen: g, rank, step, reason: why.as_str().into(), t_ms: now_ms() }.print();
                summary.cooperative_reforms += 1;
                cohort::metrics::REFORMATIONS.fetch_add(1, Ordering::Relaxed);
                drop(generation);
                group.leave(false).await?;
                events::Joining { worker: worker.to_string(), t_ms: now_ms() }.print();
                group = tokio::select! {
                    joined = ElasticGroup::join(rejoin_config.clone()) => joined?,
                    () = sigterm(&mut leaving) => {
                        events::Leave {
                            gen: g,
                            rank: None,
                            step,
                            params_digest: None,
                            expected_digest: None,
                            joined: Some(false),
                            t_ms: now_ms(),
                        }
                        .print();
                        let (digest, expected) = digests(&trajectory, &params.values, step);
                        summary.params_digest = Some(digest);
                        summary.expected_digest = Some(expected);
                        summary.final_step = step;
                        summary.left = true;
                        return Ok(summary);
                    }
                };
                print_joined(&worker, &group);
                continue 'generations;
            }
            if flags[0] != 0 || flags[1] != 0 {
                let why = if flags[1] != 0 { "leave" } else { "scale_up" };
                events::Reform { gen: g, rank, step, reason: why.into(), t_ms: now_ms() }.print();
                summary.cooperative_reforms += 1;
                cohort::metrics::REFORMATIONS.fetch_add(1, Ordering::Relaxed);
                continue 'generations;
            }
            if !train.step_interval.is_zero() {
                tokio::time::sleep(train.step_interval).await;
            }
        }
    }
    summary.final_step = checkpoint.step().unwrap_or(0);
    // The parameters are the last commit's here (every way into next_generation leaves them so).
    check_params(&trajectory, &params, 0, 0, summary.final_step, "end")?;
    let (digest, expected) = digests(&trajectory, &params.values, summary.final_step);
    summary.params_digest = Some(digest);
    summary.expected_digest = Some(expected);
    Ok(summary)
}

/// The step's compute (`work` of CPU time) on a blocking-pool thread, never on the runtime's
/// thread: the runtime is current-thread, and the heartbeats, the coordinator's watch and the
/// transports' tasks run on it, so a step that burned the CPU there would silence them for the
/// whole step, and one longer than the lease would get a healthy worker evicted.
///
/// # Cancel safety
/// Cancel safe: dropping it leaves the burn to finish on its own thread, touching nothing.
async fn compute(work: Duration) -> Result<(), TrainError> {
    if work.is_zero() {
        return Ok(());
    }
    tokio::task::spawn_blocking(move || burn_cpu(work))
        .await
        .map_err(|e| TrainError::Setup(format!("the compute thread failed: {e}")))
}

/// Burns `work` of this thread's CPU time (a fixed amount of work: on a slowed or shared
/// CPU it takes longer in wall time). Zero returns at once.
fn burn_cpu(work: Duration) {
    if work.is_zero() {
        return;
    }
    let start = thread_cpu_time();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    while thread_cpu_time().saturating_sub(start) < work {
        for _ in 0..1000 {
            x = x.rotate_left(7) ^ x.wrapping_mul(0x2545_f491_4f6c_dd1d);
        }
        std::hint::black_box(x);
    }
}

/// CPU time this thread has used.
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec to the valid pointer given.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec.max(0) as u64, ts.tv_nsec.clamp(0, 999_999_999) as u32)
}

/// Every this many steps the deadline in force per link is printed, set in the metrics and
/// sent with the heartbeats (for the coordinator's `status`).
const DEADLINES_EVERY: u64 = 16;

/// Prints `event=deadlines` (`peers=PEER:MS:BASIS,...`) after the library reported them
/// ([`ElasticGroup::report_deadlines`]: the metrics and the progress the coordinator shows).
fn report_deadlines<T: Transport + ?Sized>(g: u64, rank: u32, step: u64, transport: &T, group: &ElasticGroup) {
    let deadlines = group.report_deadlines(transport);
    let peers = cohort::elastic::deadline_summary(&deadlines);
    events::Deadlines { gen: g, rank, step, peers, t_ms: now_ms() }.print();
}

/// Where a collective failed, for its `event=error` line.
struct Failed {
    generation: u64,
    rank: u32,
    step: Option<u64>,
    /// The phase (`sync`, `alltoall`, `commit`); `None`: the step's allreduce.
    phase: Option<&'static str>,
    /// Whether the line carries the error itself beside its root cause.
    detail: bool,
}

/// A failed collective: reports it through the group, which answers the generation's root
/// cause (every rank's the same), and prints its `event=error` line. `errored_ms`: when the
/// collective failed, for a phase whose time to the root cause is measured (the line then
/// carries both); else the line carries the time the cause was known.
///
/// # Cancel safety
/// Cancel safe (reports are idempotent); the line is printed only when it completes.
async fn failed(group: &ElasticGroup, at: Failed, error: &CommError, errored_ms: Option<u64>) {
    let cause = group.on_failure(at.generation, error).await;
    let now = now_ms();
    events::Error {
        gen: at.generation,
        rank: at.rank,
        step: at.step,
        phase: at.phase.map(Into::into),
        kind: kind_of(error).into(),
        detail: at.detail.then(|| error.to_string().into()),
        cause: cause.to_string().into(),
        t_ms: errored_ms.unwrap_or(now),
        cause_t_ms: errored_ms.map(|_| now),
    }
    .print();
}

/// After a failure: the parameters back to the last agreed commit, checked against the
/// trajectory there.
fn roll_back<E: ExactElement>(
    checkpoint: &Checkpoint,
    params: &mut Params<E>,
    trajectory: &Trajectory,
    generation: u64,
    rank: u32,
) -> Result<(), TrainError> {
    checkpoint.restore(params)?;
    check_params(trajectory, params, generation, rank, checkpoint.step().unwrap_or(0), "restore")
}

/// Checks the parameters against those every worker expects after `step` steps: first their
/// step counter (exact, whatever the type), then every value; a mismatch prints
/// `event=wrong_params` and is an error.
fn check_params<E: ExactElement>(
    trajectory: &Trajectory,
    params: &Params<E>,
    generation: u64,
    rank: u32,
    step: u64,
    phase: &'static str,
) -> Result<(), TrainError> {
    if params.step != step {
        events::WrongParams {
            gen: generation,
            rank,
            step,
            phase: phase.into(),
            held_step: Some(params.step),
            index: None,
            got: None,
            expected: None,
            t_ms: now_ms(),
        }
        .print();
        return Err(TrainError::WrongStep { generation, step, phase, held: params.step });
    }
    match trajectory.first_param_mismatch(&params.values, step) {
        None => Ok(()),
        Some((index, expected)) => {
            Err(wrong_params(generation, rank, step, phase, index, params.values.get(index), expected))
        }
    }
}

/// Prints `event=wrong_params` and returns the error.
fn wrong_params<E: ExactElement>(
    generation: u64,
    rank: u32,
    step: u64,
    phase: &'static str,
    index: usize,
    got: Option<&E>,
    expected: E,
) -> TrainError {
    events::WrongParams {
        gen: generation,
        rank,
        step,
        phase: phase.into(),
        held_step: None,
        index: Some(index as u64),
        got: Some(got.map_or_else(|| "-".to_string(), |p| format!("{p:?}"))),
        expected: Some(format!("{expected:?}")),
        t_ms: now_ms(),
    }
    .print();
    TrainError::WrongParams { generation, step, phase, index }
}

/// The digests of the parameters held and of those expected after `step` steps.
/// Elements each rank sends each other rank in [`exchange`].
const ALLTOALL_BLOCK: usize = 2;

/// The `i`-th element `from` sends `to` in step `step`'s alltoall: distinct per (from, to,
/// step mod 2^18, i) for ranks below 2^20, so a block delivered to the wrong rank, from the
/// wrong rank or of another step is caught.
fn alltoall_value(from: u32, to: u32, step: u64, i: usize) -> i64 {
    (i64::from(from) << 40) | (i64::from(to) << 20) | ((step as i64 & 0x3ffff) << 2) | i as i64
}

/// One checked alltoall of step `step`: `Ok(Err(_))` when the collective failed (a
/// re-formation, as for the allreduce), `Err` on a wrong block.
///
/// # Cancel safety
/// Not cancel safe (a collective).
async fn exchange(
    comm: &mut cohort::Communicator<cohort::elastic::MeshTransport>,
    generation: u64,
    step: u64,
) -> Result<Result<(), CommError>, TrainError> {
    let (rank, world) = (comm.rank(), comm.size());
    let send: Vec<i64> =
        (0..world).flat_map(|to| (0..ALLTOALL_BLOCK).map(move |i| alltoall_value(rank, to, step, i))).collect();
    let mut received = vec![0i64; send.len()];
    if let Err(e) = comm.alltoall(&send, &mut received).await {
        return Ok(Err(e));
    }
    for (index, got) in received.iter().enumerate() {
        let (from, i) = ((index / ALLTOALL_BLOCK) as u32, index % ALLTOALL_BLOCK);
        let expected = alltoall_value(from, rank, step, i);
        if *got != expected {
            events::WrongResult {
                gen: generation,
                rank,
                step,
                index: index as u64,
                got: got.to_string(),
                expected: expected.to_string(),
                t_ms: now_ms(),
            }
            .print();
            return Err(TrainError::WrongResult { generation, step, index });
        }
    }
    Ok(Ok(()))
}

fn digests<E: ExactElement>(trajectory: &Trajectory, params: &[E], step: u64) -> (String, String) {
    (params_digest(params), params_digest(&trajectory.expected_params::<E>(step)))
}

/// The longest a leave on SIGTERM between generations waits for the coordinator.
const LEAVE_BOUND: Duration = Duration::from_secs(5);

/// Resolves once SIGTERM has been received (never, if the signal task is gone without one).
///
/// # Cancel safety
/// Cancel safe: it only watches the flag.
async fn sigterm(leaving: &mut watch::Receiver<bool>) {
    if leaving.wait_for(|l| *l).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Why `train` stopped with a failure.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TrainError {
    /// An allreduce result differed from the expected sum: the one thing that must never happen.
    #[error("WRONG RESULT in generation {generation}, step {step}, element {index}")]
    WrongResult {
        /// Generation of the step.
        generation: u64,
        /// The step.
        step: u64,
        /// First wrong element.
        index: usize,
    },
    /// The parameters differ from the ones expected after `step` steps: a wrong restore, a
    /// wrong sync, or a lost or repeated step.
    #[error("WRONG PARAMETERS in generation {generation} at step {step} (after {phase}), element {index}")]
    WrongParams {
        /// Generation of the check.
        generation: u64,
        /// The step the parameters claim.
        step: u64,
        /// Where the check ran: sync, restore, commit or end.
        phase: &'static str,
        /// First wrong element.
        index: usize,
    },
    /// The parameters were made by another number of steps than the `step` they are checked
    /// for (a stale commit restored or synced as a newer one), whatever their values.
    #[error(
        "WRONG PARAMETERS in generation {generation} at step {step} (after {phase}): they are those of step {held}"
    )]
    WrongStep {
        /// Generation of the check.
        generation: u64,
        /// The step the parameters are checked for.
        step: u64,
        /// Where the check ran: sync, restore or end.
        phase: &'static str,
        /// The step counter the parameters carry.
        held: u64,
    },
    /// Ranks disagree about the synced or committed state.
    #[error("{0}")]
    Diverged(String),
    /// The elastic runtime gave up (job failed, coordinator unreachable, ...).
    #[error(transparent)]
    Elastic(#[from] ElasticError),
    /// The settings cannot work.
    #[error("{0}")]
    Setup(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort::elastic::ElasticState;

    #[test]
    fn burning_cpu_takes_at_least_the_work_in_cpu_time() {
        let before = thread_cpu_time();
        burn_cpu(Duration::from_millis(20));
        assert!(thread_cpu_time() - before >= Duration::from_millis(20));
        burn_cpu(Duration::ZERO);
    }

    #[test]
    fn a_restore_that_loads_the_previous_commit_fails_the_check() {
        let trajectory = Trajectory::new::<f32>(100);
        let mut params = Params::new(0, vec![0f32; 100]);
        // A checkpoint whose commit of step 5 holds the parameters of step 4.
        let mut checkpoint = Checkpoint::new();
        checkpoint.commit(&Params::new(5, trajectory.expected_params::<f32>(4)), 5);
        checkpoint.restore(&mut params).unwrap();
        let err = check_params(&trajectory, &params, 2, 0, 5, "restore").unwrap_err();
        assert!(matches!(err, TrainError::WrongParams { step: 5, phase: "restore", generation: 2, .. }), "{err}");
        // The right commit passes.
        checkpoint.commit(&Params::new(5, trajectory.expected_params::<f32>(5)), 5);
        checkpoint.restore(&mut params).unwrap();
        check_params(&trajectory, &params, 2, 0, 5, "restore").unwrap();
    }

    #[test]
    fn a_wrong_snapshot_loaded_by_a_sync_fails_the_check() {
        let trajectory = Trajectory::new::<i32>(64);
        let mut params = Params::new(0, vec![0i32; 64]);
        // A snapshot of the right length with one element off (a corrupted or mixed-up state).
        let mut wrong = trajectory.expected_params::<i32>(9);
        wrong[17] = wrong[17].wrapping_add(1);
        let mut bytes = Vec::new();
        Params::new(9, wrong).save(&mut bytes);
        params.load(&bytes).unwrap();
        let err = check_params(&trajectory, &params, 3, 1, 9, "sync").unwrap_err();
        assert!(matches!(err, TrainError::WrongParams { index: 17, phase: "sync", .. }), "{err}");
        // A joiner's zeros claimed as step 9 (a sync that skipped it).
        let zeros = Params::new(0, vec![0i32; 64]);
        assert!(check_params(&trajectory, &zeros, 3, 2, 9, "sync").is_err());
        assert!(check_params(&trajectory, &zeros, 3, 2, 0, "sync").is_ok());
        // A snapshot of another length, or without its step counter, is refused.
        assert!(params.load(&bytes[8..]).is_err());
        assert!(params.load(&bytes[..bytes.len() - 4]).is_err());
    }

    /// bf16 parameters take 32 values, so the parameters of an old step can equal the current
    /// ones: a commit 32 steps old restored as the current one passes a check of the values
    /// alone. The step counter in the snapshot catches it.
    #[test]
    fn a_stale_bf16_commit_with_the_current_values_fails_the_check() {
        use half::bf16;
        let trajectory = Trajectory::new::<bf16>(64);
        // Steps whose parameters are equal (the narrow modulus makes them repeat).
        let (old, now) = (1..200u64)
            .flat_map(|s| [32, 64, 128].map(|k| (s, s + k)))
            .find(|&(a, b)| trajectory.expected_params::<bf16>(a) == trajectory.expected_params::<bf16>(b))
            .expect("bf16 parameters repeat within a few hundred steps");
        assert_eq!(trajectory.first_param_mismatch(&trajectory.expected_params::<bf16>(old), now), None);
        // The commit of `old` restored as the commit of `now` ...
        let mut checkpoint = Checkpoint::new();
        checkpoint.commit(&Params::new(old, trajectory.expected_params::<bf16>(old)), now);
        let mut params = Params::new(0, vec![bf16::ZERO; 64]);
        checkpoint.restore(&mut params).unwrap();
        let err = check_params(&trajectory, &params, 4, 1, now, "restore").unwrap_err();
        assert!(
            matches!(err, TrainError::WrongStep { step, held, phase: "restore", .. } if step == now && held == old),
            "{err}"
        );
        // ... while the real commit of `now` passes.
        checkpoint.commit(&Params::new(now, trajectory.expected_params::<bf16>(now)), now);
        checkpoint.restore(&mut params).unwrap();
        check_params(&trajectory, &params, 4, 1, now, "restore").unwrap();
    }
}
