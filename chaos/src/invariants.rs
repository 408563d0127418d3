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
    Check { what: "generations only increase".into(), ok: violations.is_empty(), detail: if violations.is_empty() { "ok".into() } else { violations.join("; ") } }
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
    Check { what: "a committed step is never lost".into(), ok: violations.is_empty(), detail: if violations.is_empty() { "ok".into() } else { violations.join("; ") } }
}

/// No worker accepted a wrong result.
pub fn no_wrong_results(events: &[WorkerEvent]) -> Check {
    let wrong: Vec<String> = events.iter().filter(|e| e.kind == "wrong_result").map(|e| format!("{} step {:?}", e.worker, e.int("step"))).collect();
    Check { what: "no wrong result was ever accepted".into(), ok: wrong.is_empty(), detail: if wrong.is_empty() { "ok".into() } else { wrong.join("; ") } }
}
