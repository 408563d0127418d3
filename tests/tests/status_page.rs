//! The coordinator's status page in a real browser: a job of three `cohort-worker` processes
//! loses one to SIGKILL, re-forms, and headless Chromium, loading the page, shows the failure
//! with its root cause (the killed rank's worker).
//!
//! Needs `chromium` (Debian's package of that name; or `chromium-browser`, `google-chrome`,
//! or the path in `COHORT_CHROMIUM`). Without one the test says so loudly and passes, unless
//! `COHORT_REQUIRE_BROWSER` is set, when it fails. `COHORT_UPDATE_SCREENSHOT=1` also writes
//! the page's screenshot to `docs/images/status-page.png`.

use cohort_chaos::cluster::{Cluster, StoreKind};
use cohort_chaos::events as ev;
use cohort_integration_tests::{test_cluster, test_worker};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The whole test's bound.
const BOUND: Duration = Duration::from_secs(240);

/// The browser, if one is installed.
fn chromium() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("COHORT_CHROMIUM") {
        return Some(PathBuf::from(path));
    }
    let dirs: Vec<PathBuf> = std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .flat_map(|name| dirs.iter().map(move |d| d.join(name)))
        .find(|p| p.is_file())
}

/// One HTTP/1.1 request to `addr`: the status code and the body.
async fn http(addr: &str, request: String) -> (u16, String) {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect to the metrics listener");
        stream.write_all(request.as_bytes()).await.expect("send the request");
        let mut bytes = Vec::new();
        // A reset after the answer (the listener closing on input it did not read) still
        // leaves the answer read.
        let _ = stream.take(8 << 20).read_to_end(&mut bytes).await;
        bytes
    };
    let bytes =
        tokio::time::timeout(Duration::from_secs(10), exchange).await.expect("the listener answers within 10 s");
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, body.to_string())
}

fn get(addr: &str, path: &str, token: Option<&str>) -> String {
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n")
}

/// Runs the browser on `url` with `args`, bounded; its standard output.
async fn browse(browser: &Path, profile: &Path, args: &[String], url: &str) -> String {
    let mut cmd = tokio::process::Command::new(browser);
    cmd.args(["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"])
        .args(["--disable-extensions", "--hide-scrollbars", "--window-size=1200,900"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(url)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(90), cmd.output())
        .await
        .expect("the browser finishes within 90 s")
        .expect("run the browser");
    assert!(out.status.success(), "the browser failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The rows of `dom` that are table rows of class `class` (`<tr class="failure" ...>...</tr>`).
fn rows<'a>(dom: &'a str, class: &str) -> Vec<&'a str> {
    let start = format!("<tr class=\"{class}");
    dom.match_indices(&start).map(|(i, _)| &dom[i..dom[i..].find("</tr>").map_or(dom.len(), |e| i + e)]).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_a_killed_rank_as_the_root_cause_in_a_browser() {
    let Some(browser) = chromium() else {
        let required = std::env::var_os("COHORT_REQUIRE_BROWSER").is_some();
        assert!(!required, "COHORT_REQUIRE_BROWSER is set but no chromium is installed (apt-get install chromium)");
        eprintln!("\n\n!!!!! SKIPPED: the status page browser test needs chromium (apt-get install chromium); set COHORT_REQUIRE_BROWSER to make this a failure !!!!!\n\n");
        return;
    };
    tokio::time::timeout(BOUND, run(browser)).await.expect("the test finishes within its bound");
}

async fn run(browser: PathBuf) {
    let job = "statuspage";
    let mut config = test_cluster(job, StoreKind::Memory, 2);
    config.metrics = true;
    let mut cluster = Cluster::start(config).await.expect("cluster");
    let addr = cluster.coordinator_metrics(0).expect("the coordinator serves metrics").to_string();
    let token = std::fs::read_to_string(cluster.log_dir().join("token")).expect("the operator secret");
    let token = token.trim().to_string();

    // The listener's refusals, before any job.
    let (status, _) = http(&addr, get(&addr, "/status.json", None)).await;
    assert_eq!(status, 401, "the coordinator has a secret: the data needs it");
    let (status, _) = http(&addr, get(&addr, "/status", None)).await;
    assert_eq!(status, 401, "and so does the page");
    let (status, _) = http(&addr, get(&addr, "/status.json", Some("wrong"))).await;
    assert_eq!(status, 401);
    let (status, _) = http(&addr, get(&addr, "/nowhere", Some(&token))).await;
    assert_eq!(status, 404);
    let (status, _) =
        http(&addr, format!("POST /status.json HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\n\r\n")).await;
    assert_eq!(status, 405);
    let (status, _) = http(&addr, "NONSENSE\r\n\r\n".to_string()).await;
    assert_eq!(status, 400);
    let huge = format!("GET /status HTTP/1.1\r\nX-Pad: {}\r\n\r\n", "a".repeat(10_000));
    let (status, _) = http(&addr, huge).await;
    assert_eq!(status, 431);
    let (status, body) = http(&addr, get(&addr, "/metrics", None)).await;
    assert!(status == 200 && body.contains("cohort_is_leader"), "/metrics is as before: {status} {body}");

    let spec = test_worker(1_000_000, "1M");
    for w in ["w0", "w1", "w2"] {
        cluster.spawn_worker(w, &spec).expect("spawn");
    }
    cluster
        .wait_for("a generation of 3", Duration::from_secs(60), |e| {
            e.get::<ev::Generation>().is_some_and(|g| g.world == 3)
        })
        .await
        .expect("formed");
    cluster
        .wait_for("100 steps", Duration::from_secs(60), |e| e.get::<ev::Step>().is_some_and(|s| s.step >= 100))
        .await
        .expect("steps");
    cluster.signal_worker("w1", libc::SIGKILL).expect("kill w1");
    cluster
        .wait_for("a generation of 2", Duration::from_secs(60), |e| {
            e.get::<ev::Generation>().is_some_and(|g| g.world == 2)
        })
        .await
        .expect("re-formed");

    // The data names the failure, its root cause and its recovery (polled: the snapshot is
    // at most a second old, and the survivors' steps need a few samples).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let snapshot = loop {
        let (status, body) = http(&addr, get(&addr, "/status.json", Some(&token))).await;
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("status.json is JSON");
        let page = v["jobs"].as_array().and_then(|jobs| jobs.iter().find(|j| j["job"] == job)).cloned();
        let killed = |p: &serde_json::Value| {
            let failures = p["failures"].as_array().cloned().unwrap_or_default();
            failures.into_iter().find(|f| f["cause"]["worker_id"] == "w1" && f["reformed_at_ms"].is_u64())
        };
        if let Some(page) = page {
            if let (Some(failure), true) =
                (killed(&page), page["steps_per_second"].as_array().is_some_and(|s| s.len() >= 4))
            {
                break (page, failure);
            }
        }
        assert!(tokio::time::Instant::now() < deadline, "no re-formed failure naming w1 in status.json: {v}");
        tokio::time::sleep(Duration::from_millis(250)).await; // polling the endpoint, bounded above
    };
    let (snapshot, failure) = snapshot;
    assert_eq!(snapshot["state"], "running", "{snapshot}");
    assert_eq!(snapshot["generation"]["size"], 2, "{snapshot}");
    assert_eq!(snapshot["members"]["hosts"], 1, "{snapshot}");
    assert_eq!((failure["size"].as_u64(), failure["reformed_size"].as_u64()), (Some(3), Some(2)), "{failure}");
    assert!(failure["cost_ms"].as_u64().is_some_and(|c| c < 30_000), "{failure}");
    // A job credential sees its own job; the page names the job in its rows.
    let credential = std::fs::read_to_string(cluster.log_dir().join("job-credential")).expect("the job's credential");
    let (status, body) = http(&addr, get(&addr, "/status.json", Some(credential.trim()))).await;
    assert!(status == 200 && body.contains("\"job\":\"statuspage\""), "{status} {body}");

    // The browser: the page loads its script, fetches the data with the token it was given,
    // and draws the failure row naming w1.
    let profile = tempfile::tempdir().expect("a browser profile");
    let url = format!("http://{addr}/status?token={token}");
    let dom = browse(&browser, profile.path(), &["--virtual-time-budget=8000".into(), "--dump-dom".into()], &url).await;
    assert!(dom.contains("data-state=\"loaded\""), "the page never drew the data:\n{dom}");
    let failures = rows(&dom, "failure");
    let killed = failures.iter().find(|r| r.contains("data-worker=\"w1\""));
    let Some(killed) = killed else { panic!("no failure row names w1:\n{dom}") };
    assert!(killed.contains("<td>w1</td>") && killed.contains("rank "), "the root cause is in the row: {killed}");
    assert!(!killed.contains("re-forming"), "the failure is shown re-formed: {killed}");
    assert!(dom.contains("class=\"chart steps-chart\"") && dom.contains("<polyline"), "the steps chart is drawn");
    assert!(dom.contains("class=\"chart recovery-chart\""), "the recovery timeline is drawn");
    assert!(!dom.contains(&token), "the token does not stay in the page");

    let shot = profile.path().join("status-page.png");
    browse(
        &browser,
        profile.path(),
        &["--virtual-time-budget=8000".into(), format!("--screenshot={}", shot.display())],
        &url,
    )
    .await;
    let png = std::fs::read(&shot).expect("the screenshot");
    assert!(png.starts_with(b"\x89PNG"), "a PNG screenshot");
    if std::env::var_os("COHORT_UPDATE_SCREENSHOT").is_some() {
        let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/images/status-page.png");
        std::fs::create_dir_all(docs.parent().expect("a parent")).expect("docs/images");
        std::fs::write(&docs, &png).expect("write the screenshot");
        eprintln!("wrote {}", docs.display());
    }
}
