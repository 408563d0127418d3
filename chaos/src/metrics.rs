//! Scraping the Prometheus endpoints (`GET /metrics`) that coordinators and workers serve,
//! as a Prometheus server or the kubelet's readiness probe would, with a deadline.
//!
//! The parser is strict on purpose: a line that is neither a comment nor a well-formed
//! sample is an error, so a broken exposition fails the caller instead of reading as empty.

use std::collections::BTreeMap;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Largest response read (the endpoints serve a few KiB).
const MAX_RESPONSE: u64 = 1 << 20;

/// Every sample of one scrape, by its series as written: the metric name with its label set
/// (`cohort_members{job="j"}`), or the bare name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Samples(pub BTreeMap<String, f64>);

impl Samples {
    /// The value of `series` (`name` or `name{labels}`, exactly as served).
    pub fn get(&self, series: &str) -> Option<f64> {
        self.0.get(series).copied()
    }

    /// The sum of every series of metric `name`, whatever their labels (0 when absent).
    pub fn sum(&self, name: &str) -> f64 {
        self.0.iter().filter(|(series, _)| metric_name(series) == name).map(|(_, v)| v).sum()
    }
}

/// Why a scrape failed.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// No answer within the deadline.
    #[error("{addr}: no answer within {after:?}")]
    Timeout {
        /// The endpoint.
        addr: String,
        /// The deadline.
        after: Duration,
    },
    /// Connecting, writing or reading failed.
    #[error("{addr}: {source}")]
    Io {
        /// The endpoint.
        addr: String,
        /// The error.
        source: std::io::Error,
    },
    /// The answer was not a 200 with a Prometheus text body.
    #[error("{addr}: {what}")]
    BadResponse {
        /// The endpoint.
        addr: String,
        /// What was wrong.
        what: String,
    },
}

/// `GET /metrics` from `addr` (`HOST:PORT`) and parses the answer.
///
/// # Cancel safety
/// Cancel safe: the connection is dropped with the future.
pub async fn scrape(addr: &str, timeout: Duration) -> Result<Samples, ScrapeError> {
    let body = scrape_text(addr, timeout).await?;
    parse_text(&body).map_err(|what| ScrapeError::BadResponse { addr: addr.to_string(), what })
}

/// `GET /metrics` from `addr` (`HOST:PORT`): the body of a 200 answer in the Prometheus text
/// format, unparsed (see [`parse_text`] and [`metric_names`]).
///
/// # Cancel safety
/// Cancel safe: the connection is dropped with the future.
pub async fn scrape_text(addr: &str, timeout: Duration) -> Result<String, ScrapeError> {
    let io = |source| ScrapeError::Io { addr: addr.to_string(), source };
    let response = tokio::time::timeout(timeout, async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.map_err(io)?;
        let request =
            format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nAccept: text/plain\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.map_err(io)?;
        let mut bytes = Vec::new();
        stream.take(MAX_RESPONSE).read_to_end(&mut bytes).await.map_err(io)?;
        Ok::<_, ScrapeError>(bytes)
    })
    .await
    .map_err(|_| ScrapeError::Timeout { addr: addr.to_string(), after: timeout })??;
    let bad = |what: String| ScrapeError::BadResponse { addr: addr.to_string(), what };
    let text = String::from_utf8(response).map_err(|_| bad("the response is not UTF-8".into()))?;
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| bad("no end of the HTTP header".into()))?;
    let status = head.lines().next().unwrap_or("");
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(bad(format!("status {status:?}")));
    }
    let text_plain = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("content-type:") && l.contains("text/plain")
    });
    if !text_plain {
        return Err(bad("no `content-type: text/plain` (the Prometheus text format)".into()));
    }
    Ok(body.to_string())
}

/// Every metric name an exposition declares or serves: the name of each `# TYPE` line (with
/// `_bucket`, `_sum` and `_count` for a histogram, `_sum` and `_count` for a summary, the
/// names a query uses), even when it has no series yet (a labelled counter before its first
/// event), and the name of each sample.
pub fn metric_names(body: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    for line in body.lines().map(str::trim) {
        if let Some(declared) = line.strip_prefix("# TYPE ") {
            let mut fields = declared.split_whitespace();
            let (Some(name), kind) = (fields.next(), fields.next()) else { continue };
            let suffixes: &[&str] = match kind {
                Some("histogram") => &["", "_bucket", "_sum", "_count"],
                Some("summary") => &["", "_sum", "_count"],
                _ => &[""],
            };
            names.extend(suffixes.iter().map(|s| format!("{name}{s}")));
        } else if !line.is_empty() && !line.starts_with('#') {
            let end = line.find(|c: char| c == '{' || c.is_whitespace()).unwrap_or(line.len());
            names.insert(line[..end].to_string());
        }
    }
    names
}

/// The metric name of a series (`name{...}` or `name`).
fn metric_name(series: &str) -> &str {
    series.split_once('{').map_or(series, |(name, _)| name)
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// Parses the Prometheus text format (version 0.0.4): `# HELP` / `# TYPE` / other comments,
/// and samples `name[{labels}] value [timestamp]`. A series given twice is an error.
pub fn parse_text(body: &str) -> Result<Samples, String> {
    let mut samples = BTreeMap::new();
    for (n, raw) in body.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = |what: &str| format!("line {}: {what}: {raw:?}", n + 1);
        // The series ends at the closing brace of its labels (label values may hold spaces),
        // else at the first whitespace.
        let series_end = match line.find('{') {
            Some(open) if line[..open].chars().all(|c| !c.is_whitespace()) => {
                open + line[open..].find('}').ok_or_else(|| at("labels not closed"))? + 1
            }
            _ => line.find(char::is_whitespace).ok_or_else(|| at("no value"))?,
        };
        let (series, rest) = line.split_at(series_end);
        if !valid_name(metric_name(series)) {
            return Err(at("invalid metric name"));
        }
        let mut fields = rest.split_whitespace();
        let value = fields.next().ok_or_else(|| at("no value"))?;
        let value: f64 = value.parse().map_err(|_| at("the value is not a number"))?;
        if let Some(ts) = fields.next() {
            ts.parse::<i64>().map_err(|_| at("the timestamp is not an integer"))?;
        }
        if fields.next().is_some() {
            return Err(at("trailing fields"));
        }
        if samples.insert(series.to_string(), value).is_some() {
            return Err(at("series given twice"));
        }
    }
    Ok(Samples(samples))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_samples_with_and_without_labels() {
        let body = "# HELP cohort_members Live members.\n# TYPE cohort_members gauge\n\
                    cohort_members{job=\"a b\"} 4\ncohort_members{job=\"c\"} 2\n\
                    cohort_is_leader 1\nx_bucket{le=\"+Inf\"} 3 1700000000000\n";
        let s = parse_text(body).expect("valid");
        assert_eq!(s.get("cohort_members{job=\"a b\"}"), Some(4.0));
        assert_eq!(s.sum("cohort_members"), 6.0);
        assert_eq!(s.get("cohort_is_leader"), Some(1.0));
        assert_eq!(s.get("x_bucket{le=\"+Inf\"}"), Some(3.0));
        assert_eq!(s.sum("absent"), 0.0);
    }

    #[test]
    fn rejects_malformed_lines() {
        for (body, why) in [
            ("cohort_members", "no value"),
            ("cohort_members{job=\"a\" 4", "labels not closed"),
            ("cohort_members four", "not a number"),
            ("9lives 1", "invalid metric name"),
            ("a 1 2 3", "trailing fields"),
            ("a 1 noon", "timestamp"),
            ("a 1\na 2", "twice"),
        ] {
            let err = parse_text(body).expect_err(body);
            assert!(err.contains(why), "{body:?}: {err}");
        }
    }

    #[test]
    fn names_come_from_type_lines_and_samples() {
        let body = "# HELP a_total A.\n# TYPE a_total counter\n# TYPE h_seconds histogram\n\
                    h_seconds_bucket{le=\"+Inf\"} 0\nplain 1\nlabelled{x=\"y z\"} 2\n";
        let names: Vec<String> = metric_names(body).into_iter().collect();
        assert_eq!(
            names,
            ["a_total", "h_seconds", "h_seconds_bucket", "h_seconds_count", "h_seconds_sum", "labelled", "plain"]
        );
    }

    #[tokio::test]
    async fn scrapes_a_real_endpoint_and_refuses_a_bad_one() {
        // A worker's metrics endpoint, served by the library on a free loopback port.
        let addr = cohort::metrics::serve("127.0.0.1:0".parse().expect("addr")).await.expect("serve");
        let s = scrape(&addr.to_string(), Duration::from_secs(5)).await.expect("scrape");
        assert!(s.get("cohort_worker_generation").is_some(), "{s:?}");
        // Something that is not a metrics endpoint: answers 404.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let other = listener.local_addr().expect("addr").to_string();
        tokio::spawn(async move {
            if let Ok((mut socket, _)) = listener.accept().await {
                let mut buf = [0u8; 512];
                let _ = socket.read(&mut buf).await;
                let _ = socket.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n").await;
            }
        });
        let err = scrape(&other, Duration::from_secs(5)).await.expect_err("404");
        assert!(err.to_string().contains("404"), "{err}");
    }
}
