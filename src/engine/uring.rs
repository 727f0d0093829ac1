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
}

pub(crate) struct UringWorker {
    ring: IoUring,
    bounce: AlignedBuf,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    fixed: bool,
    block_size: usize,
}

// SAFETY: the raw pointers in slots refer to caller memory or `bounce`, both valid across threads; the
// worker is moved into its thread before any I/O is issued.
unsafe impl Send for UringWorker {}

impl UringWorker {
    /// Sets up a ring with `depth` slots, each owning one `block_size` bounce buffer.
    pub fn new(depth: usize, block_size: usize, lock: bool) -> Result<Self> {
        let entries = depth.next_power_of_two() as u32;
        let ring = IoUring::builder()
            .setup_cqsize(entries * 2)
            .build(entries)
            .or_else(|_| IoUring::new(entries))
            .map_err(|e| {
                super::workers::ring_refusal(entries, e.raw_os_error().unwrap_or(libc::ENOSYS))
            })?;
        let bounce = AlignedBuf::new(depth * block_size, lock)?;
        let iovecs: Vec<libc::iovec> = (0..depth)
            .map(|i| libc::iovec {
                // SAFETY: in bounds: slot i spans [i*block_size, (i+1)*block_size) of the mapping.
                iov_base: unsafe { bounce.as_ptr().add(i * block_size) }.cast(),
                iov_len: block_size,
            })
            .collect();
        // SAFETY: the iovecs describe `bounce`, which this worker owns and which outlives the ring's use
        // of it: the ring is dropped with the worker, before or together with `bounce` (field order).
        let fixed = unsafe { ring.submitter().register_buffers(&iovecs) }.is_ok();
        Ok(UringWorker {
            ring,
            bounce,
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth).rev().collect(),
            fixed,
            block_size,
        })
    }

    /// Blocks this ring keeps in flight.
    pub fn depth(&self) -> usize {
        self.slots.len()
    }

    pub fn fixed_buffers(&self) -> bool {
        self.fixed
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
                let job = if inflight == 0 {
                    // Blocks while idle; Err only once the queue is closed and empty.
                    match ctx.rx.recv() {
                        Some(j) => j,
                        None => return,
                    }
                } else {
                    match ctx.rx.try_recv() {
                        Some(j) => j,
                        None => break,
                    }
                };
                self.free.pop();
                self.launch(slot, job, &ctx, &mut inflight);
            }
            if inflight == 0 {
                continue;
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

    /// Starts `job` in the free `slot` (already taken off `free`).
    fn launch(&mut self, slot: usize, job: BlockJob, ctx: &WorkerCtx, inflight: &mut usize) {
        // Checksummed writes are handed to the kernel inside `start` already.
        let bounced = job.bounce && !job.wants_checksum();
        let dest = (job.bounce && job.op == Op::Read).then_some((job.user, job.data_len));
        if !self.start(slot, job, ctx) {
            return; // a lost write (fault injection): completed without I/O
        }
        *inflight += 1;
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
            if !self.on_complete(slot, res, ctx) {
                *inflight -= 1;
                // Refill the slot just freed before copying out the next completed block, so a burst
                // of completions does not leave the disk idle while this thread copies them all.
                if let Some(&free) = self.free.last() {
                    if let Some(job) = ctx.rx.try_recv() {
                        self.free.pop();
                        self.launch(free, job, ctx, inflight);
                    }
                }
            }
        }
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
        for slot in 0..self.slots.len() {
            if let Some(s) = self.slots[slot].take() {
                let dir = &s.job.store.files[s.job.path].dir;
                let err = Error::io(
                    Op::Submit,
                    errno,
                    dir,
                    s.job.file_offset + s.done as u64,
                    (s.job.io_len - s.done) as u64,
                );
                s.job.finish(Err(err), &ctx.counters);
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
                self.on_complete(slot, res, ctx);
            } else if let Some(s) = self.slots[slot].take() {
                let dir = &s.job.store.files[s.job.path].dir;
                let err = Error::io(
                    Op::Submit,
                    errno,
                    dir,
                    s.job.file_offset,
                    s.job.io_len as u64,
                );
                s.job.finish(Err(err), &ctx.counters);
                self.free.push(slot);
            }
            *inflight -= 1;
        }
    }

    /// Starts `job` in `slot`; false when it completed at once (an injected lost write).
    fn start(&mut self, slot: usize, job: BlockJob, ctx: &WorkerCtx) -> bool {
        ctx.faults.hold(job.op);
        // SAFETY: slot `slot` is free, so its `block_size` bytes of `bounce` are ours; io_len ≤ block_size.
        let mem = unsafe { job.prepare(self.bounce.as_ptr().add(slot * self.block_size)) };
        if ctx.faults.lose(job.op) {
            // SAFETY: as below; nothing is in flight for this block.
            unsafe { job.record_checksum(mem) };
            job.finish(Ok(()), &ctx.counters);
            self.free.push(slot);
            return false;
        }
        let crc = job.wants_checksum();
        self.slots[slot] = Some(Slot { job, mem, done: 0 });
        self.push(slot);
        if crc {
            // Let the disk work while this thread checksums the block (an error resurfaces from
            // submit_and_wait). The block completes only when reaped, after the checksum is stored.
            let _ = self.ring.submit();
            if let Some(s) = &self.slots[slot] {
                // SAFETY: `mem` holds the block's data; the kernel only reads it during a write.
                unsafe { s.job.record_checksum(mem) };
            }
        }
        true
    }

    /// Queues the remaining range of `slot`'s block.
    fn push(&mut self, slot: usize) {
        let Some(s) = &self.slots[slot] else { return };
        let fd = types::Fd(s.job.fd());
        // SAFETY: `mem + done` stays inside the block's memory (done < io_len).
        let ptr = unsafe { s.mem.add(s.done) };
        let len = (s.job.io_len - s.done) as u32;
        let off = s.job.file_offset + s.done as u64;
        let fixed = self.fixed && s.job.bounce;
        let entry = match (s.job.op, fixed) {
            (Op::Read, true) => opcode::ReadFixed::new(fd, ptr, len, slot as u16)
                .offset(off)
                .build(),
            (Op::Read, false) => opcode::Read::new(fd, ptr, len).offset(off).build(),
            (_, true) => opcode::WriteFixed::new(fd, ptr, len, slot as u16)
                .offset(off)
                .build(),
            (_, false) => opcode::Write::new(fd, ptr, len).offset(off).build(),
        }
        .user_data(slot as u64);
        // SAFETY: the memory behind `ptr` stays valid until this entry completes: bounce memory is owned
        // by this worker, caller memory by the request's contract, and the slot is not reused before then.
        // The queue has room for every slot, so a full queue only means entries await submission.
        while unsafe { self.ring.submission().push(&entry) }.is_err() {
            let _ = self.ring.submit();
        }
    }

    /// Handles one completion; returns true when the slot was resubmitted (still in flight).
    fn on_complete(&mut self, slot: usize, res: i64, ctx: &WorkerCtx) -> bool {
        let Some(s) = self.slots.get_mut(slot).and_then(Option::as_mut) else {
            return false; // the NOP of a failed push
        };
        let res = ctx.faults.adjust(s.job.op, res);
        match s.job.check(res, s.done) {
            Err(e) => {
                self.fail(slot, e, ctx);
                false
            }
            Ok(n) => {
                s.done += n.min(s.job.io_len - s.done);
                if s.done < s.job.io_len {
                    ctx.counters
                        .short_transfers
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    self.push(slot);
                    return true;
                }
                let Some(s) = self.slots[slot].take() else {
                    return false;
                };
                let r = if s.job.op == Op::Read {
                    // SAFETY: the kernel has completed every transfer into `s.mem`.
                    unsafe { s.job.complete_read(s.mem, &ctx.faults) }
                } else {
                    Ok(())
                };
                s.job.finish(r, &ctx.counters);
                self.free.push(slot);
                false
            }
        }
    }

    fn fail(&mut self, slot: usize, e: Error, ctx: &WorkerCtx) {
        if let Some(s) = self.slots[slot].take() {
            s.job.finish(Err(e), &ctx.counters);
            self.free.push(slot);
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
        let dir = job.store.files[job.path].dir.clone();
        let err = Error::io(Op::Submit, errno, &dir, job.file_offset, job.io_len as u64);
        job.finish(Err(err), &ctx.counters);
    }
}
