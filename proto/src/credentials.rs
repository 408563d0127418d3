//! Per-job credentials, derived from the operator's secret.
//!
//! The coordinator holds the operator secret (`--token-file`). A job's credential is derived
//! from it and names its job: `cohort-job.v1:<job>:<hex HMAC-SHA256(secret, job)>`
//! ([`job_token`]). Its holder may act on that job only (join, heartbeat, report, leave,
//! commit, status); the operator secret itself may act on every job. The coordinator needs no
//! list of jobs: it recomputes the MAC of the job a token names.
//!
//! The data plane binds the same credential: every member of a job proves, in its handshakes,
//! knowledge of the job's credential ([`data_plane_secret`]), which a member of another job,
//! holding only that job's credential, cannot compute.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The prefix of every job credential (the version is part of it).
pub const JOB_TOKEN_PREFIX: &str = "cohort-job.v1:";

/// Why a credential cannot be used for a job.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CredentialError {
    /// A job credential used for another job.
    #[error("the credential is for job {credential_job:?}, not for job {job:?}")]
    OtherJob {
        /// The job the credential names.
        credential_job: String,
        /// The job it was used for.
        job: String,
    },
}

fn mac(secret: &[u8], job: &str) -> String {
    // Keyed by the operator's secret; the domain string keeps these MACs apart from any other
    // use of the same secret (the data-plane handshake MACs its fields under a job credential).
    let Ok(mut m) = Hmac::<Sha256>::new_from_slice(secret) else { unreachable!("HMAC takes keys of any length") };
    m.update(b"cohort job credential v1\0");
    m.update(job.as_bytes());
    m.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

/// The credential of `job` under the operator secret `secret`.
pub fn job_token(secret: &[u8], job: &str) -> String {
    format!("{JOB_TOKEN_PREFIX}{job}:{}", mac(secret, job))
}

/// The job a job credential names, or `None` for anything else (such as an operator secret).
pub fn job_of_token(token: &str) -> Option<&str> {
    let rest = token.strip_prefix(JOB_TOKEN_PREFIX)?;
    let (job, mac) = rest.rsplit_once(':')?;
    (!job.is_empty() && mac.len() == 64 && mac.bytes().all(|b| b.is_ascii_hexdigit())).then_some(job)
}

/// Whether `token` is the credential of `job` under one of `secrets` (constant time in the
/// MAC's bytes).
pub fn is_job_token_of(token: &str, job: &str, secrets: &[Vec<u8>]) -> bool {
    if job_of_token(token) != Some(job) {
        return false;
    }
    secrets.iter().any(|s| constant_time_eq(token.as_bytes(), job_token(s, job).as_bytes()))
}

/// The secret a worker of `job` keys its data-plane handshakes with: its job credential as it
/// is, or, for a worker given the operator secret, the credential derived from it (so workers
/// holding either interoperate). A credential of another job is refused.
pub fn data_plane_secret(token: &[u8], job: &str) -> Result<Vec<u8>, CredentialError> {
    if token.is_empty() {
        return Ok(Vec::new());
    }
    match std::str::from_utf8(token).ok().and_then(job_of_token) {
        Some(j) if j == job => Ok(token.to_vec()),
        Some(j) => Err(CredentialError::OtherJob { credential_job: j.to_string(), job: job.to_string() }),
        None => Ok(job_token(token, job).into_bytes()),
    }
}

/// Compares two byte strings in time that depends only on their lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // Keep the optimiser from short-circuiting the fold.
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_token_names_its_job_and_only_its_secret_makes_it() {
        let t = job_token(b"operator", "train-1");
        assert!(t.starts_with("cohort-job.v1:train-1:"));
        assert_eq!(job_of_token(&t), Some("train-1"));
        assert!(is_job_token_of(&t, "train-1", &[b"operator".to_vec()]));
        assert!(!is_job_token_of(&t, "train-2", &[b"operator".to_vec()]));
        assert!(!is_job_token_of(&t, "train-1", &[b"other".to_vec()]));
        // Rotation: the old secret's tokens stay valid while it is still listed.
        assert!(is_job_token_of(&t, "train-1", &[b"new".to_vec(), b"operator".to_vec()]));
        // Renaming the job inside the token breaks the MAC.
        let forged = t.replace("train-1", "train-2");
        assert!(!is_job_token_of(&forged, "train-2", &[b"operator".to_vec()]));
        assert_eq!(job_of_token("operator"), None);
        assert_eq!(job_of_token("cohort-job.v1::00"), None);
        assert_eq!(job_of_token(&format!("{JOB_TOKEN_PREFIX}j:{}", "g".repeat(64))), None);
    }

    #[test]
    fn the_data_plane_secret_is_the_job_credential_however_it_was_given() {
        let t = job_token(b"operator", "j");
        assert_eq!(data_plane_secret(t.as_bytes(), "j").expect("own job"), t.as_bytes());
        assert_eq!(data_plane_secret(b"operator", "j").expect("operator"), t.as_bytes());
        assert!(matches!(data_plane_secret(t.as_bytes(), "k"), Err(CredentialError::OtherJob { .. })));
        assert!(data_plane_secret(b"", "j").expect("no token").is_empty());
    }
}
