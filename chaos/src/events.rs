//! Parsing of the `key=value` event lines that `cohort-worker train` prints.

use std::collections::BTreeMap;

/// One event line of a worker.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerEvent {
    /// Which process printed it.
    pub worker: String,
    /// `event=` value: joined, generation, restored, allreduce, step, error, recovered,
    /// reform, leave, finished, summary, wrong_result, fatal, sigterm, job_ended, metrics, joining.
    pub kind: String,
    /// Every other field.
    pub fields: BTreeMap<String, String>,
    /// When the harness read the line (ms since the Unix epoch).
    pub read_ms: u64,
}

impl WorkerEvent {
    /// Parses a line; `None` if it is not an event line.
    pub fn parse(worker: &str, line: &str, read_ms: u64) -> Option<Self> {
        let mut fields = BTreeMap::new();
        let mut rest = line.trim();
        while !rest.is_empty() {
            let eq = rest.find('=')?;
            let key = rest[..eq].to_string();
            rest = &rest[eq + 1..];
            let value;
            if let Some(stripped) = rest.strip_prefix('"') {
                let end = stripped.find('"')?;
                value = stripped[..end].to_string();
                rest = stripped[end + 1..].trim_start();
            } else {
                let end = rest.find(' ').unwrap_or(rest.len());
                value = rest[..end].to_string();
                rest = rest[end..].trim_start();
            }
            fields.insert(key, value);
        }
        let kind = fields.remove("event")?;
        Some(Self { worker: worker.to_string(), kind, fields, read_ms })
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
        assert_eq!(e.kind, "error");
        assert_eq!(e.int("gen"), Some(3));
        assert_eq!(e.text("cause"), Some("rank 2 (worker w2 on h): peer closed"));
        assert_eq!(e.t_ms(), 17);
        assert!(WorkerEvent::parse("w1", "not an event", 0).is_none());
        assert!(WorkerEvent::parse("w1", "gen=3 rank=1", 0).is_none());
    }
}
