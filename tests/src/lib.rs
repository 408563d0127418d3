//! Shared helpers for the multi-process integration tests (spawning binaries, free ports, temp dirs).
