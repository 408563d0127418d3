//! The coordinator's wall clock under simulation: turmoil's logical time since the epoch,
//! plus the clock jumps the fault schedule injects.

use std::cell::Cell;

thread_local! {
    /// The current jump of the replicas' wall clock, in milliseconds (the simulation runs on
    /// one thread, so this is per simulation).
    static JUMP_MS: Cell<i64> = const { Cell::new(0) };
}

/// Installs the simulated wall clock behind `cohort_coordinator::records::now_ms` (once per
/// process; later calls change nothing).
pub(crate) fn install() {
    let _ = cohort_coordinator::records::set_wall_clock(simulated_now_ms);
}

/// Sets the jump (every replica's wall clock moves by it at once).
pub(crate) fn set_jump_ms(jump: i64) {
    JUMP_MS.with(|j| j.set(jump));
}

fn simulated_now_ms() -> u64 {
    let base = match turmoil::since_epoch() {
        Some(d) => d.as_millis() as u64,
        // Outside a host (the driver): the system clock, as the coordinator would read.
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0),
    };
    base.saturating_add_signed(JUMP_MS.with(Cell::get))
}
