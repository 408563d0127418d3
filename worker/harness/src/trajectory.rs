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

/// Elements per block of the checking loops.
const BLOCK: usize = 4096;

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

/// Where [`Trajectory::apply`] found a difference.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StepMismatch<E> {
    /// The reduced gradient differs from the target at `index`.
    Sum {
        /// First wrong element.
        index: usize,
        /// The target there.
        expected: E,
    },
    /// The parameters after the step differ from the expected ones at `index`.
    Params {
        /// First wrong element.
        index: usize,
        /// The expected parameter there.
        expected: E,
    },
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

    /// The expected parameter after the steps of `c`, as a function of an element's term
    /// `v(j)` (an integer in `0..M`; 32-bit arithmetic suffices, as `M` divides 2^32).
    fn expected_at(&self, c: Coefficients) -> impl Fn(u32) -> i32 + Copy {
        let (u, w, mask) = (c.u as u32, c.w as u32, self.mask as u32);
        move |offset| (u.wrapping_add(offset.wrapping_mul(w)) & mask) as i32
    }

    /// The parameters every worker must hold after `step` steps.
    pub fn expected_params<E: ExactElement>(&self, step: u64) -> Vec<E> {
        let at = self.expected_at(Self::coefficients(step, self.mask));
        self.offsets.iter().map(|&v| E::from_i32(at(v))).collect()
    }

    /// The first parameter that differs from its expected value after `step` steps, with
    /// that value. `params` of another length differ at `min(len)`.
    pub fn first_param_mismatch<E: ExactElement>(&self, params: &[E], step: u64) -> Option<(usize, E)> {
        let at = self.expected_at(Self::coefficients(step, self.mask));
        let want = |v: u32| E::from_i32(at(v));
        for (block, (ps, vs)) in params.chunks(BLOCK).zip(self.offsets.chunks(BLOCK)).enumerate() {
            // Branch-free over the block (so it vectorises); searched only if it differs.
            if !ps.iter().zip(vs).fold(true, |ok, (p, &v)| ok & (*p == want(v))) {
                let i = ps.iter().zip(vs).position(|(p, &v)| *p != want(v)).unwrap_or(0);
                return Some((block * BLOCK + i, want(vs[i])));
            }
        }
        (params.len() != self.len()).then(|| {
            let j = params.len().min(self.len());
            (j, self.offsets.get(j).map_or(E::from_i32(0), |&v| want(v)))
        })
    }

    /// The target `G` of step `step` as a function of a parameter's value and its element's
    /// term `v(j)`, with the step's term computed once.
    fn step_target(&self, step: u64) -> impl Fn(i32, u32) -> i32 + Copy {
        let (u, mask) = ((step_term(step) & self.mask) as u32, self.mask as u32);
        move |param, offset| {
            let next = (A as u32).wrapping_mul(param as u32).wrapping_add(u).wrapping_add(offset) & mask;
            (next as i32).wrapping_sub(param)
        }
    }

    /// The reduced gradient of step `step` expected at element `j`, given this rank's
    /// parameters.
    ///
    /// # Panics
    /// If `j` is out of range of `params` or of the trajectory.
    pub fn expected_sum<E: ExactElement>(&self, params: &[E], step: u64, j: usize) -> E {
        E::from_i32(self.step_target(step)(params[j].to_i32(), self.offsets[j]))
    }

    /// Fills `out` with rank `rank`'s contribution to step `step` in a world of `world`:
    /// [`Pattern`]'s value for ranks above 0, the target minus theirs for rank 0.
    pub fn fill<E: ExactElement>(&self, params: &[E], step: u64, rank: u32, world: u32, out: &mut [E]) {
        let pattern = Pattern::new(step, world);
        if rank == 0 {
            let target = self.step_target(step);
            for (j, ((x, p), &v)) in out.iter_mut().zip(params).zip(&self.offsets).enumerate() {
                *x = E::from_i32(target(p.to_i32(), v).wrapping_sub(pattern.sum_without_rank0(j) as i32));
            }
        } else {
            pattern.fill(rank, out);
        }
    }

    /// Step `step`, block by block: checks each element of the reduced gradient `sum` against
    /// the target for `params`, adds it, and checks the new parameter against the one
    /// expected after `step + 1` steps. On a difference, `params` is left partly updated
    /// (the caller stops).
    pub fn apply<E: ExactElement>(&self, params: &mut [E], sum: &[E], step: u64) -> Result<(), StepMismatch<E>> {
        if sum.len() != params.len() || sum.len() != self.len() {
            let index = sum.len().min(params.len()).min(self.len());
            return Err(StepMismatch::Sum { index, expected: E::from_i32(0) });
        }
        let target = self.step_target(step);
        let sum_of = |p: &E, v: u32| E::from_i32(target(p.to_i32(), v));
        let at = self.expected_at(Self::coefficients(step + 1, self.mask));
        let after = |v: u32| E::from_i32(at(v));
        let blocks = params.chunks_mut(BLOCK).zip(sum.chunks(BLOCK)).zip(self.offsets.chunks(BLOCK));
        for (block, ((ps, ss), vs)) in blocks.enumerate() {
            // Each pass is branch-free over the block (so it vectorises); a block that differs
            // is searched for the first wrong element.
            let sums_ok = ps.iter().zip(ss).zip(vs).fold(true, |ok, ((p, s), &v)| ok & (*s == sum_of(p, v)));
            if !sums_ok {
                let i = ps.iter().zip(ss).zip(vs).position(|((p, s), &v)| *s != sum_of(p, v)).unwrap_or(0);
                return Err(StepMismatch::Sum { index: block * BLOCK + i, expected: sum_of(&ps[i], vs[i]) });
            }
            let params_ok = ps.iter_mut().zip(ss).zip(vs).fold(true, |ok, ((p, s), &v)| {
                *p = p.add(*s);
                ok & (*p == after(v))
            });
            if !params_ok {
                let i = ps.iter().zip(vs).position(|(p, &v)| *p != after(v)).unwrap_or(0);
                return Err(StepMismatch::Params { index: block * BLOCK + i, expected: after(vs[i]) });
            }
        }
        Ok(())
    }

    /// The first element of the reduced gradient `sum` that differs from the target of step
    /// `step` for these parameters.
    pub fn first_sum_mismatch<E: ExactElement>(&self, params: &[E], step: u64, sum: &[E]) -> Option<usize> {
        if sum.len() != params.len() || sum.len() != self.len() {
            return Some(sum.len().min(params.len()).min(self.len()));
        }
        let target = self.step_target(step);
        sum.iter().zip(params).zip(&self.offsets).position(|((s, p), &v)| *s != E::from_i32(target(p.to_i32(), v)))
    }
}

/// SHA-256 of the parameters' bytes, in hex (what `train` prints as `params_digest`).
pub fn params_digest<E: ExactElement>(params: &[E]) -> String {
    Sha256::digest(cohort::as_bytes(params)).iter().map(|b| format!("{b:02x}")).collect()
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
    fn apply_checks_the_sum_then_the_parameters_in_one_pass() {
        let t = Trajectory::new::<f32>(50);
        let sum_for = |params: &[f32], step: u64| {
            let mut ranks = vec![params.to_vec(); 3];
            let mut sum = vec![0f32; 50];
            let mut buf = vec![0f32; 50];
            for (r, p) in ranks.iter_mut().enumerate() {
                t.fill(p, step, r as u32, 3, &mut buf);
                sum.iter_mut().zip(&buf).for_each(|(s, b)| *s += b);
            }
            sum
        };
        let mut params = t.expected_params::<f32>(6);
        let sum = sum_for(&params, 6);
        assert_eq!(t.apply(&mut params, &sum, 6), Ok(()));
        assert_eq!(params, t.expected_params::<f32>(7));
        // A wrong element of the sum.
        let mut params = t.expected_params::<f32>(6);
        let mut wrong = sum.clone();
        wrong[9] += 1.0;
        assert!(matches!(t.apply(&mut params, &wrong, 6), Err(StepMismatch::Sum { index: 9, .. })));
        // Parameters of step 5 taken for step 6 (the sum is right for them): the result is not step 7's.
        let mut stale = t.expected_params::<f32>(5);
        let sum = sum_for(&stale, 6);
        assert!(matches!(t.apply(&mut stale, &sum, 6), Err(StepMismatch::Params { .. })));
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
