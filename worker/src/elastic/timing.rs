//! The step timing a member reports with its heartbeats, for the coordinator's straggler
//! detection: per step, the time spent outside collectives (its own compute) and inside
//! them, averaged over the steps since the previous heartbeat, and per peer the smoothed
//! wait on that peer's link (from the transport's learned deadlines).

use cohort_proto::v1 as pb;
use std::time::Duration;

/// Step times gathered between two heartbeats.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepTimes {
    steps: u32,
    compute: Duration,
    collective: Duration,
    /// The newest per-peer waits: `(peer rank, smoothed wait)`.
    peer_waits: Vec<(u32, Duration)>,
}

impl StepTimes {
    /// Adds one step: its time outside and inside collectives, and the waits per peer now.
    pub fn record(&mut self, compute: Duration, collective: Duration, peer_waits: Vec<(u32, Duration)>) {
        self.steps = self.steps.saturating_add(1);
        self.compute = self.compute.saturating_add(compute);
        self.collective = self.collective.saturating_add(collective);
        self.peer_waits = peer_waits;
    }

    /// The means since the last call, as the heartbeat carries them (`None`: no step since);
    /// starts a new window.
    pub fn take(&mut self) -> Option<pb::StepTiming> {
        if self.steps == 0 {
            return None;
        }
        let window = std::mem::take(self);
        let mean = |total: Duration| (total.as_micros() / u128::from(window.steps)).min(u128::from(u64::MAX)) as u64;
        Some(pb::StepTiming {
            steps: window.steps,
            compute_us: mean(window.compute),
            collective_us: mean(window.collective),
            peer_waits: window
                .peer_waits
                .iter()
                .map(|&(rank, wait)| pb::PeerWait { rank, wait_us: wait.as_micros().min(u128::from(u64::MAX)) as u64 })
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_averages_and_restarts() {
        let mut t = StepTimes::default();
        assert_eq!(t.take(), None);
        let ms = Duration::from_millis;
        t.record(ms(10), ms(2), vec![(1, ms(5))]);
        t.record(ms(30), ms(4), vec![(1, ms(7))]);
        let timing = t.take().expect("two steps");
        assert_eq!((timing.steps, timing.compute_us, timing.collective_us), (2, 20_000, 3_000));
        assert_eq!(timing.peer_waits, vec![pb::PeerWait { rank: 1, wait_us: 7_000 }]);
        assert_eq!(t.take(), None, "a new window");
    }
}
