//! The lines `cohort-coordinator serve` prints on stdout once it serves: where it listens
//! (gRPC), and before that where its metrics are, when it serves them:
//!
//! ```text
//! cohort-coordinator metrics on 127.0.0.1:9100
//! cohort-coordinator listening on 127.0.0.1:7070
//! ```
//!
//! Launchers learn the address of a coordinator started on port 0 from them (the chaos
//! harness, the tests, the benchmarks, scripts and the Python tests). This module is the one
//! place that writes and reads them; its [`parse`] is what every Rust launcher uses.

use std::net::SocketAddr;

/// What the line announcing the gRPC address starts with.
pub const LISTENING: &str = "cohort-coordinator listening on ";
/// What the line announcing the metrics address starts with.
pub const METRICS: &str = "cohort-coordinator metrics on ";

/// One line the coordinator printed, read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Announced {
    /// It serves gRPC on this address (the last line it prints at start-up).
    Listening(SocketAddr),
    /// It serves `GET /metrics` on this address.
    Metrics(SocketAddr),
}

/// The line announcing the gRPC address `addr` (without a newline).
pub fn listening_line(addr: SocketAddr) -> String {
    format!("{LISTENING}{addr}")
}

/// The line announcing the metrics address `addr` (without a newline).
pub fn metrics_line(addr: SocketAddr) -> String {
    format!("{METRICS}{addr}")
}

/// Waits, up to `bound`, for the gRPC address among the lines the coordinator prints on
/// `stdout` (its child process's stdout; a metrics line may come first); any other line is an
/// error. A thread reads `stdout` until it closes, so the child never blocks on a full pipe.
pub fn await_listening(
    stdout: impl std::io::Read + Send + 'static,
    bound: std::time::Duration,
) -> Result<SocketAddr, String> {
    use std::io::BufRead;
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = std::time::Instant::now() + bound;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let line = lines.recv_timeout(left).map_err(|_| "cohort-coordinator printed no address".to_string())?;
        match parse(&line) {
            Some(Announced::Listening(addr)) => return Ok(addr),
            Some(Announced::Metrics(_)) => continue,
            None => return Err(format!("unexpected line {line:?}")),
        }
    }
}

/// Reads one line of the coordinator's stdout: `None` for a line that is not an
/// announcement, or one whose address does not parse.
pub fn parse(line: &str) -> Option<Announced> {
    let line = line.trim();
    if let Some(addr) = line.strip_prefix(LISTENING) {
        addr.trim().parse().ok().map(Announced::Listening)
    } else if let Some(addr) = line.strip_prefix(METRICS) {
        addr.trim().parse().ok().map(Announced::Metrics)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_read_back_as_written() {
        let v4: SocketAddr = "127.0.0.1:7070".parse().expect("an address");
        let v6: SocketAddr = "[::1]:9100".parse().expect("an address");
        assert_eq!(listening_line(v4), "cohort-coordinator listening on 127.0.0.1:7070");
        assert_eq!(parse(&listening_line(v4)), Some(Announced::Listening(v4)));
        assert_eq!(parse(&format!("{}\n", metrics_line(v6))), Some(Announced::Metrics(v6)));
        for other in
            ["", "cohort-coordinator listening on", "cohort-coordinator listening on nowhere", "listening on 1.2.3.4:5"]
        {
            assert_eq!(parse(other), None, "{other:?}");
        }
    }
}
