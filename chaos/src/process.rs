//! Child processes the harness owns: spawned with their own log, signalled, always reaped.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

/// A line a child printed on stdout, with when the harness read it.
#[derive(Clone, Debug)]
pub struct OutputLine {
    /// Name of the process (e.g. `w2`, `coord0`).
    pub name: String,
    /// The line, without its newline.
    pub line: String,
    /// Wall clock when read, ms since the Unix epoch.
    pub read_ms: u64,
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// A child process with its stdout forwarded (line by line) to the harness and copied,
/// with its stderr, to `<log_dir>/<name>.log`. Killed with SIGKILL when dropped.
pub struct ManagedProcess {
    name: String,
    child: Child,
    pid: u32,
    log: PathBuf,
    reader: Option<tokio::task::JoinHandle<()>>,
}

/// Errors starting or signalling a child.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// The program could not be started.
    #[error("starting {name} ({program}): {source}")]
    Spawn {
        /// Process name.
        name: String,
        /// Program path.
        program: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// Creating the log file failed.
    #[error("log file {0}: {1}")]
    Log(PathBuf, std::io::Error),
}

/// Called with every stdout line of a child before it is forwarded.
pub type LineHook = Box<dyn FnMut(&str) + Send>;

impl ManagedProcess {
    /// Spawns `command`, forwarding stdout lines to `lines`.
    pub fn spawn(
        name: &str,
        command: Command,
        log_dir: &Path,
        lines: mpsc::UnboundedSender<OutputLine>,
    ) -> Result<Self, ProcessError> {
        Self::spawn_with_hook(name, command, log_dir, lines, None)
    }

    /// Spawns `command`, forwarding stdout lines to `lines`; `hook` sees each line first, in
    /// the same task, so that once [`ManagedProcess::drained`] returns every line has been
    /// both seen and forwarded.
    pub fn spawn_with_hook(
        name: &str,
        mut command: Command,
        log_dir: &Path,
        lines: mpsc::UnboundedSender<OutputLine>,
        mut hook: Option<LineHook>,
    ) -> Result<Self, ProcessError> {
        let log = log_dir.join(format!("{name}.log"));
        // Created empty, then opened in append mode: the child's stderr and the harness's
        // copy of its stdout both write at the end, neither over the other.
        std::fs::File::create(&log).map_err(|e| ProcessError::Log(log.clone(), e))?;
        let stderr_file =
            std::fs::OpenOptions::new().append(true).open(&log).map_err(|e| ProcessError::Log(log.clone(), e))?;
        let program = format!("{:?}", command.as_std().get_program());
        command.stdout(Stdio::piped()).stderr(Stdio::from(stderr_file)).stdin(Stdio::null()).kill_on_drop(true);
        let mut child =
            command.spawn().map_err(|source| ProcessError::Spawn { name: name.to_string(), program, source })?;
        let pid = child.id().unwrap_or(0);
        let mut reader_task = None;
        if let Some(stdout) = child.stdout.take() {
            let name = name.to_string();
            let log = log.clone();
            reader_task = Some(tokio::spawn(async move {
                let mut reader = BufReader::new(stdout).lines();
                let mut file = tokio::fs::OpenOptions::new().append(true).open(&log).await.ok();
                while let Ok(Some(line)) = reader.next_line().await {
                    if let Some(h) = hook.as_mut() {
                        h(&line);
                    }
                    if let Some(f) = file.as_mut() {
                        let _ = f.write_all(format!("{line}\n").as_bytes()).await;
                    }
                    if lines.send(OutputLine { name: name.clone(), line, read_ms: now_ms() }).is_err() {
                        break;
                    }
                }
                // A tokio file finishes writes in the background: flush, so that the log is
                // complete once this task (what `drained` waits for) has ended.
                if let Some(f) = file.as_mut() {
                    let _ = f.flush().await;
                }
            }));
        }
        Ok(Self { name: name.to_string(), child, pid, log, reader: reader_task })
    }

    /// The process name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The OS process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The log file (stderr and a copy of stdout).
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Sends a signal (SIGKILL, SIGSTOP, SIGCONT, SIGTERM, ...). No error if it already exited.
    pub fn signal(&self, signal: i32) {
        if self.pid != 0 {
            // SAFETY: kill(2) with a pid we spawned and have not reaped yet (reaping happens in
            // `wait`/drop, after which the pid is not signalled again).
            unsafe {
                libc::kill(self.pid as libc::pid_t, signal);
            }
        }
    }

    /// Whether it has exited (and its exit code, if it exited by itself).
    pub fn try_exit(&mut self) -> Option<Option<i32>> {
        match self.child.try_wait() {
            Ok(Some(status)) => Some(status.code()),
            _ => None,
        }
    }

    /// Waits (bounded) until everything the process printed has been forwarded.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn drained(&mut self, timeout: std::time::Duration) {
        if let Some(reader) = self.reader.as_mut() {
            if tokio::time::timeout(timeout, reader).await.is_ok() {
                self.reader = None;
            }
        }
    }

    /// Waits for the exit, bounded by `timeout`; SIGKILLs it if the bound passes.
    /// Returns the exit code (`None`: killed by a signal).
    ///
    /// # Cancel safety
    /// Cancel safe; the process is killed when the handle is dropped anyway.
    pub async fn wait(&mut self, timeout: std::time::Duration) -> Option<i32> {
        match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(Ok(status)) => status.code(),
            _ => {
                self.signal(libc::SIGCONT);
                let _ = self.child.start_kill();
                self.child.wait().await.ok().and_then(|s| s.code())
            }
        }
    }
}

impl Drop for ManagedProcess {
    fn drop(&mut self) {
        // A stopped process must be continued for SIGKILL to reap it promptly.
        self.signal(libc::SIGCONT);
        let _ = self.child.start_kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    /// Once the process has exited and `drained` returned, every line it printed has been
    /// through the hook and is in the channel: nothing is still in flight.
    #[tokio::test]
    async fn drained_means_every_line_was_seen_and_forwarded() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (tx, mut rx) = mpsc::unbounded_channel();
        let seen = Arc::new(AtomicUsize::new(0));
        let counter = seen.clone();
        let hook: LineHook = Box::new(move |line| {
            if line.starts_with("event=") {
                counter.fetch_add(1, Ordering::SeqCst);
            }
        });
        let mut command = Command::new("sh");
        command.args(["-c", "i=0; while [ $i -lt 500 ]; do echo event=line n=$i; i=$((i+1)); done"]);
        let mut p = ManagedProcess::spawn_with_hook("p", command, dir.path(), tx, Some(hook)).expect("spawn");
        assert_eq!(p.wait(Duration::from_secs(20)).await, Some(0));
        p.drained(Duration::from_secs(20)).await;
        let mut forwarded = 0;
        while let Ok(line) = rx.try_recv() {
            assert_eq!(line.name, "p");
            forwarded += 1;
        }
        assert_eq!(forwarded, 500);
        assert_eq!(seen.load(Ordering::SeqCst), 500);
        let log = std::fs::read_to_string(p.log()).expect("log");
        assert_eq!(log.lines().count(), 500, "stdout is copied to the log too");
    }

    /// The child's stderr and the copy of its stdout share the log: neither overwrites the
    /// other, however they interleave.
    #[tokio::test]
    async fn stderr_and_the_stdout_copy_both_survive_in_the_log() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (tx, _rx) = mpsc::unbounded_channel();
        let mut command = Command::new("sh");
        command.args(["-c", "i=0; while [ $i -lt 300 ]; do echo out $i; echo err $i >&2; i=$((i+1)); done"]);
        let mut p = ManagedProcess::spawn("p", command, dir.path(), tx).expect("spawn");
        assert_eq!(p.wait(Duration::from_secs(20)).await, Some(0));
        p.drained(Duration::from_secs(20)).await;
        let log = std::fs::read_to_string(p.log()).expect("log");
        for stream in ["out", "err"] {
            let lines: Vec<&str> = log.lines().filter(|l| l.starts_with(stream)).collect();
            assert_eq!(lines.len(), 300, "{stream} lines in the log:\n{log}");
            for (i, line) in lines.iter().enumerate() {
                assert_eq!(*line, format!("{stream} {i}"), "{stream} lines in order and whole");
            }
        }
    }
}
