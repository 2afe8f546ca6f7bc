//! The verify threads: where a verified get's piece is finished once its read is in (its crc32c
//! taken, then a host bounce chunk copied out or the GPU copy queued), instead of on the device
//! worker that read it. A worker that took each piece's checksum itself stopped reaping and
//! submitting for that long, and the device sat idle behind it with every completion of a
//! batch; here the worker goes straight back to its queue, and the pieces of one or many gets
//! are checked in parallel with the I/O and with each other.
//!
//! Limits: `threads` threads for the store's life. Jobs queue without a bound of their own:
//! each is a piece in flight, so the in-flight byte budget bounds them.

use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Pieces up to this long are finished on the device worker: their checksum costs less than
/// handing them over (a thread wake-up, a few microseconds), and 4 KiB random gets keep their
/// latency.
pub(crate) const VERIFY_ON_WORKER_MAX_BYTES: u64 = 32 << 10;

/// The most verify threads a store starts: crc32c runs at several GB/s per core, so a few
/// threads keep up with many devices.
const VERIFY_THREADS_MAX: usize = 8;

type Job = Box<dyn FnOnce() + Send>;

/// The verify threads of one store.
pub(crate) struct Verifiers {
    to_threads: Mutex<Option<Sender<Job>>>,
    threads: Vec<JoinHandle<()>>,
    /// Jobs handed over so far (for tests: a checked get's long pieces must come here).
    jobs_handed_over: AtomicU64,
}

impl Verifiers {
    /// Starts one thread per core the process may use, at most `VERIFY_THREADS_MAX`.
    pub fn start() -> Result<Verifiers> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Verifiers::start_with(cores.clamp(1, VERIFY_THREADS_MAX))
    }

    fn start_with(count: usize) -> Result<Verifiers> {
        assert!(count > 0, "at least one verify thread");
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let threads = (0..count)
            .map(|i| {
                let rx = rx.clone();
                std::thread::Builder::new()
                    .name(format!("teraio-verify{i}"))
                    .spawn(move || run(&rx))
                    .map_err(|e| Error::io("starting a verify thread", e))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Verifiers { to_threads: Mutex::new(Some(tx)), threads, jobs_handed_over: AtomicU64::new(0) })
    }

    /// Runs `job` on a verify thread (on this thread if they have stopped, which happens only
    /// once the store has no op left).
    pub fn run(&self, job: impl FnOnce() + Send + 'static) {
        self.jobs_handed_over.fetch_add(1, Ordering::Relaxed);
        let job: Job = Box::new(job);
        let unsent = match self.to_threads.lock().expect("verify sender").as_ref() {
            Some(tx) => tx.send(job).err().map(|e| e.0),
            None => Some(job),
        };
        if let Some(job) = unsent {
            job();
        }
    }
}

/// A verify thread's loop: one job at a time until the store drops its sender.
fn run(jobs: &Mutex<Receiver<Job>>) {
    loop {
        // The lock is held only while waiting for the next job, never while running one.
        let job = jobs.lock().expect("verify jobs").recv();
        match job {
            Ok(job) => job(),
            Err(_) => return,
        }
    }
}

impl Drop for Verifiers {
    fn drop(&mut self) {
        // Closing the channel ends every thread after the jobs already queued.
        self.to_threads.lock().expect("verify sender").take();
        for thread in self.threads.drain(..) {
            // Never join from a verify thread itself (its last job may drop the store).
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Verifiers;
    use crate::config::{FormatConfig, OpenConfig, MIB};
    use crate::store::Store;
    use std::sync::atomic::Ordering;
    use std::sync::mpsc::channel;

    /// A checked get's pieces over `VERIFY_ON_WORKER_MAX_BYTES` are finished on the verify
    /// threads (the device worker only reaps them); unchecked gets and puts never go there.
    #[test]
    fn checked_gets_hand_their_long_pieces_to_the_verify_threads() {
        let dir = tempfile::tempdir().unwrap();
        let paths = [dir.path().join("d0")];
        let format = FormatConfig {
            create_file_bytes: Some(64 * MIB),
            direct_io: false,
            stripe_unit_bytes: 64 << 10,
            ..Default::default()
        };
        let open = OpenConfig { direct_io: false, durable: false, max_io_bytes: 64 << 10, ..Default::default() };
        let data: Vec<u8> = (0..MIB as usize).map(|i| (i * 13 % 251) as u8).collect();
        let handed = |store: &Store| store.shared.verifiers.jobs_handed_over.load(Ordering::Relaxed);
        {
            let store = Store::create(&paths, &format, open.clone()).unwrap();
            store.put_blocking(1, &data, b"").unwrap();
            assert_eq!(handed(&store), 0, "puts never go to the verify threads");
            assert_eq!(store.get_to_vec(1).unwrap(), data);
            // 1 MiB in 64 KiB pieces: all 16 are checked there.
            assert_eq!(handed(&store), 16);
            store.close().unwrap();
        }
        let store = Store::open(&paths, OpenConfig { verify_checksums: false, ..open }).unwrap();
        assert_eq!(store.get_to_vec(1).unwrap(), data);
        assert_eq!(handed(&store), 0, "unchecked gets finish on the device worker");
        store.close().unwrap();
    }

    #[test]
    fn jobs_run_on_the_verify_threads_and_all_run_before_drop_returns() {
        let verifiers = Verifiers::start_with(3).unwrap();
        let (tx, rx) = channel();
        for i in 0..100u32 {
            let tx = tx.clone();
            verifiers.run(move || {
                let name = std::thread::current().name().map(str::to_owned);
                tx.send((i, name)).unwrap();
            });
        }
        drop(verifiers);
        drop(tx);
        let done: Vec<_> = rx.iter().collect();
        assert_eq!(done.len(), 100, "every queued job ran");
        assert!(done.iter().all(|(_, name)| name.as_deref().is_some_and(|n| n.starts_with("teraio-verify"))));
    }
}
