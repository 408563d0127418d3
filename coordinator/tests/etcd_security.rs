//! The coordinator on an etcd secured as production clusters are: TLS on the client port,
//! client certificates required (`--client-cert-auth`), and etcd's user authentication. The
//! test makes its own CA and certificates (common/certs.rs, with the openssl tool), starts a
//! real etcd with them, creates the users and roles, enables authentication, and then runs the
//! `cohort-coordinator` binary against it with the `--etcd-*` flags. Every way of getting the
//! security wrong is a clear error at start-up, never a hang.

mod common;

use cohort_coordinator::store::etcd::{EtcdSecurity, EtcdStore};
use cohort_coordinator::store::{Store, StoreError};
use cohort_testkit::etcd::{EtcdProcess, EtcdServerTls};
use common::*;
use etcd_client::{Certificate, Client, ConnectOptions, Identity, Permission, TlsOptions};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const PASSWORD: &str = "s3cret-for-cohort";

/// The users and roles a production cluster would have: `root` (etcd needs it to enable
/// authentication) and `cohort`, allowed to read and write under the coordinator's prefix only.
async fn enable_auth(endpoint: &str, dir: &Path) {
    let read = |name: &str| std::fs::read(dir.join(name)).expect("read pem");
    let tls = TlsOptions::new()
        .ca_certificate(Certificate::from_pem(read("ca.pem")))
        .identity(Identity::from_pem(read("client.pem"), read("client.key")));
    let options = ConnectOptions::new().with_tls(tls).with_connect_timeout(Duration::from_secs(5));
    let mut admin = Client::connect([endpoint], Some(options)).await.expect("admin connection");
    admin.user_add("root", "root-password", None).await.expect("add root");
    admin.user_grant_role("root", "root").await.expect("root role");
    admin.role_add("cohort").await.expect("add role");
    admin
        .role_grant_permission("cohort", Permission::read_write("/cohort/").with_prefix())
        .await
        .expect("grant the prefix");
    admin.user_add("cohort", PASSWORD, None).await.expect("add user");
    admin.user_grant_role("cohort", "cohort").await.expect("user role");
    admin.auth_enable().await.expect("enable authentication");
}

fn security(dir: &Path, ca: bool, client_cert: bool, user: Option<(&str, &str)>) -> EtcdSecurity {
    let read = |name: &str| std::fs::read(dir.join(name)).expect("read pem");
    EtcdSecurity {
        ca_pem: ca.then(|| read("ca.pem")),
        client_identity: client_cert.then(|| (read("client.pem"), read("client.key"))),
        user: user.map(|(u, p)| (u.to_string(), p.to_string())),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_runs_on_etcd_with_tls_client_certificates_and_users() {
    bounded(async {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path().to_path_buf();
        assert!(certs::make_certificates(&d), "{}", certs::NEED_OPENSSL);
        let tls =
            EtcdServerTls { cert: d.join("server.pem"), key: d.join("server.key"), client_ca: Some(d.join("ca.pem")) };
        let etcd = tokio::task::spawn_blocking(move || EtcdProcess::start_with(Some(tls)))
            .await
            .expect("start task")
            .expect("start etcd with TLS");
        let endpoint = etcd.endpoint();
        assert!(endpoint.starts_with("https://"), "{endpoint}");
        enable_auth(&endpoint, &d).await;
        let endpoints = [endpoint.clone()];
        let timeout = Duration::from_secs(3);

        // The right CA, certificate and password: the store works, under its prefix only.
        let good = security(&d, true, true, Some(("cohort", PASSWORD)));
        let store = EtcdStore::connect_secured(&endpoints, timeout, &good).await.expect("secured connection");
        store.put("/cohort/v1/probe", b"yes".to_vec(), None).await.expect("put under the prefix");
        let got = store.get("/cohort/v1/probe").await.expect("get").expect("the key");
        assert_eq!(got.value, b"yes");
        let outside = store.put("/elsewhere", b"no".to_vec(), None).await;
        assert!(matches!(&outside, Err(StoreError::Invalid(m)) if m.contains("permission denied")), "{outside:?}");

        // Each missing or wrong piece is refused with etcd's or the TLS layer's reason.
        let refused = |s: EtcdSecurity| {
            let endpoints = endpoints.clone();
            async move { EtcdStore::connect_secured(&endpoints, timeout, &s).await.expect_err("must be refused") }
        };
        let e = refused(security(&d, true, true, Some(("cohort", "wrong")))).await;
        assert!(e.to_string().contains("authentication failed"), "wrong password: {e}");
        let e = refused(security(&d, true, true, None)).await;
        assert!(e.to_string().contains("permission denied"), "the certificate's name is no user: {e}");
        let e = refused(security(&d, true, false, Some(("cohort", PASSWORD)))).await;
        assert!(e.to_string().contains("whether etcd requires a client certificate"), "no client certificate: {e}");
        let e = refused(security(&d, false, false, Some(("cohort", PASSWORD)))).await;
        assert!(e.to_string().contains("give the etcd CA"), "https without a CA: {e}");
        let plain = [endpoint.replace("https://", "http://")];
        let e = EtcdStore::connect_secured(&plain, timeout, &good).await.expect_err("http with a CA");
        assert!(e.to_string().contains("use https://"), "http with a CA: {e}");

        // The binary with the --etcd-* flags: serves, elects itself leader, forms a generation.
        std::fs::write(d.join("etcd-password"), format!("{PASSWORD}\n")).expect("password file");
        let host_port = endpoint.trim_start_matches("https://").to_string();
        let store_flag = format!("etcd://{host_port}");
        let path = |name: &str| d.join(name).display().to_string();
        let flags = [
            "--etcd-ca".to_string(),
            path("ca.pem"),
            "--etcd-cert".into(),
            path("client.pem"),
            "--etcd-key".into(),
            path("client.key"),
            "--etcd-user".into(),
            "cohort".into(),
        ];
        let mut args: Vec<String> =
            ["--listen", "127.0.0.1:0", "--store", &store_flag, "--join-window", "200ms"].map(String::from).to_vec();
        args.extend(flags.iter().cloned());
        args.extend(["--etcd-password-file".into(), path("etcd-password")]);
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let (_running, addr) = spawn(&argv);
        let w = Worker::join(addr, "secure-job", "w0", Duration::from_millis(200)).await;
        let g = form_all(std::slice::from_ref(&w), 0).await.remove(0);
        assert_eq!(g.number, 1);
        assert_eq!(status(addr, "secure-job").await.members.len(), 1);

        // A wrong password stops the binary at start-up with etcd's reason (exit 1, no hang).
        std::fs::write(d.join("bad-password"), "nope").expect("password file");
        let mut bad = args.clone();
        let last = bad.len() - 1;
        bad[last] = path("bad-password");
        let out = tokio::task::spawn_blocking(move || Command::new(BIN).args(&bad).output())
            .await
            .expect("task")
            .expect("run the binary");
        assert!(!out.status.success(), "{out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("authentication failed"), "{out:?}");
    })
    .await;
}

#[test]
fn etcd_flags_are_checked_before_anything_starts() {
    let run = |args: &[&str]| Command::new(BIN).args(args).output().expect("run the binary");
    // TLS and users are for an etcd store.
    let out = run(&["serve", "--listen", "127.0.0.1:0", "--store", "memory", "--etcd-ca", "/nonexistent.pem"]);
    assert!(!out.status.success());
    let out = run(&["serve", "--listen", "127.0.0.1:0", "--etcd-user", "u", "--etcd-password-file", "/dev/null"]);
    assert!(!out.status.success());
    // A certificate needs its key and the CA; a user needs a password.
    for args in [
        &["serve", "--store", "etcd://127.0.0.1:1", "--etcd-cert", "c.pem"][..],
        &["serve", "--store", "etcd://127.0.0.1:1", "--etcd-user", "u"][..],
    ] {
        let out = run(args);
        assert!(!out.status.success(), "{args:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("required"), "{args:?}: {out:?}");
    }
}
