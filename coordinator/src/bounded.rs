//! Keeping per-job and per-worker caches of a replica within a fixed size, whatever the rate
//! at which jobs and workers come and go (a soak with thousands of jobs and churned workers
//! showed caches bounded only by a time window growing for as long as the window).

use std::collections::HashMap;
use std::hash::Hash;
use std::time::Duration;
use tokio::time::Instant;

/// Makes room in `map` for one more entry under `cap`: drops the entries idle for `idle`
/// (by `touched`), then, while still full, the least recently touched eighth of `cap` (at
/// least one entry) in one pass. A map already below `cap` is left alone (the common case
/// costs one comparison).
///
/// Evicting an eighth at once keeps the cost amortised O(1) per insertion when more keys
/// than `cap` are in use (a job of more members than the progress cache holds): evicting
/// one entry per insertion cost O(cap) per insertion, O(N x cap) for N members.
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
    let cap = cap.max(1);
    if map.len() < cap {
        return;
    }
    let excess = map.len() + 1 - cap;
    let evict = excess.max(cap / 8).min(map.len());
    let mut ages: Vec<(Instant, K)> = map.iter().map(|(k, v)| (touched(v), k.clone())).collect();
    if evict < ages.len() {
        ages.select_nth_unstable_by_key(evict, |(t, _)| *t);
    }
    for (_, k) in ages.iter().take(evict) {
        map.remove(k);
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

    #[test]
    fn a_full_map_sheds_its_oldest_eighth_at_once() {
        let start = Instant::now();
        let mut m: HashMap<u32, Instant> = (0..64).map(|i| (i, start + Duration::from_millis(i as u64))).collect();
        make_room(&mut m, 64, Duration::from_secs(60), start, |t| *t);
        assert_eq!(m.len(), 56, "an eighth of the cap went");
        assert!((0..8).all(|i| !m.contains_key(&i)), "the eight least recently touched");
        assert!((8..64).all(|i| m.contains_key(&i)));
        // Below the cap again: the next insertions cost nothing until it is full.
        make_room(&mut m, 64, Duration::from_secs(60), start, |t| *t);
        assert_eq!(m.len(), 56);
    }
}
