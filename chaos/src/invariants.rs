//! Invariants checked on every chaos run, from the workers' own event records.

use crate::demo::Check;
use crate::events::WorkerEvent;
use std::collections::BTreeMap;

/// No worker ever saw a generation number go down.
pub fn generations_increase(events: &[WorkerEvent]) -> Check {
    let mut last: BTreeMap<&str, i64> = BTreeMap::new();
    let mut violations = Vec::new();
    for e in events.iter().filter(|e| e.kind == "generation") {
        let g = e.int("gen").unwrap_or(0);
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
        match e.kind.as_str() {
            "step" => {
                committed.insert(&e.worker, e.int("step").unwrap_or(0));
            }
            "restored" => {
                let restored = e.int("step").unwrap_or(-1);
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

/// No worker accepted a wrong result.
pub fn no_wrong_results(events: &[WorkerEvent]) -> Check {
    let wrong: Vec<String> = events
        .iter()
        .filter(|e| e.kind == "wrong_result")
        .map(|e| format!("{} step {:?}", e.worker, e.int("step")))
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
            if e.kind != "allreduce" {
                continue;
            }
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
                    "{w}: allreduce of step {:?} (gen {:?}) {} after {took} ms",
                    e.int("step"),
                    e.int("gen"),
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
    for e in events.iter().filter(|e| e.kind == "error") {
        n += 1;
        let kind = e.text("kind").unwrap_or("");
        let cause = e.text("cause").unwrap_or("");
        if !TYPED.contains(&kind) || cause.trim().is_empty() {
            bad.push(format!("{} gen {:?}: kind {kind:?} cause {cause:?}", e.worker, e.int("gen")));
        }
    }
    Check {
        what: "every error is typed and names its root cause".into(),
        ok: bad.is_empty(),
        detail: if bad.is_empty() { format!("{n} errors") } else { bad.join("; ") },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(worker: &str, line: &str) -> WorkerEvent {
        WorkerEvent::parse(worker, line, 0).unwrap()
    }

    #[test]
    fn generations_must_increase_per_worker() {
        let ok = [
            ev("a", "event=generation gen=1 t_ms=1"),
            ev("b", "event=generation gen=1 t_ms=1"),
            ev("a", "event=generation gen=3 t_ms=2"),
        ];
        assert!(generations_increase(&ok).ok);
        let bad = [ev("a", "event=generation gen=3 t_ms=1"), ev("a", "event=generation gen=2 t_ms=2")];
        assert!(!generations_increase(&bad).ok);
    }

    #[test]
    fn a_restore_behind_a_commit_is_caught() {
        let ok = [ev("a", "event=step step=5 t_ms=1"), ev("a", "event=restored step=5 t_ms=2")];
        assert!(commits_never_lost(&ok).ok);
        let bad = [ev("a", "event=step step=5 t_ms=1"), ev("a", "event=restored step=4 t_ms=2")];
        assert!(!commits_never_lost(&bad).ok);
        assert!(!no_wrong_results(&[ev("a", "event=wrong_result step=3 t_ms=1")]).ok);
    }

    #[test]
    fn hangs_are_found_unless_the_harness_stopped_the_worker() {
        let events = [
            ev("a", "event=allreduce gen=1 step=1 t_ms=1000"),
            ev("a", "event=step gen=1 step=2 t_ms=1050"),
            ev("a", "event=allreduce gen=1 step=2 t_ms=1100"),
            ev("a", "event=error gen=1 step=2 kind=Timeout cause=x t_ms=9100"),
            ev("b", "event=allreduce gen=1 step=2 t_ms=1100"),
        ];
        let none = BTreeMap::new();
        let c = no_hang(&events, &none, 3000, 20_000);
        assert!(!c.ok);
        assert!(c.detail.contains("a: allreduce of step Some(2)") && c.detail.contains("b: allreduce"), "{}", c.detail);
        let mut stopped = BTreeMap::new();
        stopped.insert("a".to_string(), vec![1200]);
        stopped.insert("b".to_string(), vec![2000]);
        assert!(no_hang(&events, &stopped, 3000, 20_000).ok);
        assert!(no_hang(&events[..2], &none, 3000, 20_000).ok);
    }

    #[test]
    fn untyped_or_unnamed_errors_are_caught() {
        assert!(
            errors_typed(&[ev("a", r#"event=error kind=Revoked cause="rank 1 (worker w1 on h): peer closed" t_ms=1"#)])
                .ok
        );
        assert!(!errors_typed(&[ev("a", "event=error kind=Weird cause=x t_ms=1")]).ok);
        assert!(!errors_typed(&[ev("a", "event=error kind=Timeout t_ms=1")]).ok);
    }
}
