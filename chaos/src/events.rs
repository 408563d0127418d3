//! The harness's view of the event lines that `cohort-worker train` prints: each line is parsed
//! through the shared protocol type [`cohort::events::EventLine`], so the worker's printer and
//! this parser agree on every kind name, and a comparison such as
//! `e.kind == EventKind::Step` is checked by the compiler.
//!
//! A line whose `event=` value names no [`EventKind`] (a worker program speaking another
//! protocol) is rejected with [`EventParseError::UnknownKind`]; the cluster logs it as a
//! warning instead of recording it.

use std::collections::BTreeMap;

use cohort::events::EventLine;
pub use cohort::events::{EventKind, EventParseError};

/// One event line of a worker.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerEvent {
    /// Which process printed it.
    pub worker: String,
    /// The `event=` value.
    pub kind: EventKind,
    /// Every other field, unquoted.
    pub fields: BTreeMap<String, String>,
    /// When the harness read the line (ms since the Unix epoch).
    pub read_ms: u64,
}

impl WorkerEvent {
    /// Parses a line; an error if it is not an event line of a known kind.
    pub fn parse(worker: &str, line: &str, read_ms: u64) -> Result<Self, EventParseError> {
        let line: EventLine = line.parse()?;
        let fields = line.fields().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Ok(Self { worker: worker.to_string(), kind: line.kind(), fields, read_ms })
    }

    /// A field parsed as an integer.
    pub fn int(&self, key: &str) -> Option<i64> {
        self.fields.get(key)?.parse().ok()
    }

    /// A field as text.
    pub fn text(&self, key: &str) -> Option<&str> {
        self.fields.get(key).map(String::as_str)
    }

    /// The worker's own timestamp (`t_ms`), else when it was read.
    pub fn t_ms(&self) -> u64 {
        self.int("t_ms").map(|t| t as u64).unwrap_or(self.read_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_quoted_and_plain_fields() {
        let e = WorkerEvent::parse(
            "w1",
            r#"event=error gen=3 rank=1 kind=Revoked cause="rank 2 (worker w2 on h): peer closed" t_ms=17"#,
            5,
        )
        .unwrap();
        assert_eq!(e.kind, EventKind::Error);
        assert_eq!(e.int("gen"), Some(3));
        assert_eq!(e.text("cause"), Some("rank 2 (worker w2 on h): peer closed"));
        assert_eq!(e.t_ms(), 17);
        assert!(WorkerEvent::parse("w1", "not an event", 0).is_err());
        assert_eq!(WorkerEvent::parse("w1", "gen=3 rank=1", 0), Err(EventParseError::NotAnEvent));
        assert_eq!(
            WorkerEvent::parse("w1", "event=teleported t_ms=1", 0),
            Err(EventParseError::UnknownKind("teleported".into()))
        );
    }
}
