//! The pread/pwrite backend: a pool of threads, each doing one block at a time with its own bounce
//! buffer. Used on request, and where io_uring is refused.

use super::job::BlockJob;
use super::WorkerCtx;
use crate::buffer::AlignedBuf;
use crate::error::{Op, Result};
use crate::store::last_errno;

pub(crate) struct PsyncWorker {
    bounce: AlignedBuf,
}

impl PsyncWorker {
    pub fn new(block_size: usize, lock: bool) -> Result<Self> {
        Ok(PsyncWorker {
            bounce: AlignedBuf::new(block_size, lock)?,
        })
    }

    pub fn page_kind(&self) -> crate::buffer::PageKind {
        self.bounce.page_kind()
    }

    pub fn locked(&self) -> bool {
        self.bounce.locked()
    }

    pub fn run(self, ctx: WorkerCtx) {
        while let Some(job) = ctx.rx.recv() {
            self.transfer(job, &ctx);
        }
    }

    fn transfer(&self, job: BlockJob, ctx: &WorkerCtx) {
        ctx.faults.hold(job.op);
        // SAFETY: the bounce buffer is this thread's own and at least block_size ≥ io_len bytes.
        let mem = unsafe { job.prepare(self.bounce.as_ptr()) };
        // SAFETY: `mem` is what prepare returned, holding the block's data.
        unsafe { job.record_checksum(mem) };
        if ctx.faults.lose(job.op) {
            job.finish(Ok(()), &ctx.counters);
            return;
        }
        let fd = job.fd();
        let mut done = 0usize;
        let mut result = Ok(());
        while done < job.io_len {
            // SAFETY: `mem + done .. mem + io_len` is the block's memory, valid per the job's contract.
            let rc = unsafe {
                let p = mem.add(done).cast();
                let (len, off) = (job.io_len - done, (job.file_offset + done as u64) as i64);
                match job.op {
                    Op::Read => libc::pread(fd, p, len, off),
                    _ => libc::pwrite(fd, p, len, off),
                }
            };
            let res = if rc < 0 {
                -i64::from(last_errno())
            } else {
                rc as i64
            };
            if res == -i64::from(libc::EINTR) {
                continue;
            }
            match job.check(ctx.faults.adjust(job.op, res), done) {
                Err(e) => {
                    result = Err(e);
                    break;
                }
                Ok(n) => {
                    done += n.min(job.io_len - done);
                    if done < job.io_len {
                        ctx.counters
                            .short_transfers
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            }
        }
        if result.is_ok() && job.op == Op::Read {
            // SAFETY: the transfer into `mem` is complete.
            result = unsafe { job.complete_read(mem, &ctx.faults) };
        }
        job.finish(result, &ctx.counters);
    }
}
