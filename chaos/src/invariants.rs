//! Invariants checked on every chaos run, from the workers' own event records.

use crate::demo::Check;
use crate::events::{self as ev, WorkerEvent};
use crate::scenario::Expect;
use std::collections::{BTreeMap, BTreeSet};

/// No worker ever saw a generation number go down.
pub fn generations_increase(events: &[WorkerEvent]) -> Check {
    let mut last: BTreeMap<&str, u64> = BTreeMap::new();
    let mut violations = Vec::new();
    for (e, g) in events.iter().filter_map(|e| Some((e, e.get::<ev::Generation>()?.gen))) {
        if let Some(prev) = last.insert(&e.worker, g) {
            if g <= prev {
                violations.push(format!("{}: {prev} then {g}", e.worker));
            }
        }
    }
    Check {
        what: "generations only increase".into(),
        ok: violations.is_empty(),
        detail: if violations.is_empty() { "ok".into() } else { violations.join("; ") },
    }
}

/// After a restore, no worker's step is behind a step it had committed before.
pub fn commits_never_lost(events: &[WorkerEvent]) -> Check {
    let mut committed: BTreeMap<&str, i64> = BTreeMap::new();
    let mut violations = Vec::new();
    for e in events {
        match &e.event {
            ev::Event::Step(s) => {
                committed.insert(&e.worker, s.step as i64);
            }
            ev::Event::Restored(r) => {
                let restored = r.step;
                if let Some(&c) = committed.get(e.worker.as_str()) {
                    if restored < c {
                        violations.push(format!("{} restored step {restored} after committing {c}", e.worker));
                    }
                }
            }
            _ => {}
        }
    }
    Check {
        what: "a committed step is never lost".into(),
        ok: violations.is_empty(),
        detail: if violations.is_empty() { "ok".into() } else { violations.join("; ") },
    }
}

/// With workers placed on hosts (`hosts`: worker -> host), every member of every generation
/// linked over shared memory to exactly the members on its host: its `generation` event says
/// `shm` when every other member is on its host, `shm+tcp` when some are, `tcp` when none are.
/// Generations whose members did not all print their event are not judged; at least one must
/// be.
pub fn transport_by_host(events: &[WorkerEvent], hosts: &BTreeMap<String, String>) -> Check {
    // Generation -> (world, [(worker, transport)]).
    type Members<'a> = (u64, Vec<(&'a str, &'a str)>);
    let mut by_gen: BTreeMap<u64, Members<'_>> = BTreeMap::new();
    for (e, g) in events.iter().filter_map(|e| Some((e, e.get::<ev::Generation>()?))) {
        let entry = by_gen.entry(g.gen).or_insert((g.world, Vec::new()));
        entry.1.push((e.worker.as_str(), g.transport.as_str()));
    }
    let mut judged = 0;
    let mut shared = 0;
    let mut wrong = Vec::new();
    for (g, (world, members)) in &by_gen {
        if *world < 2 || members.len() as u64 != *world {
            continue;
        }
        judged += 1;
        for (w, transport) in members {
            let host = hosts.get(*w);
            let mates = members.iter().filter(|(o, _)| o != w && hosts.get(*o) == host && host.is_some()).count();
            let want = if mates == 0 {
                "tcp"
            } else if mates + 1 == members.len() {
                "shm"
            } else {
                "shm+tcp"
            };
            if mates > 0 {
                shared += 1;
            }
            if *transport != want {
                wrong.push(format!("generation {g}: {w} used {transport}, expected {want} ({mates} on its host)"));
            }
        }
    }
    Check {
        what: "each member used shared memory to the members on its host and TCP to the others".into(),
        ok: judged > 0 && wrong.is_empty(),
        detail: if wrong.is_empty() {
            format!("{judged} generations, {shared} member-generations with a shared-memory peer")
        } else {
            wrong.join("; ")
        },
    }
}

/// Every member of a generation of at most `whole_answer_up_to` members held every member's
/// entry, and every member of a larger one a sparse view (fewer entries than members). Events
/// without the count (older workers) are not judged; at least one must be.
pub fn member_views(events: &[WorkerEvent], whole_answer_up_to: u32) -> Check {
    let mut judged = 0;
    let mut sparse = 0;
    let mut fewest: Option<(u64, u64)> = None;
    let mut wrong = Vec::new();
    for (e, g) in events.iter().filter_map(|e| Some((e, e.get::<ev::Generation>()?))) {
        let Some(known) = g.known else { continue };
        judged += 1;
        let whole = g.world <= u64::from(whole_answer_up_to);
        if whole && known != g.world || !whole && known >= g.world {
            wrong.push(format!(
                "{} in generation {} ({} members, whole up to {whole_answer_up_to}): {known} entries",
                e.worker, g.gen, g.world
            ));
        }
        if !whole {
            sparse += 1;
            if fewest.is_none_or(|(k, _)| known < k) {
                fewest = Some((known, g.world));
            }
        }
    }
    Check {
        what: format!("members held the whole list up to {whole_answer_up_to} members, a sparse view above"),
        ok: judged > 0 && wrong.is_empty(),
        detail: match (wrong.is_empty(), fewest) {
            (true, Some((known, world))) => {
                format!("{judged} member-generations, {sparse} sparse; fewest entries {known} of {world} members")
            }
            (true, None) if judged > 0 => format!("{judged} member-generations, every one whole"),
            (true, None) => "no generation event carried its entry count".into(),
            (false, _) => wrong.join("; "),
        },
    }
}

/// Over TCP alone (every worker a host of its own), no rank linked more peers at the set-up of
/// a generation than links on demand allow: every other rank up to
/// [`cohort::elastic::FULL_MESH_UP_TO`] members, at most `2 ceil(log2 N) + 1` above it (see
/// `cohort::collectives::links`). Each generation's set-up dials its links anew, so this also
/// bounds the new links per survivor after a failure. Events without the count (older
/// workers) are not judged; at least one must be.
pub fn tcp_links_within_plan(events: &[WorkerEvent]) -> Check {
    let mut judged = 0;
    let mut most: Option<(u64, u64, u64)> = None;
    let mut wrong = Vec::new();
    for (e, g) in events.iter().filter_map(|e| Some((e, e.get::<ev::Generation>()?))) {
        let Some(links) = g.links.filter(|_| g.transport == "tcp") else { continue };
        judged += 1;
        let bound = plan_bound(g.world);
        if links > bound {
            wrong.push(format!(
                "{} in generation {} ({} members): {links} links, at most {bound}",
                e.worker, g.gen, g.world
            ));
        }
        if most.is_none_or(|(l, _, _)| links > l) {
            most = Some((links, g.world, bound));
        }
    }
    Check {
        what: "over TCP, each rank linked only the peers its schedules plan".into(),
        ok: judged > 0 && wrong.is_empty(),
        detail: match (wrong.is_empty(), most) {
            (true, Some((links, world, bound))) => {
                format!("{judged} member-generations; most links {links} (of {world} members, bound {bound})")
            }
            (true, None) => "no generation event carried a link count".into(),
            (false, _) => wrong.join("; "),
        },
    }
}

/// The most links a rank of a TCP generation of `world` members (each a host of its own)
/// makes at set-up: every other rank up to [`cohort::elastic::FULL_MESH_UP_TO`] members,
/// `2 ceil(log2 N) + 1` above it.
fn plan_bound(world: u64) -> u64 {
    if world <= cohort::elastic::FULL_MESH_UP_TO as u64 {
        world.saturating_sub(1)
    } else {
        2 * u64::from(world.next_power_of_two().trailing_zeros()) + 1
    }
}

/// Over TCP, re-formations carry links over (incremental re-formation): a survivor (a worker
/// that was a member of an earlier generation) dials at most the plan's bound of new links,
/// and across the run some links were carried, so that a re-formation does not dial its whole
/// plan again. Reports the share carried and the most new links of any survivor. Events
/// without the counts (older workers) are not judged; unless at least one survivor's
/// generation is, the check fails.
pub fn tcp_links_carried_over(events: &[WorkerEvent]) -> Check {
    let mut seen: BTreeSet<&str> = BTreeSet::new();
    let (mut judged, mut links_total, mut carried_total, mut most_new) = (0u64, 0u64, 0u64, 0u64);
    let mut wrong = Vec::new();
    for (e, g) in events.iter().filter_map(|e| Some((e, e.get::<ev::Generation>()?))) {
        if g.transport != "tcp" {
            continue;
        }
        let survivor = !seen.insert(&e.worker);
        let (Some(links), Some(carried), true) = (g.links, g.carried, survivor) else { continue };
        judged += 1;
        let new = links.saturating_sub(carried);
        if carried > links || new > plan_bound(g.world) {
            wrong.push(format!(
                "{} in generation {} ({} members): {links} links, {carried} carried, {new} new (at most {})",
                e.worker,
                g.gen,
                g.world,
                plan_bound(g.world)
            ));
        }
        links_total += links;
        carried_total += carried;
        most_new = most_new.max(new);
    }
    Check {
        what: "over TCP, survivors carry their links into the next generation".into(),
        ok: judged > 0 && carried_total > 0 && wrong.is_empty(),
        detail: if !wrong.is_empty() {
            wrong.join("; ")
        } else if judged == 0 {
            "no survivor's generation event carried the link counts".into()
        } else {
            format!(
                "{judged} survivor-generations: {carried_total} of {links_total} links carried ({}%), at most {most_new} new per survivor",
                carried_total * 100 / links_total.max(1)
            )
        },
    }
}

/// No worker accepted a wrong result.
pub fn no_wrong_results(events: &[WorkerEvent]) -> Check {
    let wrong: Vec<String> = events
        .iter()
        .filter_map(|e| Some((e, e.get::<ev::WrongResult>()?)))
        .map(|(e, w)| format!("{} step {}", e.worker, w.step))
        .collect();
    Check {
        what: "no wrong result was ever accepted".into(),
        ok: wrong.is_empty(),
        detail: if wrong.is_empty() { "ok".into() } else { wrong.join("; ") },
    }
}

/// No hang: every announced allreduce of a worker is followed by its next event (a verified
/// step, an error, ...) within `bound_ms`, unless the harness SIGKILLed or SIGSTOPped that
/// worker in between (`signalled`: per worker, when). An allreduce still open at `end_ms`
/// counts as lasting until then.
pub fn no_hang(events: &[WorkerEvent], signalled: &BTreeMap<String, Vec<u64>>, bound_ms: u64, end_ms: u64) -> Check {
    let mut by_worker: BTreeMap<&str, Vec<&WorkerEvent>> = BTreeMap::new();
    for e in events {
        by_worker.entry(&e.worker).or_default().push(e);
    }
    let mut violations = Vec::new();
    let mut longest = 0u64;
    for (w, evs) in &by_worker {
        for (i, e) in evs.iter().enumerate() {
            let Some(a) = e.get::<ev::Allreduce>() else { continue };
            let start = e.t_ms();
            let done = evs.get(i + 1).map(|n| n.t_ms()).unwrap_or(end_ms);
            let took = done.saturating_sub(start);
            let excused =
                signalled.get(*w).is_some_and(|ts| ts.iter().any(|&t| t >= start.saturating_sub(5) && t <= done));
            if excused {
                continue;
            }
            longest = longest.max(took);
            if took > bound_ms {
                violations.push(format!(
                    "{w}: allreduce of step {} (gen {}) {} after {took} ms",
                    a.step,
                    a.gen,
                    if i + 1 < evs.len() { "returned" } else { "never returned" }
                ));
            }
        }
    }
    Check {
        what: format!("no hang: every collective returned within its deadline + slack ({bound_ms} ms)"),
        ok: violations.is_empty(),
        detail: if violations.is_empty() { format!("longest {longest} ms") } else { violations.join("; ") },
    }
}

/// Every error a worker reported is typed (PeerFailed, Timeout, Revoked, Transport) and
/// names a root cause.
pub fn errors_typed(events: &[WorkerEvent]) -> Check {
    const TYPED: [&str; 4] = ["PeerFailed", "Timeout", "Revoked", "Transport"];
    let mut bad = Vec::new();
    let mut n = 0;
    for (e, error) in events.iter().filter_map(|e| Some((e, e.get::<ev::Error>()?))) {
        n += 1;
        let (kind, cause) = (error.kind.as_str(), &*error.cause);
        if !TYPED.contains(&kind) || cause.trim().is_empty() {
            bad.push(format!("{} gen {}: kind {kind:?} cause {cause:?}", e.worker, error.gen));
        }
    }
    Check {
        what: "every error is typed and names its root cause".into(),
        ok: bad.is_empty(),
        detail: if bad.is_empty() { format!("{n} errors") } else { bad.join("; ") },
    }
}

/// The digest of the parameters `cohort-worker train` (f32, the harness's default) must hold
/// after `steps` steps of a `size_bytes` gradient, computed here from the trajectory's closed
/// form, not from anything a worker printed.
pub fn expected_params_digest(size_bytes: u64, steps: u64) -> String {
    use cohort_harness::trajectory::{params_digest, Trajectory};
    let count = usize::try_from(size_bytes).unwrap_or(0) / std::mem::size_of::<f32>();
    params_digest(&Trajectory::new::<f32>(count).expected_params::<f32>(steps))
}

/// Where the expected final parameters come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpectedParams<'a> {
    /// Computed by the harness (built-in `cohort-worker train`): SHA-256 in hex.
    Computed(&'a str),
    /// A worker program's own: each finished worker's `expected_digest`, which must agree.
    Reported,
}

/// The trained parameters are right: no worker printed `event=wrong_params`, every worker that
/// finished reports the same `params_digest`, and it is the expected one. A worker that
/// finished without a digest fails the check, the built-in worker and a worker program
/// alike: its parameters could not be checked, and a check that could not be made is no
/// pass. When the run's `outcome` is [`Expect::Finish`], at least one worker must have
/// finished: a run where none did compared nothing and fails the check.
pub fn final_params(events: &[WorkerEvent], expected: ExpectedParams<'_>, outcome: Expect) -> Check {
    let mut bad: Vec<String> = events
        .iter()
        .filter_map(|e| Some((e, e.get::<ev::WrongParams>()?)))
        .map(|(e, w)| {
            format!("{} wrong parameters after {} at step {}, element {:?}", e.worker, w.phase, w.step, w.index)
        })
        .collect();
    let finished: Vec<(&WorkerEvent, &ev::Finished)> =
        events.iter().filter_map(|e| Some((e, e.get::<ev::Finished>()?))).collect();
    let what = "the final parameters are the expected ones on every worker that finished".to_string();
    if finished.is_empty() && outcome == Expect::Finish {
        // Nothing was compared: a run whose workers should finish proves nothing here.
        bad.push("no worker finished, so no final parameters were checked".into());
    }
    let mut digests: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (e, f) in &finished {
        let Some(digest) = f.params_digest.as_deref() else {
            bad.push(format!("{} finished without a params_digest: its final parameters were not checked", e.worker));
            continue;
        };
        digests.entry(digest).or_default().push(&e.worker);
        let want = match expected {
            ExpectedParams::Computed(d) => Some(d),
            ExpectedParams::Reported => f.expected_digest.as_deref(),
        };
        if want != Some(digest) {
            bad.push(format!("{}: params {} expected {}", e.worker, short(digest), want.map_or("none", short)));
        }
    }
    if digests.len() > 1 {
        let groups: Vec<String> = digests.iter().map(|(d, ws)| format!("{} on {}", short(d), ws.join(","))).collect();
        bad.push(format!("workers differ: {}", groups.join("; ")));
    }
    if expected == ExpectedParams::Reported {
        let claimed: BTreeSet<&str> = finished.iter().filter_map(|(_, f)| f.expected_digest.as_deref()).collect();
        if claimed.len() > 1 {
            bad.push(format!("workers expect different parameters: {}", claimed.len()));
        }
    }
    let source = match expected {
        ExpectedParams::Computed(_) => "computed by the harness",
        ExpectedParams::Reported => "as the workers' own replay expects",
    };
    Check {
        what,
        ok: bad.is_empty(),
        detail: if !bad.is_empty() {
            bad.join("; ")
        } else if finished.is_empty() {
            "no worker finished; no wrong parameters reported".into()
        } else {
            format!(
                "{} workers hold {} ({source})",
                finished.len(),
                short(digests.keys().next().copied().unwrap_or(""))
            )
        },
    }
}

/// The first 12 hex digits of a digest, for reports.
fn short(digest: &str) -> &str {
    digest.get(..12).unwrap_or(digest)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(worker: &str, line: &str) -> WorkerEvent {
        WorkerEvent::parse(worker, line, 0).unwrap()
    }

    #[test]
    fn transport_by_host_wants_shared_memory_exactly_within_a_host() {
        let hosts: BTreeMap<String, String> = [("a", "h0"), ("b", "h0"), ("c", "h1"), ("d", "h2")]
            .iter()
            .map(|(w, h)| (w.to_string(), h.to_string()))
            .collect();
        let good = [
            ev("a", "event=generation gen=1 world=3 rank=0 transport=shm+tcp t_ms=1"),
            ev("b", "event=generation gen=1 world=3 rank=1 transport=shm+tcp t_ms=1"),
            ev("c", "event=generation gen=1 world=3 rank=2 transport=tcp t_ms=1"),
            ev("a", "event=generation gen=2 world=2 rank=0 transport=shm t_ms=2"),
            ev("b", "event=generation gen=2 world=2 rank=1 transport=shm t_ms=2"),
            // Incomplete (d never printed): not judged.
            ev("c", "event=generation gen=3 world=2 rank=0 transport=shm t_ms=3"),
        ];
        let c = transport_by_host(&good, &hosts);
        assert!(c.ok, "{}", c.detail);
        assert!(c.detail.starts_with("2 generations"), "{}", c.detail);
        let mut bad = good.to_vec();
        bad[2] = ev("c", "event=generation gen=1 world=3 rank=2 transport=shm+tcp t_ms=1");
        bad[0] = ev("a", "event=generation gen=1 world=3 rank=0 transport=tcp t_ms=1");
        let c = transport_by_host(&bad, &hosts);
        assert!(!c.ok);
        assert!(
            c.detail.contains("a used tcp, expected shm+tcp") && c.detail.contains("c used shm+tcp"),
            "{}",
            c.detail
        );
        assert!(!transport_by_host(&good[5..], &hosts).ok, "nothing judged is no pass");
    }

    #[test]
    fn generations_must_increase_per_worker() {
        let ok = [
            ev("a", "event=generation gen=1 world=2 rank=0 transport=tcp t_ms=1"),
            ev("b", "event=generation gen=1 world=2 rank=0 transport=tcp t_ms=1"),
            ev("a", "event=generation gen=3 world=2 rank=0 transport=tcp t_ms=2"),
        ];
        assert!(generations_increase(&ok).ok);
        let bad = [
            ev("a", "event=generation gen=3 world=2 rank=0 transport=tcp t_ms=1"),
            ev("a", "event=generation gen=2 world=2 rank=0 transport=tcp t_ms=2"),
        ];
        assert!(!generations_increase(&bad).ok);
    }

    #[test]
    fn a_restore_behind_a_commit_is_caught() {
        let ok = [
            ev("a", "event=step gen=1 world=1 rank=0 step=5 ms=1.000 t_ms=1"),
            ev("a", "event=restored gen=2 rank=0 step=5 source=0 changed=false t_ms=2"),
        ];
        assert!(commits_never_lost(&ok).ok);
        let bad = [
            ev("a", "event=step gen=1 world=1 rank=0 step=5 ms=1.000 t_ms=1"),
            ev("a", "event=restored gen=2 rank=0 step=4 source=0 changed=true t_ms=2"),
        ];
        assert!(!commits_never_lost(&bad).ok);
        assert!(
            !no_wrong_results(&[ev("a", "event=wrong_result gen=1 rank=0 step=3 index=0 got=1.0 expected=2.0 t_ms=1")])
                .ok
        );
    }

    #[test]
    fn hangs_are_found_unless_the_harness_stopped_the_worker() {
        let events = [
            ev("a", "event=allreduce gen=1 rank=0 step=1 t_ms=1000"),
            ev("a", "event=step gen=1 world=2 rank=0 step=2 ms=50.000 t_ms=1050"),
            ev("a", "event=allreduce gen=1 rank=0 step=2 t_ms=1100"),
            ev("a", "event=error gen=1 rank=0 step=2 kind=Timeout cause=x t_ms=9100"),
            ev("b", "event=allreduce gen=1 rank=0 step=2 t_ms=1100"),
        ];
        let none = BTreeMap::new();
        let c = no_hang(&events, &none, 3000, 20_000);
        assert!(!c.ok);
        assert!(c.detail.contains("a: allreduce of step 2") && c.detail.contains("b: allreduce"), "{}", c.detail);
        let mut stopped = BTreeMap::new();
        stopped.insert("a".to_string(), vec![1200]);
        stopped.insert("b".to_string(), vec![2000]);
        assert!(no_hang(&events, &stopped, 3000, 20_000).ok);
        assert!(no_hang(&events[..2], &none, 3000, 20_000).ok);
    }

    #[test]
    fn untyped_or_unnamed_errors_are_caught() {
        assert!(
            errors_typed(&[ev(
                "a",
                r#"event=error gen=1 rank=0 kind=Revoked cause="rank 1 (worker w1 on h): peer closed" t_ms=1"#
            )])
            .ok
        );
        assert!(!errors_typed(&[ev("a", "event=error gen=1 rank=0 kind=Weird cause=x t_ms=1")]).ok);
        assert!(!errors_typed(&[ev("a", r#"event=error gen=1 rank=0 kind=Timeout cause="" t_ms=1"#)]).ok);
    }

    #[test]
    fn final_params_must_agree_with_each_other_and_the_expected() {
        let fin = |w: &str, d: &str, x: &str| {
            ev(w, &format!("event=finished gen=1 rank=0 step=9 params_digest={d} expected_digest={x} t_ms=1"))
        };
        let good = [fin("a", "d1", "d1"), fin("b", "d1", "d1")];
        assert!(final_params(&good, ExpectedParams::Computed("d1"), Expect::Finish).ok);
        assert!(final_params(&good, ExpectedParams::Reported, Expect::Finish).ok);
        // The harness expects other parameters than both workers hold (and claim).
        assert!(!final_params(&good, ExpectedParams::Computed("d2"), Expect::Finish).ok);
        // One worker ended with other parameters.
        let split = [fin("a", "d1", "d1"), fin("b", "d2", "d1")];
        let c = final_params(&split, ExpectedParams::Computed("d1"), Expect::Finish);
        assert!(!c.ok && c.detail.contains("differ"), "{}", c.detail);
        assert!(!final_params(&split, ExpectedParams::Reported, Expect::Finish).ok);
        // Workers that agree with each other but not with their own expectation.
        assert!(
            !final_params(&[fin("a", "d2", "d1"), fin("b", "d2", "d1")], ExpectedParams::Reported, Expect::Finish).ok
        );
        // A wrong_params event fails the run even if nobody finished.
        let wrong = [ev("a", "event=wrong_params gen=1 rank=0 step=4 phase=sync index=0 t_ms=1")];
        assert!(!final_params(&wrong, ExpectedParams::Computed("d1"), Expect::Finish).ok);
        assert!(!final_params(&wrong, ExpectedParams::Reported, Expect::Finish).ok);
        // Every worker must report a digest, the built-in one and a worker program alike: a
        // check that could not be made is no pass.
        let bare = [ev("a", "event=finished gen=1 rank=0 step=9 t_ms=1")];
        for expected in [ExpectedParams::Computed("d1"), ExpectedParams::Reported] {
            let c = final_params(&bare, expected, Expect::Finish);
            assert!(!c.ok && c.detail.contains("not checked"), "{expected:?}: {}", c.detail);
        }
        // One worker of several without a digest fails it too.
        let one_bare = [fin("a", "d1", "d1"), ev("b", "event=finished gen=1 rank=1 step=9 t_ms=1")];
        assert!(!final_params(&one_bare, ExpectedParams::Reported, Expect::Finish).ok);
        // Nobody finished: nothing was compared, which fails a run whose workers should finish
        // and is what a run expected to fail does.
        let started = [ev("a", "event=generation gen=1 world=1 rank=0 transport=tcp t_ms=1")];
        for expected in [ExpectedParams::Computed("d1"), ExpectedParams::Reported] {
            let c = final_params(&started, expected, Expect::Finish);
            assert!(!c.ok && c.detail.contains("no worker finished"), "{expected:?}: {}", c.detail);
            assert!(final_params(&started, expected, Expect::Fail).ok, "{expected:?}");
        }
        assert!(final_params(&[], ExpectedParams::Computed("d1"), Expect::Fail).ok);
    }
}
