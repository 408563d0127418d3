//! Progress of long runs (the chaos suite and soak, the scale harness, `cohort-worker bench`
//! sweeps) on stderr: a progress bar saying what runs and the time left when stderr is a
//! terminal, one plain line per change otherwise (a CI log, a file). Nothing goes to stdout,
//! which carries the runs' machine-readable results.
//!
//! `COHORT_PROGRESS=bar|lines|off` chooses the display whatever stderr is.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle};
use std::io::{IsTerminal, Write as _};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How much work a run has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Total {
    /// A number of items (scenarios, message sizes, phases).
    Items(u64),
    /// A length of time (a soak runs until it has passed).
    Time(Duration),
    /// Not known ahead.
    Unknown,
}

/// How progress is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// A bar redrawn in place (a terminal).
    Bar,
    /// One line per item started or done.
    Lines,
    /// Nothing.
    Off,
}

impl Mode {
    /// `COHORT_PROGRESS` when set to `bar`, `lines` or `off`; otherwise a bar when stderr is a
    /// terminal and lines when it is not.
    pub fn detect() -> Mode {
        match std::env::var("COHORT_PROGRESS").as_deref() {
            Ok("bar") => Mode::Bar,
            Ok("lines") => Mode::Lines,
            Ok("off") => Mode::Off,
            _ if std::io::stderr().is_terminal() => Mode::Bar,
            _ => Mode::Lines,
        }
    }
}

/// Items done and what runs now.
#[derive(Default)]
struct State {
    done: u64,
    running: String,
}

/// Where plain lines go.
type Sink = Box<dyn Fn(&str) + Send + Sync>;

/// The progress of one run. Shared by reference; every method takes `&self`.
pub struct Progress {
    what: String,
    total: Total,
    mode: Mode,
    started: Instant,
    state: Mutex<State>,
    bar: Option<ProgressBar>,
    lines: Sink,
}

impl Progress {
    /// Progress of `what` (e.g. `suite`, `bench 4 ranks`) with `total` work, shown as
    /// [`Mode::detect`] says.
    pub fn new(what: impl Into<String>, total: Total) -> Self {
        Self::with_mode(what, total, Mode::detect())
    }

    /// Progress shown as `mode` says.
    pub fn with_mode(what: impl Into<String>, total: Total, mode: Mode) -> Self {
        // Progress is best effort: a closed stderr does not fail the run.
        Self::with_sink(what, total, mode, Box::new(|line| drop(writeln!(std::io::stderr().lock(), "{line}"))))
    }

    fn with_sink(what: impl Into<String>, total: Total, mode: Mode, lines: Sink) -> Self {
        let what = what.into();
        let bar = (mode == Mode::Bar).then(|| bar(&what, total));
        Self { what, total, mode, started: Instant::now(), state: Mutex::new(State::default()), bar, lines }
    }

    /// An item starts: `running` says what it is.
    pub fn start(&self, running: impl Into<String>) {
        let running = running.into();
        if let Some(bar) = &self.bar {
            bar.set_message(running.clone());
        }
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.running = running;
        self.line(&state, "running");
    }

    /// The item running is done (`outcome`: how it went, e.g. `pass`; empty for nothing).
    pub fn done(&self, outcome: &str) {
        if let Some(bar) = &self.bar {
            bar.inc(1);
        }
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.done += 1;
        let verb = if outcome.is_empty() { "done" } else { outcome };
        self.line(&state, verb);
    }

    /// Runs `f` with the bar hidden, so that what `f` prints (on stdout or stderr) does not
    /// mix with it.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.bar {
            Some(bar) => bar.suspend(f),
            None => f(),
        }
    }

    /// Removes the bar (lines and off: nothing). Dropping the progress does the same.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }

    /// In [`Mode::Lines`], writes the line for `state` (`verb`: running, pass, done, ...).
    fn line(&self, state: &State, verb: &str) {
        if self.mode != Mode::Lines {
            return;
        }
        (self.lines)(&plain_line(&self.what, self.total, state.done, self.started.elapsed(), verb, &state.running));
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

/// The bar for `total`, on stderr, ticking every half second (the elapsed and left times
/// move between items).
fn bar(what: &str, total: Total) -> ProgressBar {
    let (bar, template) = match total {
        Total::Items(n) => {
            (ProgressBar::new(n), "{prefix} [{bar:24}] {pos}/{len}, {elapsed} elapsed, {items_left}: {wide_msg}")
        }
        Total::Time(_) => (ProgressBar::no_length(), "{spinner} {prefix} {elapsed} elapsed, {time_left}: {wide_msg}"),
        Total::Unknown => (ProgressBar::no_length(), "{spinner} {prefix} {elapsed} elapsed: {wide_msg}"),
    };
    let style = ProgressStyle::with_template(template)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ")
        .with_key("items_left", |state: &ProgressState, w: &mut dyn std::fmt::Write| {
            let left = items_left(state.elapsed(), state.pos(), state.len().unwrap_or(0));
            let _ = w.write_str(&left.map_or_else(|| "? left".to_string(), |l| format!("~{} left", short(l))));
        })
        .with_key("time_left", move |state: &ProgressState, w: &mut dyn std::fmt::Write| {
            let left = match total {
                Total::Time(d) => d.saturating_sub(state.elapsed()),
                _ => Duration::ZERO,
            };
            let _ = write!(w, "{} left", short(left));
        });
    bar.set_draw_target(ProgressDrawTarget::stderr());
    bar.set_style(style);
    bar.set_prefix(what.to_string());
    bar.enable_steady_tick(Duration::from_millis(500));
    bar
}

/// The time left when `done` of `total` items took `elapsed`, at the same pace (`None`
/// before the first item is done).
fn items_left(elapsed: Duration, done: u64, total: u64) -> Option<Duration> {
    if done == 0 {
        return None;
    }
    let per_item = elapsed.as_secs_f64() / done as f64;
    Some(Duration::from_secs_f64(per_item * total.saturating_sub(done) as f64))
}

/// A duration for people: `42s`, `3m05s`, `1h02m`.
pub fn short(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// One plain progress line: `what: position, elapsed, time left: verb running`, e.g.
/// `suite: 2/9, 1m12s elapsed, ~4m12s left: pass kills (seed 7)`.
pub fn plain_line(what: &str, total: Total, done: u64, elapsed: Duration, verb: &str, running: &str) -> String {
    let position = match total {
        Total::Items(n) => {
            let left = items_left(elapsed, done, n)
                .map_or_else(|| "time left unknown".to_string(), |l| format!("~{} left", short(l)));
            format!("{done}/{n}, {} elapsed, {left}", short(elapsed))
        }
        Total::Time(d) => format!("{done} done, {} elapsed, {} left", short(elapsed), short(d.saturating_sub(elapsed))),
        Total::Unknown => format!("{done} done, {} elapsed", short(elapsed)),
    };
    if running.is_empty() {
        format!("{what}: {position}: {verb}")
    } else {
        format!("{what}: {position}: {verb} {running}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_lines_say_position_elapsed_and_time_left() {
        let s = Duration::from_secs;
        assert_eq!(
            plain_line("suite", Total::Items(9), 2, s(72), "pass", "kills (seed 7)"),
            "suite: 2/9, 1m12s elapsed, ~4m12s left: pass kills (seed 7)"
        );
        assert_eq!(
            plain_line("suite", Total::Items(9), 0, s(3), "running", "kills"),
            "suite: 0/9, 3s elapsed, time left unknown: running kills"
        );
        assert_eq!(
            plain_line("soak", Total::Time(s(600)), 4, s(130), "running", "run 5 (seed 5)"),
            "soak: 4 done, 2m10s elapsed, 7m50s left: running run 5 (seed 5)"
        );
        // Past its duration a soak finishes the run it is in: nothing left, not negative.
        assert_eq!(
            plain_line("soak", Total::Time(s(60)), 1, s(75), "pass", ""),
            "soak: 1 done, 1m15s elapsed, 0s left: pass"
        );
        assert_eq!(
            plain_line("scale store=etcd", Total::Unknown, 3, s(4000), "running", "one round of heartbeats"),
            "scale store=etcd: 3 done, 1h06m elapsed: running one round of heartbeats"
        );
    }

    #[test]
    fn a_progress_counts_what_is_done_and_writes_lines_in_lines_mode_only() {
        use std::sync::Arc;
        for mode in [Mode::Lines, Mode::Off, Mode::Bar] {
            let written = Arc::new(Mutex::new(Vec::<String>::new()));
            let sink = written.clone();
            let sink: Sink =
                Box::new(move |line| sink.lock().unwrap_or_else(PoisonError::into_inner).push(line.into()));
            let p = Progress::with_sink("test", Total::Items(2), mode, sink);
            p.start("a");
            p.done("pass");
            p.start("b");
            assert_eq!(p.suspend(|| 7), 7);
            p.done("");
            p.finish();
            let state = p.state.lock().unwrap_or_else(PoisonError::into_inner);
            assert_eq!((state.done, state.running.as_str()), (2, "b"), "{mode:?}");
            // Lines carry no timing in this test: compare their ends.
            let written = written.lock().unwrap_or_else(PoisonError::into_inner).clone();
            let ends: Vec<&str> = written.iter().map(|l| l.rsplit(": ").next().unwrap_or("")).collect();
            if mode == Mode::Lines {
                assert_eq!(ends, ["running a", "pass a", "running b", "done b"], "{written:?}");
                assert!(written[1].starts_with("test: 1/2, 0s elapsed, ~0s left: "), "{written:?}");
            } else {
                assert!(written.is_empty(), "{mode:?}: {written:?}");
            }
        }
    }
}
