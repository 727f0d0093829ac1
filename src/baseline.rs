//! A raw-disk baseline: the simplest io_uring loop over one `O_DIRECT` file with huge-page buffers —
//! what fio does with `--ioengine=io_uring --direct=1` — used by `zswap bench` when fio is not
//! installed and by the Criterion benches, so the engine is always shown next to the disk's own speed.

use std::path::Path;
use std::time::{Duration, Instant};

use io_uring::{opcode, types, IoUring};

use crate::align::align_up;
use crate::buffer::AlignedBuf;
use crate::error::{Error, Op, Result};
use crate::store::SwapFile;

/// Seconds to write and then read `size` bytes sequentially in `block_size` transfers with
/// `queue_depth` in flight, on a fresh unlinked file in `dir` (preallocated, then written once before
/// the timed pass so both passes overwrite, as fio's do after its layout).
pub fn raw_io_uring(
    dir: &Path,
    size: u64,
    block_size: usize,
    queue_depth: usize,
) -> Result<(Duration, Duration)> {
    let (file, notes) = SwapFile::create(dir, Some(true))?;
    debug_assert!(notes.direct_refused.is_none());
    let size = align_up(size, block_size as u64);
    file.ensure_size(size)?;
    let buf = AlignedBuf::new(queue_depth * block_size, false)?;
    let mut ring = IoUring::new(queue_depth.next_power_of_two() as u32)
        .map_err(|e| Error::InvalidArgument(format!("io_uring setup failed: {e}")))?;
    pass(
        &mut ring,
        &file,
        &buf,
        Op::Write,
        size,
        block_size,
        queue_depth,
    )?; // layout
    let w = pass(
        &mut ring,
        &file,
        &buf,
        Op::Write,
        size,
        block_size,
        queue_depth,
    )?;
    let r = pass(
        &mut ring,
        &file,
        &buf,
        Op::Read,
        size,
        block_size,
        queue_depth,
    )?;
    Ok((w, r))
}

fn pass(
    ring: &mut IoUring,
    file: &SwapFile,
    buf: &AlignedBuf,
    op: Op,
    size: u64,
    bs: usize,
    qd: usize,
) -> Result<Duration> {
    let blocks = (size / bs as u64) as usize;
    let fd = types::Fd(file.raw_fd());
    let (mut next, mut done, mut inflight) = (0usize, 0usize, 0usize);
    let mut free: Vec<usize> = (0..qd).collect();
    let start = Instant::now();
    while done < blocks {
        while inflight < qd && next < blocks {
            let slot = free.pop().unwrap_or_default();
            // SAFETY: slot < qd, so the range lies inside `buf`.
            let p = unsafe { buf.as_ptr().add(slot * bs) };
            let off = (next * bs) as u64;
            let e = match op {
                Op::Read => opcode::Read::new(fd, p, bs as u32).offset(off).build(),
                _ => opcode::Write::new(fd, p, bs as u32).offset(off).build(),
            }
            .user_data(slot as u64);
            // SAFETY: `buf` outlives the pass, which waits for every entry it queues; at most qd entries
            // are queued in a ring of at least qd.
            unsafe { ring.submission().push(&e) }
                .map_err(|_| Error::InvalidArgument("submission queue full".into()))?;
            next += 1;
            inflight += 1;
        }
        ring.submit_and_wait(1)
            .map_err(|e| Error::from_io(op, &e, &file.dir))?;
        for c in ring.completion() {
            if c.result() != bs as i32 {
                let errno = if c.result() < 0 {
                    -c.result()
                } else {
                    libc::EIO
                };
                return Err(Error::io(op, errno, &file.dir, 0, bs as u64));
            }
            free.push(c.user_data() as usize);
            inflight -= 1;
            done += 1;
        }
    }
    Ok(start.elapsed())
}
