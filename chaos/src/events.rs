//! The harness's view of the event lines that `cohort-worker train` prints: each line is parsed
//! into the shared protocol type [`cohort_harness::events::Event`], one struct per kind, so the
//! worker's printer and this parser share every kind and every key, and a read such as
//! `e.get::<Step>().is_some_and(|s| s.step >= 10)` is checked by the compiler.
//!
//! A line whose `event=` value names no [`EventKind`] (a worker program speaking another
//! protocol), or that lacks a key its kind requires, is rejected with an
//! [`EventParseError`]; the cluster logs it as a warning instead of recording it.

pub use cohort_harness::events::*;

/// One event line of a worker.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerEvent {
    /// Which process printed it.
    pub worker: String,
    /// The event, typed.
    pub event: Event,
    /// When the harness read the line (ms since the Unix epoch).
    pub read_ms: u64,
}

impl WorkerEvent {
    /// Parses a line; an error if it is not an event line of a known kind with its keys.
    pub fn parse(worker: &str, line: &str, read_ms: u64) -> Result<Self, EventParseError> {
        Ok(Self { worker: worker.to_string(), event: line.parse()?, read_ms })
    }

    /// The kind.
    pub fn kind(&self) -> EventKind {
        self.event.kind()
    }

    /// The struct of kind `T`, if the event is of that kind.
    pub fn get<T: EventBody>(&self) -> Option<&T> {
        self.event.get::<T>()
    }

    /// The worker's own timestamp (`t_ms`).
    pub fn t_ms(&self) -> u64 {
        self.event.t_ms()
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
        assert_eq!(e.kind(), EventKind::Error);
        let error = e.get::<Error>().unwrap();
        assert_eq!(error.gen, 3);
        assert_eq!(error.cause, "rank 2 (worker w2 on h): peer closed");
        assert_eq!(e.t_ms(), 17);
        assert!(WorkerEvent::parse("w1", "not an event", 0).is_err());
        assert_eq!(WorkerEvent::parse("w1", "gen=3 rank=1", 0), Err(EventParseError::NotAnEvent));
        assert_eq!(
            WorkerEvent::parse("w1", "event=teleported t_ms=1", 0),
            Err(EventParseError::UnknownKind("teleported".into()))
        );
    }
}
