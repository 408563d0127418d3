//! The no-progress deadlines in force on a generation's links, reported by the library: to
//! the worker's metrics (`cohort_worker_deadline_milliseconds`) and, in brief, to the
//! coordinator with the next heartbeat (what `cohort-coordinator status` shows). Any worker
//! on [`ElasticGroup`] reports them (the Python package's at every commit), not only
//! `cohort-worker train`.

use super::{DataPlane, ElasticGroup};
use cohort_transports::{DeadlineInForce, Rank, Transport};

/// `PEER:MS:BASIS` per link, comma separated (`1:250:floor,2:250:floor`).
pub fn deadline_summary(deadlines: &[(Rank, DeadlineInForce)]) -> String {
    let parts: Vec<String> =
        deadlines.iter().map(|(p, d)| format!("{p}:{}:{}", d.value.as_millis(), d.basis.name())).collect();
    parts.join(",")
}

/// The deadlines in force in brief, for `status`: `250 ms floor` when every link agrees,
/// else the range and the reasons (`250-480 ms floor/learned`); empty with no links.
pub fn deadline_brief(deadlines: &[(Rank, DeadlineInForce)]) -> String {
    let Some(lo) = deadlines.iter().map(|(_, d)| d.value).min() else { return String::new() };
    let hi = deadlines.iter().map(|(_, d)| d.value).max().unwrap_or(lo);
    let mut bases: Vec<&str> = deadlines.iter().map(|(_, d)| d.basis.name()).collect();
    bases.sort_unstable();
    bases.dedup();
    let range = if lo == hi { format!("{}", lo.as_millis()) } else { format!("{}-{}", lo.as_millis(), hi.as_millis()) };
    format!("{range} ms {}", bases.join("/"))
}

impl<P: DataPlane> ElasticGroup<P> {
    /// Reports the deadlines in force on `transport`'s links (a generation's communicator's):
    /// sets the worker's deadline metrics and sends their brief with the next heartbeat.
    /// Returns them, for a caller that prints them too.
    pub fn report_deadlines<T: Transport + ?Sized>(&self, transport: &T) -> Vec<(Rank, DeadlineInForce)> {
        let deadlines = transport.deadlines_in_force();
        crate::metrics::set_deadlines(&deadlines);
        self.set_deadlines(&deadline_brief(&deadlines));
        deadlines
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_transports::DeadlineBasis;
    use std::time::Duration;

    #[test]
    fn deadlines_are_summed_up_per_link_and_in_brief() {
        let d = |ms: u64, basis| DeadlineInForce {
            value: Duration::from_millis(ms),
            basis,
            smoothed: Duration::ZERO,
            variation: Duration::ZERO,
            peak: Duration::ZERO,
            samples: 0,
        };
        let same = [(1, d(250, DeadlineBasis::Floor)), (2, d(250, DeadlineBasis::Floor))];
        assert_eq!(deadline_summary(&same), "1:250:floor,2:250:floor");
        assert_eq!(deadline_brief(&same), "250 ms floor");
        let mixed = [(0, d(480, DeadlineBasis::Learned)), (2, d(250, DeadlineBasis::Floor))];
        assert_eq!(deadline_brief(&mixed), "250-480 ms floor/learned");
        assert_eq!(deadline_brief(&[]), "");
    }
}
