//! cohort: elastic, fault-tolerant collectives.
