//! Who may call: the operator secret, or a job's credential (`authorization: Bearer <token>`
//! on every RPC, compared in constant time).
//!
//! The coordinator is configured with the operator secret (and, while it is being rotated,
//! the previous ones). A request carrying an operator secret may act on every job; one
//! carrying a job credential (`cohort_proto::credentials::job_token`) only on the job it names.
//! The interceptor authenticates the token and records the [`Caller`] in the request's
//! extensions; the service then checks the caller against the job of the message
//! ([`Caller::permits`]), since the interceptor does not see the message.

use cohort_proto::credentials::{constant_time_eq, is_job_token_of, job_of_token};
use tonic::{Request, Status};

/// Who made a request, as its token shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Caller {
    /// No token is configured: everyone may do everything.
    Anyone,
    /// The operator secret: every job.
    Operator,
    /// A job credential: that job only.
    Job(String),
}

impl Caller {
    /// Refuses a request about `job` from a caller whose credential is for another job.
    pub(crate) fn permits(&self, job: &str) -> Result<(), Status> {
        match self {
            Caller::Job(own) if own != job => Err(Status::permission_denied(format!(
                "this credential is for job {own:?}; the request is about job {job:?}"
            ))),
            _ => Ok(()),
        }
    }
}

/// A tonic interceptor that authenticates the token (or lets everything through without one).
#[derive(Clone)]
pub(crate) struct TokenCheck {
    /// The operator secrets accepted: the current one first, then those being rotated out.
    secrets: Vec<Vec<u8>>,
}

impl TokenCheck {
    /// Accepts the operator secrets `secrets` and the job credentials derived from them;
    /// with none, requires nothing.
    pub(crate) fn new(secrets: &[String]) -> Self {
        Self { secrets: secrets.iter().map(|s| s.as_bytes().to_vec()).collect() }
    }

    /// Whether requests must carry a credential.
    pub(crate) fn required(&self) -> bool {
        !self.secrets.is_empty()
    }

    /// Authenticates one request's token.
    pub(crate) fn check<T>(&self, request: &Request<T>) -> Result<Caller, Status> {
        let header = match request.metadata().get(cohort_proto::AUTHORIZATION_HEADER) {
            None => None,
            Some(value) => Some(value.to_str().unwrap_or("")),
        };
        self.check_header(header).map_err(|e| Status::unauthenticated(e.to_string()))
    }

    /// Authenticates an `authorization` header's value (`None`: the request had none).
    pub(crate) fn check_header(&self, header: Option<&str>) -> Result<Caller, AuthError> {
        if self.secrets.is_empty() {
            return Ok(Caller::Anyone);
        }
        let header = header.ok_or(AuthError::Missing)?;
        let token = header.strip_prefix("Bearer ").ok_or(AuthError::NotBearer)?;
        self.check_token(token)
    }

    /// Authenticates a bare token (the operator secret or a job credential).
    pub(crate) fn check_token(&self, token: &str) -> Result<Caller, AuthError> {
        if self.secrets.is_empty() {
            return Ok(Caller::Anyone);
        }
        if self.secrets.iter().any(|s| constant_time_eq(token.as_bytes(), s)) {
            return Ok(Caller::Operator);
        }
        match job_of_token(token) {
            Some(job) if is_job_token_of(token, job, &self.secrets) => Ok(Caller::Job(job.to_string())),
            Some(job) => Err(AuthError::ForeignJobCredential(job.to_string())),
            None => Err(AuthError::Wrong),
        }
    }
}

/// Why a credential was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum AuthError {
    /// The request carried none.
    #[error("missing job token (authorization: Bearer <token>)")]
    Missing,
    /// The `authorization` header is not a bearer token.
    #[error("the authorization header is not `Bearer <token>`")]
    NotBearer,
    /// A job credential that no accepted operator secret derives.
    #[error("the credential for job {0:?} is not valid here")]
    ForeignJobCredential(String),
    /// Neither an operator secret nor a job credential.
    #[error("wrong job token")]
    Wrong,
}

impl tonic::service::Interceptor for TokenCheck {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        let caller = self.check(&request)?;
        request.extensions_mut().insert(caller);
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_proto::credentials::job_token;

    fn with(token: &str) -> Request<()> {
        let mut r = Request::new(());
        r.metadata_mut().insert("authorization", format!("Bearer {token}").parse().expect("ascii"));
        r
    }

    #[test]
    fn operator_secrets_and_job_credentials() {
        let check = TokenCheck::new(&["s3cret".into(), "old".into()]);
        assert_eq!(check.check(&with("s3cret")).expect("operator"), Caller::Operator);
        assert_eq!(check.check(&with("old")).expect("rotating out"), Caller::Operator);
        let job = job_token(b"s3cret", "a");
        assert_eq!(check.check(&with(&job)).expect("job a"), Caller::Job("a".into()));
        assert_eq!(check.check(&with(&job_token(b"old", "a"))).expect("old secret"), Caller::Job("a".into()));
        let foreign = job_token(b"another coordinator", "a");
        assert_eq!(check.check(&with(&foreign)).expect_err("foreign").code(), tonic::Code::Unauthenticated);
        assert_eq!(check.check(&with("nope")).expect_err("wrong").code(), tonic::Code::Unauthenticated);
        assert_eq!(check.check(&Request::new(())).expect_err("missing").code(), tonic::Code::Unauthenticated);
        assert_eq!(TokenCheck::new(&[]).check(&Request::new(())).expect("open"), Caller::Anyone);
    }

    #[test]
    fn a_job_credential_permits_its_job_only() {
        assert!(Caller::Job("a".into()).permits("a").is_ok());
        let denied = Caller::Job("a".into()).permits("b").expect_err("other job");
        assert_eq!(denied.code(), tonic::Code::PermissionDenied);
        assert!(Caller::Operator.permits("b").is_ok() && Caller::Anyone.permits("b").is_ok());
    }
}
