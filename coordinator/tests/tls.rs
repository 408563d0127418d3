//! The coordinator over TLS: a CA and a server certificate made with the `openssl` tool in a
//! temporary directory (common/certs.rs; the test fails, saying why, where the tool is missing).

mod common;

use cohort_coordinator::config::Settings;
use cohort_coordinator::server::{ServeConfig, TlsFiles};
use cohort_proto::v1 as pb;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_over_tls() {
    bounded(async {
        let dir = tempfile::tempdir().expect("tempdir");
        // The test command installs openssl (scripts/ensure-deps.sh): without it this test
        // cannot do its job, and says so by failing rather than passing silently.
        assert!(certs::make_certificates(dir.path()), "{}", certs::NEED_OPENSSL);
        let read = |name: &str| std::fs::read(dir.path().join(name)).expect("read pem");
        let backing = Backing::new(Backend::Memory).await;
        let mut config = ServeConfig::new(
            backing.store.clone(),
            Settings::uniform(test_settings(Backend::Memory)).expect("settings"),
        );
        config.tls = Some(TlsFiles { cert_pem: read("server.pem"), key_pem: read("server.key") });
        config.token = Some("tok".into());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let server = cohort_coordinator::start(config, listener).await.expect("start");
        let tls = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(read("ca.pem")))
            .domain_name("localhost");
        let channel = tonic::transport::Endpoint::from_shared(format!("https://{}", server.local_addr()))
            .expect("endpoint")
            .tls_config(tls)
            .expect("tls config")
            .connect()
            .await
            .expect("TLS connect");
        let mut client = pb::coordinator_client::CoordinatorClient::new(channel);
        let mut request = tonic::Request::new(join_request("tls-job", "w0"));
        request.metadata_mut().insert("authorization", "Bearer tok".parse().expect("ascii"));
        let joined = client.join(request).await.expect("join over TLS").into_inner();
        assert!(joined.incarnation > 0);
        // Plain text to a TLS port does not get an answer.
        let plain = tonic::transport::Endpoint::from_shared(format!("http://{}", server.local_addr()))
            .expect("endpoint")
            .connect_timeout(std::time::Duration::from_secs(2))
            .timeout(std::time::Duration::from_secs(2));
        if let Ok(channel) = plain.connect().await {
            let mut c = pb::coordinator_client::CoordinatorClient::new(channel);
            assert!(c.status(pb::StatusRequest { job: "tls-job".into() }).await.is_err());
        }
        // `cohort-coordinator status` speaks TLS with --tls-ca (deploy/README.md offers it),
        // and refuses an https endpoint without a CA instead of failing obscurely.
        std::fs::write(dir.path().join("token"), "tok").expect("token file");
        let status = |with_ca: bool| {
            let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_cohort-coordinator"));
            cmd.args(["status", "--job", "tls-job", "--timeout", "5s", "--endpoints"])
                .arg(format!("https://localhost:{}", server.local_addr().port()))
                .arg("--token-file")
                .arg(dir.path().join("token"));
            if with_ca {
                cmd.arg("--tls-ca").arg(dir.path().join("ca.pem"));
            }
            tokio::task::spawn_blocking(move || cmd.output().expect("run cohort-coordinator status"))
        };
        let out = status(true).await.expect("join");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && text.contains("tls-job") && text.contains("w0"), "{text} {out:?}");
        let out = status(false).await.expect("join");
        assert!(!out.status.success(), "{out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("give the CA certificate"), "{out:?}");
        server.shutdown().await.expect("shutdown");
    })
    .await;
}
