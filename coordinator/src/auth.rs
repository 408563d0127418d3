//! The job token check: `authorization: Bearer <token>` on every RPC, compared in constant
//! time.

use tonic::{Request, Status};

/// Compares two byte strings in time that depends only on their lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // Keep the optimiser from short-circuiting the fold.
    std::hint::black_box(diff) == 0
}

/// A tonic interceptor that requires the token (or lets everything through without one).
#[derive(Clone)]
pub struct TokenCheck {
    expected: Option<Vec<u8>>,
}

impl TokenCheck {
    /// Requires `Bearer <token>` when `token` is set.
    pub fn new(token: Option<&str>) -> Self {
        Self { expected: token.map(|t| format!("Bearer {t}").into_bytes()) }
    }

    /// Checks one request's metadata.
    pub fn check<T>(&self, request: &Request<T>) -> Result<(), Status> {
        let Some(expected) = &self.expected else { return Ok(()) };
        match request.metadata().get(cohort_proto::AUTHORIZATION_HEADER) {
            Some(value) if constant_time_eq(value.as_bytes(), expected) => Ok(()),
            Some(_) => Err(Status::unauthenticated("wrong job token")),
            None => Err(Status::unauthenticated("missing job token (authorization: Bearer <token>)")),
        }
    }
}

impl tonic::service::Interceptor for TokenCheck {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        self.check(&request)?;
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_check() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        let check = TokenCheck::new(Some("s3cret"));
        let mut ok = Request::new(());
        ok.metadata_mut().insert("authorization", "Bearer s3cret".parse().expect("ascii"));
        assert!(check.check(&ok).is_ok());
        let mut wrong = Request::new(());
        wrong.metadata_mut().insert("authorization", "Bearer nope".parse().expect("ascii"));
        assert_eq!(check.check(&wrong).expect_err("wrong").code(), tonic::Code::Unauthenticated);
        assert_eq!(check.check(&Request::new(())).expect_err("missing").code(), tonic::Code::Unauthenticated);
        assert!(TokenCheck::new(None).check(&Request::new(())).is_ok());
    }
}
