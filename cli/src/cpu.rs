//! Host CPU used by this process (all threads: the bench's submitters and the engine's
//! dispatcher, queue and commit threads), from getrusage.

use std::time::Duration;

/// User and system CPU time consumed so far by the whole process.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuTimes {
    pub user: Duration,
    pub system: Duration,
}

impl CpuTimes {
    /// The process's CPU times now.
    pub fn now() -> CpuTimes {
        // SAFETY: getrusage fills the struct we hand it; RUSAGE_SELF always succeeds.
        let usage = unsafe {
            let mut usage: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_SELF, &mut usage);
            usage
        };
        let to_duration = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
        CpuTimes { user: to_duration(usage.ru_utime), system: to_duration(usage.ru_stime) }
    }

    /// CPU time spent between `earlier` and `self`.
    pub fn since(&self, earlier: &CpuTimes) -> CpuTimes {
        CpuTimes { user: self.user.saturating_sub(earlier.user), system: self.system.saturating_sub(earlier.system) }
    }
}
