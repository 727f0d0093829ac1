//! The io_uring backend: one ring per worker thread, fed from the engine's shared job queue, with up to
//! `depth` blocks in flight. Bounce buffers are registered as fixed buffers when the kernel allows it
//! (registration is charged to RLIMIT_MEMLOCK unless the process has CAP_IPC_LOCK; a refusal just means
//! plain READ/WRITE opcodes).

use io_uring::{opcode, types, IoUring};

use super::job::BlockJob;
use super::WorkerCtx;
use crate::buffer::AlignedBuf;
use crate::error::{Error, Op, Result};

/// Whether this kernel and sandbox give us an io_uring: `Err(errno)` when setup is refused (ENOSYS on
/// old or stripped kernels, EPERM under seccomp or `kernel.io_uring_disabled`, ENOMEM under memlock).
pub fn probe() -> std::result::Result<(), i32> {
    let ring = IoUring::new(2).map_err(|e| e.raw_os_error().unwrap_or(libc::ENOSYS))?;
    // READ/WRITE with offsets exist since 5.6; refuse older rings rather than fail per request.
    let mut p = io_uring::Probe::new();
    if ring.submitter().register_probe(&mut p).is_ok()
        && (!p.is_supported(opcode::Read::CODE) || !p.is_supported(opcode::Write::CODE))
    {
        return Err(libc::ENOSYS);
    }
    Ok(())
}

struct Slot {
    job: BlockJob,
    mem: *mut u8,
    done: usize,
    /// The bounce buffer the block uses, if it bounces.
    buf: Option<usize>,
}

/// A job taken off the queue while every slot was in flight, made ready for the kernel (a bounced
/// write already copied into its buffer) so that it goes out the moment a slot frees.
struct Ahead {
    job: BlockJob,
    mem: *mut u8,
    buf: Option<usize>,
}

pub(crate) struct UringWorker {
    ring: IoUring,
    bounce: AlignedBuf,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    /// Free bounce buffers. There are `spare` more buffers than slots: one slot's worth is filled
    /// ahead while every slot is in flight (`Ahead`), so the copy into a bounce buffer overlaps the
    /// transfers instead of holding a slot idle (on the project VM a 4 MiB copy takes about as long
    /// as the drive needs for one block at the fio queue depth).
    bufs: Vec<usize>,
    ahead: Option<Ahead>,
    nbuf: usize,
    /// Whether the bounce buffers are registered: the errno the kernel refused them with otherwise.
    fixed: std::result::Result<(), i32>,
    block_size: usize,
}

// SAFETY: the raw pointers in slots refer to caller memory or `bounce`, both valid across threads; the
// worker is moved into its thread before any I/O is issued.
unsafe impl Send for UringWorker {}

impl UringWorker {
    /// Sets up a ring with `depth` slots and `depth + spare` bounce buffers of `block_size` bytes.
    pub fn new(depth: usize, spare: usize, block_size: usize, lock: bool) -> Result<Self> {
        let entries = depth.next_power_of_two() as u32;
        let ring = IoUring::builder()
            .setup_cqsize(entries * 2)
            .build(entries)
            .or_else(|_| IoUring::new(entries))
            .map_err(|e| {
                super::workers::ring_refusal(entries, e.raw_os_error().unwrap_or(libc::ENOSYS))
            })?;
        let nbuf = depth + spare;
        let bounce = AlignedBuf::new(nbuf * block_size, lock)?;
        let iovecs: Vec<libc::iovec> = (0..nbuf)
            .map(|i| libc::iovec {
                // SAFETY: in bounds: buffer i spans [i*block_size, (i+1)*block_size) of the mapping.
                iov_base: unsafe { bounce.as_ptr().add(i * block_size) }.cast(),
                iov_len: block_size,
            })
            .collect();
        // SAFETY: the iovecs describe `bounce`, which this worker owns and which outlives the ring's use
        // of it: the ring is dropped with the worker, before or together with `bounce` (field order).
        let fixed = unsafe { ring.submitter().register_buffers(&iovecs) }
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EINVAL));
        Ok(UringWorker {
            ring,
            bounce,
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth).rev().collect(),
            bufs: (0..nbuf).rev().collect(),
            ahead: None,
            nbuf,
            fixed,
            block_size,
        })
    }

    /// Bounce buffers beyond one per slot.
    pub fn spare(&self) -> usize {
        self.nbuf - self.slots.len()
    }

    /// Bytes of bounce buffers this ring holds.
    pub fn bounce_bytes(&self) -> usize {
        self.nbuf * self.block_size
    }

    /// The errno registering the bounce buffers failed with (`None`: registered).
    pub fn fixed_refusal(&self) -> Option<i32> {
        self.fixed.err()
    }

    pub fn locked(&self) -> bool {
        self.bounce.locked()
    }

    pub fn page_kind(&self) -> crate::buffer::PageKind {
        self.bounce.page_kind()
    }

    /// Runs until the job queue is closed and drained and nothing is in flight, or until the ring
    /// fails for good (see `abandon`).
    pub fn run(mut self, ctx: WorkerCtx) {
        let mut inflight = 0usize;
        loop {
            while let Some(&slot) = self.free.last() {
                let next = if let Some(a) = self.ahead.take() {
                    a
                } else if inflight == 0 {
                    // Blocks while idle; None only once the queue is closed and empty.
                    match ctx.rx.recv() {
                        Some(j) => self.ready(j, &ctx),
                        None => return,
                    }
                } else {
                    match ctx.rx.try_recv() {
                        Some(j) => self.ready(j, &ctx),
                        None => break,
                    }
                };
                self.free.pop();
                self.launch(slot, next, &ctx, &mut inflight);
            }
            if inflight == 0 {
                continue;
            }
            if self.free.is_empty() && self.ahead.is_none() && !self.bufs.is_empty() {
                // Every slot is in flight: prepare the next job now rather than after a completion.
                if let Some(j) = ctx.rx.try_recv() {
                    self.ahead = Some(self.ready(j, &ctx));
                }
            }
            let submitted = match ctx.faults.submit_errno() {
                Some(errno) => Err(std::io::Error::from_raw_os_error(errno)),
                None => self.ring.submit_and_wait(1),
            };
            if let Err(e) = submitted {
                let errno = e.raw_os_error().unwrap_or(libc::EIO);
                // EINTR/EAGAIN/EBUSY are transient (a signal; the kernel short of request memory; the
                // completion queue full until we reap, which the next loop does).
                if matches!(errno, libc::EINTR | libc::EAGAIN | libc::EBUSY) {
                    self.reap(&ctx, &mut inflight);
                    continue;
                }
                self.abandon(errno, &ctx, inflight);
                fail_rest_if_last(errno, &ctx);
                return;
            }
            self.reap(&ctx, &mut inflight);
        }
    }

    /// Makes `job` ready for the kernel: takes a bounce buffer if it bounces and, for a write, copies
    /// the caller's bytes into it.
    fn ready(&mut self, job: BlockJob, ctx: &WorkerCtx) -> Ahead {
        ctx.faults.hold(job.op);
        // Callers make a job ready only while a buffer is free: held buffers are at most one per slot
        // in flight, plus `ahead` and a read being copied out, so a free slot always finds one once
        // the copy-out is done, and `ahead` is taken only with a spare free.
        let buf = if job.bounce { self.bufs.pop() } else { None };
        let base = match buf {
            // SAFETY: buffer `b` is free, so its `block_size` bytes of `bounce` are ours.
            Some(b) => unsafe { self.bounce.as_ptr().add(b * self.block_size) },
            None => std::ptr::null_mut(),
        };
        if job.bounce && buf.is_none() {
            // Not reachable (see above); failing the block beats writing through a null buffer.
            return Ahead {
                job,
                mem: base,
                buf,
            };
        }
        // SAFETY: when the job bounces, `base` is a free buffer of `block_size ≥ io_len` bytes.
        let mem = unsafe { job.prepare(base) };
        Ahead { job, mem, buf }
    }

    /// Starts a ready job in the free `slot` (already taken off `free`).
    fn launch(&mut self, slot: usize, next: Ahead, ctx: &WorkerCtx, inflight: &mut usize) {
        let Ahead { job, mem, buf } = next;
        if job.bounce && buf.is_none() {
            let dir = job.store.files[job.path].dir.clone();
            let e = Error::io(
                job.op,
                libc::ENOBUFS,
                &dir,
                job.file_offset,
                job.io_len as u64,
            );
            job.finish(Err(e), &ctx.counters);
            self.free.push(slot);
            return;
        }
        // Checksummed writes are handed to the kernel below, before the checksum is taken.
        let bounced = job.bounce && !job.wants_checksum();
        let dest = (job.bounce && job.op == Op::Read).then_some((job.user, job.data_len));
        if ctx.faults.lose(job.op) {
            // A lost write (fault injection): completed without I/O.
            // SAFETY: `mem` holds the block's data; nothing is in flight for it.
            unsafe { job.record_checksum(mem) };
            job.finish(Ok(()), &ctx.counters);
            self.free.push(slot);
            self.bufs.extend(buf);
            return;
        }
        let crc = job.wants_checksum();
        self.slots[slot] = Some(Slot {
            job,
            mem,
            done: 0,
            buf,
        });
        self.push(slot);
        *inflight += 1;
        if crc {
            // Let the disk work while this thread checksums the block (an error resurfaces from
            // submit_and_wait). The block completes only when reaped, after the checksum is stored.
            let _ = self.ring.submit();
            if let Some(s) = &self.slots[slot] {
                // SAFETY: `mem` holds the block's data; the kernel only reads it during a write.
                unsafe { s.job.record_checksum(mem) };
            }
        }
        if bounced {
            // Hand the block to the kernel before copying the next one, so the disk works
            // while this thread copies. An error here resurfaces from submit_and_wait.
            let _ = self.ring.submit();
        }
        if let Some((user, len)) = dest {
            // Fault the destination in while the disk reads the block, not in the copy out
            // after it completes (a fresh tensor's first touch runs far below disk speed).
            crate::buffer::prefault_destination(user, len);
        }
    }

    fn reap(&mut self, ctx: &WorkerCtx, inflight: &mut usize) {
        let done: Vec<(usize, i64)> = self
            .ring
            .completion()
            .map(|c| (c.user_data() as usize, i64::from(c.result())))
            .collect();
        for (slot, res) in done {
            let Some(read) = self.on_complete(slot, res, ctx) else {
                continue; // resubmitted: still in flight
            };
            *inflight -= 1;
            // Refill the slot just freed before copying this block out, so the disk does not sit idle
            // while this thread copies (a spare buffer lets the slot go out again at once).
            self.refill(ctx, inflight);
            if let Some(s) = read {
                self.finish_read(s, ctx);
                self.refill(ctx, inflight);
            }
        }
    }

    /// Launches the job prepared ahead, or the next queued one, into a free slot, if there is one and
    /// a bounce buffer for the job (a bounced read being copied out may hold the last one).
    fn refill(&mut self, ctx: &WorkerCtx, inflight: &mut usize) {
        let Some(&slot) = self.free.last() else {
            return;
        };
        let next = match self.ahead.take() {
            Some(a) => a,
            None if !self.bufs.is_empty() => match ctx.rx.try_recv() {
                Some(j) => self.ready(j, ctx),
                None => return,
            },
            None => return,
        };
        self.free.pop();
        self.launch(slot, next, ctx, inflight);
    }

    /// Verifies a completed read and copies it out of its bounce buffer, then frees the buffer.
    fn finish_read(&mut self, s: Slot, ctx: &WorkerCtx) {
        // SAFETY: the kernel has completed every transfer into `s.mem`.
        let r = unsafe { s.job.complete_read(s.mem, &ctx.faults) };
        s.job.finish(r, &ctx.counters);
        self.bufs.extend(s.buf);
    }

    /// `io_uring_enter` failed with a non-transient errno: the ring cannot be driven any more. Blocks
    /// the kernel already holds are given a short grace to complete (their memory must not be reused
    /// while it may still write it); then every block in flight fails with the errno, and this worker
    /// stops — the engine's other workers carry on, and once none is left every job fails at once.
    /// Blocks the kernel never completed keep their ring and bounce memory mapped (leaked) for good.
    fn abandon(mut self, errno: i32, ctx: &WorkerCtx, mut inflight: usize) {
        let queued = self.ring.submission().len();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while inflight > queued && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
            self.reap_no_resubmit(errno, ctx, &mut inflight);
        }
        let kernel_owned = inflight > queued;
        if let Some(a) = self.ahead.take() {
            fail_unsent(a.job, errno, 0, ctx);
        }
        for slot in 0..self.slots.len() {
            if let Some(s) = self.slots[slot].take() {
                fail_unsent(s.job, errno, s.done, ctx);
            }
        }
        if kernel_owned {
            std::mem::forget(self);
        }
    }

    /// Reaps completions during `abandon`: finished blocks complete; short ones fail instead of being
    /// resubmitted on the broken ring.
    fn reap_no_resubmit(&mut self, errno: i32, ctx: &WorkerCtx, inflight: &mut usize) {
        let done: Vec<(usize, i64)> = self
            .ring
            .completion()
            .map(|c| (c.user_data() as usize, i64::from(c.result())))
            .collect();
        for (slot, res) in done {
            let Some(s) = self.slots.get(slot).and_then(Option::as_ref) else {
                continue;
            };
            let full = res >= 0 && s.done + res as usize >= s.job.io_len;
            if res < 0 || full {
                if let Some(Some(read)) = self.on_complete(slot, res, ctx) {
                    self.finish_read(read, ctx);
                }
            } else if let Some(s) = self.slots[slot].take() {
                fail_unsent(s.job, errno, 0, ctx);
                self.free.push(slot);
                self.bufs.extend(s.buf);
            }
            *inflight -= 1;
        }
    }

    /// Queues the remaining range of `slot`'s block.
    fn push(&mut self, slot: usize) {
        let Some(s) = &self.slots[slot] else { return };
        let fd = types::Fd(s.job.fd());
        // SAFETY: `mem + done` stays inside the block's memory (done < io_len).
        let ptr = unsafe { s.mem.add(s.done) };
        let len = (s.job.io_len - s.done) as u32;
        let off = s.job.file_offset + s.done as u64;
        let fixed = s.buf.filter(|_| self.fixed.is_ok()).map(|b| b as u16);
        let entry = match (s.job.op, fixed) {
            (Op::Read, Some(b)) => opcode::ReadFixed::new(fd, ptr, len, b).offset(off).build(),
            (Op::Read, None) => opcode::Read::new(fd, ptr, len).offset(off).build(),
            (_, Some(b)) => opcode::WriteFixed::new(fd, ptr, len, b).offset(off).build(),
            (_, None) => opcode::Write::new(fd, ptr, len).offset(off).build(),
        }
        .user_data(slot as u64);
        // SAFETY: the memory behind `ptr` stays valid until this entry completes: bounce memory is owned
        // by this worker, caller memory by the request's contract, and the slot is not reused before then.
        // The queue has room for every slot, so a full queue only means entries await submission.
        while unsafe { self.ring.submission().push(&entry) }.is_err() {
            let _ = self.ring.submit();
        }
    }

    /// Handles one completion: `None` when the slot was resubmitted (still in flight); otherwise the
    /// slot is free again and, for a read that completed, its block is returned for `finish_read`.
    fn on_complete(&mut self, slot: usize, res: i64, ctx: &WorkerCtx) -> Option<Option<Slot>> {
        let Some(s) = self.slots.get_mut(slot).and_then(Option::as_mut) else {
            return Some(None); // the NOP of a failed push
        };
        let res = ctx.faults.adjust(s.job.op, res);
        match s.job.check(res, s.done) {
            Err(e) => {
                self.fail(slot, e, ctx);
                Some(None)
            }
            Ok(n) => {
                s.done += n.min(s.job.io_len - s.done);
                if s.done < s.job.io_len {
                    ctx.counters
                        .short_transfers
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    self.push(slot);
                    return None;
                }
                let Some(s) = self.slots[slot].take() else {
                    return Some(None);
                };
                self.free.push(slot);
                if s.job.op == Op::Read {
                    return Some(Some(s));
                }
                s.job.finish(Ok(()), &ctx.counters);
                self.bufs.extend(s.buf);
                Some(None)
            }
        }
    }

    fn fail(&mut self, slot: usize, e: Error, ctx: &WorkerCtx) {
        if let Some(s) = self.slots[slot].take() {
            s.job.finish(Err(e), &ctx.counters);
            self.free.push(slot);
            self.bufs.extend(s.buf);
        }
    }
}

/// After a ring was abandoned: the last worker standing keeps receiving jobs and fails each with the
/// ring's errno until the engine closes — a job queued with no worker left would otherwise wait forever.
fn fail_rest_if_last(errno: i32, ctx: &WorkerCtx) {
    if ctx.alive.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) != 1 {
        return;
    }
    while let Some(job) = ctx.rx.recv() {
        fail_unsent(job, errno, 0, ctx);
    }
}

/// Fails `job` with a broken ring's `errno`, naming the range from `done` bytes into the block on (what
/// the kernel never transferred).
fn fail_unsent(job: BlockJob, errno: i32, done: usize, ctx: &WorkerCtx) {
    let dir = &job.store.files[job.path].dir;
    let off = job.file_offset + done as u64;
    let err = Error::io(Op::Submit, errno, dir, off, (job.io_len - done) as u64);
    job.finish(Err(err), &ctx.counters);
}
