//! Between the conductor and its farms: one line per command on a farm's stdin, one line per
//! answer on its stdout, `VERB key=value ...` (a free text, when there is one, last, as
//! `text=...` to the end of the line). Times are `CLOCK_MONOTONIC` nanoseconds, one clock for
//! every process of the machine, so the conductor can time what a farm saw.
//!
//! Also here: the summary of the generations a farm's members hold ([`summarize`]), and the
//! conductor's check of every farm's summaries together ([`Views`]).

use cohort::elastic::Generation;
use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::time::Duration;

/// Now, on the machine's monotonic clock, in nanoseconds (the same in every process).
pub(crate) fn mono_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime with a valid clock and a pointer to a local struct.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The time from `from` to `to` (nanoseconds of [`mono_ns`]; zero if `to` is earlier).
pub(crate) fn between(from: u64, to: u64) -> Duration {
    Duration::from_nanos(to.saturating_sub(from))
}

/// Writes one line to stdout at once (a farm's answers; the stdout lock keeps lines whole).
pub(crate) fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    // A conductor that is gone reads nothing: the farm ends when its stdin closes.
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// A line's verb and its `key=value` fields.
pub(crate) struct Fields<'a> {
    pub(crate) verb: &'a str,
    fields: HashMap<&'a str, &'a str>,
}

impl<'a> Fields<'a> {
    /// Splits `line`: its first word, then `key=value` words; `text=` takes the rest of the line.
    pub(crate) fn parse(line: &'a str) -> Self {
        let (head, text) = match line.find(" text=") {
            Some(at) => (&line[..at], Some(&line[at + 6..])),
            None => (line, None),
        };
        let mut words = head.split_whitespace();
        let verb = words.next().unwrap_or("");
        let mut fields: HashMap<&str, &str> = words.filter_map(|w| w.split_once('=')).collect();
        if let Some(text) = text {
            fields.insert("text", text);
        }
        Self { verb, fields }
    }

    /// The value of `key`, or an error naming it.
    pub(crate) fn get(&self, key: &str) -> Result<&'a str, String> {
        self.fields.get(key).copied().ok_or_else(|| format!("`{}` answer without {key}=", self.verb))
    }

    /// The value of `key`, parsed.
    pub(crate) fn num<T: std::str::FromStr>(&self, key: &str) -> Result<T, String> {
        self.get(key)?.parse().map_err(|_| format!("`{}` answer: {key}= is not a number", self.verb))
    }

    /// The comma-separated numbers of `key` (none for an empty value).
    pub(crate) fn nums<T: std::str::FromStr>(&self, key: &str) -> Result<Vec<T>, String> {
        let v = self.get(key)?;
        v.split(',')
            .filter(|s| !s.is_empty())
            .map(|s| s.parse().map_err(|_| format!("`{}` answer: {key}= holds {s:?}", self.verb)))
            .collect()
    }
}

/// Summarizes the generations a farm's members hold (`(member index, generation)`), after
/// checking that each is generation `number` of `size` members: `held=` the entries held in
/// all, `ranks=INDEX:RANK,...`, `entries=RANK:WORKER:INCARNATION,...` (each rank anyone holds,
/// once; two different entries for one rank is an error here already).
pub(crate) fn summarize<'g>(
    views: impl Iterator<Item = (usize, &'g Generation<()>)>,
    number: u64,
    size: usize,
) -> Result<String, String> {
    let mut held = 0usize;
    let mut ranks = Vec::new();
    let mut entries: HashMap<u32, (&str, u64)> = HashMap::new();
    for (index, g) in views {
        if g.number != number || g.members.size() as usize != size {
            return Err(format!(
                "member {index} holds generation {} of {} members where {number} of {size} was expected",
                g.number,
                g.members.size()
            ));
        }
        ranks.push(format!("{index}:{}", g.rank));
        for m in g.members.iter() {
            held += 1;
            let entry = (m.worker_id.as_str(), g.members.incarnation_of(m.rank).unwrap_or(0));
            if let Some(other) = entries.insert(m.rank, entry) {
                if other != entry {
                    return Err(format!("generation {number}: rank {} is {other:?} and {entry:?}", m.rank));
                }
            }
        }
    }
    let entries: Vec<String> = entries.iter().map(|(rank, (id, inc))| format!("{rank}:{id}:{inc}")).collect();
    Ok(format!("held={held} ranks={} entries={}", ranks.join(","), entries.join(",")))
}

/// Every farm's summary of one generation, checked together: every rank held by exactly one
/// member, and every entry anyone holds the same member in every view.
pub(crate) struct Views {
    number: u64,
    size: usize,
    /// The member index at each rank.
    index_at: Vec<Option<usize>>,
    /// Each rank's entry as some member holds it: worker id and incarnation.
    entries: HashMap<u32, (String, u64)>,
    held: usize,
    members: usize,
}

impl Views {
    /// An empty check of generation `number` of `size` members.
    pub(crate) fn new(number: u64, size: usize) -> Self {
        Self { number, size, index_at: vec![None; size], entries: HashMap::new(), held: 0, members: 0 }
    }

    /// Adds a farm's summary ([`summarize`]'s fields).
    pub(crate) fn add(&mut self, f: &Fields<'_>) -> Result<(), String> {
        let number = self.number;
        self.held += f.num::<usize>("held")?;
        for pair in f.get("ranks")?.split(',').filter(|s| !s.is_empty()) {
            let (index, rank) = pair.split_once(':').ok_or("ranks= without INDEX:RANK")?;
            let (index, rank): (usize, usize) =
                (index.parse().map_err(|_| "a bad index")?, rank.parse().map_err(|_| "a bad rank")?);
            match self.index_at.get_mut(rank) {
                Some(slot @ None) => *slot = Some(index),
                _ => return Err(format!("generation {number}: rank {rank} twice or out of range")),
            }
            self.members += 1;
        }
        for entry in f.get("entries")?.split(',').filter(|s| !s.is_empty()) {
            let mut parts = entry.split(':');
            let (Some(rank), Some(id), Some(inc)) = (parts.next(), parts.next(), parts.next()) else {
                return Err(format!("entries= holds {entry:?}"));
            };
            let rank: u32 = rank.parse().map_err(|_| format!("entries= holds {entry:?}"))?;
            let inc: u64 = inc.parse().map_err(|_| format!("entries= holds {entry:?}"))?;
            if let Some((other_id, other_inc)) = self.entries.get(&rank) {
                if (other_id.as_str(), *other_inc) != (id, inc) {
                    return Err(format!("generation {number}: rank {rank} is {other_id}#{other_inc} and {id}#{inc}"));
                }
            } else {
                self.entries.insert(rank, (id.to_string(), inc));
            }
        }
        Ok(())
    }

    /// Checks that every rank is held; returns the entries held per member on average.
    pub(crate) fn complete(&self) -> Result<f64, String> {
        if let Some(rank) = self.index_at.iter().position(Option::is_none) {
            return Err(format!("generation {}: rank {rank} of {} is held by no member", self.number, self.size));
        }
        Ok(self.held as f64 / self.members.max(1) as f64)
    }

    /// The member index at `rank`.
    pub(crate) fn index_at(&self, rank: u32) -> Option<usize> {
        self.index_at.get(rank as usize).copied().flatten()
    }

    /// Every worker id anyone holds an entry of.
    pub(crate) fn ids(&self) -> impl Iterator<Item = &str> {
        self.entries.values().map(|(id, _)| id.as_str())
    }
}

/// The conductor's end of a farm: the process (killed when dropped), its stdin, and its
/// answers, read by a thread.
pub(crate) struct Farm {
    /// Which farm (for errors).
    pub(crate) number: usize,
    /// Its members' indices.
    pub(crate) members: std::ops::Range<usize>,
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
    /// Answers read before they were asked for (a farm answers some on its own, e.g. `reformed`).
    early: Vec<String>,
}

impl Drop for Farm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Farm {
    /// Starts this executable as farm `number` with `args` (its stderr is ours).
    pub(crate) fn spawn(number: usize, members: std::ops::Range<usize>, args: &[String]) -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| format!("the harness's executable: {e}"))?;
        let mut child = std::process::Command::new(exe)
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting farm {number}: {e}"))?;
        let stdin = child.stdin.take().ok_or("a farm without stdin")?;
        let stdout = child.stdout.take().ok_or("a farm without stdout")?;
        let (tx, lines) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Self { number, members, child, stdin, lines, early: Vec::new() })
    }

    /// Sends one command line.
    pub(crate) fn send(&mut self, command: &str) -> Result<(), String> {
        writeln!(self.stdin, "{command}")
            .and_then(|()| self.stdin.flush())
            .map_err(|e| format!("farm {}: {e}", self.number))
    }

    /// Waits for the farm's next answer with verb `verb` (earlier answers of other verbs are
    /// kept for later). An `error` answer, or the farm's end, fails it.
    ///
    /// Cancel safety: cancel-safe; an answer read meanwhile is kept.
    pub(crate) async fn expect(&mut self, verb: &str) -> Result<String, String> {
        let matches = |line: &str| line.split_whitespace().next() == Some(verb);
        if let Some(at) = self.early.iter().position(|l| matches(l)) {
            return Ok(self.early.remove(at));
        }
        loop {
            let Some(line) = self.lines.recv().await else {
                return Err(format!("farm {} ended before answering `{verb}`", self.number));
            };
            if let Some(error) = line.strip_prefix("error ") {
                return Err(format!("farm {}: {error}", self.number));
            }
            if matches(&line) {
                return Ok(line);
            }
            self.early.push(line);
        }
    }

    /// Sends `command` and waits for its answer, `verb`.
    ///
    /// Cancel safety: as [`Farm::expect`]; the command is sent either way.
    pub(crate) async fn ask(&mut self, command: &str, verb: &str) -> Result<String, String> {
        self.send(command)?;
        self.expect(verb).await
    }
}
