//! cohort-proto: generated code for coordinator.proto.
