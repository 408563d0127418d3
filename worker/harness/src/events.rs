//! The worker-to-harness event protocol: the `event=KIND key=value ...` lines that
//! `cohort-worker train` prints on stdout, one per event, and that the chaos harness, the
//! integration tests and the Python workers share.
//!
//! Each kind is one struct ([`Step`], [`Error`], ...), defined once in the `events!` table
//! below; its fields are the line's keys, in print order. The writer builds the struct and
//! prints it ([`Step::print`]); a reader parses a line into an [`Event`] (a variant per kind)
//! and reads the struct's fields ([`Event::get`]). Both go through the same definition, so a
//! renamed field fails to compile wherever it is read, and the golden lines of the tests
//! below (one per kind, printed and parsed back) fail for any key whose name or order
//! changes. The Python workers print through `cohort.events` (`python/cohort/events.py`),
//! whose key table is generated from [`EventKind::keys`] and checked by a test here.
//!
//! # Format (protocol version [`PROTOCOL_VERSION`])
//!
//! One line per event: `event=KIND` first, then `key=value` pairs separated by single spaces.
//! A value is printed plain unless it is free text ([`Text`]) or contains a space or a double
//! quote: then it is quoted as `"..."`, with `\` written as `\\` and `"` written as `'` (so a
//! quoted value never contains a double quote and ends at the next one). An optional field
//! that is `None` leaves its key out. Python workers (`python/tests/workers/`, `examples/`)
//! print the same format and their tests match it with regular expressions, so the order of
//! the keys is part of the protocol. A reader ignores keys it does not know (a newer worker's,
//! or the extra keys of an example's report).
//!
//! # Versioning
//!
//! The version is not printed (a `v=` key would shift the keys that the Python regular
//! expressions anchor on). Adding a kind, or an optional key at the end of a line before
//! `t_ms`, keeps the version; renaming, removing or reordering a key, or changing a value's
//! format, bumps [`PROTOCOL_VERSION`] and must be announced in the lines themselves (a
//! trailing `v=N`).

use std::fmt;
use std::net::SocketAddr;
use std::ops::Deref;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The version of the event line format described in the [module docs](self).
pub const PROTOCOL_VERSION: u32 = 1;

/// Declares every event kind once: the [`EventKind`] variant and its `event=` name, the
/// struct of its fields (the keys, in print order), the [`Event`] variant that holds it, and
/// the printing and parsing of each, all from the same field list.
macro_rules! events {
    ($(
        $(#[doc = $doc:literal])*
        $kind:ident = $name:literal {
            $( $(#[doc = $fdoc:literal])* $field:ident : $ty:ty ),* $(,)?
        }
    )*) => {
        /// Every kind of event line (`event=` value) a worker prints.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        pub enum EventKind {
            $( $(#[doc = $doc])* #[serde(rename = $name)] $kind, )*
        }

        impl EventKind {
            /// Every kind, in declaration order.
            pub const ALL: &'static [EventKind] = &[$(EventKind::$kind),*];

            /// The `event=` value of this kind.
            pub fn name(self) -> &'static str {
                match self { $(EventKind::$kind => $name,)* }
            }

            /// The keys of this kind's line, in print order.
            pub fn keys(self) -> &'static [Key] {
                match self { $(EventKind::$kind => $kind::KEYS,)* }
            }
        }

        /// One event line, typed: a variant per kind, holding that kind's struct.
        #[derive(Clone, Debug, PartialEq)]
        pub enum Event {
            $( $(#[doc = $doc])* $kind($kind), )*
        }

        impl Event {
            /// The kind.
            pub fn kind(&self) -> EventKind {
                match self { $(Event::$kind(_) => EventKind::$kind,)* }
            }

            /// The worker's wall clock when it printed the line (`t_ms`, ms since the Unix
            /// epoch; every kind carries it).
            pub fn t_ms(&self) -> u64 {
                match self { $(Event::$kind(e) => e.t_ms,)* }
            }

            fn to_line(&self) -> EventLine {
                match self { $(Event::$kind(e) => e.to_line(),)* }
            }

            fn from_line(line: &EventLine) -> Result<Self, EventParseError> {
                match line.kind { $(EventKind::$kind => $kind::from_line(line).map(Event::$kind),)* }
            }
        }

        $(
            $(#[doc = $doc])*
            #[derive(Clone, Debug, PartialEq)]
            pub struct $kind {
                $( $(#[doc = $fdoc])* pub $field: $ty, )*
            }

            impl $kind {
                /// This kind's keys, in print order.
                pub const KEYS: &'static [Key] = &[$(Key {
                    name: stringify!($field),
                    required: <$ty as FieldValue>::REQUIRED,
                    quoted: <$ty as FieldValue>::QUOTED,
                }),*];

                /// Prints the line on stdout (the protocol's channel).
                pub fn print(&self) {
                    println!("{self}");
                }

                fn to_line(&self) -> EventLine {
                    let mut line = EventLine::new(EventKind::$kind);
                    $( line.push(stringify!($field), &self.$field); )*
                    line
                }

                fn from_line(line: &EventLine) -> Result<Self, EventParseError> {
                    Ok(Self { $( $field: line.take(EventKind::$kind, stringify!($field))?, )* })
                }
            }

            impl fmt::Display for $kind {
                fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    self.to_line().fmt(f)
                }
            }

            impl From<$kind> for Event {
                fn from(e: $kind) -> Self {
                    Event::$kind(e)
                }
            }

            impl EventBody for $kind {
                const KIND: EventKind = EventKind::$kind;

                fn of(event: &Event) -> Option<&Self> {
                    match event {
                        Event::$kind(e) => Some(e),
                        _ => None,
                    }
                }
            }
        )*
    };
}

events! {
    /// The worker starts joining the job.
    Joining = "joining" {
        /// The worker's id.
        worker: String,
        /// Wall clock (ms since the Unix epoch).
        t_ms: u64,
    }
    /// The worker is a member.
    Joined = "joined" {
        /// The worker's id.
        worker: String,
        /// Its incarnation (a fresh one per join).
        incarnation: u64,
        /// The data-plane address peers dial.
        addr: String,
        /// The address it listens on (absent from workers that do not know it: Python's).
        listen: Option<SocketAddr>,
        /// Wall clock (ms since the Unix epoch).
        t_ms: u64,
    }
    /// The job ended while the worker waited for a generation.
    JobEnded = "job_ended" {
        /// How it ended (`finished`).
        outcome: String,
        /// The coordinator's reason.
        reason: Text,
        /// Wall clock (ms since the Unix epoch).
        t_ms: u64,
    }
    /// A generation formed.
    Generation = "generation" {
        /// The generation.
        gen: u64,
        /// Its number of members.
        world: u64,
        /// This worker's rank in it.
        rank: u32,
        /// The transport its mesh uses (`tcp`, `shm`, `rdma`).
        transport: String,
        /// Data-plane peers linked at set-up (every other rank in a full mesh; fewer when
        /// only the links the schedules use are made up front).
        links: Option<u64>,
        /// How many of those links were carried over from the previous generation rather
        /// than dialled (incremental re-formation); the others are new.
        carried: Option<u64>,
        /// Member entries this worker holds: every member's when the generation was answered
        /// whole, fewer in a sparse view (its partners, host-mates and planned peers).
        known: Option<u64>,
        /// Wall clock (ms since the Unix epoch).
        t_ms: u64,
    }
    /// The state sync at the start of a generation finished.
    Restored = "restored" {
        /// The generation.
        gen: u64,
        /// This worker's rank.
        rank: u32,
        /// The step of the state now held (-1: nothing committed yet).
        step: i64,
        /// The rank whose state was taken.
        source: u32,
        /// Whether this worker's state changed.
        changed: bool,
        /// Wall clock (ms since the Unix epoch).
        t_ms: u64,
    }
    /// A collective, sync or commit failed.
    Error = "error" {
        /// The generation.
        gen: u64,
        /// This worker's rank.
        rank: u32,
        /// The step (absent for a sync).
        step: Option<u64>,
        /// Where it failed when not in a step's allreduce (`sync`, `commit`).
        phase: Option<String>,
        /// The error's kind (`PeerFailed`, `Timeout`, `Revoked`, `Transport`, ...).
        kind: String,
        /// The collective's own error (a step's allreduce only).
        detail: Option<Text>,
        /// The root cause learned from the coordinator.
        cause: Text,
        /// Wall clock when the collective failed (ms since the Unix epoch).
        t_ms: u64,
        /// Wall clock when the root cause was known (a step's allreduce only).
        cause_t_ms: Option<u64>,
    }
    /// The job reached its last step.
    Finished = "finished" {
        /// The generation.
        gen: u64,
        /// This worker's rank.
        rank: u32,
        /// The last step.
        step: u64,
        /// SHA-256 (hex) of the parameters held (absent from a worker program that does not
        /// report it: the harness then skips the comparison, visibly).
        params_digest: Option<String>,
        /// SHA-256 (hex) of the parameters expected after `step` steps.
        expected_digest: Option<String>,
        /// Wall clock (ms since the Unix epoch).
        t_ms: u64,
    }
    /// A step's allreduce starts.
    Allreduce = "allreduce" {
        /// The generation.
        gen: u64,
        /// This worker's rank.
        rank: u32,
        /// The step.
        step: u64,
        /// Wall clock (ms since the Unix epoch).
        t_ms: u64,
    }
    /// An allreduce returned a wrong element.
    WrongResult = "wrong_result" {
        /// The generation.
        gen: u64,
        /// This worker's rank.
        rank: u32,
        /// The step.
        step: u64,
        /// The first wrong element.
        index: u64,
        /// Its value (`-`: none).
        got: String,
        /// The value expected.
        expected: String,
        /// Wall clock (ms since the Unix epoch).
        t_ms: u64,
    }
    /// The first step after a failure finished.
    Recovered = "recovered" {
        /// The generation.
        gen: u64,
        /// This worker's rank.
        rank: u32,
        /// The step.
        step: u64,
        /// Time from the failure to this step (ms).
        lost_ms: u64,
        /// Wall clock (ms since the Unix epoch).
        t_ms: u64,
    }
    /// A step finished.
    Step = "step" {
        /// The generation.
        gen: u64,
        /// Its number of members.
        world: u64,
        /// This worker's rank.
        rank: u32,
        /// The steps committed (this one included).
        step: u64,
        /// The step's collectives (ms, printed with three decimals).
        ms: f64,
        /// Wall clock (ms since the Unix epoch).
        t_ms: u64,
    }
    /// The worker left.
    Leave = "leave" {
        /// The generation (0: none yet).
        gen: u64,
        /// Its rank (absent when it left between generations).
        rank: Option<u32>,
        /// The last committed step.
        step: u64,
        /// SHA-256 (hex) of the parameters held.
        params_digest: Option<String>,
        /// SHA-256 (hex) of the parameters expected after `step` steps.
        expected_digest: Option<String>,
        /// `false` when it left between generations (absent: at a commit point).
        joined: Option<bool>,
        /// Wall clock (ms since the Unix epoch).
        t_ms: u64,
    }
    /// The coordinator asked this straggler to leave.
    StragglerLeave = "straggler_leave" {
        /// The generation.
        gen: u64,
        /// This worker's rank.
        rank: u32,
        /// The step of the commit point it leaves at.
        step: u64,
        /// The coordinator's verdict.
        reason: Text,
        /// Wall clock (ms since the Unix epoch).
        t_ms: u64,
    }
    /// A cooperative re-formation at a commit point.
    Reform = "reform" {
        /// The generation.
        gen: u64,
        /// This worker's rank.
        rank: u32,
        /// The step of the commit point.
        step: u64,
        /// Why (`scale_up`, `leave`).
        reason: String,
        /// Wall clock (ms since the Unix epoch).
        t_ms: u64,
    }
    /// The per-link deadlines in force.
    Deadlines = "deadlines" {
        /// The generation.
        gen: u64,
        /// This worker's rank.
        rank: u32,
        /// The step.
        step: u64,
        /// `PEER:MS:BASIS` per link, comma separated (`1:250:floor,2:250:floor`).
        peers: String,
        /// Wall clock (ms since the Unix epoch).
        t_ms: u64,
    }
    /// The parameters left the expected trajectory.
    WrongParams = "wrong_params" {
        /// The generation.
        gen: u64,
        /// This worker's rank.
        rank: u32,
        /// The step the parameters are checked for.
        step: u64,
        /// Where the check ran (`sync`, `restore`, `commit`, `end`).
        phase: String,
        /// The step the parameters were made by, when it is not `step`.
        held_step: Option<u64>,
        /// The first wrong element (when the step matched).
        index: Option<u64>,
        /// Its value (`-`: none).
        got: Option<String>,
        /// The value expected.
        expected: Option<String>,
        /// Wall clock (ms since the Unix epoch).
        t_ms: u64,
    }
    /// The worker's totals at exit.
    Summary = "summary" {
        /// Steps this worker ran and verified.
        verified_steps: u64,
        /// The last committed step.
        final_step: u64,
        /// Re-formations after failures.
        failures: u64,
        /// The time lost to each failure (ms, comma separated; `-`: none).
        lost_ms: String,
        /// Cooperative re-formations (scale-up, leaves).
        cooperative_reforms: u64,
        /// Whether this worker left early (SIGTERM).
        left: bool,
        /// Alltoalls run and verified (`train --alltoall-every`; absent: none).
        alltoalls: Option<u64>,
        /// SHA-256 (hex) of the final parameters (`-`: never a member).
        params_digest: String,
        /// SHA-256 (hex) of the parameters expected after `final_step` steps (`-`: never a
        /// member).
        expected_digest: String,
        /// Wall clock (ms since the Unix epoch).
        t_ms: u64,
    }
    /// The worker stops on an error.
    Fatal = "fatal" {
        /// The error.
        error: Text,
        /// Wall clock (ms since the Unix epoch).
        t_ms: u64,
    }
    /// The metrics endpoint is listening.
    Metrics = "metrics" {
        /// Its address.
        address: SocketAddr,
        /// Wall clock (ms since the Unix epoch).
        t_ms: u64,
    }
    /// The worker received SIGTERM.
    Sigterm = "sigterm" {
        /// Wall clock (ms since the Unix epoch).
        t_ms: u64,
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
        EventKind::ALL
            .iter()
            .copied()
            .find(|k| k.name() == s)
            .ok_or_else(|| EventParseError::UnknownKind(s.to_string()))
    }
}

/// One key of an event kind's line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Key {
    /// The key (the struct field's name).
    pub name: &'static str,
    /// Whether every line of the kind carries it (an `Option` field may be absent).
    pub required: bool,
    /// Whether its value is free text, always quoted.
    pub quoted: bool,
}

/// A kind's struct: which kind it is, and how to find it in an [`Event`].
pub trait EventBody: Sized {
    /// The kind.
    const KIND: EventKind;

    /// The struct if `event` is of this kind.
    fn of(event: &Event) -> Option<&Self>;
}

impl Event {
    /// The struct of kind `T`, if the event is of that kind:
    /// `e.get::<Step>().is_some_and(|s| s.step >= 10)`.
    pub fn get<T: EventBody>(&self) -> Option<&T> {
        T::of(self)
    }

    /// Prints the line on stdout (the protocol's channel).
    pub fn print(&self) {
        println!("{self}");
    }
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.to_line().fmt(f)
    }
}

impl FromStr for Event {
    type Err = EventParseError;

    /// Parses a line into its kind's struct; keys the kind does not define are ignored.
    fn from_str(line: &str) -> Result<Self, Self::Err> {
        Event::from_line(&line.parse()?)
    }
}

/// Free text (an error, a reason): always printed quoted.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Text(pub String);

impl Deref for Text {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<String> for Text {
    fn from(s: String) -> Self {
        Text(s)
    }
}

impl From<&str> for Text {
    fn from(s: &str) -> Self {
        Text(s.to_string())
    }
}

impl PartialEq<str> for Text {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for Text {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

/// How a field's value is printed and read back: implemented by the types event fields have.
pub trait FieldValue: Sized {
    /// Whether a line must carry the key (an `Option` may leave it out).
    const REQUIRED: bool = true;
    /// Whether the value is always quoted (free text).
    const QUOTED: bool = false;

    /// The value as printed, unquoted; `None` leaves the key out.
    fn render(&self) -> Option<String>;

    /// The value from its unquoted text; `None` if the text is not one.
    fn parse(text: &str) -> Option<Self>;

    /// The value of a key the line lacks; `None` if the key is required.
    fn absent() -> Option<Self> {
        None
    }
}

/// [`FieldValue`] through `Display` and `FromStr`.
macro_rules! plain_values {
    ($($ty:ty),*) => {$(
        impl FieldValue for $ty {
            fn render(&self) -> Option<String> {
                Some(self.to_string())
            }
            fn parse(text: &str) -> Option<Self> {
                text.parse().ok()
            }
        }
    )*};
}

plain_values!(u64, u32, i64, bool, String, SocketAddr);

/// Milliseconds with three decimals (`1.234`).
impl FieldValue for f64 {
    fn render(&self) -> Option<String> {
        Some(format!("{self:.3}"))
    }
    fn parse(text: &str) -> Option<Self> {
        text.parse().ok()
    }
}

impl FieldValue for Text {
    const QUOTED: bool = true;

    fn render(&self) -> Option<String> {
        Some(self.0.clone())
    }
    fn parse(text: &str) -> Option<Self> {
        Some(Text(text.to_string()))
    }
}

impl<T: FieldValue> FieldValue for Option<T> {
    const REQUIRED: bool = false;
    const QUOTED: bool = T::QUOTED;

    fn render(&self) -> Option<String> {
        self.as_ref().and_then(T::render)
    }
    fn parse(text: &str) -> Option<Self> {
        T::parse(text).map(Some)
    }
    fn absent() -> Option<Self> {
        Some(None)
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
    /// A key its kind requires is missing.
    #[error("event={kind} without its key {key}")]
    Missing {
        /// The line's kind.
        kind: EventKind,
        /// The missing key.
        key: &'static str,
    },
    /// A value does not parse as its field's type.
    #[error("event={kind}: {key}={value:?} is not a valid value")]
    BadValue {
        /// The line's kind.
        kind: EventKind,
        /// The key.
        key: &'static str,
        /// Its text.
        value: String,
    },
}

/// One event line as text: its kind and its `key=value` fields in print order, untyped (the
/// tokenizer under [`Event`]; every key read as text, the unknown ones too).
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
    fn new(kind: EventKind) -> Self {
        Self { kind, fields: Vec::new() }
    }

    /// Appends `key=value` unless the value leaves the key out; quoted for free text, or
    /// when the value holds a space or a double quote.
    fn push<T: FieldValue>(&mut self, key: &str, value: &T) {
        if let Some(text) = value.render() {
            let quoted = T::QUOTED || text.contains(char::is_whitespace) || text.contains('"');
            self.fields.push((key.to_string(), Value { text, quoted }));
        }
    }

    /// The value of `key` as a `T`.
    fn take<T: FieldValue>(&self, kind: EventKind, key: &'static str) -> Result<T, EventParseError> {
        match self.get(key) {
            None => T::absent().ok_or(EventParseError::Missing { kind, key }),
            Some(text) => {
                T::parse(text).ok_or_else(|| EventParseError::BadValue { kind, key, value: text.to_string() })
            }
        }
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

/// The key table of `python/cohort/events.py` (between its `# BEGIN` and `# END` markers):
/// one line per kind, `"KIND": "KEY KEY? KEY:text ..."` (`?`: optional, `:text`: always
/// quoted), generated from [`EventKind::keys`].
pub fn python_key_table() -> String {
    let mut out = String::from("KEYS = {\n");
    for kind in EventKind::ALL {
        let keys: Vec<String> = kind
            .keys()
            .iter()
            .map(|k| format!("{}{}{}", k.name, if k.required { "" } else { "?" }, if k.quoted { ":text" } else { "" }))
            .collect();
        let line = format!("    \"{}\": \"{}\",", kind.name(), keys.join(" "));
        // Python's line limit (ruff, 120): a longer kind's line says it is generated.
        let noqa = if line.len() > 120 { "  # noqa: E501 - generated" } else { "" };
        out.push_str(&format!("{line}{noqa}\n"));
    }
    out.push_str("}\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One line of every kind, as the worker prints it: the wire format, written out. Each is
    /// parsed into its struct and printed back to the same text, so renaming, removing or
    /// reordering a key of any kind fails here.
    const GOLDEN: &[&str] = &[
        "event=joining worker=w1 t_ms=1700000000000",
        "event=joined worker=w1 incarnation=3 addr=127.0.0.1:4100 listen=0.0.0.0:4100 t_ms=1700000000001",
        r#"event=job_ended outcome=finished reason="job finished: 40 steps" t_ms=1700000000002"#,
        "event=generation gen=2 world=3 rank=1 transport=shm t_ms=1700000000003",
        "event=restored gen=2 rank=1 step=-1 source=0 changed=false t_ms=1700000000004",
        r#"event=error gen=4 rank=0 step=12 kind=PeerFailed detail="rank 2: peer closed" cause="rank 2 (worker w2 on h): peer closed" t_ms=100 cause_t_ms=101"#,
        "event=finished gen=2 rank=1 step=40 params_digest=ab12 expected_digest=ab12 t_ms=1700000000005",
        "event=allreduce gen=2 rank=1 step=7 t_ms=1700000000006",
        "event=wrong_result gen=2 rank=1 step=7 index=5 got=1.0 expected=2.0 t_ms=1700000000007",
        "event=recovered gen=3 rank=0 step=8 lost_ms=412 t_ms=1700000000008",
        "event=step gen=3 world=2 rank=0 step=8 ms=1.250 t_ms=1700000000009",
        "event=leave gen=3 rank=0 step=8 params_digest=ab12 expected_digest=ab12 t_ms=1700000000010",
        r#"event=straggler_leave gen=3 rank=2 step=9 reason="straggler (slow): 2.1x the median" t_ms=1700000000011"#,
        "event=reform gen=3 rank=0 step=10 reason=scale_up t_ms=1700000000012",
        "event=deadlines gen=3 rank=0 step=16 peers=1:250:floor,2:250:floor t_ms=1700000000013",
        "event=wrong_params gen=3 rank=0 step=16 phase=commit index=4 got=1.5 expected=2.5 t_ms=1700000000014",
        "event=summary verified_steps=40 final_step=40 failures=1 lost_ms=412 cooperative_reforms=0 left=false params_digest=ab12 expected_digest=ab12 t_ms=1700000000015",
        r#"event=fatal error="bad 'path' C:\\tmp" t_ms=1700000000016"#,
        "event=metrics address=127.0.0.1:9100 t_ms=1700000000017",
        "event=sigterm t_ms=1700000000018",
    ];

    #[test]
    fn every_kind_round_trips_through_its_struct() {
        let mut seen = std::collections::BTreeSet::new();
        for text in GOLDEN {
            let event: Event = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(event.to_string(), *text, "printed back");
            assert_eq!(event.to_string().parse::<Event>().as_ref(), Ok(&event));
            // The line carries exactly its kind's keys, in the struct's order.
            let line: EventLine = text.parse().unwrap();
            let keys: Vec<&str> = line.fields().map(|(k, _)| k).collect();
            let declared: Vec<&str> = event.kind().keys().iter().map(|k| k.name).collect();
            let mut declared_iter = declared.iter();
            for k in &keys {
                assert!(declared_iter.any(|d| d == k), "{text}: key {k} not declared in this order: {declared:?}");
            }
            for key in event.kind().keys().iter().filter(|k| k.required) {
                assert!(keys.contains(&key.name), "{text}: required key {} missing", key.name);
            }
            seen.insert(event.kind());
        }
        assert_eq!(seen.len(), EventKind::ALL.len(), "a kind has no golden line");
    }

    #[test]
    fn the_worker_variants_of_error_leave_and_wrong_params_round_trip() {
        for text in [
            r#"event=error gen=4 rank=0 phase=sync kind=Revoked cause="rank 2 left" t_ms=100"#,
            r#"event=error gen=4 rank=0 step=12 phase=commit kind=Timeout cause="no progress" t_ms=100"#,
            "event=leave gen=0 step=0 joined=false t_ms=5",
            "event=leave gen=3 step=8 params_digest=ab expected_digest=ab joined=false t_ms=5",
            "event=wrong_params gen=3 rank=0 step=16 phase=restore held_step=15 t_ms=1",
        ] {
            let event: Event = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(event.to_string(), text);
        }
    }

    #[test]
    fn every_kind_round_trips_by_name_and_through_serde() {
        for &kind in EventKind::ALL {
            assert_eq!(kind.name().parse::<EventKind>(), Ok(kind));
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{}\"", kind.name()));
            assert_eq!(serde_json::from_str::<EventKind>(&json).unwrap(), kind);
            assert!(kind.keys().iter().any(|k| k.name == "t_ms" && k.required), "{kind} has no t_ms");
        }
        let names: std::collections::BTreeSet<_> = EventKind::ALL.iter().map(|k| k.name()).collect();
        assert_eq!(names.len(), EventKind::ALL.len(), "two kinds share a name");
    }

    #[test]
    fn structs_print_what_the_worker_printed_by_hand() {
        let e = Error {
            gen: 4,
            rank: 0,
            step: Some(12),
            phase: None,
            kind: "PeerFailed".into(),
            detail: Some("rank 2: peer closed".into()),
            cause: "rank 2 (worker w2 on h): peer closed".into(),
            t_ms: 100,
            cause_t_ms: Some(101),
        };
        assert_eq!(
            e.to_string(),
            r#"event=error gen=4 rank=0 step=12 kind=PeerFailed detail="rank 2: peer closed" cause="rank 2 (worker w2 on h): peer closed" t_ms=100 cause_t_ms=101"#
        );
        let parsed: Event = e.to_string().parse().unwrap();
        assert_eq!(parsed.get::<Error>(), Some(&e));
        assert_eq!(parsed.get::<Step>(), None);
        assert_eq!(parsed.t_ms(), 100);
        let step = Step { gen: 1, world: 2, rank: 0, step: 3, ms: 0.12345, t_ms: 9 };
        assert_eq!(step.to_string(), "event=step gen=1 world=2 rank=0 step=3 ms=0.123 t_ms=9");
    }

    #[test]
    fn quoting_escapes_backslashes_and_replaces_double_quotes() {
        let fatal = Fatal { error: r#"bad "path" C:\tmp"#.into(), t_ms: 1 };
        let printed = fatal.to_string();
        assert_eq!(printed, r#"event=fatal error="bad 'path' C:\\tmp" t_ms=1"#);
        let back: Event = printed.parse().unwrap();
        assert_eq!(back.get::<Fatal>().map(|f| &*f.error), Some(r"bad 'path' C:\tmp"));
        // A plain value that turns out to hold a space is quoted rather than split.
        let spaced = Reform { gen: 1, rank: 0, step: 2, reason: "two words".into(), t_ms: 3 };
        assert_eq!(spaced.to_string(), r#"event=reform gen=1 rank=0 step=2 reason="two words" t_ms=3"#);
        let back: Event = spaced.to_string().parse().unwrap();
        assert_eq!(back.get::<Reform>().map(|r| r.reason.as_str()), Some("two words"));
    }

    #[test]
    fn bad_lines_are_typed_errors() {
        assert_eq!("event=teleported gen=1".parse::<Event>(), Err(EventParseError::UnknownKind("teleported".into())));
        assert_eq!("gen=3 rank=1".parse::<Event>(), Err(EventParseError::NotAnEvent));
        assert_eq!("".parse::<EventLine>(), Err(EventParseError::NotAnEvent));
        assert!(matches!("not an event".parse::<Event>(), Err(EventParseError::Malformed(_))));
        assert!(matches!(r#"event=fatal error="never closed"#.parse::<Event>(), Err(EventParseError::Malformed(_))));
        assert!(matches!("event=step =3".parse::<EventLine>(), Err(EventParseError::Malformed(_))));
        assert_eq!("nonsense".parse::<EventKind>(), Err(EventParseError::UnknownKind("nonsense".into())));
        assert_eq!(
            "event=step gen=1 world=2 rank=0 ms=1.0 t_ms=5".parse::<Event>(),
            Err(EventParseError::Missing { kind: EventKind::Step, key: "step" })
        );
        assert_eq!(
            "event=step gen=1 world=2 rank=0 step=x ms=1.0 t_ms=5".parse::<Event>(),
            Err(EventParseError::BadValue { kind: EventKind::Step, key: "step", value: "x".into() })
        );
    }

    #[test]
    fn unknown_keys_are_ignored_and_the_event_key_may_stand_anywhere() {
        let line: EventLine = "gen=2 event=step joined= t_ms=5".parse().unwrap();
        assert_eq!(line.kind(), EventKind::Step);
        assert_eq!(line.get("joined"), Some(""));
        assert_eq!(line.fields().map(|(k, _)| k).collect::<Vec<_>>(), ["gen", "joined", "t_ms"]);
        // An example's extra keys (digits.py prints `loss`) do not stop its line parsing.
        let e: Event = "event=step gen=1 world=2 rank=0 step=3 ms=4.000 loss=0.5 t_ms=9".parse().unwrap();
        assert_eq!(e.get::<Step>().map(|s| s.step), Some(3));
    }

    /// `python/cohort/events.py` holds the key table the Python workers print with; it must be
    /// the one these definitions make (a renamed Rust field fails here until the Python side
    /// follows).
    #[test]
    fn the_python_key_table_is_the_rust_one() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../python/cohort/events.py");
        let text = std::fs::read_to_string(path).expect("python/cohort/events.py");
        let begin = "# BEGIN generated by cohort_harness::events::python_key_table\n";
        let start = text.find(begin).expect("the BEGIN marker") + begin.len();
        let end = text[start..].find("# END").expect("the END marker") + start;
        assert_eq!(
            &text[start..end],
            python_key_table(),
            "python/cohort/events.py's table differs from worker/harness/src/events.rs: paste the table above between its markers"
        );
    }
}
