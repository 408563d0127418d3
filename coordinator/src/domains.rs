//! Failure domains, as pure logic: when the ranks of one domain (a node, a host) are lost
//! together, that is one failure with one root cause, counted once against the domain.
//!
//! A worker publishes its domain at join (`JoinRequest.domain`; the host when it publishes
//! none). The rule, applied when a failure report is about to revoke a generation: the
//! suspect's domain is *lost* when it holds at least two members of the generation (that have
//! not left it) and every one of them is lost by the coordinator's own evidence: its process
//! is gone (control stream closed, lease gone), it has certainly been silent for longer than
//! twice the heartbeat interval, or another member timed out waiting on it (unless it reported
//! a timeout of its own in the generation: a member that reports is alive, which keeps a
//! cycle of timeouts on one silent link from reading as a whole host lost). Then the cause
//! names the domain and all its ranks, every one of them is evicted at once (the survivors
//! do not wait for their leases), and the failure counts once, against the domain, for
//! exclusion ([`domain_key`]). Some of a domain's ranks failing while another of its members
//! is alive is not a domain loss: each is judged as a member, as before.

use crate::records::{Cause, GenerationRecord};

/// The failure-history key of a domain (beside workers' ids in `failures/`): `@` and the
/// domain with every character outside `[A-Za-z0-9._-]` replaced by `_`. `@` never starts a
/// worker id, so the two never collide.
pub(crate) fn domain_key(domain: &str) -> String {
    let safe: String = domain
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') { c } else { '_' })
        .collect();
    format!("@{safe}")
}

/// The domain a failure-history key is about, if it is a domain's.
pub(crate) fn key_domain(key: &str) -> Option<&str> {
    key.strip_prefix('@')
}

/// What the coordinator knows of one member when judging a domain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Evidence {
    /// Lost: its process is gone, it is certainly silent, or a peer timed out on it.
    Lost,
    /// Heard from recently: alive.
    Alive,
    /// Neither is certain.
    Unknown,
}

/// A whole domain lost at once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DomainLoss {
    /// The domain.
    pub(crate) domain: String,
    /// Every rank of it in the generation, ascending.
    pub(crate) ranks: Vec<u32>,
}

/// Whether the domain of rank `suspect` in `g` is lost, by `evidence(rank)` for each of its
/// other members that have not left `g` (the suspect itself is lost: it is the report's
/// subject). `None` when the domain holds fewer than two such members or any of them is not
/// known to be lost.
pub(crate) fn whole_domain_lost(
    g: &GenerationRecord,
    suspect: u32,
    mut evidence: impl FnMut(u32) -> Evidence,
) -> Option<DomainLoss> {
    let domain = g.members.get(suspect as usize)?.domain().to_string();
    let departures = g.departures();
    let ranks: Vec<u32> = g
        .members
        .iter()
        .enumerate()
        .filter(|(_, m)| m.domain() == domain && !departures.contains(&m.worker_id, m.incarnation))
        .map(|(rank, _)| rank as u32)
        .collect();
    if ranks.len() < 2 || !ranks.contains(&suspect) {
        return None;
    }
    let all_lost = ranks.iter().filter(|&&r| r != suspect).all(|&r| evidence(r) == Evidence::Lost);
    all_lost.then_some(DomainLoss { domain, ranks })
}

/// `cause` (about one member of the lost domain) as the domain's: it names the domain and
/// its ranks, and keeps what was reported as the detail.
pub(crate) fn domain_cause(cause: Cause, loss: &DomainLoss) -> Cause {
    let reason = format!(
        "domain {} lost: ranks {} (all {} of its ranks) failed together; first report: {}",
        loss.domain,
        ranks_text(&loss.ranks),
        loss.ranks.len(),
        cause.reason
    );
    Cause { reason, domain: loss.domain.clone(), lost_ranks: loss.ranks.clone(), ..cause }
}

/// Ranks as people write them: `3-5`, `1, 3, 4`, `0-1, 4`.
pub(crate) fn ranks_text(ranks: &[u32]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let start = ranks[i];
        let mut end = start;
        while i + 1 < ranks.len() && ranks[i + 1] == end + 1 {
            i += 1;
            end = ranks[i];
        }
        parts.push(if end > start + 1 {
            format!("{start}-{end}")
        } else if end == start + 1 {
            format!("{start}, {end}")
        } else {
            start.to_string()
        });
        i += 1;
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::{Departure, Placed};
    use crate::rendezvous::next_generation;

    /// Ranks 0-1 on node-a, 2-4 on node-b, 5 on node-c.
    fn six() -> GenerationRecord {
        let domains = ["node-a", "node-a", "node-b", "node-b", "node-b", "node-c"];
        let members = domains
            .iter()
            .enumerate()
            .map(|(i, d)| Placed {
                worker_id: format!("w{i}"),
                incarnation: 1,
                host: "vm".into(),
                addresses: vec![],
                domain: d.to_string(),
            })
            .collect();
        next_generation(None, members, 0)
    }

    fn cause() -> Cause {
        Cause::member(Some(3), "w3", "vm", "rank 1 timed out".into(), "w1")
    }

    #[test]
    fn every_rank_of_the_domain_lost_is_one_domain_loss() {
        let g = six();
        let loss = whole_domain_lost(&g, 3, |_| Evidence::Lost).expect("node-b lost");
        assert_eq!(loss, DomainLoss { domain: "node-b".into(), ranks: vec![2, 3, 4] });
        let c = domain_cause(cause(), &loss);
        assert_eq!(c.domain, "node-b");
        assert_eq!(c.lost_ranks, vec![2, 3, 4]);
        assert_eq!(c.rank, Some(3), "the reported rank stays the cause's rank");
        assert!(c.reason.starts_with("domain node-b lost: ranks 2-4 (all 3 of its ranks)"), "{}", c.reason);
        assert!(c.reason.ends_with("first report: rank 1 timed out"), "{}", c.reason);
    }

    #[test]
    fn one_live_or_unknown_member_keeps_it_a_member_failure() {
        let g = six();
        assert_eq!(whole_domain_lost(&g, 3, |r| if r == 4 { Evidence::Alive } else { Evidence::Lost }), None);
        assert_eq!(whole_domain_lost(&g, 3, |r| if r == 2 { Evidence::Unknown } else { Evidence::Lost }), None);
    }

    #[test]
    fn a_domain_of_one_rank_is_never_a_domain_loss() {
        let g = six();
        assert_eq!(whole_domain_lost(&g, 5, |_| Evidence::Lost), None);
    }

    #[test]
    fn members_that_left_do_not_count() {
        let mut g = six();
        // w4 left gracefully: node-b's members are ranks 2 and 3, both lost.
        g.departed.push(Departure { worker_id: "w4".into(), incarnation: 1, finished: false });
        let loss = whole_domain_lost(&g, 3, |r| if r == 4 { Evidence::Alive } else { Evidence::Lost });
        assert_eq!(loss.map(|l| l.ranks), Some(vec![2, 3]));
        // w1 left: node-a holds one member, rank 0 alone.
        g.departed.push(Departure { worker_id: "w1".into(), incarnation: 1, finished: false });
        assert_eq!(whole_domain_lost(&g, 0, |_| Evidence::Lost), None);
    }

    #[test]
    fn the_suspect_is_not_asked_about() {
        let g = six();
        let mut asked = Vec::new();
        let _ = whole_domain_lost(&g, 0, |r| {
            asked.push(r);
            Evidence::Lost
        });
        assert_eq!(asked, vec![1]);
        assert_eq!(whole_domain_lost(&g, 9, |_| Evidence::Lost), None, "a rank outside the generation");
    }

    #[test]
    fn an_empty_domain_is_the_host() {
        let mut g = six();
        for m in &mut g.members {
            m.domain.clear();
        }
        // Every member on host "vm": a domain loss only if all six are lost.
        assert_eq!(whole_domain_lost(&g, 0, |r| if r == 5 { Evidence::Alive } else { Evidence::Lost }), None);
        assert_eq!(whole_domain_lost(&g, 0, |_| Evidence::Lost).map(|l| l.domain), Some("vm".into()));
    }

    #[test]
    fn keys_and_rank_lists_read_well() {
        assert_eq!(domain_key("node-7.zone_a"), "@node-7.zone_a");
        assert_eq!(domain_key("a/b c"), "@a_b_c");
        assert_eq!(key_domain("@node-7"), Some("node-7"));
        assert_eq!(key_domain("w3"), None);
        assert_eq!(ranks_text(&[3, 4, 5]), "3-5");
        assert_eq!(ranks_text(&[1, 3, 4]), "1, 3, 4");
        assert_eq!(ranks_text(&[0, 1, 4, 6, 7, 8]), "0, 1, 4, 6-8");
        assert_eq!(ranks_text(&[2]), "2");
        assert_eq!(ranks_text(&[]), "");
    }
}
