//! A worker checks its job and worker ids by cohort's one rule for ids before it contacts
//! anyone: a bad id is named at once, not by a coordinator's refusal later.

use cohort::control::ControlConfig;
use cohort::elastic::{ElasticConfig, ElasticError, ElasticGroup};
use cohort_proto::ids::IdError;
use std::time::Duration;

async fn join_error(job: &str, worker: &str) -> ElasticError {
    // No coordinator listens here: an id that passed the check would wait to connect.
    let mut config = ElasticConfig::new(job, worker, ControlConfig::new(vec!["http://127.0.0.1:9".into()]));
    config.listen = "127.0.0.1:0".parse().unwrap();
    match tokio::time::timeout(Duration::from_secs(5), ElasticGroup::join(config)).await {
        Ok(Ok(_)) => panic!("joined with job {job:?}, worker {worker:?}"),
        Ok(Err(e)) => e,
        Err(_) => panic!("join({job:?}, {worker:?}) was not refused at once: it waited for the coordinator"),
    }
}

#[tokio::test]
async fn a_bad_job_or_worker_id_is_refused_before_anything_is_contacted() {
    let e = join_error("a b", "w0").await;
    assert!(matches!(e, ElasticError::InvalidId(IdError::Character { field: "job", found: ' ' })), "{e}");
    assert_eq!(e.to_string(), "job contains ' '; ids are 1..=128 characters of [A-Za-z0-9._-]");
    let e = join_error("train", &"w".repeat(129)).await;
    assert!(matches!(e, ElasticError::InvalidId(IdError::TooLong { field: "worker_id", len: 129 })), "{e}");
    let e = join_error("train", "").await;
    assert!(matches!(e, ElasticError::InvalidId(IdError::Empty { field: "worker_id" })), "{e}");
}
