//! A single-member etcd server run as a child process, for tests and the chaos harness.
//!
//! [`EtcdProcess::start`] picks free loopback ports, runs `etcd` on a temporary data
//! directory and waits (bounded) until `/health` reports a leader. The process can be stopped
//! gracefully, SIGKILLed and restarted on the same ports and data, so tests can check that
//! data survives and clients recover.
//!
//! Children are spawned from one long-lived helper thread with `PR_SET_PDEATHSIG` set to
//! SIGKILL, so an etcd never outlives the process that started it, even when that process
//! crashes or keeps its `EtcdProcess` in a static that is never dropped.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Environment variable naming the etcd binary (default: `etcd` on `PATH`).
pub const ETCD_BIN_ENV: &str = "COHORT_ETCD_BIN";

/// How long to wait for a started etcd to report healthy.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// How long [`EtcdProcess::stop`] waits after SIGTERM before it SIGKILLs.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// How many port pairs [`EtcdProcess::start`] tries when etcd cannot bind.
const START_ATTEMPTS: u32 = 5;

/// Pause between two health probes.
const PROBE_INTERVAL: Duration = Duration::from_millis(50);

/// Errors from starting or restarting etcd.
#[derive(Debug, thiserror::Error)]
pub enum EtcdProcessError {
    /// No etcd binary could be found.
    #[error("etcd binary not found ({0}); run `bash scripts/ensure-deps.sh` (apt install etcd-server) or set {ETCD_BIN_ENV}")]
    BinaryNotFound(String),
    /// A local I/O operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// etcd exited while starting.
    #[error("etcd exited during startup ({status}); log {log}:\n{tail}")]
    Exited {
        /// Its exit status.
        status: String,
        /// The log file.
        log: PathBuf,
        /// The end of the log.
        tail: String,
    },
    /// etcd did not become healthy in time (it has been killed).
    #[error("etcd not healthy within {timeout:?}; log {log}:\n{tail}")]
    NotReady {
        /// The bound that was exceeded.
        timeout: Duration,
        /// The log file.
        log: PathBuf,
        /// The end of the log.
        tail: String,
    },
}

impl EtcdProcessError {
    fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> EtcdProcessError {
        let context = context.into();
        move |source| EtcdProcessError::Io { context, source }
    }

    /// Whether etcd failed because one of its ports was taken.
    fn is_port_conflict(&self) -> bool {
        matches!(self, EtcdProcessError::Exited { tail, .. } if tail.contains("address already in use"))
    }
}

/// TLS on a test etcd's client port (the files are PEM).
#[derive(Clone, Debug)]
pub struct EtcdServerTls {
    /// The server certificate (valid for 127.0.0.1).
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// With a CA, etcd runs with `--client-cert-auth`: clients must show a certificate it signed.
    pub client_ca: Option<PathBuf>,
}

/// A running (or stopped) single-member etcd server on loopback ports.
#[derive(Debug)]
pub struct EtcdProcess {
    bin: PathBuf,
    /// Holds `data/` (etcd's data dir) and `etcd.log`; removed on drop.
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    /// With TLS: TLS on the client port, and `/health` served in plain text on `metrics_port`.
    tls: Option<(EtcdServerTls, u16)>,
    /// More command-line flags for the server (limits such as `--max-txn-ops`).
    flags: Vec<String>,
    child: Option<Child>,
}

/// Finds the etcd binary: `$COHORT_ETCD_BIN`, else `etcd` on `PATH`.
fn find_binary() -> Result<PathBuf, EtcdProcessError> {
    find_binary_in(std::env::var_os(ETCD_BIN_ENV), std::env::var_os("PATH"))
}

/// [`find_binary`] with the environment passed in.
fn find_binary_in(explicit: Option<OsString>, path: Option<OsString>) -> Result<PathBuf, EtcdProcessError> {
    if let Some(bin) = explicit {
        let bin = PathBuf::from(bin);
        return if bin.is_file() {
            Ok(bin)
        } else {
            Err(EtcdProcessError::BinaryNotFound(format!("{ETCD_BIN_ENV}={} is not a file", bin.display())))
        };
    }
    std::env::split_paths(&path.unwrap_or_default())
        .map(|dir| dir.join("etcd"))
        .find(|candidate| candidate.is_file())
        .ok_or_else(|| EtcdProcessError::BinaryNotFound("no `etcd` on PATH".into()))
}

/// Two distinct free loopback ports (client, peer). They are released before etcd binds
/// them, so a race with another process is possible; [`EtcdProcess::start`] retries.
fn pick_ports() -> Result<(u16, u16), EtcdProcessError> {
    let a = TcpListener::bind("127.0.0.1:0").map_err(EtcdProcessError::io("binding a probe port"))?;
    let b = TcpListener::bind("127.0.0.1:0").map_err(EtcdProcessError::io("binding a probe port"))?;
    let pa = a.local_addr().map_err(EtcdProcessError::io("reading a probe port"))?.port();
    let pb = b.local_addr().map_err(EtcdProcessError::io("reading a probe port"))?.port();
    Ok((pa, pb))
}

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Spawns `cmd` from the helper thread, which lives as long as the process, so that the
/// child's parent-death signal fires only when this process dies.
fn spawn_tied_to_process(mut cmd: Command) -> std::io::Result<Child> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    // SAFETY: the closure runs in the child between fork and exec and only calls prctl,
    // which is async-signal-safe; it touches no memory shared with the parent.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        let started = std::thread::Builder::new().name("cohort-etcd-spawner".into()).spawn(move || {
            for (mut cmd, reply) in rx {
                // The requester may have given up; nothing to do then.
                let _ = reply.send(cmd.spawn());
            }
        });
        if let Err(e) = started {
            tracing::error!(error = %e, "cannot start the etcd spawner thread");
        }
        Mutex::new(tx)
    });
    let (reply_tx, reply_rx) = mpsc::channel();
    spawner
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .send((cmd, reply_tx))
        .map_err(|_| std::io::Error::other("the etcd spawner thread is not running"))?;
    reply_rx
        .recv_timeout(Duration::from_secs(10))
        .map_err(|_| std::io::Error::other("the etcd spawner thread did not answer"))?
}

/// The last `max` bytes of a file, as text (empty if unreadable).
fn file_tail(path: &Path, max: u64) -> String {
    let Ok(mut f) = File::open(path) else { return String::new() };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    if f.seek(SeekFrom::Start(len.saturating_sub(max))).is_err() {
        return String::new();
    }
    let mut buf = Vec::new();
    let _ = f.take(max).read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

/// One `GET /health` against etcd's client port; true if it reports healthy.
fn probe_health(addr: SocketAddr) -> bool {
    let Ok(mut conn) = TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else { return false };
    if conn.set_read_timeout(Some(Duration::from_secs(2))).is_err()
        || conn.set_write_timeout(Some(Duration::from_secs(2))).is_err()
    {
        return false;
    }
    let request = format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if conn.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut response = Vec::new();
    // Connection: close, so the response ends at EOF; cap what a broken peer can send.
    if (&mut conn).take(64 * 1024).read_to_end(&mut response).is_err() {
        return false;
    }
    let text = String::from_utf8_lossy(&response);
    text.starts_with("HTTP/1.1 200") && text.contains("\"health\":\"true\"")
}

impl EtcdProcess {
    /// Starts etcd on free loopback ports with a fresh temporary data directory and waits
    /// (at most [`READY_TIMEOUT`]) until it is healthy. Blocking.
    pub fn start() -> Result<EtcdProcess, EtcdProcessError> {
        EtcdProcess::start_with(None)
    }

    /// Like [`EtcdProcess::start`], with TLS on the client port when `tls` is given (the
    /// endpoint is then `https://`). Blocking.
    pub fn start_with(tls: Option<EtcdServerTls>) -> Result<EtcdProcess, EtcdProcessError> {
        EtcdProcess::start_configured(tls, &[])
    }

    /// Like [`EtcdProcess::start`], with more server `flags` (e.g. `["--max-txn-ops", "512"]`;
    /// kept across restarts). Blocking.
    pub fn start_with_flags(flags: &[&str]) -> Result<EtcdProcess, EtcdProcessError> {
        EtcdProcess::start_configured(None, flags)
    }

    fn start_configured(tls: Option<EtcdServerTls>, flags: &[&str]) -> Result<EtcdProcess, EtcdProcessError> {
        let bin = find_binary()?;
        let mut attempt = 1;
        loop {
            let dir = tempfile::Builder::new()
                .prefix("cohort-etcd-")
                .tempdir()
                .map_err(EtcdProcessError::io("creating the etcd data directory"))?;
            let (client_port, peer_port) = pick_ports()?;
            let tls = match &tls {
                Some(t) => Some((t.clone(), pick_ports()?.0)),
                None => None,
            };
            let flags = flags.iter().map(|f| f.to_string()).collect();
            let mut etcd = EtcdProcess { bin: bin.clone(), dir, client_port, peer_port, tls, flags, child: None };
            match etcd.launch() {
                Ok(()) => {
                    tracing::info!(endpoint = %etcd.endpoint(), dir = %etcd.dir.path().display(), "etcd started");
                    return Ok(etcd);
                }
                Err(e) if e.is_port_conflict() && attempt < START_ATTEMPTS => {
                    tracing::warn!(
                        attempt,
                        client_port,
                        peer_port,
                        "etcd could not bind its ports; retrying with others"
                    );
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The client URL, `http://127.0.0.1:PORT` (`https://` with TLS).
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// The process id while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// etcd's data directory.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The file etcd's log goes to (appended across restarts).
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    /// Whether the process is running (not exited, not stopped by this handle).
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(None)) => true,
            Some(Ok(Some(_)) | Err(_)) | None => false,
        }
    }

    /// Stops etcd gracefully: SIGTERM, then waits up to [`STOP_TIMEOUT`] (SIGKILL after
    /// that). No-op if not running.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        if let Ok(pid) = libc::pid_t::try_from(child.id()) {
            // SAFETY: kill(2) with a pid we own (our un-reaped child) and a valid signal.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
        let deadline = Instant::now() + STOP_TIMEOUT;
        while Instant::now() < deadline {
            match child.try_wait() {
                Ok(Some(status)) => {
                    tracing::info!(endpoint = %self.endpoint(), %status, "etcd stopped");
                    return;
                }
                Ok(None) => std::thread::sleep(PROBE_INTERVAL),
                Err(_) => break,
            }
        }
        tracing::warn!(endpoint = %self.endpoint(), "etcd ignored SIGTERM; killing it");
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Kills etcd with SIGKILL (a crash, for chaos tests) and reaps it. No-op if not running.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            tracing::info!(endpoint = %self.endpoint(), "etcd killed");
        }
    }

    /// Starts etcd again on the same ports and data directory (stopping it first if it is
    /// running) and waits until it is healthy. Blocking.
    pub fn restart(&mut self) -> Result<(), EtcdProcessError> {
        self.stop();
        self.launch()?;
        tracing::info!(endpoint = %self.endpoint(), "etcd restarted");
        Ok(())
    }

    /// Spawns etcd with this handle's ports and directory and waits for health; kills it
    /// on failure.
    fn launch(&mut self) -> Result<(), EtcdProcessError> {
        let log_path = self.log_path();
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(EtcdProcessError::io(format!("opening {}", log_path.display())))?;
        let client_url = self.endpoint();
        let peer_url = format!("http://127.0.0.1:{}", self.peer_port);
        let name = "cohort";
        let mut cmd = Command::new(&self.bin);
        cmd.arg("--name")
            .arg(name)
            .arg("--data-dir")
            .arg(self.data_dir())
            .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("{name}={peer_url}")])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", &format!("cohort-{}-{}", std::process::id(), self.client_port)])
            // A short election timeout makes startup fast and lowers the minimum lease TTL
            // to 1 s; a single member never holds an election after startup.
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .args(["--logger", "zap", "--log-outputs", "stderr", "--log-level", "error"]);
        if let Some((tls, metrics_port)) = &self.tls {
            cmd.arg("--cert-file").arg(&tls.cert).arg("--key-file").arg(&tls.key);
            if let Some(ca) = &tls.client_ca {
                cmd.arg("--client-cert-auth").arg("--trusted-ca-file").arg(ca);
            }
            cmd.args(["--listen-metrics-urls", &format!("http://127.0.0.1:{metrics_port}")]);
        }
        cmd.args(&self.flags);
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::from(log));
        // Settings in the environment (ETCD_*) would silently change the member.
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("ETCD_") {
                cmd.env_remove(key);
            }
        }
        let child =
            spawn_tied_to_process(cmd).map_err(EtcdProcessError::io(format!("spawning {}", self.bin.display())))?;
        self.child = Some(child);
        match self.wait_ready() {
            Ok(()) => Ok(()),
            Err(e) => {
                self.kill();
                Err(e)
            }
        }
    }

    /// Polls `/health` until it passes, the process exits, or [`READY_TIMEOUT`] passes.
    fn wait_ready(&mut self) -> Result<(), EtcdProcessError> {
        // With TLS on the client port, /health is probed on the plain-text metrics port.
        let addr = SocketAddr::from(([127, 0, 0, 1], self.tls.as_ref().map_or(self.client_port, |(_, p)| *p)));
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let exited = match self.child.as_mut().map(Child::try_wait) {
                Some(Ok(Some(status))) => Some(status.to_string()),
                Some(Err(e)) => Some(format!("unknown: {e}")),
                None => Some("not started".to_owned()),
                Some(Ok(None)) => None,
            };
            if let Some(status) = exited {
                self.child = None;
                return Err(EtcdProcessError::Exited {
                    status,
                    log: self.log_path(),
                    tail: file_tail(&self.log_path(), 4096),
                });
            }
            if probe_health(addr) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(EtcdProcessError::NotReady {
                    timeout: READY_TIMEOUT,
                    log: self.log_path(),
                    tail: file_tail(&self.log_path(), 4096),
                });
            }
            std::thread::sleep(PROBE_INTERVAL);
        }
    }
}

impl Drop for EtcdProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_binary_error_says_how_to_install() {
        let empty = tempfile::tempdir().expect("tempdir");
        let err = find_binary_in(None, Some(empty.path().as_os_str().to_owned())).expect_err("no etcd there");
        let msg = err.to_string();
        assert!(msg.contains("scripts/ensure-deps.sh") && msg.contains(ETCD_BIN_ENV), "{msg}");

        let missing = empty.path().join("no-such-etcd");
        let err = find_binary_in(Some(missing.into_os_string()), None).expect_err("not a file");
        assert!(matches!(err, EtcdProcessError::BinaryNotFound(m) if m.contains("no-such-etcd")));
    }

    #[test]
    fn binary_is_found_on_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fake = dir.path().join("etcd");
        File::create(&fake).expect("create");
        let other = tempfile::tempdir().expect("tempdir");
        let path = std::env::join_paths([other.path(), dir.path()]).expect("join");
        assert_eq!(find_binary_in(None, Some(path)).expect("found"), fake);
    }

    #[test]
    fn port_conflict_is_recognised() {
        let exited = |tail: &str| EtcdProcessError::Exited {
            status: "exit status: 1".into(),
            log: PathBuf::new(),
            tail: tail.into(),
        };
        assert!(exited("listen tcp 127.0.0.1:2380: bind: address already in use").is_port_conflict());
        assert!(!exited("member has already been bootstrapped").is_port_conflict());
    }
}
