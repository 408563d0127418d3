//! cohort: elastic, fault-tolerant collectives for data-parallel training.

pub mod control;
