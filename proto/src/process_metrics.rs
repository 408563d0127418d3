//! Process gauges in the Prometheus text format, shown by every cohort binary's `/metrics`
//! (coordinator and worker alike), so that a soak can show memory, descriptors and tasks
//! staying flat (docs/testing.md, "Nothing leaks over time").

use std::fmt::Write as _;

/// This process's resident memory in bytes (`/proc/self/statm`), if readable.
pub fn resident_memory_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).ok().map(|page| pages * page)
}

/// This process's open file descriptors (entries of `/proc/self/fd`), if readable.
pub fn open_fds() -> Option<u64> {
    Some(std::fs::read_dir("/proc/self/fd").ok()?.count() as u64)
}

/// CPU time this process has used, user and system together, in seconds
/// (`/proc/self/stat`), if readable.
pub fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from its end.
    let after_name = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_name.split_whitespace();
    // Fields 3.. follow the name; utime and stime are fields 14 and 15.
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let ticks = u64::try_from(ticks).ok().filter(|t| *t > 0)?;
    Some((utime + stime) as f64 / ticks as f64)
}

/// Tasks alive on the tokio runtime this is called from (`None` outside one).
pub fn runtime_alive_tasks() -> Option<u64> {
    tokio::runtime::Handle::try_current().ok().map(|h| h.metrics().num_alive_tasks() as u64)
}

/// Appends `process_cpu_seconds_total`, `process_resident_memory_bytes`, `process_open_fds`
/// and `cohort_runtime_alive_tasks` (each only when it can be read) to `out`.
pub fn render(out: &mut String) {
    if let Some(cpu) = cpu_seconds() {
        let name = "process_cpu_seconds_total";
        let _ = write!(
            out,
            "# HELP {name} Total user and system CPU time spent in seconds.\n# TYPE {name} counter\n{name} {cpu}\n"
        );
    }
    let gauges = [
        ("process_resident_memory_bytes", "Resident memory size in bytes.", resident_memory_bytes()),
        ("process_open_fds", "Number of open file descriptors.", open_fds()),
        ("cohort_runtime_alive_tasks", "Tasks alive on the process's tokio runtime.", runtime_alive_tasks()),
    ];
    for (name, help, value) in gauges {
        if let Some(v) = value {
            let _ = write!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}\n");
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn gauges_read_this_process() {
        assert!(super::resident_memory_bytes().unwrap() > 0);
        assert!(super::open_fds().unwrap() >= 3, "stdin, stdout, stderr at least");
        assert!(super::cpu_seconds().unwrap() >= 0.0);
        let mut out = String::new();
        super::render(&mut out);
        assert!(out.contains("\nprocess_open_fds "), "{out}");
        assert!(out.starts_with("# HELP process_cpu_seconds_total "), "{out}");
        assert!(!out.contains("cohort_runtime_alive_tasks"), "no runtime here: {out}");
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let tasks = rt.block_on(async {
            let _pending = tokio::spawn(std::future::pending::<()>());
            super::runtime_alive_tasks()
        });
        assert_eq!(tasks, Some(1));
    }
}
