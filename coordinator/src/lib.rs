//! cohort-coordinator: the control plane.

pub mod store;
