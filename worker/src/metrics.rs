//! Worker metrics in the Prometheus text format, served over a minimal HTTP endpoint.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Current generation of this worker.
pub static GENERATION: AtomicU64 = AtomicU64::new(0);
/// World size of the current generation.
pub static WORLD_SIZE: AtomicU64 = AtomicU64::new(0);
/// Verified steps run by this worker.
pub static STEPS_VERIFIED: AtomicU64 = AtomicU64::new(0);
/// Failed generations this worker went through.
pub static FAILURES: AtomicU64 = AtomicU64::new(0);
/// Cooperative re-formations (scale-up, leaves).
pub static REFORMATIONS: AtomicU64 = AtomicU64::new(0);
/// Time lost to failures, total milliseconds.
pub static LOST_MS: AtomicU64 = AtomicU64::new(0);
/// Data-plane peers this rank holds a link to (those linked at set-up and those linked on
/// first use since; see `cohort_transports::tcp::Upfront`).
pub static LINKS: AtomicU64 = AtomicU64::new(0);

/// The no-progress deadline in force on each data-plane link: (peer rank, milliseconds, why).
static DEADLINES: std::sync::Mutex<Vec<(u32, u64, &'static str)>> = std::sync::Mutex::new(Vec::new());

/// Records the deadline in force per peer (see `cohort_transports::deadline`); replaces the
/// previous generation's.
pub fn set_deadlines(deadlines: &[(u32, cohort_transports::DeadlineInForce)]) {
    let rows = deadlines.iter().map(|(peer, d)| (*peer, d.value.as_millis() as u64, d.basis.name())).collect();
    *DEADLINES.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = rows;
}

/// Renders every metric.
pub fn render() -> String {
    let rows: [(&str, &str, &str, &AtomicU64); 7] = [
        ("cohort_worker_generation", "gauge", "Current generation", &GENERATION),
        ("cohort_worker_world_size", "gauge", "World size of the current generation", &WORLD_SIZE),
        ("cohort_worker_steps_verified_total", "counter", "Verified training steps", &STEPS_VERIFIED),
        ("cohort_worker_failures_total", "counter", "Failed generations", &FAILURES),
        ("cohort_worker_reformations_total", "counter", "Cooperative re-formations", &REFORMATIONS),
        ("cohort_worker_lost_milliseconds_total", "counter", "Time from failures to the next verified step", &LOST_MS),
        ("cohort_worker_links", "gauge", "Data-plane peers linked in the current generation", &LINKS),
    ];
    let mut out = String::new();
    for (name, kind, help, value) in rows {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {}\n",
            value.load(Ordering::Relaxed)
        ));
    }
    let name = "cohort_worker_no_progress_deadline_milliseconds";
    out.push_str(&format!(
        "# HELP {name} No-progress deadline in force on the link to each peer, and why (fixed, unlearned, floor, learned, ceiling)\n# TYPE {name} gauge\n"
    ));
    for (peer, ms, basis) in DEADLINES.lock().unwrap_or_else(std::sync::PoisonError::into_inner).iter() {
        out.push_str(&format!("{name}{{peer=\"{peer}\",basis=\"{basis}\"}} {ms}\n"));
    }
    cohort_proto::process_metrics::render(&mut out);
    out
}

/// Binds `addr` and serves `GET /metrics` in a background task.
///
/// # Cancel safety
/// Cancel safe: it returns once the listener is bound; the server runs until the process ends.
pub async fn serve(addr: SocketAddr) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let mut socket = match listener.accept().await {
                Ok((socket, _)) => socket,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics listener accept failed");
                    // Back off briefly (e.g. out of file descriptors) instead of spinning.
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let read = tokio::time::timeout(std::time::Duration::from_secs(2), socket.read(&mut buf)).await;
                let Ok(Ok(n)) = read else { return };
                let request = String::from_utf8_lossy(&buf[..n]);
                let (status, body) = if request.starts_with("GET /metrics") {
                    ("200 OK", render())
                } else {
                    ("404 Not Found", "not found: try /metrics\n".to_string())
                };
                let response = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = socket.write_all(response.as_bytes()).await;
            });
        }
    });
    Ok(local)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_transports::{DeadlineBasis, DeadlineInForce};
    use std::time::Duration;

    #[test]
    fn the_deadline_in_force_is_a_gauge_per_peer() {
        let d = DeadlineInForce {
            value: Duration::from_millis(250),
            basis: DeadlineBasis::Floor,
            smoothed: Duration::ZERO,
            variation: Duration::ZERO,
            peak: Duration::ZERO,
            samples: 9,
        };
        set_deadlines(&[
            (1, d),
            (3, DeadlineInForce { value: Duration::from_secs(10), basis: DeadlineBasis::Fixed, ..d }),
        ]);
        let text = render();
        assert!(
            text.contains("cohort_worker_no_progress_deadline_milliseconds{peer=\"1\",basis=\"floor\"} 250\n"),
            "{text}"
        );
        assert!(
            text.contains("cohort_worker_no_progress_deadline_milliseconds{peer=\"3\",basis=\"fixed\"} 10000\n"),
            "{text}"
        );
    }
}
