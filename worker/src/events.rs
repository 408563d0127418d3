//! The worker-to-harness event protocol: the `event=KIND key=value ...` lines that
//! `cohort-worker train` prints on stdout, one per event, and that the chaos harness and the
//! integration tests read back.
//!
//! [`EventKind`] names every kind a worker prints; [`EventLine`] is one line: it renders the
//! exact text the worker prints ([`std::fmt::Display`]) and parses it back
//! ([`std::str::FromStr`]), so the printer and every parser share one definition and the
//! compiler checks the kind names.
//!
//! # Format (protocol version [`PROTOCOL_VERSION`])
//!
//! One line per event: `event=KIND` first, then `key=value` pairs separated by single spaces.
//! A value is printed plain unless it is free text (or contains a space or a double quote):
//! then it is quoted as `"..."`, with `\` written as `\\` and `"` written as `'` (so a quoted
//! value never contains a double quote and ends at the next one). Python workers
//! (`python/tests/workers/`, `examples/`) print the same format and their tests match it with
//! regular expressions, so the order of the keys is part of the protocol.
//!
//! # Versioning
//!
//! The version is not printed (a `v=` key would shift the keys that the Python regular
//! expressions anchor on). Adding a kind, or a key at the end of a line before `t_ms`, keeps
//! the version; renaming, removing or reordering a key, or changing a value's format, bumps
//! [`PROTOCOL_VERSION`] and must be announced in the lines themselves (a trailing `v=N`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The version of the event line format described in the [module docs](self).
pub const PROTOCOL_VERSION: u32 = 1;

/// Every kind of event line (`event=` value) a worker prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// The worker starts joining the job (`worker`).
    Joining,
    /// The worker is a member (`worker incarnation addr listen`).
    Joined,
    /// The job ended while the worker waited for a generation (`outcome reason`).
    JobEnded,
    /// A generation formed (`gen world rank transport`).
    Generation,
    /// The state sync at the start of a generation finished (`gen rank step source changed`).
    Restored,
    /// A collective, sync or commit failed (`gen rank [step] [phase] kind [detail] cause`).
    Error,
    /// The job reached its last step (`gen rank step params_digest expected_digest`).
    Finished,
    /// A step's allreduce starts (`gen rank step`).
    Allreduce,
    /// An allreduce returned a wrong element (`gen rank step index got expected`).
    WrongResult,
    /// The first step after a failure finished (`gen rank step lost_ms`).
    Recovered,
    /// A step finished (`gen world rank step ms`).
    Step,
    /// The worker left (`gen [rank] step [params_digest expected_digest] [joined]`).
    Leave,
    /// The coordinator asked this straggler to leave (`gen rank step reason`).
    StragglerLeave,
    /// A cooperative re-formation at a commit point (`gen rank step reason`).
    Reform,
    /// The per-link deadlines in force (`gen rank step peers`).
    Deadlines,
    /// The parameters left the expected trajectory (`gen rank step phase index got expected`).
    WrongParams,
    /// The worker's totals at exit (`verified_steps final_step failures lost_ms ...`).
    Summary,
    /// The worker stops on an error (`error`).
    Fatal,
    /// The metrics endpoint is listening (`address`).
    Metrics,
    /// The worker received SIGTERM.
    Sigterm,
}

impl EventKind {
    /// Every kind, in declaration order.
    pub const ALL: [EventKind; 20] = [
        EventKind::Joining,
        EventKind::Joined,
        EventKind::JobEnded,
        EventKind::Generation,
        EventKind::Restored,
        EventKind::Error,
        EventKind::Finished,
        EventKind::Allreduce,
        EventKind::WrongResult,
        EventKind::Recovered,
        EventKind::Step,
        EventKind::Leave,
        EventKind::StragglerLeave,
        EventKind::Reform,
        EventKind::Deadlines,
        EventKind::WrongParams,
        EventKind::Summary,
        EventKind::Fatal,
        EventKind::Metrics,
        EventKind::Sigterm,
    ];

    /// The `event=` value of this kind.
    pub fn name(self) -> &'static str {
        match self {
            EventKind::Joining => "joining",
            EventKind::Joined => "joined",
            EventKind::JobEnded => "job_ended",
            EventKind::Generation => "generation",
            EventKind::Restored => "restored",
            EventKind::Error => "error",
            EventKind::Finished => "finished",
            EventKind::Allreduce => "allreduce",
            EventKind::WrongResult => "wrong_result",
            EventKind::Recovered => "recovered",
            EventKind::Step => "step",
            EventKind::Leave => "leave",
            EventKind::StragglerLeave => "straggler_leave",
            EventKind::Reform => "reform",
            EventKind::Deadlines => "deadlines",
            EventKind::WrongParams => "wrong_params",
            EventKind::Summary => "summary",
            EventKind::Fatal => "fatal",
            EventKind::Metrics => "metrics",
            EventKind::Sigterm => "sigterm",
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for EventKind {
    type Err = EventParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EventKind::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| EventParseError::UnknownKind(s.to_string()))
    }
}

/// Why a line is not an event line.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EventParseError {
    /// The line has no `event=` key (log output, not an event).
    #[error("not an event line (no `event=` key)")]
    NotAnEvent,
    /// The `event=` value names no [`EventKind`] (a worker speaking another protocol).
    #[error("unknown event kind {0:?}")]
    UnknownKind(String),
    /// A token is not `key=value`, or a quoted value is not closed.
    #[error("malformed event line: {0}")]
    Malformed(String),
}

/// One event line: its kind and its `key=value` fields in print order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventLine {
    kind: EventKind,
    fields: Vec<(String, Value)>,
}

/// A field value and whether it is printed quoted.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Value {
    text: String,
    quoted: bool,
}

impl EventLine {
    /// A line of `kind` with no fields yet.
    pub fn new(kind: EventKind) -> Self {
        Self { kind, fields: Vec::new() }
    }

    /// Appends `key=value`, printed plain (quoted only if the value has a space or a quote).
    pub fn field(mut self, key: &str, value: impl fmt::Display) -> Self {
        let text = value.to_string();
        let quoted = text.contains(char::is_whitespace) || text.contains('"');
        self.fields.push((key.to_string(), Value { text, quoted }));
        self
    }

    /// Appends `key="value"`: free text, always quoted.
    pub fn text(mut self, key: &str, value: impl fmt::Display) -> Self {
        self.fields.push((key.to_string(), Value { text: value.to_string(), quoted: true }));
        self
    }

    /// Prints the line on stdout (the protocol's channel).
    pub fn print(&self) {
        println!("{self}");
    }

    /// The kind.
    pub fn kind(&self) -> EventKind {
        self.kind
    }

    /// The value of `key` (the last one if a key repeats), unquoted.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.fields.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.text.as_str())
    }

    /// Every field in print order, values unquoted.
    pub fn fields(&self) -> impl Iterator<Item = (&str, &str)> {
        self.fields.iter().map(|(k, v)| (k.as_str(), v.text.as_str()))
    }
}

/// `"value"` with `\` as `\\` and `"` as `'`: how quoted values are written.
fn quote(text: &str) -> String {
    format!("\"{}\"", text.replace('\\', "\\\\").replace('"', "'"))
}

impl fmt::Display for EventLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "event={}", self.kind)?;
        for (key, value) in &self.fields {
            if value.quoted {
                write!(f, " {key}={}", quote(&value.text))?;
            } else {
                write!(f, " {key}={}", value.text)?;
            }
        }
        Ok(())
    }
}

impl FromStr for EventLine {
    type Err = EventParseError;

    /// Parses a line; the `event=` key may stand anywhere (it is printed first).
    fn from_str(line: &str) -> Result<Self, Self::Err> {
        let mut pairs = Vec::new();
        let mut rest = line.trim();
        while !rest.is_empty() {
            let eq = rest.find('=').ok_or_else(|| EventParseError::Malformed(format!("no `=` in {rest:?}")))?;
            let key = &rest[..eq];
            if key.is_empty() || key.contains(char::is_whitespace) {
                return Err(EventParseError::Malformed(format!("bad key {key:?}")));
            }
            rest = &rest[eq + 1..];
            let value = if let Some(quoted) = rest.strip_prefix('"') {
                let end = quoted
                    .find('"')
                    .ok_or_else(|| EventParseError::Malformed(format!("unclosed quote after {key}=")))?;
                rest = quoted[end + 1..].trim_start();
                Value { text: quoted[..end].replace("\\\\", "\\"), quoted: true }
            } else {
                let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
                let text = rest[..end].to_string();
                rest = rest[end..].trim_start();
                Value { text, quoted: false }
            };
            pairs.push((key.to_string(), value));
        }
        let at = pairs.iter().position(|(k, _)| k == "event").ok_or(EventParseError::NotAnEvent)?;
        let (_, kind) = pairs.remove(at);
        Ok(Self { kind: kind.text.parse()?, fields: pairs })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_round_trips_by_name_and_through_serde() {
        for kind in EventKind::ALL {
            assert_eq!(kind.name().parse::<EventKind>(), Ok(kind));
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{}\"", kind.name()));
            assert_eq!(serde_json::from_str::<EventKind>(&json).unwrap(), kind);
        }
        let names: std::collections::BTreeSet<_> = EventKind::ALL.iter().map(|k| k.name()).collect();
        assert_eq!(names.len(), EventKind::ALL.len(), "two kinds share a name");
    }

    #[test]
    fn every_kind_renders_and_parses_back() {
        for kind in EventKind::ALL {
            let line =
                EventLine::new(kind).field("gen", 3).field("rank", 1).text("cause", "peer 2 closed").field("t_ms", 17);
            let printed = line.to_string();
            assert!(printed.starts_with(&format!("event={} gen=3 rank=1 ", kind.name())), "{printed}");
            let back: EventLine = printed.parse().unwrap();
            assert_eq!(back, line);
            assert_eq!(back.to_string(), printed);
        }
    }

    #[test]
    fn renders_exactly_what_the_worker_printed_by_hand() {
        let line = EventLine::new(EventKind::Error)
            .field("gen", 4)
            .field("rank", 0)
            .field("step", 12)
            .field("kind", "PeerFailed")
            .text("detail", "rank 2: peer closed")
            .text("cause", "rank 2 (worker w2 on h): peer closed")
            .field("t_ms", 100)
            .field("cause_t_ms", 101);
        assert_eq!(
            line.to_string(),
            r#"event=error gen=4 rank=0 step=12 kind=PeerFailed detail="rank 2: peer closed" cause="rank 2 (worker w2 on h): peer closed" t_ms=100 cause_t_ms=101"#
        );
    }

    #[test]
    fn quoting_escapes_backslashes_and_replaces_double_quotes() {
        let line = EventLine::new(EventKind::Fatal).text("error", r#"bad "path" C:\tmp"#).field("t_ms", 1);
        let printed = line.to_string();
        assert_eq!(printed, r#"event=fatal error="bad 'path' C:\\tmp" t_ms=1"#);
        let back: EventLine = printed.parse().unwrap();
        assert_eq!(back.get("error"), Some(r"bad 'path' C:\tmp"));
        assert_eq!(back.get("t_ms"), Some("1"));
        // A plain value that turns out to hold a space is quoted rather than split.
        let spaced = EventLine::new(EventKind::Reform).field("reason", "two words");
        assert_eq!(spaced.to_string(), r#"event=reform reason="two words""#);
        assert_eq!(spaced.to_string().parse::<EventLine>().unwrap().get("reason"), Some("two words"));
    }

    #[test]
    fn bad_lines_are_typed_errors() {
        assert_eq!(
            "event=teleported gen=1".parse::<EventLine>(),
            Err(EventParseError::UnknownKind("teleported".into()))
        );
        assert_eq!("gen=3 rank=1".parse::<EventLine>(), Err(EventParseError::NotAnEvent));
        assert_eq!("".parse::<EventLine>(), Err(EventParseError::NotAnEvent));
        assert!(matches!("not an event".parse::<EventLine>(), Err(EventParseError::Malformed(_))));
        assert!(matches!(
            r#"event=fatal error="never closed"#.parse::<EventLine>(),
            Err(EventParseError::Malformed(_))
        ));
        assert!(matches!("event=step =3".parse::<EventLine>(), Err(EventParseError::Malformed(_))));
        assert_eq!("nonsense".parse::<EventKind>(), Err(EventParseError::UnknownKind("nonsense".into())));
    }

    #[test]
    fn the_event_key_may_stand_anywhere_and_empty_values_survive() {
        let line: EventLine = "gen=2 event=step joined= t_ms=5".parse().unwrap();
        assert_eq!(line.kind(), EventKind::Step);
        assert_eq!(line.get("joined"), Some(""));
        assert_eq!(line.fields().map(|(k, _)| k).collect::<Vec<_>>(), ["gen", "joined", "t_ms"]);
    }
}
