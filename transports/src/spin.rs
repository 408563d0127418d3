//! How a waiting side spends the time before it parks, and how it parks: shared by the TCP
//! and the shared-memory links.
//!
//! # Why not yield
//! A link that finds nothing to read spins for a short window before it parks, because a
//! peer that is running answers within microseconds and a park and wake-up costs more than
//! that. Until issue 31 each turn of the spin called `sched_yield`. Under the kernel's EEVDF
//! scheduler a yield pushes the caller's virtual deadline back by a whole slice, so beside a
//! CPU-bound neighbour (a DataLoader worker, an intra-op thread, another job) every yield
//! handed the core to the neighbour until the next tick: 4 ms at `HZ=250`. A 4 KiB allreduce
//! that waits a few times took 4 to 8 ms instead of 4 us.
//!
//! So a turn of the spin no longer yields ([`Turn::Spin`]: the CPU's pause hint), *unless*
//! the host runs more ranks than it has CPUs ([`spin_or_yield`]: then whatever a thread spins
//! on, some rank that needs its CPU waits; Open MPI yields when oversubscribed too), or the
//! peer it waits for last ran on this very CPU ([`turn`]): then the peer cannot be
//! running (this thread holds the CPU), spinning would only keep it off, and the turn yields
//! as before ([`Turn::Yield`]; with more ranks than cores, or two unbound ranks the scheduler
//! packed onto one CPU). The shared-memory rings carry each side's CPU (`crate::shm::ring`).
//! A TCP link always keeps the CPU: its peer is on another host, or on this one only when
//! shared memory was turned off (`--transport tcp`), and the socket cannot say where the peer
//! runs (`SO_INCOMING_CPU` was tried: on loopback the ACKs of this side's own sends are
//! processed on this CPU, so it named this CPU for a peer bound to the other one and made the
//! spin yield; 64 KiB beside two CPU-bound processes took 2.6 to 10 ms instead of 0.1 ms).
//!
//! # Waking up in time
//! A parked thread (past the window, or a peer that is away) is woken by the peer's doorbell
//! or bytes. EEVDF lets a waking task preempt the running one only if its virtual deadline is
//! earlier, and it protects the running task's slice: a woken rank waited behind a CPU-bound
//! neighbour for the rest of its slice. A thread that parks on a link therefore asks, once,
//! for the shortest slice the kernel gives a normal task (`sched_setattr` with
//! `sched_runtime`, 0.1 ms, Linux 6.12 and later; unprivileged; [`prefer_short_slice`]).
//! Its share of the CPU is unchanged (that is its weight, its nice value); a short slice
//! gives it an earlier deadline, so its wake-ups preempt a neighbour at once instead of a
//! slice later. Older kernels ignore the request; it is made once per thread and a failure is
//! only logged.

use std::cell::Cell;

/// What one turn of a spin does between looks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Turn {
    /// Keep the CPU: the CPU's spin-wait hint, a few times.
    Spin,
    /// Give the CPU away (`sched_yield`): the peer waits for it.
    Yield,
}

/// How a turn should be spent, given the CPU the peer last ran on and the one this thread
/// runs on (either unknown: `None`). Only a peer known to share this CPU makes it yield.
pub(crate) fn turn(peer_cpu: Option<u32>, this_cpu: Option<u32>) -> Turn {
    match (peer_cpu, this_cpu) {
        (Some(p), Some(me)) if p == me => Turn::Yield,
        _ => Turn::Spin,
    }
}

/// How a turn of a shared-memory wait is spent: yield on an oversubscribed host (more ranks
/// than CPUs: whatever this thread spins on, some rank that needs this CPU waits for it, as
/// Open MPI yields when oversubscribed), else as [`turn`] says.
pub(crate) fn spin_or_yield(oversubscribed: bool, peer_cpu: Option<u32>, this_cpu: Option<u32>) -> Turn {
    if oversubscribed {
        Turn::Yield
    } else {
        turn(peer_cpu, this_cpu)
    }
}

/// Whether `local_ranks` rank processes on this host outnumber its online CPUs. Not the
/// process's own affinity: a rank bound to one CPU, beside peers bound to the others (as
/// `bench` and Open MPI bind), is not oversubscribed; ranks packed onto fewer CPUs than they
/// are are caught per wait by [`turn`].
pub(crate) fn oversubscribed(local_ranks: usize) -> bool {
    // SAFETY: sysconf has no preconditions.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    local_ranks > usize::try_from(online).unwrap_or(1).max(1)
}

/// Spends one turn as `t` says.
pub(crate) fn spend(t: Turn) {
    match t {
        Turn::Spin => {
            for _ in 0..PAUSES_PER_TURN {
                std::hint::spin_loop();
            }
        }
        Turn::Yield => std::thread::yield_now(),
    }
}

/// Spin-wait hints per spinning turn: short enough (well under a microsecond) that a look
/// follows soon after the data lands.
const PAUSES_PER_TURN: u32 = 16;

/// The CPU this thread runs on now (glibc reads it from rseq: no system call), if known.
pub(crate) fn this_cpu() -> Option<u32> {
    // SAFETY: sched_getcpu has no preconditions.
    let c = unsafe { libc::sched_getcpu() };
    u32::try_from(c).ok()
}

/// A CPU number as stored in a shared word: 0 means unknown, otherwise the CPU plus one.
pub(crate) fn encode_cpu(cpu: Option<u32>) -> u32 {
    cpu.map_or(0, |c| c.saturating_add(1))
}

/// The inverse of [`encode_cpu`].
pub(crate) fn decode_cpu(word: u32) -> Option<u32> {
    word.checked_sub(1)
}

/// The shortest slice a normal task may ask for (the kernel clamps to 0.1..=100 ms).
const SHORT_SLICE_NS: u64 = 100_000;

thread_local! {
    static SLICE_ASKED: Cell<bool> = const { Cell::new(false) };
}

/// Asks once per thread for the shortest EEVDF slice (see the module docs), keeping the
/// thread's policy and nice value. Only normal (`SCHED_OTHER`/`SCHED_BATCH`) threads are
/// touched. Errors (an old kernel, a seccomp filter) are logged at debug level and not
/// retried.
pub(crate) fn prefer_short_slice() {
    if SLICE_ASKED.with(|a| a.replace(true)) {
        return;
    }
    if let Err(e) = set_short_slice() {
        tracing::debug!(error = %e, "could not ask for a short scheduler slice; wake-ups may wait behind CPU-bound neighbours");
    }
}

/// `struct sched_attr` as of Linux 3.14 (`SCHED_ATTR_SIZE_VER0`, 48 bytes).
#[repr(C)]
#[derive(Default)]
struct SchedAttr {
    size: u32,
    policy: u32,
    flags: u64,
    nice: i32,
    priority: u32,
    runtime: u64,
    deadline: u64,
    period: u64,
}

const SCHED_OTHER: u32 = 0;
const SCHED_BATCH: u32 = 3;

#[cfg(target_os = "linux")]
fn set_short_slice() -> std::io::Result<()> {
    let size = std::mem::size_of::<SchedAttr>() as u32;
    let mut attr = SchedAttr::default();
    // SAFETY: attr is a writable sched_attr of `size` bytes; pid 0 is this thread.
    if unsafe { libc::syscall(libc::SYS_sched_getattr, 0, &mut attr as *mut SchedAttr, size, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if attr.policy != SCHED_OTHER && attr.policy != SCHED_BATCH {
        return Ok(());
    }
    if attr.runtime == SHORT_SLICE_NS {
        return Ok(());
    }
    // Same policy, nice and flags; only the slice changes.
    attr.size = size;
    attr.flags = 0;
    attr.runtime = SHORT_SLICE_NS;
    // SAFETY: attr is a valid sched_attr of `size` bytes; pid 0 is this thread.
    if unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn set_short_slice() -> std::io::Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_peer_on_this_cpu_makes_the_spin_yield() {
        assert_eq!(turn(Some(1), Some(1)), Turn::Yield);
        assert_eq!(turn(Some(0), Some(1)), Turn::Spin);
        assert_eq!(turn(None, Some(1)), Turn::Spin);
        assert_eq!(turn(Some(1), None), Turn::Spin);
        assert_eq!(turn(None, None), Turn::Spin);
    }

    #[test]
    fn an_oversubscribed_host_always_yields() {
        assert_eq!(spin_or_yield(true, Some(0), Some(1)), Turn::Yield);
        assert_eq!(spin_or_yield(true, None, None), Turn::Yield);
        assert_eq!(spin_or_yield(false, Some(0), Some(1)), Turn::Spin);
        assert_eq!(spin_or_yield(false, Some(1), Some(1)), Turn::Yield);
        // SAFETY: as in oversubscribed.
        let cpus = usize::try_from(unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }).unwrap().max(1);
        assert!(!oversubscribed(1));
        assert!(!oversubscribed(cpus));
        assert!(oversubscribed(cpus + 1));
    }

    #[test]
    fn cpu_words_round_trip_and_zero_is_unknown() {
        assert_eq!(decode_cpu(0), None);
        for c in [0, 1, 7, 1023] {
            assert_eq!(decode_cpu(encode_cpu(Some(c))), Some(c));
        }
        assert_eq!(encode_cpu(None), 0);
    }

    #[test]
    fn this_thread_gets_the_short_slice_and_keeps_its_nice_value() {
        std::thread::spawn(|| {
            // SAFETY: setpriority on this thread (who = 0) with a higher nice is always allowed.
            assert_eq!(unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 3) }, 0);
            prefer_short_slice();
            let mut attr = SchedAttr::default();
            let size = std::mem::size_of::<SchedAttr>() as u32;
            // SAFETY: as in set_short_slice.
            let rc = unsafe { libc::syscall(libc::SYS_sched_getattr, 0, &mut attr as *mut SchedAttr, size, 0) };
            assert_eq!(rc, 0);
            assert_eq!(attr.nice, 3, "the nice value must be kept");
            // Kernels before 6.12 have no custom slice for normal tasks and report their own.
            let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
            let mut v = release.split(['.', '-']).map(|p| p.parse::<u32>().unwrap_or(0));
            let (major, minor) = (v.next().unwrap_or(0), v.next().unwrap_or(0));
            if (major, minor) >= (6, 12) {
                assert_eq!(attr.runtime, SHORT_SLICE_NS);
            }
        })
        .join()
        .unwrap();
    }
}
