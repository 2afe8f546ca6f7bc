//! The cuFile backend: requests whose buffers are GPU memory go to libcufile (`cuFileRead` /
//! `cuFileWrite`) on the device file registered once with cuFile. cuFile's calls block, so a
//! small pool of threads per device runs them and hands completions back to the queue worker,
//! which sees the same push / submit_and_reap shape as io_uring. In true GDS mode the DMA goes
//! SSD <-> GPU; in compatibility mode cuFile itself bounces through its own pinned buffers.

use super::{Backend, BackendCompletion, BackendRequest, IoKind, Waker};
use crate::cuda::cufile::{self, FileHandle};
use crate::cuda::driver as cuda;
use crate::device::Device;
use crate::error::Result;
use std::io;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

struct Done {
    completions: Vec<BackendCompletion>,
    woken: bool,
}

struct Inbox {
    done: Mutex<Done>,
    ready: Condvar,
}

pub struct CufileBackend {
    jobs: Option<Sender<BackendRequest>>,
    inbox: Arc<Inbox>,
    threads: Vec<JoinHandle<()>>,
    pending: Vec<BackendRequest>,
}

impl CufileBackend {
    /// Registers `device` with cuFile (once) and starts `threads` I/O threads that make the
    /// primary context of CUDA device `ordinal` current.
    pub fn new(device: &Device, threads: usize, ordinal: u32) -> Result<Self> {
        let lib = cufile::cufile()?;
        let ctx = cuda::context(ordinal)?;
        let handle = Arc::new(lib.register_file(device.fd())?);
        let (tx, rx) = channel::<BackendRequest>();
        let rx = Arc::new(Mutex::new(rx));
        let inbox =
            Arc::new(Inbox { done: Mutex::new(Done { completions: Vec::new(), woken: false }), ready: Condvar::new() });
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let (rx, inbox, handle) = (rx.clone(), inbox.clone(), handle.clone());
            let path = device.path.clone();
            handles.push(
                std::thread::Builder::new()
                    .name(format!("teraio-cufile{i}"))
                    .spawn(move || {
                        let current = ctx.make_current();
                        run_io_thread(&rx, &inbox, &handle, current.is_ok(), &path)
                    })
                    .map_err(|e| crate::Error::io("starting a cuFile I/O thread", e))?,
            );
        }
        Ok(CufileBackend { jobs: Some(tx), inbox, threads: handles, pending: Vec::new() })
    }
}

fn run_io_thread(
    rx: &Mutex<Receiver<BackendRequest>>,
    inbox: &Inbox,
    handle: &FileHandle,
    context_ok: bool,
    path: &std::path::Path,
) {
    loop {
        let job = rx.lock().expect("cufile jobs").recv();
        let Ok(r) = job else { return };
        let result = if !context_ok {
            -libc::ENODEV
        } else {
            // SAFETY: the queue keeps the request's buffer valid until its completion is reaped.
            let outcome = unsafe {
                match r.kind {
                    IoKind::Read => handle.read(r.buf as u64, r.len as usize, r.offset),
                    IoKind::Write => handle.write(r.buf as u64, r.len as usize, r.offset),
                    // Never routed here: flushes go to the host-memory queue of the device.
                    IoKind::Flush => Ok(0),
                }
            };
            match outcome {
                Ok(n) => n as i32,
                Err((errno, message)) => {
                    tracing::error!(path = %path.display(), offset = r.offset, len = r.len, "{message}");
                    -errno
                }
            }
        };
        let mut done = inbox.done.lock().expect("cufile inbox");
        done.completions.push(BackendCompletion { token: r.token, result });
        drop(done);
        inbox.ready.notify_one();
    }
}

impl Backend for CufileBackend {
    fn name(&self) -> &'static str {
        "cufile"
    }

    unsafe fn push(&mut self, request: BackendRequest) {
        self.pending.push(request);
    }

    fn submit_and_reap(&mut self, wait: bool, out: &mut Vec<BackendCompletion>) -> io::Result<()> {
        let jobs = self.jobs.as_ref().ok_or_else(|| io::Error::other("cuFile backend closed"))?;
        for r in self.pending.drain(..) {
            jobs.send(r).map_err(|_| io::Error::other("cuFile I/O threads stopped"))?;
        }
        let mut done = self.inbox.done.lock().expect("cufile inbox");
        while wait && done.completions.is_empty() && !done.woken {
            done = self.inbox.ready.wait(done).expect("cufile inbox");
        }
        done.woken = false;
        out.append(&mut done.completions);
        Ok(())
    }

    fn waker(&self) -> Waker {
        let inbox = self.inbox.clone();
        Arc::new(move || {
            inbox.done.lock().expect("cufile inbox").woken = true;
            inbox.ready.notify_all();
        })
    }
}

impl Drop for CufileBackend {
    fn drop(&mut self) {
        self.jobs.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
