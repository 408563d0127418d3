//! Per-job credentials: a job's credential acts on its job only (every RPC about another job
//! is refused and changes nothing there), the operator secret acts on every job, a forged or
//! foreign credential is refused, and the previous secret keeps working while it is rotated
//! out. `Status` of a job that does not exist says so.

mod common;

use cohort_proto::credentials::job_token;
use cohort_proto::v1 as pb;
use common::*;
use tonic::Code;

const OPERATOR: &str = "operator secret";

/// `message` carrying `Bearer token`.
fn authed<T>(message: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.metadata_mut().insert("authorization", format!("Bearer {token}").parse().expect("ascii"));
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_credential_acts_on_its_job_only() {
    bounded(async {
        let backing = Backing::new(Backend::Memory).await;
        let mut options = Options::new(test_settings(Backend::Memory));
        options.token = Some(OPERATOR.into());
        let server = replica(backing.store.clone(), &options).await;
        let mut c = client(server.local_addr()).await;
        let (cred_a, cred_b) = (job_token(OPERATOR.as_bytes(), "a"), job_token(OPERATOR.as_bytes(), "b"));
        c.join(authed(join_request("a", "wa"), &cred_a)).await.expect("a's member joins a");
        let wb = c.join(authed(join_request("b", "wb"), &cred_b)).await.expect("b's member joins b").into_inner();
        let before =
            c.status(authed(pb::StatusRequest { job: "b".into() }, OPERATOR)).await.expect("status").into_inner();

        // Every RPC about job b with a's credential: refused before it is looked at.
        let b = || "b".to_string();
        let denied: Vec<(&str, Result<(), tonic::Status>)> = vec![
            ("Join", c.join(authed(join_request("b", "intruder"), &cred_a)).await.map(drop)),
            ("Status", c.status(authed(pb::StatusRequest { job: b() }, &cred_a)).await.map(drop)),
            (
                "Heartbeat",
                c.heartbeat(authed(
                    pb::HeartbeatRequest {
                        job: b(),
                        worker_id: "wb".into(),
                        incarnation: wb.incarnation,
                        ..Default::default()
                    },
                    &cred_a,
                ))
                .await
                .map(drop),
            ),
            (
                "ReportFailure",
                c.report_failure(authed(
                    pb::FailureReport {
                        job: b(),
                        worker_id: "wb".into(),
                        incarnation: wb.incarnation,
                        ..Default::default()
                    },
                    &cred_a,
                ))
                .await
                .map(drop),
            ),
            (
                "Leave",
                c.leave(authed(
                    pb::LeaveRequest {
                        job: b(),
                        worker_id: "wb".into(),
                        incarnation: wb.incarnation,
                        ..Default::default()
                    },
                    &cred_a,
                ))
                .await
                .map(drop),
            ),
            (
                "Commit",
                c.commit(authed(
                    pb::CommitRequest {
                        job: b(),
                        worker_id: "wb".into(),
                        incarnation: wb.incarnation,
                        ..Default::default()
                    },
                    &cred_a,
                ))
                .await
                .map(drop),
            ),
            (
                "Rendezvous",
                c.rendezvous(authed(
                    pb::RendezvousRequest {
                        job: b(),
                        worker_id: "wb".into(),
                        incarnation: wb.incarnation,
                        ..Default::default()
                    },
                    &cred_a,
                ))
                .await
                .map(drop),
            ),
            (
                "Watch",
                c.watch(authed(
                    pb::WatchRequest {
                        job: b(),
                        worker_id: "wb".into(),
                        incarnation: wb.incarnation,
                        compact: false,
                        quiet: false,
                    },
                    &cred_a,
                ))
                .await
                .map(drop),
            ),
        ];
        for (rpc, result) in denied {
            let status = result.expect_err(rpc);
            assert_eq!(status.code(), Code::PermissionDenied, "{rpc}: {status:?}");
            assert!(status.message().contains("for job \"a\""), "{rpc}: {status:?}");
        }
        // Job b is as it was: same members, nothing revoked, nobody left.
        let after =
            c.status(authed(pb::StatusRequest { job: "b".into() }, OPERATOR)).await.expect("status").into_inner();
        assert_eq!(after.members, before.members);
        assert_eq!(after.current_revoked, before.current_revoked);
        // A job's credential reads its own job; the operator's reads every job.
        c.status(authed(pb::StatusRequest { job: "a".into() }, &cred_a)).await.expect("a reads a");
        c.status(authed(pb::StatusRequest { job: "a".into() }, OPERATOR)).await.expect("the operator reads a");

        // Forged (a's MAC under b's name) and foreign (another operator's secret): unauthenticated.
        let forged = cred_a.replace(":a:", ":b:");
        let foreign = job_token(b"some other coordinator", "b");
        for token in [&forged, &foreign] {
            let refused = c.status(authed(pb::StatusRequest { job: b() }, token)).await.expect_err("refused");
            assert_eq!(refused.code(), Code::Unauthenticated, "{token}");
        }

        // A job nobody joined does not exist: NOT_FOUND, with the leader (still known) in
        // the metadata.
        let a = c.status(authed(pb::StatusRequest { job: "a".into() }, OPERATOR)).await.expect("status");
        let nobody =
            c.status(authed(pb::StatusRequest { job: "nobody".into() }, OPERATOR)).await.expect_err("no such job");
        assert_eq!(nobody.code(), Code::NotFound, "{nobody:?}");
        assert!(nobody.message().contains("job nobody does not exist here"), "{nobody:?}");
        let leader = nobody.metadata().get(cohort_proto::LEADER_HEADER).and_then(|v| v.to_str().ok());
        assert_eq!(leader.unwrap_or_default(), a.into_inner().leader, "the leader is named: {nobody:?}");
        server.shutdown().await.expect("shutdown");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_accepts_the_previous_secret_until_it_is_removed() {
    bounded(async {
        let backing = Backing::new(Backend::Memory).await;
        let mut rotating = Options::new(test_settings(Backend::Memory));
        rotating.token = Some("new secret".into());
        rotating.previous_tokens = vec![OPERATOR.into()];
        let server = replica(backing.store.clone(), &rotating).await;
        let mut c = client(server.local_addr()).await;
        let (old, new) = (job_token(OPERATOR.as_bytes(), "j"), job_token(b"new secret", "j"));
        c.join(authed(join_request("j", "w-old"), &old)).await.expect("old credential, during the overlap");
        c.join(authed(join_request("j", "w-new"), &new)).await.expect("new credential");
        server.shutdown().await.expect("shutdown");

        // The rotation is over: only the new secret's credentials are accepted.
        let mut done = Options::new(test_settings(Backend::Memory));
        done.token = Some("new secret".into());
        let server = replica(backing.store.clone(), &done).await;
        let mut c = client(server.local_addr()).await;
        let refused = c.status(authed(pb::StatusRequest { job: "j".into() }, &old)).await.expect_err("old");
        assert_eq!(refused.code(), Code::Unauthenticated);
        c.status(authed(pb::StatusRequest { job: "j".into() }, &new)).await.expect("new");
        server.shutdown().await.expect("shutdown");
    })
    .await;
}

/// `GET path` on the metrics listener `addr` with `token` as a bearer credential: the status
/// code and the body.
async fn http_get(addr: std::net::SocketAddr, path: &str, token: Option<&str>) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n");
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect to the metrics listener");
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut bytes = Vec::new();
    let _ = stream.read_to_end(&mut bytes).await;
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    (head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0), body.to_string())
}

/// The jobs `/status.json` lists.
fn listed(body: &str) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_str(body).expect("status.json is JSON");
    let jobs = v["jobs"].as_array().expect("jobs");
    jobs.iter().map(|j| j["job"].as_str().expect("job id").to_string()).collect()
}

/// The status page (on the metrics listener) takes the credentials the RPCs take: the
/// operator secret sees every job, a job's credential its job only, anything else nothing.
/// A coordinator without a secret shows every job to anyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_takes_the_rpc_credentials() {
    bounded(async {
        let backing = Backing::new(Backend::Memory).await;
        let mut options = Options::new(test_settings(Backend::Memory));
        options.token = Some(OPERATOR.into());
        let server = replica(backing.store.clone(), &options).await;
        let metrics = server.metrics_addr().expect("metrics listener");
        let mut c = client(server.local_addr()).await;
        let (cred_a, cred_b) = (job_token(OPERATOR.as_bytes(), "a"), job_token(OPERATOR.as_bytes(), "b"));
        c.join(authed(join_request("a", "wa"), &cred_a)).await.expect("a's member joins a");
        c.join(authed(join_request("b", "wb"), &cred_b)).await.expect("b's member joins b");

        let (status, body) = http_get(metrics, "/status.json", Some(OPERATOR)).await;
        assert_eq!((status, listed(&body)), (200, vec!["a".to_string(), "b".to_string()]), "{body}");
        let (status, body) = http_get(metrics, "/status.json", Some(&cred_a)).await;
        assert_eq!((status, listed(&body)), (200, vec!["a".to_string()]), "{body}");
        let (status, body) = http_get(metrics, &format!("/status.json?token={cred_b}"), None).await;
        assert_eq!((status, listed(&body)), (200, vec!["b".to_string()]), "{body}");
        let foreign = job_token(b"another coordinator", "a");
        for token in [None, Some("wrong"), Some(foreign.as_str())] {
            let (status, body) = http_get(metrics, "/status.json", token).await;
            assert_eq!(status, 401, "{token:?}: {body}");
            assert!(!body.contains("\"wa\"") && !body.contains("\"jobs\""), "{body}");
        }
        let (status, body) = http_get(metrics, "/", None).await;
        assert_eq!(status, 401, "the page too: {body}");
        let (status, body) = http_get(metrics, &format!("/?token={cred_a}"), None).await;
        assert!(status == 200 && body.contains("status.js"), "{status} {body}");
        let (status, body) = http_get(metrics, "/status.js", None).await;
        assert!(status == 200 && body.contains("status.json"), "the script holds no data: {status}");
        let (status, body) = http_get(metrics, "/metrics", None).await;
        assert!(status == 200 && body.contains("cohort_is_leader"), "/metrics as before: {body}");

        let open = replica(backing.store.clone(), &Options::new(test_settings(Backend::Memory))).await;
        let (status, body) = http_get(open.metrics_addr().expect("metrics listener"), "/status.json", None).await;
        assert_eq!((status, listed(&body)), (200, vec!["a".to_string(), "b".to_string()]), "{body}");
        open.kill();
        server.kill();
    })
    .await;
}
