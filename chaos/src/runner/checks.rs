//! Judging a run: what each fault did and how fast the job reacted (measured from the
//! workers' events), and the per-fault checks on top of the run's invariants: one function
//! per kind of check, [`Run::checks`] gathers them.

use super::*;

impl Run<'_> {
    /// Fills the records' measurements from the events.
    pub(super) fn measure(&self) -> Vec<FaultRecord> {
        measure(&self.records, &self.cluster.events)
    }

    /// Every check of the run: the invariants, each fault's own checks, the shared-memory
    /// release after each disruptive fault, the transports by host, the quiet faults, and how
    /// the job ended.
    pub(super) fn checks(&mut self, codes: &BTreeMap<String, Option<i32>>, end_ms: u64) -> Vec<Check> {
        let events = self.cluster.events.clone();
        let records = self.measure();
        let mut checks = self.invariant_checks(&events, end_ms);
        for r in &records {
            checks.extend(self.fault_checks(r, &events));
        }
        checks.extend(self.fault_checks.iter().cloned());
        checks.extend(self.transport_check(&events));
        if self.sc.transport.as_deref() == Some("tcp") && self.sc.worker_command.is_none() {
            checks.push(invariants::tcp_links_within_plan(&events));
            checks.push(invariants::tcp_links_carried_over(&events));
        }
        if self.sc.worker_command.is_none() {
            let up_to = self.sc.whole_answer_up_to.unwrap_or(JobSettings::default().whole_answer_up_to);
            checks.push(invariants::member_views(&events, up_to));
        }
        checks.extend(self.quiet_checks(&events, &records));
        checks.push(match self.sc.expect {
            Expect::Finish => self.finished_check(codes, &events),
            Expect::Fail => self.failed_check(codes, &events),
        });
        checks
    }

    /// The invariants every run keeps, whatever its faults.
    fn invariant_checks(&self, events: &[WorkerEvent], end_ms: u64) -> Vec<Check> {
        let sc = self.sc;
        let bound_ms = (sc.no_progress.0 + Duration::from_secs(3)).as_millis() as u64;
        let computed =
            sc.worker_command.is_none().then(|| invariants::expected_params_digest(sc.size_bytes(), sc.steps));
        vec![
            invariants::no_wrong_results(events),
            invariants::generations_increase(events),
            invariants::commits_never_lost(events),
            invariants::no_hang(events, &self.signal_windows(), bound_ms, end_ms),
            invariants::errors_typed(events),
            invariants::final_params(
                events,
                computed.as_deref().map_or(invariants::ExpectedParams::Reported, invariants::ExpectedParams::Computed),
                sc.expect,
            ),
        ]
    }

    /// The checks of fault `r` by its kind: disruptive ones reach every survivor with the
    /// root cause; quiet ones are judged by [`Run::quiet_checks`].
    fn fault_checks(&self, r: &FaultRecord, events: &[WorkerEvent]) -> Vec<Check> {
        let sc = self.sc;
        match r.kind {
            FaultKind::Kill | FaultKind::Stop if sc.expect == Expect::Fail => Vec::new(),
            FaultKind::Kill => self.kill_checks(r),
            FaultKind::Stop => stop_checks(r, events, sc),
            FaultKind::Isolate => self.isolate_checks(r, events),
            FaultKind::Straggler => straggler_checks(r, events, sc),
            FaultKind::JoinStorm => vec![join_storm_check(r, events)],
            FaultKind::Blackhole | FaultKind::Partition | FaultKind::Reset => link_checks(r, sc),
            // No per-fault check of their own: the quiet kinds get "no collective failed
            // because of it", a graceful leave and the control-plane faults are judged by the
            // run's invariants (no hang, no lost commit, the final parameters) and by the
            // faults that follow them.
            FaultKind::Term
            | FaultKind::Slow
            | FaultKind::Latency
            | FaultKind::Bandwidth
            | FaultKind::CoordinatorLeaderKill
            | FaultKind::CoordinatorsDown
            | FaultKind::EtcdRestart => Vec::new(),
        }
    }

    /// Kill fault `r`: every survivor named the root cause, the next step came, within the
    /// scenario's bound if it sets one, and several ranks killed at once did not make the
    /// survivors wait for the other dead ones.
    fn kill_checks(&self, r: &FaultRecord) -> Vec<Check> {
        let sc = self.sc;
        let mut checks = vec![
            root_cause_check(r, "every survivor got an error naming the root cause"),
            next_step_check(r, r.kind.name()),
        ];
        if let Some(bound) = sc.kill_errors_within {
            checks.push(kill_errors_check(r, bound.0, &self.cluster.hosts()));
        }
        if r.targets.len() > 1 {
            // One report wins and evicts its suspect; the other dead ranks still hold live
            // leases. Their control streams closed with them, so the survivors must not wait
            // for them (the join window, or the leases).
            let window = sc.join_window.0.as_millis() as i64;
            checks.push(Check {
                what: format!(
                    "fault {} (kill of {} ranks at once): the survivors re-formed without waiting for the other dead ranks (join window {window} ms)",
                    r.index,
                    r.targets.len()
                ),
                ok: r.next_step_ms.is_some_and(|t| t < window),
                detail: format!("next verified step after {} ms", o(r.next_step_ms)),
            });
        }
        checks
    }

    /// Isolate fault `r`: every survivor named the cut-off host (its domain, with several
    /// ranks on it), detection and the next step in time, and the host back once plugged in.
    fn isolate_checks(&self, r: &FaultRecord, events: &[WorkerEvent]) -> Vec<Check> {
        let sc = self.sc;
        let mut checks = vec![root_cause_check(r, "every survivor got an error naming the cut-off host")];
        if sc.ranks_per_host > 1 && r.targets.len() > 1 {
            checks.push(domain_cause_check(r, &self.cluster.hosts()));
        }
        checks.push(detection_check(r, r.kind.name(), sc));
        checks.push(next_step_check(r, r.kind.name()));
        let back: Vec<String> = culprits(r)
            .into_iter()
            .filter(|w| {
                !events
                    .iter()
                    .any(|e| e.worker == *w && e.get::<ev::Step>().is_some_and(|s| s.gen as i64 > r.generation))
            })
            .collect();
        checks.push(Check {
            what: format!("fault {} (isolate): the cut-off host rejoined once plugged back", r.index),
            ok: back.is_empty(),
            detail: if back.is_empty() {
                "verified steps in a later generation".into()
            } else {
                format!("never back: {}", back.join(","))
            },
        });
        checks
    }

    /// With network namespaces and the automatic transport (the built-in worker): shared
    /// memory exactly within each host.
    fn transport_check(&self, events: &[WorkerEvent]) -> Option<Check> {
        let sc = self.sc;
        let auto = sc.transport.as_deref().is_none_or(|t| t == "auto");
        (sc.network == NetworkChoice::Netns && auto && sc.worker_command.is_none())
            .then(|| invariants::transport_by_host(events, &self.cluster.hosts()))
    }

    /// Each quiet fault failed no collective while it lasted.
    fn quiet_checks(&self, events: &[WorkerEvent], records: &[FaultRecord]) -> Vec<Check> {
        self.quiet
            .iter()
            .map(|&(from, to, index)| {
                let errs: Vec<String> = events
                    .iter()
                    .filter(|e| e.t_ms() >= from && e.t_ms() <= to)
                    .filter_map(|e| Some(format!("{}: {}", e.worker, e.get::<ev::Error>()?.cause)))
                    .collect();
                let kind = records.iter().find(|r| r.index == index).map_or("?", |r| r.kind.name());
                Check {
                    what: format!("fault {index} ({kind}): no collective failed because of it"),
                    ok: errs.is_empty(),
                    detail: if errs.is_empty() { "none failed".into() } else { errs.join("; ") },
                }
            })
            .collect()
    }

    /// A job expected to finish: every worker not killed ran all the steps and exited 0 (a
    /// worker sent SIGTERM left gracefully; a stopped one refused afterwards says why).
    fn finished_check(&self, codes: &BTreeMap<String, Option<i32>>, events: &[WorkerEvent]) -> Check {
        let sc = self.sc;
        let mut bad = Vec::new();
        for (w, code) in codes {
            if self.killed.contains(w) {
                continue;
            }
            let summary = last_of::<ev::Summary>(events, w);
            let fatal = last_of::<ev::Fatal>(events, w).map(|f| &*f.error);
            if self.leaving.contains(w) {
                if *code != Some(0) || !summary.is_some_and(|s| s.left) {
                    bad.push(format!("{w} (SIGTERM) exit {code:?} without a graceful leave"));
                }
            } else if self.signals.iter().any(|s| s.worker == *w && s.signal == libc::SIGSTOP) && *code != Some(0) {
                // A hung rank that came back after its exclusion may be refused; then it
                // must say why.
                if fatal.is_none_or(str::is_empty) {
                    bad.push(format!("{w} (was stopped) exit {code:?} without a reason"));
                }
            } else if *code != Some(0) || summary.map(|s| s.final_step) != Some(sc.steps) {
                bad.push(format!(
                    "{w} exit {code:?} final step {:?}{}",
                    summary.map(|s| s.final_step),
                    fatal.map(|e| format!(": {e}")).unwrap_or_default()
                ));
            } else if sc.alltoall_every.is_some() && summary.and_then(|s| s.alltoalls).unwrap_or(0) == 0 {
                bad.push(format!("{w} finished without a verified alltoall (alltoall_every is set)"));
            }
        }
        Check {
            what: format!("the job finished: every remaining worker ran all {} steps and exited 0", sc.steps),
            ok: bad.is_empty(),
            detail: if bad.is_empty() { format!("{} workers", codes.len()) } else { bad.join("; ") },
        }
    }

    /// A job expected to fail below `min_workers`: every worker not killed failed saying so.
    fn failed_check(&self, codes: &BTreeMap<String, Option<i32>>, events: &[WorkerEvent]) -> Check {
        let mut bad = Vec::new();
        for (w, code) in codes {
            if self.killed.contains(w) {
                continue;
            }
            let fatal = last_of::<ev::Fatal>(events, w).map_or("", |f| &*f.error);
            if *code == Some(0) || !fatal.contains("min_workers") {
                bad.push(format!("{w}: exit {code:?}, error {fatal:?}"));
            }
        }
        Check {
            what: "the job failed below min_workers, every remaining worker saying why".into(),
            ok: bad.is_empty(),
            detail: if bad.is_empty() {
                "every remaining worker failed naming min_workers".into()
            } else {
                bad.join("; ")
            },
        }
    }
}

/// The last event of kind `T` that worker `w` printed.
fn last_of<'a, T: ev::EventBody>(events: &'a [WorkerEvent], w: &str) -> Option<&'a T> {
    events.iter().rev().filter(|e| e.worker == w).find_map(WorkerEvent::get::<T>)
}

/// The workers fault `r` struck: its targets, then its peers.
fn culprits(r: &FaultRecord) -> Vec<String> {
    r.targets.iter().map(|t| t.split('(').next().unwrap_or("").to_string()).chain(r.peers.iter().cloned()).collect()
}

/// Check: every survivor of fault `r` got an error naming one of the workers it struck.
fn root_cause_check(r: &FaultRecord, what: &str) -> Check {
    let culprits = culprits(r);
    let named = r.errors.iter().filter(|e| culprits.iter().any(|c| cause_names(&e.cause, c))).count();
    Check {
        what: format!("fault {} ({}): {what}", r.index, r.kind.name()),
        ok: named == r.survivors.len() && !r.survivors.is_empty(),
        detail: format!("{named} of {} survivors; causes: {}", r.survivors.len(), causes(r)),
    }
}

/// Stop fault `r`: every survivor named the hung rank, the next step came, `status` showed
/// the hung rank as the stalest; hung past the deadline, it is a silent fault like a cut link
/// (detected in time, by a timeout).
fn stop_checks(r: &FaultRecord, events: &[WorkerEvent], sc: &Scenario) -> Vec<Check> {
    let mut checks = vec![
        root_cause_check(r, "every survivor got an error naming the root cause"),
        next_step_check(r, r.kind.name()),
    ];
    checks.extend(hung_rank_status_check(r, events, sc));
    let deadline = sc.no_progress.0 + sc.step_interval.0 + Duration::from_millis(1000);
    if Duration::from_millis(r.duration_ms) > deadline {
        checks.push(detection_check(r, r.kind.name(), sc));
        checks.push(hang_timeout_check(r));
    }
    checks
}

/// Join-storm fault `r`: every joiner verified steps.
fn join_storm_check(r: &FaultRecord, events: &[WorkerEvent]) -> Check {
    let joiners: Vec<&str> = r.note.strip_prefix("joined: ").map(|n| n.split(',').collect()).unwrap_or_default();
    let missing: Vec<&str> = joiners
        .iter()
        .copied()
        .filter(|w| !events.iter().any(|e| e.worker == *w && e.get::<ev::Step>().is_some()))
        .collect();
    Check {
        what: format!("fault {} (join_storm): every joiner verified steps", r.index),
        ok: !joiners.is_empty() && missing.is_empty(),
        detail: if missing.is_empty() {
            format!("{} joiners", joiners.len())
        } else {
            format!("never stepped: {}", missing.join(","))
        },
    }
}

/// Link fault `r` (blackhole, partition, reset): every member named an end of the link and
/// none called it a lost failure domain (every process lives and reports: a cycle of
/// timeouts on one host is the link's failure, not the host's), detection in time (not for
/// a reset, which is no silence), and the next step.
fn link_checks(r: &FaultRecord, sc: &Scenario) -> Vec<Check> {
    let kind = r.kind.name();
    let culprits = culprits(r);
    let named = r.errors.iter().filter(|e| culprits.iter().any(|c| cause_names(&e.cause, c))).count();
    let as_domain = r.errors.iter().filter(|e| names_a_lost_domain(&e.cause)).count();
    let mut checks = vec![
        Check {
            what: format!("fault {} ({kind}): every member got an error naming an end of the link", r.index),
            ok: named == r.survivors.len() && !r.survivors.is_empty(),
            detail: format!("{named} of {}; causes: {}", r.survivors.len(), causes(r)),
        },
        Check {
            what: format!("fault {} ({kind}): no error calls the link's failure a lost domain", r.index),
            ok: as_domain == 0,
            detail: format!("{as_domain} of {} did; causes: {}", r.errors.len(), causes(r)),
        },
    ];
    if r.kind != FaultKind::Reset {
        checks.push(detection_check(r, kind, sc));
    }
    checks.push(next_step_check(r, kind));
    checks
}

/// Whether the evidence shows the fault struck while the target's allreduce was in flight
/// (the harness strikes after the target announced one, but announcing is not proof): the
/// target's last announced allreduce before the strike, of step S, had not completed (no
/// `step` event for S+1 before the strike), and a survivor's error names step S outside the
/// commit and sync phases.
pub(super) fn struck_mid_allreduce(r: &FaultRecord, events: &[WorkerEvent]) -> bool {
    let Some(target) = r.targets.first().map(|t| t.split('(').next().unwrap_or("").to_string()) else {
        return false;
    };
    let at = r.at_ms;
    let gen = r.generation;
    let Some(step) = events
        .iter()
        .filter(|e| e.worker == target && e.t_ms() <= at)
        .filter_map(|e| e.get::<ev::Allreduce>())
        .filter(|a| a.gen as i64 == gen)
        .map(|a| a.step)
        .max()
    else {
        return false;
    };
    let completed = events.iter().any(|e| {
        e.worker == target
            && e.t_ms() <= at
            && e.get::<ev::Step>().is_some_and(|s| s.gen as i64 == gen && s.step == step + 1)
    });
    let in_flight_error = events.iter().any(|e| {
        r.survivors.contains(&e.worker)
            && e.get::<ev::Error>().is_some_and(|x| x.gen as i64 == gen && x.step == Some(step) && x.phase.is_none())
    });
    !completed && in_flight_error
}

/// Fills the records' measurements from the events. A fault's errors are its survivors'
/// first errors in its generation from its moment on, and before the next fault of the same
/// generation (whose errors they would be).
pub(super) fn measure(records: &[FaultRecord], events: &[WorkerEvent]) -> Vec<FaultRecord> {
    let mut out = records.to_vec();
    for r in out.iter_mut() {
        r.mid_allreduce = r.mid_allreduce && struck_mid_allreduce(r, events);
    }
    for (i, r) in out.iter_mut().enumerate() {
        let at = r.at_ms as i64;
        let until =
            records[i + 1..].iter().find(|n| n.generation == r.generation).map_or(i64::MAX, |n| n.at_ms as i64 - 5);
        let mut errors: Vec<ErrorSeen> = Vec::new();
        for w in &r.survivors {
            let seen = events
                .iter()
                .filter(|e| e.worker == *w)
                .filter_map(|e| e.get::<ev::Error>())
                .find(|x| x.gen as i64 == r.generation && x.t_ms as i64 >= at - 5);
            if let Some(x) = seen.filter(|x| (x.t_ms as i64) < until) {
                errors.push(ErrorSeen {
                    worker: w.clone(),
                    kind: x.kind.clone(),
                    cause: x.cause.to_string(),
                    after_ms: x.t_ms as i64 - at,
                });
            }
        }
        if !errors.is_empty() {
            let first = errors.iter().map(|e| e.after_ms).min();
            let last = errors.iter().map(|e| e.after_ms).max();
            r.first_error_ms = first;
            if errors.len() == r.survivors.len() {
                r.survivors_errors_ms = last;
            }
            r.revocation_ms = first.zip(last).map(|(a, b)| b - a);
        }
        r.errors = errors;
        let kind = Some(r.kind);
        if kind.is_some_and(|k| !k.quiet()) {
            if let Some(s) = events
                .iter()
                .filter_map(|e| e.get::<ev::Step>())
                .find(|s| s.gen as i64 > r.generation && s.t_ms as i64 >= at)
            {
                r.next_step_ms = Some(s.t_ms as i64 - at);
                r.next_generation = Some(s.gen as i64);
            }
        }
        if kind.is_some_and(FaultKind::quiet) && r.duration_ms > 0 {
            let d = r.duration_ms as i64;
            r.steps_per_s_before = step_rate(events, at - d, at);
            r.steps_per_s_during = step_rate(events, at, at + d);
        }
        if let Some(s) = r.straggler.as_mut() {
            let highest = |t: u64| {
                events.iter().filter_map(|e| e.get::<ev::Step>()).filter(|s| s.t_ms <= t).map(|s| s.step as i64).max()
            };
            s.named_after_steps = s.named_at_ms.and_then(highest).map(|n| n - r.step);
            // Before: up to 3 s of the fault-free job; during: while the straggler was a
            // member; after: from its leave (plus the re-formation) to its return.
            r.steps_per_s_before = step_rate(events, at - (r.duration_ms as i64).min(3000), at);
            let left = s.excluded_at_ms.map(|t| t as i64);
            r.steps_per_s_during = step_rate(events, at, left.unwrap_or(at + r.duration_ms as i64));
            if let Some(left) = left {
                let back = s.rejoined_at_ms.map_or(at + r.duration_ms as i64, |t| t as i64);
                s.steps_per_s_after = step_rate(events, left + 300, back);
            }
            if let Some(back) = s.rejoined_at_ms.map(|t| t as i64) {
                s.steps_per_s_rejoined = step_rate(events, back + 300, back + 3300);
            }
        }
        if kind == Some(FaultKind::JoinStorm) {
            let joiners: Vec<&str> =
                r.note.strip_prefix("joined: ").map(|n| n.split(',').collect()).unwrap_or_default();
            r.absorbed_ms = absorbed(events, r.generation, &joiners).map(|t| t as i64 - at);
        }
    }
    out
}

/// Checks of straggler fault `r`: the slowed rank named (as a compute straggler) within the
/// scenario's bound, nobody else named, no collective failed (no false timeout: the stops
/// stay under the learned deadlines' floor); under `exclude` it left at a commit point, the
/// job's pace recovered to 0.9 of the fault-free rate, and it came back after its cool-down;
/// under `report` nothing was excluded.
pub(super) fn straggler_checks(r: &FaultRecord, events: &[WorkerEvent], sc: &Scenario) -> Vec<Check> {
    let Some(s) = &r.straggler else { return Vec::new() };
    let spec = sc.faults.get((r.index - 1) % sc.faults.len().max(1));
    let within = spec.and_then(|f| f.name_within_steps).unwrap_or(0) as i64;
    let i = r.index;
    let mut out = vec![
        Check {
            what: format!("fault {i} (straggler): the coordinator named the slowed rank a compute straggler within {within} steps"),
            ok: s.named.as_deref() == Some(s.target.as_str())
                && s.kind == "compute"
                && s.named_after_steps.is_some_and(|n| n <= within),
            detail: format!(
                "{} named after {} steps ({} ms): {}; action: {}",
                s.named.as_deref().unwrap_or("nobody"),
                o(s.named_after_steps),
                o(s.named_at_ms.map(|t| t as i64 - r.at_ms as i64)),
                s.reason,
                s.action
            ),
        },
        Check {
            what: format!("fault {i} (straggler): no other member was named"),
            ok: s.others_named.is_empty(),
            detail: if s.others_named.is_empty() { "none".into() } else { s.others_named.join(",") },
        },
    ];
    let errors: Vec<String> = events
        .iter()
        .filter(|e| e.t_ms() >= r.at_ms)
        .filter_map(|e| Some((e, e.get::<ev::Error>()?)))
        .map(|(e, x)| format!("{}: {} {}", e.worker, x.kind, x.cause))
        .collect();
    out.push(Check {
        what: format!("fault {i} (straggler): no false timeout (no collective failed from the fault to the end)"),
        ok: errors.is_empty(),
        detail: if errors.is_empty() { format!("{} duty cycles, none failed", s.cycles) } else { errors.join("; ") },
    });
    let leaves: Vec<(&WorkerEvent, &ev::StragglerLeave)> =
        events.iter().filter_map(|e| Some((e, e.get::<ev::StragglerLeave>()?))).collect();
    if s.policy == "exclude" {
        out.push(Check {
            what: format!("fault {i} (straggler, exclude): the straggler left at a commit point"),
            ok: s.excluded_at_ms.is_some() && leaves.iter().all(|(e, _)| e.worker == s.target),
            detail: leaves
                .first()
                .map_or("no straggler_leave event".into(), |(e, l)| format!("{} at step {}", e.worker, l.step)),
        });
        let (before, after) = (r.steps_per_s_before.unwrap_or(0.0), s.steps_per_s_after.unwrap_or(0.0));
        out.push(Check {
            what: format!("fault {i} (straggler, exclude): steps/s after the exclusion >= 0.9 of the fault-free rate"),
            ok: before > 0.0 && after >= 0.9 * before,
            detail: format!(
                "before {before:.1}, with the straggler {:.1}, after its exclusion {after:.1} (x{:.2})",
                r.steps_per_s_during.unwrap_or(0.0),
                after / before.max(f64::MIN_POSITIVE)
            ),
        });
        let cooldown = sc.straggler_cooldown.map_or(60_000, |d| d.0.as_millis() as i64);
        let away = s.excluded_at_ms.zip(s.rejoined_at_ms).map(|(a, b)| b as i64 - a as i64);
        out.push(Check {
            what: format!("fault {i} (straggler, exclude): it came back after its cool-down ({cooldown} ms)"),
            ok: away.is_some_and(|t| t >= cooldown - 200),
            detail: format!("verified steps again {} ms after its leave", o(away)),
        });
    } else {
        let shrank: Vec<u64> = events
            .iter()
            .filter_map(|e| e.get::<ev::Generation>())
            .filter(|g| g.t_ms >= r.at_ms && (g.world as i64) < r.world)
            .map(|g| g.gen)
            .collect();
        out.push(Check {
            what: format!("fault {i} (straggler, report): nothing was excluded"),
            ok: leaves.is_empty() && shrank.is_empty(),
            detail: format!("{} straggler leaves, smaller generations: {shrank:?}", leaves.len()),
        });
    }
    out
}

/// The job's verified steps per second between `from` and `to` (ms since the epoch): the
/// highest verified step at `to` less the highest at `from`, over the time between. The
/// window starts no earlier than the job's first verified step; `None` if nothing is left.
pub(super) fn step_rate(events: &[WorkerEvent], from: i64, to: i64) -> Option<f64> {
    let steps = || events.iter().filter_map(|e| e.get::<ev::Step>());
    let first = steps().map(|s| s.t_ms as i64).min()?;
    let from = from.max(first);
    if to <= from {
        return None;
    }
    let highest = |t: i64| steps().filter(|s| s.t_ms as i64 <= t).map(|s| s.step as i64).max().unwrap_or(0);
    Some((highest(to) - highest(from)) as f64 * 1000.0 / (to - from) as f64)
}

/// When the first verified step of a generation newer than `after` holding every one of
/// `joiners` came (ms since the epoch).
pub(super) fn absorbed(events: &[WorkerEvent], after: i64, joiners: &[&str]) -> Option<u64> {
    if joiners.is_empty() {
        return None;
    }
    let mut members: BTreeMap<i64, BTreeSet<&str>> = BTreeMap::new();
    for (e, g) in events.iter().filter_map(|e| Some((e, e.get::<ev::Generation>()?))) {
        members.entry(g.gen as i64).or_default().insert(e.worker.as_str());
    }
    let full = members.iter().find(|(g, m)| **g > after && joiners.iter().all(|j| m.contains(j))).map(|(g, _)| *g)?;
    events.iter().filter_map(|e| e.get::<ev::Step>()).filter(|s| s.gen as i64 == full).map(|s| s.t_ms).min()
}

/// Check: while the ranks of stop fault `r` were hung, the coordinator's `status` showed
/// them as the members silent the longest (every other member's heartbeat was fresher), in
/// the generation they hung in, at a step no later than the last one they printed. `None`
/// when no status was taken (the scenario's timings leave no room; said in the note).
pub(super) fn hung_rank_status_check(r: &FaultRecord, events: &[WorkerEvent], sc: &Scenario) -> Option<Check> {
    let what = format!("fault {} (stop): the coordinator's status showed the hung rank as the stalest member", r.index);
    let Some(status) = &r.status else {
        if r.note.starts_with("no status taken") {
            return None;
        }
        return Some(Check { what, ok: false, detail: "status could not be read".into() });
    };
    let hung: Vec<&str> = r.targets.iter().map(|t| t.split('(').next().unwrap_or("")).collect();
    let mut problems = Vec::new();
    let freshest_hung =
        status.members.iter().filter(|m| hung.contains(&m.worker.as_str())).map(|m| m.heartbeat_age_ms).min();
    let stalest_other =
        status.members.iter().filter(|m| !hung.contains(&m.worker.as_str())).map(|m| m.heartbeat_age_ms).max();
    let mut shown = Vec::new();
    for w in &hung {
        let Some(m) = status.members.iter().find(|m| m.worker == *w) else {
            problems.push(format!("{w} not listed"));
            continue;
        };
        let printed = events
            .iter()
            .filter(|e| e.worker == *w)
            .filter_map(|e| e.get::<ev::Allreduce>())
            .filter(|a| a.gen as i64 == r.generation && a.t_ms <= r.at_ms)
            .map(|a| a.step as i64)
            .max();
        shown.push(format!(
            "{w}: heartbeat {} ms ago, gen {} step {} {} (printed step {})",
            m.heartbeat_age_ms,
            m.generation,
            m.step,
            m.activity,
            o(printed)
        ));
        let min_age = (sc.heartbeat_interval.0 * 2).as_millis() as u64;
        if m.heartbeat_age_ms < min_age {
            problems.push(format!("{w}'s heartbeat age {} ms < {min_age} ms", m.heartbeat_age_ms));
        }
        if m.generation as i64 != r.generation {
            problems.push(format!("{w} shown in generation {}, hung in {}", m.generation, r.generation));
        }
        if printed.is_none_or(|p| m.step as i64 > p) {
            problems.push(format!("{w} shown at step {}, beyond the last it printed ({})", m.step, o(printed)));
        }
    }
    if let (Some(hung_age), Some(other_age)) = (freshest_hung, stalest_other) {
        if other_age >= hung_age {
            problems.push(format!("another member's heartbeat is as old ({other_age} ms)"));
        }
    }
    shown.push(format!("others at most {} ms", stalest_other.map_or_else(|| "-".into(), |a| a.to_string())));
    Some(Check {
        what,
        ok: problems.is_empty(),
        detail: format!(
            "+{} ms: {}{}",
            status.after_ms,
            shown.join("; "),
            if problems.is_empty() { String::new() } else { format!(" -- {}", problems.join("; ")) }
        ),
    })
}

/// Check: every survivor of kill `r` got its error within `bound` of the SIGKILL; the detail
/// gives each survivor's time, marking those on the killed rank's host (its shared-memory
/// peers) with `shm`.
pub(super) fn kill_errors_check(r: &FaultRecord, bound: Duration, hosts: &BTreeMap<String, String>) -> Check {
    let dead: Vec<&str> = r.targets.iter().map(|t| t.split('(').next().unwrap_or("")).collect();
    let dead_hosts: BTreeSet<&str> = dead.iter().filter_map(|w| hosts.get(*w)).map(String::as_str).collect();
    let limit = bound.as_millis() as i64;
    let mut late = Vec::new();
    let mut seen = Vec::new();
    for w in &r.survivors {
        let shm = hosts.get(w).is_some_and(|h| dead_hosts.contains(h.as_str()));
        match r.errors.iter().find(|e| e.worker == *w) {
            Some(e) => {
                seen.push(format!("{w}{} {} ms", if shm { " (shm)" } else { "" }, e.after_ms));
                if e.after_ms > limit {
                    late.push(w.clone());
                }
            }
            None => {
                seen.push(format!("{w}{} none", if shm { " (shm)" } else { "" }));
                late.push(w.clone());
            }
        }
    }
    Check {
        what: format!("fault {} (kill): every survivor's error within {limit} ms", r.index),
        ok: late.is_empty() && !r.survivors.is_empty(),
        detail: format!(
            "{}{}",
            seen.join(", "),
            if late.is_empty() { String::new() } else { format!(" -- late or missing: {}", late.join(",")) }
        ),
    }
}

/// Check: a hung rank (stop fault `r`) is detected as a `Timeout` (the first survivor's
/// error), and no survivor takes it for a death (`PeerFailed`): a stopped process's links
/// stay open, so only the no-progress deadline can tell. A survivor whose link closed
/// because a peer aborted on the revocation reports `PeerFailed` with the generation's root
/// cause, the timeout: that is the verdict reaching it, not a death taken for the hang (with
/// learned deadlines the revocation and those closes arrive within the same millisecond).
///
/// The detector's own `Timeout` line is not always printed first: it reports to the
/// coordinator before it prints, and a survivor the revocation reaches meanwhile may print
/// its `PeerFailed` (carrying the timeout verdict) a millisecond earlier. So the check asks
/// that some survivor detected a `Timeout` and that the first error, whatever its kind,
/// carries a hang's root cause.
pub(super) fn hang_timeout_check(r: &FaultRecord) -> Check {
    // A timeout's root cause reads "timed out after ..." or, when the peer's process was
    // probed, what was found: "process stopped, no progress for N ms".
    let hang_cause = |cause: &str| cause.contains("timed out") || cause.contains("no progress for");
    let first = r.errors.iter().min_by_key(|e| e.after_ms);
    let dead: Vec<&str> = r
        .errors
        .iter()
        .filter(|e| e.kind == "PeerFailed" && !hang_cause(&e.cause))
        .map(|e| e.worker.as_str())
        .collect();
    let kinds: BTreeSet<&str> = r.errors.iter().map(|e| e.kind.as_str()).collect();
    let detected = r.errors.iter().any(|e| e.kind == "Timeout");
    Check {
        what: format!("fault {} (stop): detected as a Timeout, by no survivor as a death", r.index),
        ok: detected && first.is_some_and(|e| e.kind == "Timeout" || hang_cause(&e.cause)) && dead.is_empty(),
        detail: format!(
            "first error {}; kinds seen {:?}{}",
            first.map_or_else(|| "none".to_string(), |e| format!("{} at {} ms", e.kind, e.after_ms)),
            kinds,
            if dead.is_empty() { String::new() } else { format!(" -- PeerFailed at {}", dead.join(",")) }
        ),
    }
}

/// Check: a later generation verified a step after fault `r`.
pub(super) fn next_step_check(r: &FaultRecord, kind: &str) -> Check {
    Check {
        what: format!("fault {} ({kind}): the next generation verified a step", r.index),
        ok: r.next_step_ms.is_some(),
        detail: format!("{} ms", o(r.next_step_ms)),
    }
}

/// Check: a silent fault (no FIN, no RST) was detected within the no-progress deadline, plus
/// a step interval and 1 s of slack.
pub(super) fn detection_check(r: &FaultRecord, kind: &str, sc: &Scenario) -> Check {
    let limit = (sc.no_progress.0 + sc.step_interval.0 + Duration::from_millis(1000)).as_millis() as i64;
    Check {
        what: format!(
            "fault {} ({kind}): detected within the no-progress deadline ({} ms) + 1 s",
            r.index,
            sc.no_progress.0.as_millis()
        ),
        ok: r.first_error_ms.is_some_and(|t| t <= limit),
        detail: format!("first error after {} ms", o(r.first_error_ms)),
    }
}

pub(super) fn o(v: Option<i64>) -> String {
    v.map_or_else(|| "-".into(), |x| x.to_string())
}

/// A host of several ranks cut off at once is one failure of its domain: every survivor's root
/// cause names the host as the lost domain and counts all of its ranks (the coordinator's
/// domain rule, `cohort_coordinator::domains`; the chaos harness publishes each emulated host
/// as its workers' domain).
pub(super) fn domain_cause_check(r: &FaultRecord, hosts: &BTreeMap<String, String>) -> Check {
    let worker = |t: &String| t.split('(').next().unwrap_or("").to_string();
    let host = r.targets.first().map(worker).and_then(|w| hosts.get(&w).cloned()).unwrap_or_default();
    let want = (format!("domain {host} lost: ranks "), format!("(all {} of its ranks)", r.targets.len()));
    let named = r.errors.iter().filter(|e| e.cause.contains(&want.0) && e.cause.contains(&want.1)).count();
    Check {
        what: format!(
            "fault {} (host {host} of {} ranks lost): one root cause naming the domain and all its ranks",
            r.index,
            r.targets.len()
        ),
        ok: !host.is_empty() && named == r.survivors.len() && !r.survivors.is_empty(),
        detail: format!("{named} of {} survivors; causes: {}", r.survivors.len(), causes(r)),
    }
}

/// Whether a root cause as a worker prints it (`rank 2 (worker w2 on host-a): SIGKILL
/// (reported by w0)`, see `cohort::RootCause`'s Display) blames worker `name`: the id after
/// "(worker " is compared exactly, so that `w1` matches neither `w10` nor a reporter's name.
/// Whether a root cause is the coordinator's whole-domain loss (`domain H lost: ranks ...`).
fn names_a_lost_domain(cause: &str) -> bool {
    cause
        .split("domain ")
        .skip(1)
        .any(|rest| rest.split_once(' ').is_some_and(|(_, tail)| tail.starts_with("lost: ranks")))
}

pub(crate) fn cause_names(cause: &str, name: &str) -> bool {
    let Some(start) = cause.find("(worker ") else { return false };
    let rest = &cause[start + "(worker ".len()..];
    let end = rest.find([' ', ')']).unwrap_or(rest.len());
    !name.is_empty() && &rest[..end] == name
}

pub(super) fn causes(r: &FaultRecord) -> String {
    let mut c: Vec<String> = r.errors.iter().map(|e| format!("{} {}: {}", e.worker, e.kind, e.cause)).collect();
    c.truncate(4);
    c.join(" | ")
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_kill_is_mid_allreduce_only_on_evidence() {
        let record = FaultRecord {
            targets: vec!["w1(rank 1)".into()],
            survivors: vec!["w0".into()],
            generation: 2,
            at_ms: 1000,
            mid_allreduce: true,
            ..Default::default()
        };
        let announced = ev("w1", "event=allreduce gen=2 rank=1 step=7 t_ms=990");
        // In flight: the survivor's allreduce of step 7 failed.
        let in_flight =
            [announced.clone(), ev("w0", "event=error gen=2 rank=0 step=7 kind=PeerFailed cause=x t_ms=1003")];
        assert!(struck_mid_allreduce(&record, &in_flight));
        // The collective had ended before the kill: the victim reported step 8, and the
        // survivor failed later, at the commit point.
        let after = [
            announced.clone(),
            ev("w1", "event=step gen=2 world=2 rank=1 step=8 ms=1.000 t_ms=995"),
            ev("w0", "event=error gen=2 rank=0 step=8 phase=commit kind=PeerFailed cause=x t_ms=1004"),
        ];
        assert!(!struck_mid_allreduce(&record, &after));
        // No error from a survivor at that step: no evidence.
        assert!(!struck_mid_allreduce(&record, &[announced]));
        let measured = measure(&[record], &after);
        assert!(!measured[0].mid_allreduce, "measure reports the kill as not mid-allreduce");
    }

    #[test]
    fn a_lost_domain_is_told_from_other_causes() {
        assert!(names_a_lost_domain(
            "rank 0 (worker w1 on vm): domain vm lost: ranks 0-3 (all 4 of its ranks) failed together; first report: x"
        ));
        assert!(!names_a_lost_domain("rank 0 (worker w1 on vm): timed out after 1.5s waiting on rank 3"));
        assert!(!names_a_lost_domain("rank 0 (worker w1 on vm): failure domain vm is excluded"));
    }

    #[test]
    fn a_cause_names_a_worker_exactly() {
        let cause = "rank 1 (worker w1 on vm): peer rank 1 failed (reported by w0)";
        assert!(cause_names(cause, "w1"));
        assert!(!cause_names(cause, "w0"), "the reporter is not the culprit");
        assert!(!cause_names("rank 1 (worker w10 on vm): SIGKILL", "w1"), "w10 is not w1");
        assert!(!cause_names("rank 1 (worker w1 on vm): SIGKILL", "w10"));
        assert!(cause_names("(worker w3): left", "w3"));
        assert!(!cause_names("lease expired", "w3"));
        assert!(!cause_names("rank 1 (worker w1 on vm): x", ""));
    }

    use super::*;

    fn ev(worker: &str, line: &str) -> WorkerEvent {
        WorkerEvent::parse(worker, line, 0).unwrap()
    }

    #[test]
    fn straggler_checks_follow_the_policy() {
        let scenario = |policy: &str| {
            Scenario::parse(
                "s",
                &format!(
                    "compute = \"8ms\"\nstraggler_policy = \"{policy}\"\nstraggler_cooldown = \"5s\"\n[[fault]]\nkind = \"straggler\"\nranks = [1]\nduration = \"5s\"\nstop_for = \"20ms\"\nrun_for = \"10ms\"\nname_within_steps = 50"
                ),
            )
            .unwrap()
        };
        let record = |seen: StragglerSeen| FaultRecord {
            index: 1,
            kind: FaultKind::Straggler,
            generation: 1,
            world: 3,
            step: 100,
            at_ms: 10_000,
            steps_per_s_before: Some(40.0),
            steps_per_s_during: Some(25.0),
            straggler: Some(seen),
            ..Default::default()
        };
        let named = StragglerSeen {
            target: "w1".into(),
            named: Some("w1".into()),
            kind: "compute".into(),
            named_after_steps: Some(20),
            ..Default::default()
        };
        let failed = |checks: &[Check]| checks.iter().filter(|c| !c.ok).map(|c| c.what.clone()).collect::<Vec<_>>();
        // Report: named in time, nothing excluded, nothing failed.
        let report = StragglerSeen { policy: "report".into(), ..named.clone() };
        let steps = [ev("w0", "event=step gen=1 world=3 rank=0 step=120 ms=1.000 t_ms=11000")];
        assert!(failed(&straggler_checks(&record(report.clone()), &steps, &scenario("report"))).is_empty());
        // ... but named too late, or someone else named, or a timeout, or a leave: each fails.
        let late = StragglerSeen { named_after_steps: Some(51), ..report.clone() };
        assert_eq!(failed(&straggler_checks(&record(late), &steps, &scenario("report"))).len(), 1);
        let other = StragglerSeen { others_named: vec!["w2".into()], ..report.clone() };
        assert_eq!(failed(&straggler_checks(&record(other), &steps, &scenario("report"))).len(), 1);
        let timeout = [ev("w0", "event=error gen=1 rank=0 step=121 kind=Timeout cause=x t_ms=11500")];
        assert_eq!(failed(&straggler_checks(&record(report.clone()), &timeout, &scenario("report"))).len(), 1);
        let leave = [ev("w1", "event=straggler_leave gen=1 rank=1 step=121 reason=x t_ms=11500")];
        assert_eq!(failed(&straggler_checks(&record(report), &leave, &scenario("report"))).len(), 1);
        // Exclude: a leave, the pace back to 0.9 of the fault-free rate, a return after the
        // cool-down.
        let excluded = StragglerSeen {
            policy: "exclude".into(),
            excluded_at_ms: Some(11_500),
            rejoined_at_ms: Some(16_600),
            steps_per_s_after: Some(37.0),
            ..named
        };
        assert!(failed(&straggler_checks(&record(excluded.clone()), &leave, &scenario("exclude"))).is_empty());
        let slow = StragglerSeen { steps_per_s_after: Some(35.0), ..excluded.clone() };
        assert_eq!(failed(&straggler_checks(&record(slow), &leave, &scenario("exclude"))).len(), 1);
        let early = StragglerSeen { rejoined_at_ms: Some(12_000), ..excluded.clone() };
        assert_eq!(failed(&straggler_checks(&record(early), &leave, &scenario("exclude"))).len(), 1);
        let stayed = StragglerSeen { excluded_at_ms: None, rejoined_at_ms: None, ..excluded };
        assert!(failed(&straggler_checks(&record(stayed), &steps, &scenario("exclude"))).len() >= 2);
    }

    fn record(index: usize, kind: &str, generation: i64, at_ms: u64, survivors: &[&str]) -> FaultRecord {
        FaultRecord {
            index,
            kind: FaultKind::from_name(kind).expect("a fault kind"),
            generation,
            at_ms,
            survivors: survivors.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn quiet_faults_measure_the_step_rate_and_re_form_nothing() {
        // Steps 1..=10 at t=1000..1900 (10 per second), then steps 11..=15 at t=2100..2900
        // (5 per second while a 1 s latency fault struck at t=2000 lasts); a kill at t=3500
        // re-forms into generation 2 at t=3600.
        let mut events: Vec<WorkerEvent> = (1..=10)
            .map(|s| ev("w0", &format!("event=step gen=1 world=1 rank=0 step={s} ms=1.000 t_ms={}", 900 + s * 100)))
            .collect();
        events.extend((11..=15).map(|s| {
            ev("w0", &format!("event=step gen=1 world=1 rank=0 step={s} ms=1.000 t_ms={}", 2100 + (s - 11) * 200))
        }));
        events.push(ev("w0", "event=step gen=2 world=1 rank=0 step=16 ms=1.000 t_ms=3600"));
        let mut latency = record(1, "latency", 1, 2000, &["w0"]);
        latency.duration_ms = 1000;
        let out = measure(&[latency, record(2, "kill", 1, 3500, &["w0"])], &events);
        assert_eq!(out[0].next_step_ms, None, "a latency fault re-forms nothing; generation 2 is the kill's");
        assert_eq!(out[0].steps_per_s_before, Some(9.0), "steps 1..10 between t=1000 and t=2000: 10 - 1 over 1 s");
        assert_eq!(out[0].steps_per_s_during, Some(5.0));
        assert!(out[0].extra().contains("x0.56"), "{}", out[0].extra());
        assert_eq!(out[1].next_step_ms, Some(100));
        assert_eq!(step_rate(&events, 0, 500), None, "before the first step");
    }

    #[test]
    fn the_kill_bound_wants_every_survivor_in_time_and_marks_the_shared_memory_peers() {
        let hosts: BTreeMap<String, String> = [("w0", "host0"), ("w1", "host0"), ("w2", "host1")]
            .iter()
            .map(|(w, h)| (w.to_string(), h.to_string()))
            .collect();
        let mut r = record(1, "kill", 1, 1000, &["w0", "w2"]);
        r.targets = vec!["w1(rank 1)".into()];
        let seen = |worker: &str, after_ms| ErrorSeen {
            worker: worker.into(),
            kind: "PeerFailed".into(),
            cause: "rank 1 (worker w1 on vm): SIGKILL".into(),
            after_ms,
        };
        r.errors = vec![seen("w0", 3), seen("w2", 40)];
        let c = kill_errors_check(&r, Duration::from_millis(100), &hosts);
        assert!(c.ok, "{}", c.detail);
        assert_eq!(c.detail, "w0 (shm) 3 ms, w2 40 ms");
        r.errors = vec![seen("w0", 3), seen("w2", 140)];
        let c = kill_errors_check(&r, Duration::from_millis(100), &hosts);
        assert!(!c.ok && c.detail.ends_with("late or missing: w2"), "{}", c.detail);
        r.errors.truncate(1);
        assert!(!kill_errors_check(&r, Duration::from_millis(100), &hosts).ok, "a survivor without an error");
    }

    #[test]
    fn a_lost_host_must_be_one_domain_cause_with_all_its_ranks() {
        let hosts: BTreeMap<String, String> =
            [("w0", "host0"), ("w1", "host0"), ("w2", "host0"), ("w3", "host1"), ("w4", "host1"), ("w5", "host1")]
                .iter()
                .map(|(w, h)| (w.to_string(), h.to_string()))
                .collect();
        let mut r = record(1, "isolate", 1, 1000, &["w0", "w1", "w2"]);
        r.targets = vec!["w4(rank 4)".into(), "w3(rank 3)".into(), "w5(rank 5)".into()];
        let seen = |worker: &str, cause: &str| ErrorSeen {
            worker: worker.into(),
            kind: "Timeout".into(),
            cause: cause.into(),
            after_ms: 500,
        };
        let domain = "rank 4 (worker w4 on vm): domain host1 lost: ranks 3-5 (all 3 of its ranks) failed together; first report: timed out";
        r.errors = vec![seen("w0", domain), seen("w1", domain), seen("w2", domain)];
        let c = domain_cause_check(&r, &hosts);
        assert!(c.ok, "{}", c.detail);
        assert!(c.what.contains("host host1 of 3 ranks"), "{}", c.what);
        // One survivor heard a member's cause: the domain was not judged as one failure.
        r.errors[2] = seen("w2", "rank 4 (worker w4 on vm): timed out");
        assert!(!domain_cause_check(&r, &hosts).ok);
        // Two of the three ranks counted: not the whole domain.
        let partial = "rank 4 (worker w4 on vm): domain host1 lost: ranks 3-4 (all 2 of its ranks) failed together";
        r.errors[2] = seen("w2", partial);
        assert!(!domain_cause_check(&r, &hosts).ok);
    }

    #[test]
    fn a_hung_rank_must_be_a_timeout_and_never_a_death() {
        let seen = |worker: &str, kind: &str, after_ms| ErrorSeen {
            worker: worker.into(),
            kind: kind.into(),
            cause: "rank 2 (worker w2 on vm): timed out".into(),
            after_ms,
        };
        let mut r = record(2, "stop", 3, 1000, &["w0", "w1"]);
        r.errors = vec![seen("w1", "Revoked", 1510), seen("w0", "Timeout", 1501)];
        let c = hang_timeout_check(&r);
        assert!(c.ok, "{}", c.detail);
        assert!(c.detail.starts_with("first error Timeout at 1501 ms"), "{}", c.detail);
        // A survivor whose peer closed a link on the revocation carries the timeout verdict.
        r.errors = vec![seen("w0", "Timeout", 1501), seen("w1", "PeerFailed", 1502)];
        assert!(hang_timeout_check(&r).ok, "{}", hang_timeout_check(&r).detail);
        r.errors[1].cause = "rank 2 (worker w2 on vm): peer rank 2 failed: connection reset".into();
        assert!(!hang_timeout_check(&r).ok, "a stopped rank is no dead one");
        // The verdict's PeerFailed printed a millisecond before the detector's Timeout.
        r.errors = vec![seen("w1", "PeerFailed", 1500), seen("w0", "Timeout", 1501)];
        assert!(hang_timeout_check(&r).ok, "{}", hang_timeout_check(&r).detail);
        // ... but some survivor must have detected the timeout itself.
        r.errors = vec![seen("w1", "PeerFailed", 1500), seen("w0", "Revoked", 1501)];
        assert!(!hang_timeout_check(&r).ok, "nobody detected a timeout");
        r.errors.clear();
        assert!(!hang_timeout_check(&r).ok, "no error at all");
    }

    #[test]
    fn a_join_storm_is_absorbed_when_a_generation_holds_every_joiner() {
        let events = [
            ev("w0", "event=generation gen=2 world=3 rank=0 transport=tcp t_ms=100"),
            ev("j1", "event=generation gen=2 world=3 rank=2 transport=tcp t_ms=100"),
            ev("w0", "event=step gen=2 world=1 rank=0 step=5 ms=1.000 t_ms=120"),
            ev("w0", "event=generation gen=3 world=4 rank=0 transport=tcp t_ms=200"),
            ev("j1", "event=generation gen=3 world=4 rank=2 transport=tcp t_ms=200"),
            ev("j2", "event=generation gen=3 world=4 rank=3 transport=tcp t_ms=201"),
            ev("j2", "event=step gen=3 world=1 rank=0 step=6 ms=1.000 t_ms=230"),
            ev("w0", "event=step gen=3 world=1 rank=0 step=6 ms=1.000 t_ms=231"),
        ];
        assert_eq!(absorbed(&events, 1, &["j1", "j2"]), Some(230));
        assert_eq!(absorbed(&events, 1, &["j1"]), Some(120));
        assert_eq!(absorbed(&events, 1, &["j1", "j9"]), None);
        assert_eq!(absorbed(&events, 3, &["j1"]), None, "only generations after the storm's");
    }

    fn seen(worker: &str, age: u64, step: u64) -> crate::report::MemberSeen {
        crate::report::MemberSeen {
            worker: worker.into(),
            rank: Some(0),
            generation: 4,
            step,
            activity: "allreduce".into(),
            heartbeat_age_ms: age,
            control_connected: Some(true),
        }
    }

    #[test]
    fn the_status_check_wants_the_hung_rank_stalest_and_where_it_stopped() {
        let sc: Scenario = toml::from_str("name = \"t\"\nheartbeat_interval = \"200ms\"").expect("scenario");
        let events = [ev("w2", "event=allreduce gen=4 rank=2 step=12 t_ms=900")];
        let mut r = record(1, "stop", 4, 1000, &["w0", "w1"]);
        r.targets = vec!["w2(rank 2)".into()];
        r.status = Some(StatusSeen {
            after_ms: 600,
            members: vec![seen("w0", 90, 12), seen("w1", 150, 12), seen("w2", 680, 11)],
        });
        let c = hung_rank_status_check(&r, &events, &sc).expect("a check");
        assert!(c.ok, "{}", c.detail);
        // Another member as stale: status would not tell who hung.
        r.status = Some(StatusSeen { after_ms: 600, members: vec![seen("w0", 700, 12), seen("w2", 680, 11)] });
        assert!(!hung_rank_status_check(&r, &events, &sc).expect("check").ok);
        // A step beyond the one it printed, or a fresh heartbeat, is wrong too.
        r.status = Some(StatusSeen { after_ms: 600, members: vec![seen("w0", 90, 12), seen("w2", 680, 13)] });
        assert!(!hung_rank_status_check(&r, &events, &sc).expect("check").ok);
        r.status = Some(StatusSeen { after_ms: 600, members: vec![seen("w0", 90, 12), seen("w2", 300, 11)] });
        assert!(!hung_rank_status_check(&r, &events, &sc).expect("check").ok);
        // No status read is a failure; none taken by design is no check.
        r.status = None;
        assert!(!hung_rank_status_check(&r, &events, &sc).expect("check").ok);
        r.note = "no status taken: ...".into();
        assert!(hung_rank_status_check(&r, &events, &sc).is_none());
    }

    #[test]
    fn a_later_fault_of_the_same_generation_keeps_its_own_errors() {
        // A leader kill at t=1000 fails nothing; a SIGKILL of w2 at t=3000 in the same
        // generation fails w0 and w1 at t=3004.
        let records = [
            record(1, "coordinator_leader_kill", 4, 1000, &["w0", "w1", "w2"]),
            record(2, "kill", 4, 3000, &["w0", "w1"]),
        ];
        let events = [
            ev("w0", "event=error gen=4 rank=0 step=9 kind=PeerFailed cause=\"rank 2 (worker w2): SIGKILL\" t_ms=3004"),
            ev("w1", "event=error gen=4 rank=1 step=9 kind=PeerFailed cause=\"rank 2 (worker w2): SIGKILL\" t_ms=3005"),
            ev("w0", "event=step gen=5 world=2 rank=0 step=9 ms=1.000 t_ms=3300"),
        ];
        let out = measure(&records, &events);
        assert!(out[0].errors.is_empty(), "the leader kill failed nothing: {:?}", out[0].errors);
        assert_eq!(out[1].errors.len(), 2);
        assert_eq!(out[1].first_error_ms, Some(4));
        assert_eq!(out[1].survivors_errors_ms, Some(5));
        assert_eq!(out[1].next_step_ms, Some(300));
    }
}
