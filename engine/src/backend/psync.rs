//! The psync backend: a pool of threads doing pread/pwrite/fdatasync, for kernels or sandboxes
//! without io_uring. Depth is the number of threads, so queue depth means the same as for io_uring.

use super::{Backend, BackendCompletion, BackendRequest, IoKind, Waker};
use crate::device::Device;
use crate::error::{Error, Result};
use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

enum Message {
    Done(BackendCompletion),
    Wake,
}

struct Work {
    queue: Mutex<(VecDeque<BackendRequest>, bool)>,
    ready: Condvar,
}

pub struct PsyncBackend {
    work: Arc<Work>,
    pending: Vec<BackendRequest>,
    completions: Receiver<Message>,
    sender: Sender<Message>,
    threads: Vec<JoinHandle<()>>,
}

impl PsyncBackend {
    pub fn new(device: &Device, depth: usize) -> Result<Self> {
        let fd: Arc<OwnedFd> = Arc::new(
            device.file.try_clone().map_err(|e| Error::io(format!("duplicating {}", device.path.display()), e))?.into(),
        );
        let work = Arc::new(Work { queue: Mutex::new((VecDeque::new(), false)), ready: Condvar::new() });
        let (sender, completions) = channel();
        let threads = (0..depth.max(1))
            .map(|i| {
                let (work, fd, sender) = (work.clone(), fd.clone(), sender.clone());
                std::thread::Builder::new()
                    .name(format!("teraio-psync-{i}"))
                    .spawn(move || worker(&work, fd.as_raw_fd(), &sender))
                    .map_err(|e| Error::io("starting a psync thread", e))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(PsyncBackend { work, pending: Vec::new(), completions, sender, threads })
    }
}

fn worker(work: &Work, fd: i32, done: &Sender<Message>) {
    loop {
        let request = {
            let mut q = work.queue.lock().expect("psync queue");
            loop {
                if let Some(r) = q.0.pop_front() {
                    break r;
                }
                if q.1 {
                    return;
                }
                q = work.ready.wait(q).expect("psync queue");
            }
        };
        // SAFETY: the queue keeps the buffer alive and unaliased until this completion is reaped.
        let rc = unsafe {
            match request.kind {
                IoKind::Read => libc::pread(fd, request.buf as *mut _, request.len as usize, request.offset as i64),
                IoKind::Write => libc::pwrite(fd, request.buf as *const _, request.len as usize, request.offset as i64),
                IoKind::Flush => libc::fdatasync(fd) as isize,
            }
        };
        let result = if rc < 0 { -io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO) } else { rc as i32 };
        if done.send(Message::Done(BackendCompletion { token: request.token, result })).is_err() {
            return;
        }
    }
}

impl Backend for PsyncBackend {
    fn name(&self) -> &'static str {
        "psync"
    }

    unsafe fn push(&mut self, request: BackendRequest) {
        self.pending.push(request);
    }

    fn submit_and_reap(&mut self, wait: bool, out: &mut Vec<BackendCompletion>) -> io::Result<()> {
        if !self.pending.is_empty() {
            let mut q = self.work.queue.lock().expect("psync queue");
            q.0.extend(self.pending.drain(..));
            drop(q);
            self.work.ready.notify_all();
        }
        let first = if wait { self.completions.recv().ok() } else { self.completions.try_recv().ok() };
        for message in first.into_iter().chain(std::iter::from_fn(|| self.completions.try_recv().ok())) {
            if let Message::Done(c) = message {
                out.push(c);
            }
        }
        Ok(())
    }

    fn waker(&self) -> Waker {
        let sender = Mutex::new(self.sender.clone());
        Arc::new(move || {
            let _ = sender.lock().expect("waker").send(Message::Wake);
        })
    }
}

impl Drop for PsyncBackend {
    fn drop(&mut self) {
        self.work.queue.lock().expect("psync queue").1 = true;
        self.work.ready.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
