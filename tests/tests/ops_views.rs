//! The operations views in deploy/ name only metrics the binaries export.
//!
//! deploy/grafana/cohort-dashboard.json (the Grafana dashboard), deploy/prometheus/
//! cohort-alerts.yaml (the alert rules) and deploy/prometheus/servicemonitors.yaml (what
//! Prometheus scrapes) are written by hand; a renamed or misspelled metric would leave a
//! panel empty or an alert silent without any error. So:
//!
//! - the files parse (JSON, YAML), every panel has a query, every alert has a severity, a
//!   summary and a description, and every ServiceMonitor selects a Service of deploy/base
//!   that has the port it scrapes;
//! - a real coordinator (on a real etcd, so that the `cohort_etcd_*` series exist) and two
//!   real workers run with `--metrics` on free loopback ports and step; both kinds of
//!   endpoint are scraped, and every metric name in every panel query, template variable
//!   and alert expression must be one of theirs (`# TYPE` lines count: a labelled counter is
//!   declared before its first event). A histogram's `_bucket`, `_sum` and `_count` count as
//!   exported with it.
//!
//! Metric names are read out of PromQL by a small scanner: an identifier is a metric name
//! unless it calls a function, is a keyword or aggregation, or stands inside a label matcher
//! `{...}`, a range `[...]`, a string, or the label list of `by`, `without`, `on`,
//! `ignoring`, `group_left` or `group_right`.
//!
//! Every wait is bounded; nothing sleeps to synchronise.

use cohort_chaos::cluster::{Cluster, StoreKind};
use cohort_chaos::events as ev;
use cohort_chaos::metrics::{metric_names, scrape_text};
use cohort_integration_tests::{check, test_cluster, test_worker};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;
use yaml_rust2::{Yaml, YamlLoader};

/// The whole test.
const BOUND: Duration = Duration::from_secs(120);
/// A phase of it (formation and a few steps; the series showing up).
const PHASE: Duration = Duration::from_secs(40);
/// One scrape.
const SCRAPE: Duration = Duration::from_secs(5);

/// Series that Prometheus makes itself rather than scraping them (`up`: whether the last
/// scrape of a target worked).
const FROM_PROMETHEUS: &[&str] = &["up"];

/// Identifiers that are PromQL keywords or aggregation operators, not metric names.
const KEYWORDS: &[&str] = &[
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "atan2",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
    "inf",
    "nan",
    "start",
    "end",
];

/// Keywords followed by a parenthesised list of label names.
const LABEL_LISTS: &[&str] = &["by", "without", "on", "ignoring", "group_left", "group_right"];

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The index just past the delimiter closing the one at `open` (`close`), skipping strings;
/// an error when it is never closed.
fn skip_to(chars: &[char], open: usize, close: char) -> Result<usize, String> {
    let mut i = open + 1;
    while i < chars.len() {
        match chars[i] {
            c if c == close => return Ok(i + 1),
            '"' | '\'' | '`' => i = skip_string(chars, i)?,
            _ => i += 1,
        }
    }
    Err(format!("{:?} opened at {open} is not closed", chars[open]))
}

/// The index just past the string literal starting at `open` (backslash escapes honoured).
fn skip_string(chars: &[char], open: usize) -> Result<usize, String> {
    let quote = chars[open];
    let mut i = open + 1;
    while i < chars.len() {
        match chars[i] {
            '\\' if quote != '`' => i += 2,
            c if c == quote => return Ok(i + 1),
            _ => i += 1,
        }
    }
    Err(format!("string opened at {open} is not closed"))
}

/// The metric names a PromQL expression reads.
fn promql_metric_names(expr: &str) -> Result<BTreeSet<String>, String> {
    let chars: Vec<char> = expr.chars().collect();
    let is_start = |c: char| c.is_ascii_alphabetic() || c == '_' || c == ':';
    let is_part = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut names = BTreeSet::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = skip_string(&chars, i)?;
        } else if c == '{' {
            i = skip_to(&chars, i, '}')?;
        } else if c == '[' {
            i = skip_to(&chars, i, ']')?;
        } else if c.is_ascii_digit() || (c == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit)) {
            // A number or a duration (1e3, 0.95, 5m, 1h30m): not a name.
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else if is_start(c) {
            let start = i;
            while i < chars.len() && is_part(chars[i]) {
                i += 1;
            }
            let ident: String = chars[start..i].iter().collect();
            let mut next = i;
            while next < chars.len() && chars[next].is_whitespace() {
                next += 1;
            }
            let calls = chars.get(next) == Some(&'(');
            if LABEL_LISTS.contains(&ident.as_str()) {
                if calls {
                    i = skip_to(&chars, next, ')')?;
                }
            } else if !KEYWORDS.contains(&ident.as_str()) && !calls {
                names.insert(ident);
            }
        } else {
            i += 1;
        }
    }
    Ok(names)
}

/// A Grafana template variable's query as PromQL: `label_values(EXPR, LABEL)` reads EXPR;
/// `query_result(EXPR)` and a bare expression read themselves.
fn template_query_expr(query: &str) -> String {
    let q = query.trim();
    if let Some(inner) = q.strip_prefix("label_values(").and_then(|r| r.strip_suffix(')')) {
        return match inner.rfind(',') {
            Some(comma) => inner[..comma].to_string(),
            // label_values(LABEL): no metric.
            None => String::new(),
        };
    }
    q.strip_prefix("query_result(").and_then(|r| r.strip_suffix(')')).unwrap_or(q).to_string()
}

/// Every PromQL expression of the dashboard, by where it is (`panel "Title" A`), after
/// checking its shape: unique panel ids, a query on every panel that is not a row.
fn dashboard_exprs(text: &str) -> Result<BTreeMap<String, String>, String> {
    let dash: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let mut exprs = BTreeMap::new();
    let mut ids = BTreeSet::new();
    let mut panels: Vec<&serde_json::Value> = dash["panels"].as_array().ok_or("no panels")?.iter().collect();
    while let Some(panel) = panels.pop() {
        let title = panel["title"].as_str().ok_or("a panel without a title")?;
        let id = panel["id"].as_u64().ok_or_else(|| format!("panel {title:?} has no id"))?;
        if !ids.insert(id) {
            return Err(format!("panel id {id} is used twice"));
        }
        if panel["type"] == "row" {
            panels.extend(panel["panels"].as_array().into_iter().flatten());
            continue;
        }
        let targets = panel["targets"].as_array().filter(|t| !t.is_empty());
        let targets = targets.ok_or_else(|| format!("panel {title:?} has no query"))?;
        for target in targets {
            let expr = target["expr"].as_str().filter(|e| !e.trim().is_empty());
            let expr = expr.ok_or_else(|| format!("panel {title:?} has a target without an expr"))?;
            let at = format!("panel {title:?} {}", target["refId"].as_str().unwrap_or("?"));
            exprs.insert(at, expr.to_string());
        }
    }
    for var in dash["templating"]["list"].as_array().into_iter().flatten() {
        if var["type"] == "query" {
            let query = var["query"]["query"].as_str().or(var["query"].as_str());
            let query = query.ok_or_else(|| format!("template variable {} has no query", var["name"]))?;
            exprs.insert(format!("variable {}", var["name"]), template_query_expr(query));
        }
    }
    Ok(exprs)
}

fn str_at<'a>(y: &'a Yaml, what: &str) -> Result<&'a str, String> {
    y.as_str().filter(|s| !s.trim().is_empty()).ok_or_else(|| format!("{what} missing or not a string"))
}

/// Every alert's expression, by alert name, after checking the rule file's shape: a
/// PrometheusRule; each rule an alert named `Cohort...` (unique), with an expression, a
/// severity (critical, warning, info), a summary and a description, and a `for` that is a
/// duration when given.
fn alert_exprs(text: &str) -> Result<BTreeMap<String, String>, String> {
    let docs = YamlLoader::load_from_str(text).map_err(|e| format!("not YAML: {e}"))?;
    let [doc] = docs.as_slice() else { return Err(format!("{} YAML documents, not one", docs.len())) };
    if str_at(&doc["kind"], "kind")? != "PrometheusRule" {
        return Err("not a PrometheusRule".into());
    }
    let mut exprs = BTreeMap::new();
    let groups = doc["spec"]["groups"].as_vec().ok_or("spec.groups missing")?;
    for group in groups {
        let gname = str_at(&group["name"], "a group's name")?;
        for rule in group["rules"].as_vec().ok_or_else(|| format!("group {gname} has no rules"))? {
            let name = str_at(&rule["alert"], &format!("a rule's alert name in {gname}"))?;
            if !name.starts_with("Cohort") || !name.chars().all(|c| c.is_ascii_alphanumeric()) {
                return Err(format!("alert {name:?} is not named CohortUpperCamelCase"));
            }
            let severity = str_at(&rule["labels"]["severity"], &format!("{name}: labels.severity"))?;
            if !["critical", "warning", "info"].contains(&severity) {
                return Err(format!("{name}: severity {severity:?}"));
            }
            str_at(&rule["annotations"]["summary"], &format!("{name}: annotations.summary"))?;
            str_at(&rule["annotations"]["description"], &format!("{name}: annotations.description"))?;
            if !rule["for"].is_badvalue() {
                let period = str_at(&rule["for"], &format!("{name}: for"))?;
                let unit = period.trim_start_matches(|c: char| c.is_ascii_digit());
                if unit.len() == period.len() || !["s", "m", "h"].contains(&unit) {
                    return Err(format!("{name}: for {period:?} is not a duration"));
                }
            }
            let expr = str_at(&rule["expr"], &format!("{name}: expr"))?;
            if exprs.insert(name.to_string(), expr.to_string()).is_some() {
                return Err(format!("alert {name} is defined twice"));
            }
        }
    }
    Ok(exprs)
}

/// The names in `exprs` (where → PromQL) that are neither in `exported` nor Prometheus's own
/// (`where: name`).
fn unknown_names(exprs: &BTreeMap<String, String>, exported: &BTreeSet<String>) -> Result<Vec<String>, String> {
    let mut unknown = Vec::new();
    for (at, expr) in exprs {
        for name in promql_metric_names(expr).map_err(|e| format!("{at}: {e}: {expr}"))? {
            if !exported.contains(&name) && !FROM_PROMETHEUS.contains(&name.as_str()) {
                unknown.push(format!("{at}: {name}"));
            }
        }
    }
    Ok(unknown)
}

/// Every resource of the YAML files of a directory.
fn resources(dir: &Path) -> Vec<Yaml> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("a directory entry").path();
        if path.extension().is_some_and(|x| x == "yaml") {
            let docs = YamlLoader::load_from_str(&read(&path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            out.extend(docs);
        }
    }
    out
}

#[test]
fn the_scanner_finds_metric_names_only() {
    let names = |e: &str| promql_metric_names(e).expect("valid").into_iter().collect::<Vec<_>>();
    assert_eq!(
        names(
            r#"histogram_quantile(0.95, sum by (namespace, le) (rate(a_seconds_bucket{x="by(y)", z=~"$v"}[$__rate_interval])))"#
        ),
        ["a_seconds_bucket"]
    );
    assert_eq!(
        names("max by (j) (m1) > 0 and on (j) changes(max by (j) (m2)[30m:1m]) == 0 unless sum(m3 offset 5m) > 1e3"),
        ["m1", "m2", "m3"]
    );
    assert_eq!(names("a / ignoring(x) group_left(y) b or vector(0)"), ["a", "b"]);
    assert_eq!(names("sum(rate(c_total[5m])) / sum without (pod) (d)"), ["c_total", "d"]);
    assert_eq!(names("absent(up{job=\"cohort-coordinator\"} == 1)"), ["up"]);
    assert!(promql_metric_names("m{job=\"x\"").is_err(), "an unclosed matcher is an error");
    assert_eq!(template_query_expr("label_values(cohort_members{n=\"$n\"}, exported_job)"), "cohort_members{n=\"$n\"}");
    assert_eq!(template_query_expr("label_values(namespace)"), "");
}

/// A misspelled metric in a panel or an alert is caught (and so is one not exported at all).
#[test]
fn a_misspelled_metric_is_caught() {
    let exported = metric_names(
        "# TYPE cohort_members gauge\n# TYPE cohort_formation_latency_seconds histogram\ncohort_members{job=\"j\"} 1\n",
    );
    let dashboard = r#"{"panels": [{"id": 1, "type": "timeseries", "title": "p", "targets": [
        {"refId": "A", "expr": "max(cohort_member)"},
        {"refId": "B", "expr": "rate(cohort_formation_latency_seconds_sum[5m])"}]}]}"#;
    let unknown = unknown_names(&dashboard_exprs(dashboard).expect("valid"), &exported).expect("valid");
    assert_eq!(unknown, [r#"panel "p" A: cohort_member"#]);
    let rules =
        "kind: PrometheusRule\nspec:\n  groups:\n    - name: g\n      rules:\n        - alert: CohortX\n          \
                 expr: cohort_members > 0 and up == 0 and cohort_revocation_total > 1\n          for: 5m\n          \
                 labels: {severity: warning}\n          annotations: {summary: s, description: d}\n";
    let unknown = unknown_names(&alert_exprs(rules).expect("valid"), &exported).expect("valid");
    assert_eq!(unknown, ["CohortX: cohort_revocation_total"]);
    // And the shape checks refuse what Prometheus or Grafana would not show.
    assert!(alert_exprs(&rules.replace("severity: warning", "severity: page")).is_err());
    assert!(alert_exprs(&rules.replace("for: 5m", "for: soon")).is_err());
    assert!(dashboard_exprs(&dashboard.replace("\"targets\"", "\"nothing\"")).is_err());
}

/// Each ServiceMonitor selects a Service of deploy/base that has the port it scrapes.
#[test]
fn service_monitors_select_services_with_their_port() {
    let services: Vec<Yaml> =
        resources(&deploy().join("base")).into_iter().filter(|r| r["kind"].as_str() == Some("Service")).collect();
    let monitors = resources(&deploy().join("prometheus"));
    let monitors: Vec<&Yaml> = monitors.iter().filter(|r| r["kind"].as_str() == Some("ServiceMonitor")).collect();
    assert_eq!(monitors.len(), 2, "the coordinator's and the workers'");
    for m in monitors {
        let name = m["metadata"]["name"].as_str().expect("a name");
        let wanted = m["spec"]["selector"]["matchLabels"].as_hash().expect("matchLabels");
        let selected: Vec<&Yaml> = services
            .iter()
            .filter(|s| wanted.iter().all(|(k, v)| s["metadata"]["labels"][k.as_str().expect("a label")] == *v))
            .collect();
        assert_eq!(selected.len(), 1, "{name} selects one Service of deploy/base");
        for endpoint in m["spec"]["endpoints"].as_vec().expect("endpoints") {
            let port = endpoint["port"].as_str().expect("a named port");
            let ports = selected[0]["spec"]["ports"].as_vec().expect("ports");
            assert!(ports.iter().any(|p| p["name"].as_str() == Some(port)), "{name}: the Service has no port {port}");
        }
    }
}

/// The dashboard's and the alerts' metrics are all exported by a real coordinator and real
/// workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_and_alerts_read_is_exported() {
    let mut exprs = dashboard_exprs(&read(&deploy().join("grafana/cohort-dashboard.json")))
        .unwrap_or_else(|e| panic!("cohort-dashboard.json: {e}"));
    let alerts = alert_exprs(&read(&deploy().join("prometheus/cohort-alerts.yaml")))
        .unwrap_or_else(|e| panic!("cohort-alerts.yaml: {e}"));
    exprs.extend(alerts.into_iter().map(|(name, expr)| (format!("alert {name}"), expr)));

    tokio::time::timeout(BOUND, async {
        let mut config = test_cluster("ops-views", StoreKind::Etcd, 2);
        config.metrics = true;
        let mut cluster = Cluster::start(config).await.expect("etcd and a coordinator");
        let spec = test_worker(1_000_000, "64K");
        for w in ["w0", "w1"] {
            cluster.spawn_worker(w, &spec).expect("spawn a worker");
        }
        // Both step in one generation: every job and worker series exists.
        let mut stepped = BTreeSet::new();
        while stepped.len() < 2 {
            match cluster.wait_for("both workers to step", PHASE, |e| e.get::<ev::Step>().is_some()).await {
                Ok(e) => {
                    stepped.insert(e.worker);
                }
                Err(err) => check(false, &err.to_string(), &cluster.events),
            }
        }
        let coordinator = cluster.coordinator_metrics(0).expect("the coordinator serves metrics").to_string();
        let worker = cluster.worker_metrics("w0").expect("w0 printed its metrics address").to_string();
        // The job gauges and the store census come with the leader's next evaluation and the
        // census's first count: poll, bounded.
        let deadline = tokio::time::Instant::now() + PHASE;
        let coordinator_text = loop {
            let text = scrape_text(&coordinator, SCRAPE).await.expect("scrape the coordinator");
            if text.contains("\ncohort_members{") && text.contains("\ncohort_store_keys ") {
                break text;
            }
            assert!(tokio::time::Instant::now() < deadline, "no job gauges or store census after {PHASE:?}:\n{text}");
            tokio::time::sleep(Duration::from_millis(100)).await; // polling the endpoint, not synchronisation
        };
        let worker_text = scrape_text(&worker, SCRAPE).await.expect("scrape a worker");
        let mut exported = metric_names(&coordinator_text);
        exported.extend(metric_names(&worker_text));
        for series in ["cohort_etcd_shared_retried_alone_total", "cohort_worker_steps_verified_total"] {
            assert!(exported.contains(series), "{series} is not exported:\n{coordinator_text}\n{worker_text}");
        }
        let unknown = unknown_names(&exprs, &exported).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            unknown.is_empty(),
            "deploy/ reads metrics that no binary exports:\n  {}\nexported: {exported:?}",
            unknown.join("\n  ")
        );
    })
    .await
    .expect("the test exceeded its bound");
}
