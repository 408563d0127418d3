//! A worker checks its job and worker ids by cohort's one rule for ids when they are made,
//! before its configuration exists: a bad id is named at once, not by a coordinator's refusal
//! later, and nothing can be joined with it.

use cohort::control::ControlConfig;
use cohort::elastic::{ElasticConfig, ElasticError, IdError, JobId, WorkerId};

/// The configuration of `job`'s worker `worker`, or why one of the ids is refused.
fn config(job: &str, worker: &str) -> Result<ElasticConfig, ElasticError> {
    // No coordinator listens here: nothing may be contacted either way.
    let control = ControlConfig::new(vec!["http://127.0.0.1:9".into()]);
    Ok(ElasticConfig::new(JobId::new(job)?, WorkerId::new(worker)?, control))
}

fn refusal(job: &str, worker: &str) -> ElasticError {
    match config(job, worker) {
        Ok(_) => panic!("a configuration with job {job:?}, worker {worker:?}"),
        Err(e) => e,
    }
}

#[test]
fn a_bad_job_or_worker_id_is_refused_before_anything_is_contacted() {
    let e = refusal("a b", "w0");
    assert!(matches!(e, ElasticError::InvalidId(IdError::Character { field: "job", found: ' ' })), "{e}");
    assert_eq!(e.to_string(), "job contains ' '; ids are 1..=128 characters of [A-Za-z0-9._-]");
    let e = refusal("train", &"w".repeat(129));
    assert!(matches!(e, ElasticError::InvalidId(IdError::TooLong { field: "worker_id", len: 129 })), "{e}");
    let e = refusal("train", "");
    assert!(matches!(e, ElasticError::InvalidId(IdError::Empty { field: "worker_id" })), "{e}");
    let ok = config("train", "w0").expect("good ids");
    assert_eq!((ok.job.as_str(), ok.worker_id.as_str()), ("train", "w0"));
}
