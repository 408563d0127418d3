//! cohort-chaos: fault injection.
