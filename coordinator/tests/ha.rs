//! Several coordinator replicas on one etcd: the leader dies mid-rendezvous, another takes
//! over within the lease TTL, formation completes with one identical generation for all,
//! and restarting every replica loses nothing.

mod common;

use cohort_coordinator::server::ServerHandle;
use common::*;
use std::time::{Duration, Instant};

/// Polls `cond` every 50 ms until it holds, at most `bound`.
async fn until(what: &str, bound: Duration, mut cond: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + bound;
    while !cond().await {
        assert!(Instant::now() < deadline, "{what}: not within {bound:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn leader_index(replicas: &[Option<ServerHandle>]) -> Vec<usize> {
    replicas.iter().enumerate().filter(|(_, r)| r.as_ref().is_some_and(|r| r.is_leader())).map(|(i, _)| i).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_failover_mid_rendezvous_and_full_restart() {
    bounded(async {
        let backing = Backing::new(Backend::Etcd).await;
        let mut settings = test_settings(Backend::Etcd);
        settings.join_window = Duration::from_millis(1500);
        settings.elastic_timeout = Duration::from_secs(60);
        let leader_ttl = Duration::from_secs(2);
        let mut replicas: Vec<Option<ServerHandle>> = Vec::new();
        for i in 0..3 {
            let mut options = Options::new(settings);
            options.leader_ttl = leader_ttl;
            options.name = Some(format!("replica-{i}"));
            replicas.push(Some(replica(backing.store.clone(), &options).await));
        }
        until("one leader", Duration::from_secs(10), async || leader_index(&replicas).len() == 1).await;
        let leader = leader_index(&replicas)[0];
        let followers: Vec<usize> = (0..3).filter(|i| *i != leader).collect();
        let addr_of = |i: usize| replicas[i].as_ref().map(|r| r.local_addr()).expect("running");
        let status_addr = addr_of(followers[0]);

        // Workers talk to the followers only.
        let mut workers = Vec::new();
        for i in 0..3 {
            let addr = addr_of(followers[i % followers.len()]);
            workers.push(Worker::join(addr, "ha", &format!("w{i}"), Duration::from_millis(100)).await);
        }
        // A follower names the leader (the job exists now: Status of an unknown job is NOT_FOUND).
        assert_eq!(status(status_addr, "ha").await.leader, format!("replica-{leader}"));
        let workers = std::sync::Arc::new(workers);
        let polls: Vec<_> = (0..3)
            .map(|i| {
                let workers = workers.clone();
                tokio::spawn(async move { workers[i].next_generation(0).await })
            })
            .collect();
        until("all three waiting", Duration::from_secs(10), async || {
            status(status_addr, "ha").await.members.iter().filter(|m| m.waiting).count() == 3
        })
        .await;
        // The leader dies before the join window ends (no resignation: its lease must lapse).
        let killed_at = Instant::now();
        replicas[leader].take().expect("leader").kill();
        let mut generations = Vec::new();
        for p in polls {
            generations.push(p.await.expect("rendezvous task"));
        }
        let elapsed = killed_at.elapsed();
        eprintln!("formation completed {elapsed:?} after the leader was killed");
        let g = &generations[0];
        assert_eq!(g.number, 1);
        assert_eq!(g.members.len(), 3);
        assert!(generations.iter().all(|x| x == g), "every worker sees the identical generation");
        // etcd may keep a 2 s lease up to one more second; then the join window runs again.
        assert!(
            elapsed < leader_ttl + settings.join_window + Duration::from_secs(3),
            "formation took {elapsed:?} after the leader died"
        );
        let new_leaders = leader_index(&replicas);
        assert_eq!(new_leaders.len(), 1, "exactly one replica leads after the failover");
        assert_ne!(new_leaders[0], leader);

        // Restart every replica: the job's state is in etcd.
        for r in replicas.iter_mut() {
            if let Some(r) = r.take() {
                r.shutdown().await.expect("shutdown");
            }
        }
        let mut options = Options::new(settings);
        options.leader_ttl = leader_ttl;
        options.name = Some("replica-new".into());
        let fresh = replica(backing.store.clone(), &options).await;
        let s = status(fresh.local_addr(), "ha").await;
        assert_eq!(s.current.as_ref(), Some(g), "the generation survives a restart of every replica");
        assert_eq!(s.members.len(), 3);
        until("the new replica leads", Duration::from_secs(10), async || fresh.is_leader()).await;
        fresh.shutdown().await.expect("shutdown");
    })
    .await;
}

/// Two replicas that both believe they lead race to publish generation 1 from the same
/// view: the CAS on the generation key lets exactly one group through (memory store).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_leaders_cannot_publish_two_groups() {
    two_leaders_race(Backend::Memory).await;
}

/// The same race on a real etcd: the CAS is etcd's transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_leaders_cannot_publish_two_groups_on_etcd() {
    two_leaders_race(Backend::Etcd).await;
}

async fn two_leaders_race(backend: Backend) {
    use cohort_coordinator::config::Settings;
    use cohort_coordinator::hub::Hubs;
    use cohort_coordinator::metrics::Metrics;
    use cohort_coordinator::ops::{self, Context};
    use cohort_coordinator::records::Placed;
    bounded(async {
        let backing = Backing::new(backend).await;
        let (_tx, rx) = tokio::sync::watch::channel(false);
        let ctx = |name: &str| Context {
            store: backing.store.clone(),
            settings: Settings::uniform(test_settings(backend)).expect("settings"),
            exclusion: Default::default(),
            metrics: std::sync::Arc::new(Metrics::default()),
            hubs: Hubs::new(backing.store.clone()),
            replica: name.into(),
            shutdown: rx.clone(),
            ended_ttl: ops::ENDED_TTL,
        };
        let (a, b) = (ctx("a"), ctx("b"));
        let placed = |w: &str| Placed {
            worker_id: w.into(),
            incarnation: 1,
            host: "h".into(),
            addresses: vec![],
            domain: String::new(),
        };
        let (ra, rb) = tokio::join!(
            ops::form_generation(&a, "race", None, None, vec![placed("x"), placed("y")]),
            ops::form_generation(&b, "race", None, None, vec![placed("y"), placed("x")]),
        );
        let (ra, rb) = (ra.expect("store"), rb.expect("store"));
        assert!(ra.is_some() != rb.is_some(), "exactly one formation wins: {ra:?} {rb:?}");
        let winner = ra.or(rb).expect("one");
        let (stored, _) =
            ops::read_generation(backing.store.as_ref(), "race").await.expect("read").expect("generation");
        assert_eq!(stored, winner);
        // A second round from the stale view (expected: absent) fails too.
        assert!(ops::form_generation(&a, "race", None, None, vec![placed("z")]).await.expect("store").is_none());
    })
    .await;
}

/// A leader killed without resigning and restarted under its own name takes its key back at
/// once instead of waiting out its old lease (20 s here). A second live replica under the
/// same name (a misconfiguration) takes the key once, and the older one steps down: one
/// leader, no tug of war.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_leader_takes_its_key_back_at_once() {
    bounded(async {
        let backing = Backing::new(Backend::Etcd).await;
        let leader_ttl = Duration::from_secs(20);
        let mut options = Options::new(test_settings(Backend::Etcd));
        options.leader_ttl = leader_ttl;
        options.name = Some("solo".into());
        let first = replica(backing.store.clone(), &options).await;
        until("the first process leads", Duration::from_secs(10), async || first.is_leader()).await;
        first.kill();
        let restarted_at = Instant::now();
        let second = replica(backing.store.clone(), &options).await;
        until("the restarted replica leads", Duration::from_secs(10), async || second.is_leader()).await;
        assert!(
            restarted_at.elapsed() < leader_ttl / 4,
            "took {:?}: it waited for the old lease",
            restarted_at.elapsed()
        );

        let twin = replica(backing.store.clone(), &options).await;
        until("the twin leads and the older one steps down", Duration::from_secs(10), async || {
            twin.is_leader() && !second.is_leader()
        })
        .await;
        let settled = Instant::now() + Duration::from_secs(1);
        while Instant::now() < settled {
            assert!(twin.is_leader() && !second.is_leader(), "leadership went back and forth");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        twin.shutdown().await.expect("shutdown");
        second.shutdown().await.expect("shutdown");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_excluding_two_stragglers_of_120_keep_min_workers_on_etcd() {
    two_stragglers_at_once(Backend::Etcd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_excluding_two_stragglers_of_120_keep_min_workers_on_the_memory_store() {
    two_stragglers_at_once(Backend::Memory).await;
}

/// Two replicas exclude two different stragglers of a 120-member generation with
/// `min_workers` 119 at the same moment: one exclusion lands, the other is refused (it would
/// leave 118). The store holds both replicas' reads of the failure records until both have
/// read them, so that both count no exclusion in force: the race happens every time. (A
/// generation this large is past what comparing every member's failure record would fit in
/// one etcd transaction.)
async fn two_stragglers_at_once(backend: Backend) {
    use cohort_coordinator::config::Settings;
    use cohort_coordinator::hub::Hubs;
    use cohort_coordinator::metrics::Metrics;
    use cohort_coordinator::ops::{self, Context, StragglerExclusion};
    bounded(async {
        let backing = Backing::new(backend).await;
        let job = "stragglers";
        let failures = cohort_coordinator::keys::kind_prefix(job, cohort_coordinator::keys::Kind::Failures);
        let gated = common::gate::GatedStore::new(backing.store.clone(), 2, move |key| key == failures);
        let (_tx, rx) = tokio::sync::watch::channel(false);
        let ctx = |name: &str| Context {
            store: gated.clone(),
            settings: Settings::uniform(test_settings(backend)).expect("settings"),
            exclusion: Default::default(),
            metrics: std::sync::Arc::new(Metrics::default()),
            hubs: Hubs::new(gated.clone()),
            replica: name.into(),
            shutdown: rx.clone(),
            ended_ttl: ops::ENDED_TTL,
        };
        let (a, b) = (ctx("a"), ctx("b"));
        let members: Vec<String> = (0..120).map(|i| format!("w{i:03}")).collect();
        let cooldown = Duration::from_secs(60);
        let (ra, rb) = tokio::join!(
            ops::exclude_straggler(&a, job, "w007", &members, 119, cooldown, "compute slow"),
            ops::exclude_straggler(&b, job, "w100", &members, 119, cooldown, "compute slow"),
        );
        assert!(gated.met(), "both replicas read the failure records before either wrote");
        let (ra, rb) = (ra.expect("store"), rb.expect("store"));
        let excluded = [&ra, &rb].iter().filter(|r| matches!(r, StragglerExclusion::Excluded(_))).count();
        assert_eq!(excluded, 1, "exactly one of the two is excluded: {ra:?}, {rb:?}");
        let refused = [&ra, &rb].into_iter().find_map(|r| match r {
            StragglerExclusion::Refused(why) => Some(why.clone()),
            StragglerExclusion::Excluded(_) => None,
        });
        let refused = refused.expect("the other is refused");
        assert!(refused.contains("1 of them excluded already"), "{refused}");
    })
    .await;
}
