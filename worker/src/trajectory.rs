//! The parameters `cohort-worker train` trains, and the sums that move them: a trajectory
//! every worker computes for any step on its own, whatever world sizes the job went through.
//!
//! Parameters are integers in `0..M` (`M` = [`ExactElement::PARAM_MODULUS`], a power of two).
//! Step `s` moves element `j` from `p` to
//!
//! ```text
//! next(p, s, j) = (A·p + u(s) + v(j)) mod M        (A odd, u and v hashes)
//! ```
//!
//! so the allreduce of step `s` must produce the target `G = next(p, s, j) - p`, which depends
//! on the parameters, the step and the element, and not on the world size: ranks `1..n`
//! contribute [`Pattern`]'s per-rank values and rank 0 contributes `G` minus their sum. The
//! reduced gradient is checked element-wise against `G` (a missing, duplicated or displaced
//! contribution still shows), then added to the parameters.
//!
//! Because `A` is odd, `next` is a bijection of `p`: parameters that are wrong before a step
//! (a restore of an older commit, a sync that skipped a rank) stay wrong after it. And the
//! expected parameters after `s` steps from zero have a closed form,
//! `p_s(j) = (U(s) + v(j)·W(s)) mod M` with `U(s+1) = A·U(s) + u(s)`, `W(s+1) = A·W(s) + 1`,
//! so every worker checks its parameters after each sync, restore and commit and at the end in
//! one pass, without replaying the job's history. A lost or repeated step, or the previous
//! commit restored as the current one, leaves parameters that differ from `p_s`.

use crate::exact::{ExactElement, Pattern};
use sha2::{Digest, Sha256};

/// Multiplier of the recurrence (odd, so a step is a bijection of the parameter).
const A: u64 = 5;

/// splitmix64's finaliser.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The per-step term `u(s)`.
fn step_term(step: u64) -> u64 {
    mix(step.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5851_F42D_4C95_7F2D)
}

/// The trajectory of one parameter vector: its length, modulus and per-element terms `v(j)`.
#[derive(Clone, Debug)]
pub struct Trajectory {
    mask: u64,
    offsets: Vec<u32>,
}

/// `U(s)` and `W(s)` of the closed form, modulo 2^64 (`M` divides 2^64).
#[derive(Clone, Copy, Debug)]
struct Coefficients {
    u: u64,
    w: u64,
}

impl Trajectory {
    /// The trajectory of `count` parameters of type `E`.
    pub fn new<E: ExactElement>(count: usize) -> Self {
        let mask = E::PARAM_MODULUS - 1;
        let offsets =
            (0..count).map(|j| (mix((j as u64).wrapping_mul(0xD1B5_4A32_D192_ED03) ^ 0x2545) & mask) as u32).collect();
        Self { mask, offsets }
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        self.offsets.len()
    }

    /// Whether there are no parameters.
    pub fn is_empty(&self) -> bool {
        self.offsets.is_empty()
    }

    /// Whether `E` holds every partial sum of a step exactly in a world of `world` ranks: the
    /// largest is bounded by `M` plus twice the sum of the other ranks' contributions.
    /// Wrapping integer types are exact modulo 2^bits, which is all a step needs.
    pub fn check_exact<E: ExactElement>(world: u32) -> Result<(), String> {
        let bound = E::PARAM_MODULUS.saturating_add(Pattern::new(0, world).max_sum().saturating_mul(2));
        if E::WRAPS || bound <= E::EXACT_LIMIT {
            Ok(())
        } else {
            Err(format!("{} cannot hold the exact sums of {world} ranks; use f32/f64/i32/i64 or fewer ranks", E::NAME))
        }
    }

    fn coefficients(step: u64, mask: u64) -> Coefficients {
        let mut c = Coefficients { u: 0, w: 0 };
        for s in 0..step {
            c.u = A.wrapping_mul(c.u).wrapping_add(step_term(s) & mask);
            c.w = A.wrapping_mul(c.w).wrapping_add(1);
        }
        c
    }

    /// The expected parameter `j` after `step` steps, as an integer in `0..M`.
    fn expected_int(&self, c: Coefficients, j: usize) -> u64 {
        c.u.wrapping_add(u64::from(self.offsets[j]).wrapping_mul(c.w)) & self.mask
    }

    /// The parameters every worker must hold after `step` steps.
    pub fn expected_params<E: ExactElement>(&self, step: u64) -> Vec<E> {
        let c = Self::coefficients(step, self.mask);
        (0..self.len()).map(|j| E::from_int(self.expected_int(c, j) as i64)).collect()
    }

    /// The first parameter that differs from its expected value after `step` steps, with
    /// that value. `params` of another length differ at `min(len)`.
    pub fn first_param_mismatch<E: ExactElement>(&self, params: &[E], step: u64) -> Option<(usize, E)> {
        let c = Self::coefficients(step, self.mask);
        let found = params
            .iter()
            .zip(0..self.len())
            .map(|(p, j)| (j, *p, E::from_int(self.expected_int(c, j) as i64)))
            .find(|(_, got, want)| got != want)
            .map(|(j, _, want)| (j, want));
        found.or_else(|| {
            (params.len() != self.len()).then(|| {
                let j = params.len().min(self.len());
                (j, E::from_int(if j < self.len() { self.expected_int(c, j) as i64 } else { 0 }))
            })
        })
    }

    /// The target `G` at element `j` of step `step` for a parameter holding `param`.
    fn target(&self, param: i64, step: u64, j: usize) -> i64 {
        let next = A
            .wrapping_mul(param as u64)
            .wrapping_add(step_term(step) & self.mask)
            .wrapping_add(u64::from(self.offsets[j]))
            & self.mask;
        next as i64 - param
    }

    /// The reduced gradient of step `step` expected at element `j`, given this rank's
    /// parameters.
    pub fn expected_sum<E: ExactElement>(&self, params: &[E], step: u64, j: usize) -> E {
        E::from_int(self.target(params[j].to_int(), step, j))
    }

    /// Fills `out` with rank `rank`'s contribution to step `step` in a world of `world`:
    /// [`Pattern`]'s value for ranks above 0, the target minus theirs for rank 0.
    pub fn fill<E: ExactElement>(&self, params: &[E], step: u64, rank: u32, world: u32, out: &mut [E]) {
        let pattern = Pattern::new(step, world);
        if rank == 0 {
            for (j, (x, p)) in out.iter_mut().zip(params).enumerate() {
                *x = E::from_int(self.target(p.to_int(), step, j) - pattern.sum_without_rank0(j) as i64);
            }
        } else {
            pattern.fill(rank, out);
        }
    }

    /// The first element of the reduced gradient `sum` that differs from the target of step
    /// `step` for these parameters.
    pub fn first_sum_mismatch<E: ExactElement>(&self, params: &[E], step: u64, sum: &[E]) -> Option<usize> {
        if sum.len() != params.len() || sum.len() != self.len() {
            return Some(sum.len().min(params.len()).min(self.len()));
        }
        (0..sum.len()).find(|&j| sum[j] != self.expected_sum(params, step, j))
    }
}

/// SHA-256 of the parameters' bytes, in hex (what `train` prints as `params_digest`).
pub fn params_digest<E: ExactElement>(params: &[E]) -> String {
    Sha256::digest(crate::dtype::as_bytes(params)).iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One step as a job of `world` ranks runs it: every rank fills its contribution from its
    /// own parameters, the contributions are summed, every rank checks the sum against its
    /// own target and adds it. Returns each rank's verdict (first wrong element).
    fn step_ranks<E: ExactElement>(t: &Trajectory, ranks: &mut [Vec<E>], step: u64) -> Vec<Option<usize>> {
        let world = ranks.len() as u32;
        let mut sum = vec![E::from_int(0); t.len()];
        let mut buf = vec![E::from_int(0); t.len()];
        for (r, params) in ranks.iter().enumerate() {
            t.fill(params, step, r as u32, world, &mut buf);
            sum.iter_mut().zip(&buf).for_each(|(s, b)| *s = s.add(*b));
        }
        let verdicts: Vec<Option<usize>> = ranks.iter().map(|p| t.first_sum_mismatch(p, step, &sum)).collect();
        for params in ranks.iter_mut() {
            params.iter_mut().zip(&sum).for_each(|(p, s)| *p = p.add(*s));
        }
        verdicts
    }

    fn world_of<E: ExactElement>(params: &[E], n: usize) -> Vec<Vec<E>> {
        vec![params.to_vec(); n]
    }

    /// Runs steps `from..to` in a world of `n` ranks starting from `params`; every rank's sum
    /// and parameters must verify at every step.
    fn run_steps<E: ExactElement>(t: &Trajectory, params: Vec<E>, from: u64, to: u64, n: usize) -> Vec<E> {
        let mut ranks = world_of(&params, n);
        for s in from..to {
            assert!(step_ranks(t, &mut ranks, s).iter().all(Option::is_none), "step {s} of {n} ranks");
            for p in &ranks {
                assert_eq!(t.first_param_mismatch(p, s + 1), None, "{} after step {s} of {n} ranks", E::NAME);
            }
        }
        ranks.swap_remove(0)
    }

    fn world_independent<E: ExactElement>() {
        let t = Trajectory::new::<E>(97);
        let zero = vec![E::from_int(0); 97];
        assert_eq!(t.first_param_mismatch(&zero, 0), None);
        // Generations of 3, 1 and 5 ranks end where one rank alone ends, and where the closed form says.
        let a = run_steps(&t, zero.clone(), 0, 7, 3);
        let a = run_steps(&t, a, 7, 9, 1);
        let a = run_steps(&t, a, 9, 20, 5);
        let b = run_steps(&t, zero, 0, 20, 1);
        assert_eq!(params_digest(&a), params_digest(&b));
        assert_eq!(params_digest(&a), params_digest(&t.expected_params::<E>(20)));
    }

    #[test]
    fn the_trajectory_does_not_depend_on_world_sizes() {
        world_independent::<f32>();
        world_independent::<f64>();
        world_independent::<i32>();
        world_independent::<i64>();
        world_independent::<u8>();
        world_independent::<half::f16>();
        world_independent::<half::bf16>();
    }

    #[test]
    fn parameters_change_every_step_and_differ_between_steps() {
        let t = Trajectory::new::<f32>(64);
        let steps: Vec<Vec<f32>> = (0..30).map(|s| t.expected_params(s)).collect();
        for s in 1..steps.len() {
            for earlier in 0..s {
                assert_ne!(steps[s], steps[earlier], "step {s} equals step {earlier}");
            }
        }
    }

    #[test]
    fn a_restore_of_the_previous_commit_is_caught() {
        let t = Trajectory::new::<f32>(256);
        // The state of step 11 restored as if it were the commit of step 12.
        let previous = t.expected_params::<f32>(11);
        assert!(t.first_param_mismatch(&previous, 12).is_some());
        // And had it gone unchecked, every later step stays wrong.
        let mut ranks = vec![previous];
        step_ranks(&t, &mut ranks, 12);
        assert!(t.first_param_mismatch(&ranks[0], 13).is_some());
    }

    #[test]
    fn a_lost_or_repeated_step_is_caught() {
        let t = Trajectory::new::<i32>(256);
        let at5 = t.expected_params::<i32>(5);
        // Lost: the step counter moved on without the update.
        assert!(t.first_param_mismatch(&at5, 6).is_some());
        // Repeated: step 5 applied twice.
        let mut ranks = vec![at5.clone()];
        step_ranks(&t, &mut ranks, 5);
        assert_eq!(t.first_param_mismatch(&ranks[0], 6), None);
        step_ranks(&t, &mut ranks, 5);
        assert!(t.first_param_mismatch(&ranks[0], 7).is_some());
    }

    #[test]
    fn a_sync_that_skips_a_rank_is_caught_by_every_check() {
        let t = Trajectory::new::<f64>(128);
        let good = t.expected_params::<f64>(8);
        // Rank 2 of 3 (a joiner) never received the broadcast: it holds the initial zeros.
        let mut ranks = vec![good.clone(), good.clone(), vec![0.0; 128]];
        assert!(t.first_param_mismatch(&ranks[2], 8).is_some());
        // Unchecked, its own sum check fails (the target depends on the parameters) ...
        let verdicts = step_ranks(&t, &mut ranks, 8);
        assert_eq!(&verdicts[..2], &[None, None]);
        assert!(verdicts[2].is_some());
        // ... and when rank 0 is the stale one, every other rank sees a wrong sum.
        let mut ranks = vec![t.expected_params::<f64>(7), good.clone(), good];
        let verdicts = step_ranks(&t, &mut ranks, 8);
        assert!(verdicts[1].is_some() && verdicts[2].is_some());
    }

    #[test]
    fn a_missing_duplicated_or_displaced_contribution_is_caught() {
        let t = Trajectory::new::<f32>(64);
        let params = t.expected_params::<f32>(3);
        let world = 4;
        let fill = |r: u32| {
            let mut b = vec![0f32; 64];
            t.fill(&params, 3, r, world, &mut b);
            b
        };
        let sum_of = |ranks: &[u32]| {
            let mut s = vec![0f32; 64];
            for &r in ranks {
                s.iter_mut().zip(fill(r)).for_each(|(a, b)| *a += b);
            }
            s
        };
        assert_eq!(t.first_sum_mismatch(&params, 3, &sum_of(&[0, 1, 2, 3])), None);
        assert!(t.first_sum_mismatch(&params, 3, &sum_of(&[0, 1, 2])).is_some());
        assert!(t.first_sum_mismatch(&params, 3, &sum_of(&[0, 1, 2, 2])).is_some());
        let mut swapped = sum_of(&[0, 1, 2, 3]);
        let (a, b) = swapped.split_at_mut(16);
        a.swap_with_slice(&mut b[..16]);
        assert!(t.first_sum_mismatch(&params, 3, &swapped).is_some());
    }

    #[test]
    fn exactness_bounds_follow_the_type() {
        assert!(Trajectory::check_exact::<f32>(1000).is_ok());
        assert!(Trajectory::check_exact::<u8>(1000).is_ok());
        assert!(Trajectory::check_exact::<half::bf16>(6).is_ok());
        assert!(Trajectory::check_exact::<half::bf16>(7).is_err());
        assert!(Trajectory::check_exact::<half::f16>(8).is_ok());
    }
}
