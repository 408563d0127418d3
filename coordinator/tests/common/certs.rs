//! Test certificates made with the `openssl` tool (scripts/ensure-deps.sh installs it): a CA,
//! a server certificate for localhost and 127.0.0.1, and a client certificate, all signed by
//! the CA and valid for a day.

use std::path::Path;
use std::process::Command;

fn openssl(dir: &Path, args: &[&str]) -> bool {
    match Command::new("openssl").args(args).current_dir(dir).output() {
        Ok(out) if out.status.success() => true,
        Ok(out) => panic!("openssl {args:?} failed: {}", String::from_utf8_lossy(&out.stderr)),
        Err(_) => false,
    }
}

/// A key and a certificate `NAME.key`/`NAME.pem` for `subject`, signed by `ca.pem`, with the
/// extensions in `ext` (openssl extension-file syntax).
fn signed(dir: &Path, name: &str, subject: &str, ext: &str) -> bool {
    let ext_file = format!("{name}.ext");
    std::fs::write(dir.join(&ext_file), ext).expect("write the extension file");
    let (key, csr, pem) = (format!("{name}.key"), format!("{name}.csr"), format!("{name}.pem"));
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    let request = [&["req"][..], &ec, &["-keyout", &key, "-out", &csr, "-subj", subject]].concat();
    openssl(dir, &request)
        && openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &pem,
                "-days",
                "1",
                "-extfile",
                &ext_file,
            ],
        )
}

/// Makes `ca.pem`, `server.pem`/`server.key` (for localhost and 127.0.0.1) and
/// `client.pem`/`client.key` in `dir`. Panics when openssl is installed but fails; `false`
/// when it is not installed (the caller fails with a clear message: without certificates the
/// test cannot do its job).
pub(crate) fn make_certificates(dir: &Path) -> bool {
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    let ca = [&["req", "-x509"][..], &ec, &["-keyout", "ca.key", "-out", "ca.pem", "-days", "1"]].concat();
    let ca = [&ca[..], &["-subj", "/CN=cohort test CA"]].concat();
    openssl(dir, &ca)
        && signed(
            dir,
            "server",
            "/CN=localhost",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n\
             extendedKeyUsage=serverAuth,clientAuth\n",
        )
        && signed(
            dir,
            "client",
            "/CN=cohort-coordinator",
            "basicConstraints=critical,CA:FALSE\nextendedKeyUsage=clientAuth\n",
        )
}

/// The assertion message when openssl is missing.
pub(crate) const NEED_OPENSSL: &str =
    "the openssl tool is needed to make the test certificates (apt-get install openssl)";
