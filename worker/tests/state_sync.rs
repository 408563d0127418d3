//! `Checkpoint`: commit, restore and the post-re-formation sync, over the simulated network.

use cohort::elastic::{Checkpoint, CommitError, SyncError};
use cohort::{CommConfig, Communicator};
use cohort_testkit::sim::{SimNetwork, SimTransport};
use cohort_transports::Deadlines;
use std::sync::Arc;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(30);

fn world(n: u32) -> Vec<Communicator<SimTransport>> {
    let deadlines = Deadlines { no_progress: Duration::from_secs(5), connect: Duration::from_secs(5), learning: None };
    let (_net, ts) = SimNetwork::new(n, 11, deadlines);
    ts.into_iter().map(|t| Communicator::new(Arc::new(t), CommConfig::default())).collect()
}

/// Runs `sync` on every rank with the given checkpoints and states; returns what each got.
async fn sync_all(
    checkpoints: Vec<Checkpoint>,
    states: Vec<Vec<u8>>,
) -> Vec<(Result<cohort::elastic::SyncOutcome, String>, Checkpoint, Vec<u8>)> {
    let comms = world(checkpoints.len() as u32);
    let tasks: Vec<_> = comms
        .into_iter()
        .zip(checkpoints.into_iter().zip(states))
        .map(|(mut comm, (mut cp, mut state))| {
            tokio::spawn(async move {
                let r = cp.sync(&mut comm, &mut state).await.map_err(|e: SyncError| e.to_string());
                (r, cp, state)
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(tokio::time::timeout(LIMIT, t).await.expect("sync bounded").expect("rank task"));
    }
    out
}

#[tokio::test]
async fn first_sync_without_commits_broadcasts_the_initial_state_of_rank_0() {
    let states = vec![b"init-from-rank-0".to_vec(), b"other".to_vec(), Vec::new()];
    let results = sync_all(vec![Checkpoint::new(), Checkpoint::new(), Checkpoint::new()], states).await;
    for (rank, (r, cp, state)) in results.iter().enumerate() {
        let outcome = r.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(outcome.step, None);
        assert_eq!(outcome.source, 0);
        assert_eq!(state, b"init-from-rank-0", "rank {rank} did not take rank 0's initial state");
        assert_eq!(cp.step(), None);
    }
    let digests: Vec<_> = results.iter().map(|(_, cp, _)| cp.digest()).collect();
    assert!(digests.windows(2).all(|w| w[0] == w[1]));
    // A failed first step restores the initial state.
    let (_, cp, _) = &results[2];
    let mut state = b"garbage".to_vec();
    cp.restore(&mut state).expect("restore");
    assert_eq!(state, b"init-from-rank-0");
}

#[tokio::test]
async fn joiner_receives_the_newest_commit_from_the_lowest_rank_holding_it() {
    let mut old = Checkpoint::new();
    old.commit(&b"step-4".to_vec(), 4);
    let mut newest_a = Checkpoint::new();
    newest_a.commit(&b"step-7".to_vec(), 7);
    let newest_b = newest_a.clone();
    let joiner = Checkpoint::new();
    let results = sync_all(
        vec![old, newest_a, newest_b, joiner],
        vec![b"step-4".to_vec(), b"step-7".to_vec(), b"step-7".to_vec(), Vec::new()],
    )
    .await;
    for (rank, (r, cp, state)) in results.iter().enumerate() {
        let outcome = r.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(outcome.step, Some(7));
        assert_eq!(outcome.source, 1, "the lowest rank with the newest commit is the source");
        assert_eq!(outcome.changed, rank == 0 || rank == 3, "rank {rank}");
        assert_eq!(state, b"step-7");
        assert_eq!(cp.step(), Some(7));
    }
}

#[tokio::test]
async fn members_with_the_same_step_but_different_bytes_are_a_divergence_on_every_rank() {
    // Two members claim the same committed step with different bytes (their states diverged
    // before the failure): every member fails with Diverged naming the rank, and nobody's
    // state or checkpoint is overwritten.
    let mut a = Checkpoint::new();
    a.commit(&b"aaaa".to_vec(), 3);
    let mut b = Checkpoint::new();
    b.commit(&b"bbbb".to_vec(), 3);
    let joiner = Checkpoint::new();
    let (digest_a, digest_b) = (a.digest(), b.digest());
    let results = sync_all(vec![a, b, joiner], vec![b"aaaa".to_vec(), b"bbbb".to_vec(), b"joiner".to_vec()]).await;
    for (rank, (r, _, state)) in results.iter().enumerate() {
        let e = r.as_ref().expect_err("a divergence must not sync");
        assert!(e.contains("diverged") && e.contains("rank(s) 1 committed step 3"), "rank {rank}: {e}");
        assert_eq!(state, [&b"aaaa"[..], b"bbbb", b"joiner"][rank], "rank {rank}'s state was overwritten");
    }
    assert_eq!(results[0].1.digest(), digest_a);
    assert_eq!(results[1].1.digest(), digest_b);
}

#[tokio::test]
async fn a_member_behind_and_a_joiner_are_not_a_divergence() {
    // Older steps and empty checkpoints differ from the newest legitimately: they take it.
    let mut newest = Checkpoint::new();
    newest.commit(&b"seven".to_vec(), 7);
    let mut behind = Checkpoint::new();
    behind.commit(&b"six".to_vec(), 6);
    let results = sync_all(
        vec![behind, Checkpoint::new(), newest.clone(), newest],
        vec![b"six".to_vec(), Vec::new(), b"seven".to_vec(), b"seven".to_vec()],
    )
    .await;
    for (rank, (r, cp, state)) in results.iter().enumerate() {
        let outcome = r.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!((outcome.source, outcome.step), (2, Some(7)));
        assert_eq!(state, b"seven");
        assert_eq!(cp.step(), Some(7));
    }
}

/// Runs `agree` on every rank with the given checkpoints and flags; returns what each got.
async fn agree_all(checkpoints: Vec<Checkpoint>, flags: Vec<[u8; 2]>) -> Vec<Result<[u8; 2], CommitError>> {
    let comms = world(checkpoints.len() as u32);
    let tasks: Vec<_> = comms
        .into_iter()
        .zip(checkpoints.into_iter().zip(flags))
        .map(|(mut comm, (mut cp, mut flags))| {
            tokio::spawn(async move { cp.agree(&mut comm, &mut flags).await.map(|()| flags) })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(tokio::time::timeout(LIMIT, t).await.expect("agree bounded").expect("rank task"));
    }
    out
}

fn committed(state: &[u8], step: u64) -> Checkpoint {
    let mut cp = Checkpoint::new();
    cp.commit(&state.to_vec(), step);
    cp
}

#[tokio::test]
async fn members_agreeing_at_a_commit_point_get_the_flags_of_all() {
    let results =
        agree_all(vec![committed(b"s9", 9), committed(b"s9", 9), committed(b"s9", 9)], vec![[0, 0], [1, 0], [0, 0]])
            .await;
    for (rank, r) in results.into_iter().enumerate() {
        assert_eq!(r.unwrap_or_else(|e| panic!("rank {rank}: {e}")), [1, 0], "rank {rank}");
    }
}

/// The commit point catches a divergence on every rank, at the commit that caused it: one
/// member of three holds other state under the same step (a difference in the last byte
/// of the snapshot, so only the digest can show it).
#[tokio::test]
async fn a_member_committing_other_state_fails_every_rank_at_that_commit() {
    let results = agree_all(
        vec![committed(b"s9-a", 9), committed(b"s9-a", 9), committed(b"s9-b", 9)],
        vec![[0, 0], [0, 0], [0, 0]],
    )
    .await;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Err(e @ CommitError::Diverged { generation: 11, step: Some(9), .. }) => {
                assert!(e.to_string().contains("step 9") && e.to_string().contains("different state"), "{e}")
            }
            other => panic!("rank {rank}: {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_member_committing_another_step_fails_every_rank_at_that_commit() {
    // The same bytes under another step (a lost or repeated step).
    let results = agree_all(vec![committed(b"s", 9), committed(b"s", 8)], vec![[0, 1], [0, 0]]).await;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Err(e @ CommitError::Diverged { .. }) => assert!(e.to_string().contains("different steps"), "{e}"),
            other => panic!("rank {rank}: {other:?}"),
        }
    }
}

/// A commit whose agreement fails is not committed: the checkpoint rolls back to the last
/// agreed commit, which is what a restore loads and what the next sync claims. Two ranks
/// agree on step 1, commit step 2, and rank 1 crashes before the agreement of step 2.
#[tokio::test]
async fn a_commit_whose_agreement_fails_is_rolled_back_to_the_last_agreed() {
    let deadlines = Deadlines { no_progress: Duration::from_secs(5), connect: Duration::from_secs(5), learning: None };
    let (net, ts) = SimNetwork::new(2, 11, deadlines);
    let mut comms: Vec<_> = ts.into_iter().map(|t| Communicator::new(Arc::new(t), CommConfig::default())).collect();
    let mut checkpoints = [Checkpoint::new(), Checkpoint::new()];
    for cp in &mut checkpoints {
        cp.commit(&b"step-1".to_vec(), 1);
        assert!(cp.is_tentative(), "a commit is tentative until agreed");
    }
    let agreed = futures::future::join_all(
        comms.iter_mut().zip(checkpoints.iter_mut()).map(|(comm, cp)| async move { cp.agree(comm, &mut [0u8]).await }),
    );
    for r in tokio::time::timeout(LIMIT, agreed).await.expect("agree bounded") {
        r.expect("step 1 agreed");
    }
    assert!(checkpoints.iter().all(|cp| !cp.is_tentative() && cp.step() == Some(1)));
    let agreed_digest = checkpoints[0].digest();

    let cp = &mut checkpoints[0];
    cp.commit(&b"step-2".to_vec(), 2);
    assert_eq!(cp.step(), Some(2));
    net.crash(1);
    let mut flags = [1u8];
    let failed = tokio::time::timeout(LIMIT, cp.agree(&mut comms[0], &mut flags)).await.expect("agree bounded");
    assert!(matches!(failed, Err(CommitError::Comm(_))), "{failed:?}");
    assert_eq!(cp.step(), Some(1), "the commit of step 2 was not agreed, so it is not kept");
    assert_eq!(cp.digest(), agreed_digest);
    assert!(!cp.is_tentative());
    assert_eq!(flags, [1], "flags are left as they were");
    let mut state = b"garbage".to_vec();
    cp.restore(&mut state).expect("restore");
    assert_eq!(state, b"step-1", "a restore loads the last agreed commit");
}
