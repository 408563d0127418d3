//! Keeping per-job and per-worker caches of a replica within a fixed size, whatever the rate
//! at which jobs and workers come and go (a soak with thousands of jobs and churned workers
//! showed caches bounded only by a time window growing for as long as the window).

use std::collections::HashMap;
use std::hash::Hash;
use std::time::Duration;
use tokio::time::Instant;

/// Makes room in `map` for one more entry under `cap`: drops the entries idle for `idle`
/// (by `touched`), then, while still full, the least recently touched one. A map already
/// below `cap` is left alone (the common case costs one comparison).
pub(crate) fn make_room<K: Eq + Hash + Clone, V>(
    map: &mut HashMap<K, V>,
    cap: usize,
    idle: Duration,
    now: Instant,
    touched: impl Fn(&V) -> Instant,
) {
    if map.len() < cap {
        return;
    }
    map.retain(|_, v| now.saturating_duration_since(touched(v)) < idle);
    while map.len() >= cap.max(1) {
        let Some(oldest) = map.iter().min_by_key(|(_, v)| touched(v)).map(|(k, _)| k.clone()) else { return };
        map.remove(&oldest);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_is_made_from_the_idle_then_the_oldest() {
        let start = Instant::now();
        let mut m: HashMap<u32, Instant> = (0..4).map(|i| (i, start + Duration::from_secs(i as u64))).collect();
        make_room(&mut m, 8, Duration::from_secs(60), start, |t| *t);
        assert_eq!(m.len(), 4, "below the cap nothing goes");
        make_room(&mut m, 4, Duration::from_secs(60), start + Duration::from_secs(3), |t| *t);
        assert_eq!(m.len(), 3);
        assert!(!m.contains_key(&0), "the least recently touched went");
        make_room(&mut m, 3, Duration::from_millis(500), start + Duration::from_secs(3), |t| *t);
        assert_eq!(m.keys().copied().collect::<std::collections::BTreeSet<_>>(), [3].into(), "idle ones first");
    }
}
