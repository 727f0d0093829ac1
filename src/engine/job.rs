//! One block of a request, and the work both backends do around its transfer: filling a bounce buffer
//! before a write, verifying and copying out after a read, and reporting the outcome.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use super::fault::FaultInjector;
use super::request::{Counters, Request};
use crate::buffer::AlignedBuf;
use crate::error::{Error, Op, Result};
use crate::store::Store;

/// CRC32C of each block of a key, recorded by writes and checked by reads.
pub type Checksums = Arc<[AtomicU32]>;

pub(crate) struct BlockJob {
    pub op: Op,
    pub store: Arc<Store>,
    pub path: usize,
    pub file_offset: u64,
    /// Bytes to transfer: `data_len` rounded up to the file's direct-I/O alignment.
    pub io_len: usize,
    /// Bytes of caller data in this block.
    pub data_len: usize,
    /// The caller's memory for this block.
    pub user: *mut u8,
    /// Whether the transfer must go through a bounce buffer (alignment, or padding past the caller's
    /// memory); otherwise the kernel reads or writes `user` directly.
    pub bounce: bool,
    pub block: usize,
    pub checksums: Option<Checksums>,
    pub req: Arc<Request>,
    /// Keeps an engine buffer mapped while the kernel may touch it.
    pub _keep: Option<Arc<AlignedBuf>>,
    /// Set by `finish`; a job dropped without it (a closed queue, a stopped worker) completes its block
    /// with `Error::Closed` in `Drop`, so no waiter hangs.
    pub finished: bool,
}

// SAFETY: `user` points into memory the submitter guarantees stays valid and is not accessed by others
// until `req` completes (the `Engine::write`/`read` contract); everything else is Send.
unsafe impl Send for BlockJob {}

impl BlockJob {
    pub fn fd(&self) -> i32 {
        self.store.files[self.path].raw_fd()
    }

    /// Prepares the memory the kernel will use: for a bounced write, copies the caller's bytes into
    /// `bounce` and zeroes the padding. Returns the I/O address.
    ///
    /// # Safety
    /// `bounce`, when the job bounces, must be valid for `io_len` bytes and owned by the caller.
    pub unsafe fn prepare(&self, bounce: *mut u8) -> *mut u8 {
        let mem = if self.bounce { bounce } else { self.user };
        if self.op == Op::Write && self.bounce {
            crate::copy::copy_block(bounce, self.user, self.data_len);
            std::ptr::write_bytes(bounce.add(self.data_len), 0, self.io_len - self.data_len);
        }
        mem
    }

    /// Whether `record_checksum` has work to do for this job.
    pub fn wants_checksum(&self) -> bool {
        self.op == Op::Write && self.checksums.is_some()
    }

    /// Records the CRC32C of a write's data. The kernel only reads `mem` during a write and nobody
    /// may modify it (the `Engine::write` contract, or our own bounce slot), so a backend may call this
    /// after handing the block to the kernel, overlapping the checksum with the transfer.
    ///
    /// # Safety
    /// `mem` must be the address `prepare` returned, valid for `data_len` bytes.
    pub unsafe fn record_checksum(&self, mem: *const u8) {
        if let (Op::Write, Some(c)) = (self.op, &self.checksums) {
            let data = std::slice::from_raw_parts(mem, self.data_len);
            c[self.block].store(crc32c::crc32c(data), Ordering::Relaxed);
        }
    }

    /// Finishes a transferred read: applies an injected corruption, verifies the checksum, and copies a
    /// bounced block out to the caller.
    ///
    /// # Safety
    /// `mem` must be the address `prepare` returned, with the kernel done writing it.
    pub unsafe fn complete_read(&self, mem: *mut u8, faults: &FaultInjector) -> Result<()> {
        if self.data_len > 0 && faults.corrupt(Op::Read) {
            *mem ^= 0xff;
        }
        if let Some(c) = &self.checksums {
            let expected = c[self.block].load(Ordering::Relaxed);
            let found = crc32c::crc32c(std::slice::from_raw_parts(mem, self.data_len));
            if found != expected {
                return Err(Error::Checksum {
                    key: self.req.key().to_owned(),
                    block: self.block,
                    path: self.store.files[self.path].dir.clone(),
                    offset: self.file_offset,
                    length: self.io_len as u64,
                    expected,
                    found,
                });
            }
        }
        if self.bounce {
            crate::copy::copy_block(self.user, mem, self.data_len);
        }
        Ok(())
    }

    /// Turns a raw completion (`-errno` or a byte count) for the range starting `done` bytes into the
    /// block into progress: `Ok(n)` bytes transferred, or the error to report.
    pub fn check(&self, res: i64, done: usize) -> Result<usize> {
        let off = self.file_offset + done as u64;
        let len = (self.io_len - done) as u64;
        let dir = &self.store.files[self.path].dir;
        if res < 0 {
            return Err(Error::io(self.op, (-res) as i32, dir, off, len).in_block(self.block));
        }
        if res == 0 && len > 0 {
            return Err(match self.op {
                Op::Read => Error::UnexpectedEof {
                    path: dir.clone(),
                    offset: off,
                    length: len,
                    key: None,
                    block: Some(self.block),
                },
                // A write that makes no progress would loop forever; the kernel reports ENOSPC this way
                // on some file systems.
                _ => Error::io(self.op, libc::ENOSPC, dir, off, len).in_block(self.block),
            });
        }
        Ok(res as usize)
    }

    /// Reports the block's outcome to its request.
    pub fn finish(mut self, r: Result<()>, counters: &Counters) {
        counters.blocks.fetch_add(1, Ordering::Relaxed);
        if self.bounce {
            counters.bounced_blocks.fetch_add(1, Ordering::Relaxed);
        }
        self.finished = true;
        self.req.complete_block(r);
    }
}

impl Drop for BlockJob {
    fn drop(&mut self) {
        if !self.finished {
            self.req.complete_block(Err(Error::Closed));
        }
    }
}
