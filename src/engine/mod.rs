//! The engine: keys → layouts in the swap files, requests split into blocks, and worker threads (io_uring
//! rings or a pread/pwrite pool) that move the blocks.
//!
//! Contract for `write`/`read`: the caller's memory must stay valid, and must not be written (by a write)
//! or touched at all (by a read), until the returned request completes. `src/py/` keeps the tensor
//! alive for that long.
//!
//! Overwrites are copy-on-write (`keys`): a key reads its previous value until a new write of it has
//! completed, so a failed write never loses data. No lock is held while waiting for I/O: the keys mutex
//! guards bookkeeping only, and `read`/`free` wait after releasing it.

mod fault;
mod job;
mod keys;
mod psync;
mod queue;
mod request;
mod settings;
mod uring;
mod workers;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard};
use std::thread::JoinHandle;

pub use fault::{Fault, FaultInjector};
use job::{BlockJob, Checksums};
use keys::{Keys, Version};
pub use request::{Counters, Request};
pub use workers::PSYNC_MAX_THREADS;

use crate::buffer::{AlignedBuf, BufferRegistry, PageKind};
use crate::error::{Error, Feature, Op, Result};
use crate::machine::{plan_io, QueueLimits};
use crate::store::{Access, Layout, Store, SwapFile};
use settings::{finish_validation, pick, validate};

/// Which I/O backend moves the blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// io_uring where the kernel allows it, else psync with a note.
    Auto,
    IoUring,
    Psync,
}

/// Whether swap files use `O_DIRECT`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirectMode {
    /// Direct I/O where the file system accepts it, else buffered with a note.
    Auto,
    On,
    Off,
}

/// Engine settings. `Default` gives zswap's choices.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Swap directories; more than one stripes each key over all of them.
    pub paths: Vec<PathBuf>,
    /// Bytes per block: the unit of one transfer and of striping. A power of two, 4 KiB to 64 MiB.
    /// Default 0: picked from the drive's request limits (`machine::plan_io`).
    pub block_size: usize,
    /// Blocks in flight across the whole engine (fio's `iodepth` for one job). Default 0: picked
    /// with the block size (16 MiB in flight, at least 4 blocks).
    pub queue_depth: usize,
    /// Worker threads: io_uring rings (each with `queue_depth / threads` slots), or for psync the
    /// number of threads doing blocking calls is `queue_depth`. Default: 2 rings, at least one per path.
    pub threads: usize,
    pub backend: Backend,
    pub direct: DirectMode,
    /// Record a CRC32C per block on write and check it on read: turns flipped bits and lost writes into
    /// errors. Default off: measured at more than 3 % of swap throughput (README, "Checksums").
    pub checksum: bool,
    /// Bytes of bounce buffers the engine may hold: at least `threads × block_size`. Default one
    /// block per slot plus one spare per io_uring ring (filled while every slot is in flight).
    pub pinned_memory_budget: Option<usize>,
    /// `mlock` engine buffers (bounce and `alloc`) where RLIMIT_MEMLOCK allows.
    pub lock_memory: bool,
    /// Whether direct reads into engine buffers skip the bounce buffers. Default `None`: decided for
    /// the drive (`machine::zero_copy_reads`).
    pub zero_copy_reads: Option<bool>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            paths: Vec::new(),
            block_size: 0,
            queue_depth: 0,
            threads: 0,
            backend: Backend::Auto,
            direct: DirectMode::Auto,
            checksum: false,
            pinned_memory_budget: None,
            lock_memory: false,
            zero_copy_reads: None,
        }
    }
}

/// `Ok` when this kernel and sandbox allow io_uring, else the errno of the refusal. Setting
/// `ZSWAP_DISABLE_IO_URING=1` refuses it with EPERM: an escape hatch around a misbehaving kernel, and
/// how the fallback path is tested on machines where io_uring works.
pub fn probe_io_uring() -> std::result::Result<(), i32> {
    if io_uring_disabled() {
        return Err(libc::EPERM);
    }
    uring::probe()
}

/// Whether `ZSWAP_DISABLE_IO_URING` asks for the psync backend (set, not empty, not "0").
pub fn io_uring_disabled() -> bool {
    std::env::var_os("ZSWAP_DISABLE_IO_URING").is_some_and(|v| !v.is_empty() && v != "0")
}

/// Why io_uring was refused with `errno`, for a note or an error.
fn refusal(errno: i32) -> String {
    if io_uring_disabled() {
        "ZSWAP_DISABLE_IO_URING is set".into()
    } else if errno == libc::ENOMEM {
        // The probe's ring is tiny: ENOMEM there is the memlock charge (every kernel before 5.12, and
        // later ones where the ring's pages are still accounted) or a limit of 0.
        format!(
            "{}{}",
            crate::error::strerror(errno),
            workers::memlock_hint(None)
        )
    } else {
        crate::error::strerror(errno)
    }
}

/// What a worker thread needs besides its own ring or buffer.
pub(crate) struct WorkerCtx {
    pub rx: queue::JobReceiver,
    pub counters: Arc<Counters>,
    pub faults: Arc<FaultInjector>,
    /// Workers still serving the queue (a failed ring leaves; the last one never does, see uring.rs).
    pub alive: Arc<std::sync::atomic::AtomicUsize>,
}

/// Figures for `stats()`.
#[derive(Clone, Debug)]
pub struct Stats {
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub reads: u64,
    pub writes: u64,
    pub blocks: u64,
    pub bounced_blocks: u64,
    pub short_transfers: u64,
    pub busy_seconds: f64,
    pub keys: usize,
    pub reserved_bytes: u64,
    pub file_bytes: u64,
    /// Bytes the file systems actually hold for the swap files (`st_blocks`).
    pub allocated_bytes: u64,
    pub live_buffers: usize,
}

/// Settings the engine actually runs with, after probing.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub backend: Backend,
    pub direct: bool,
    /// Direct-I/O offset alignment (largest over the paths), 1 when buffered.
    pub io_align: u64,
    pub mem_align: u64,
    pub block_size: usize,
    pub queue_depth: usize,
    pub threads: usize,
    /// Why the bounce buffers are not registered io_uring buffers (`None`: they are).
    pub fixed_refused: Option<String>,
    pub bounce_pages: PageKind,
    pub bounce_bytes: usize,
    /// Bounce buffers each io_uring ring holds beyond one per slot, filled while every slot is in flight.
    pub bounce_spare: usize,
    /// Pages `alloc` buffers of a huge page or more get where nothing runs short.
    pub buffer_pages: PageKind,
    /// Why the block size and queue depth are what they are (picked, or given).
    pub why_block: String,
    pub why_depth: String,
    /// The drive's request limits (first path with a block device), when readable.
    pub limits: Option<QueueLimits>,
    /// Whether a bounced read advises its destination `MADV_HUGEPAGE`, and why
    /// (`machine::huge_destinations`).
    pub huge_destinations: (bool, &'static str),
    /// Whether direct reads into engine buffers skip the bounce buffers, and why
    /// (`machine::zero_copy_reads`: not where any path lies on a virtio disk).
    pub zero_copy_reads: (bool, &'static str),
    /// Fallbacks taken, one line each, for the caller to warn about.
    pub notes: Vec<String>,
}

pub struct Engine {
    cfg: EngineConfig,
    resolved: Resolved,
    store: Arc<Store>,
    /// `None` once closed. Calls that queue jobs hold the read side from their open check until their
    /// jobs are queued, so `close` (the write side) sees every job queued before it stops the workers.
    tx: RwLock<Option<queue::JobSender>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    keys: Mutex<Keys>,
    buffers: BufferRegistry,
    counters: Arc<Counters>,
    faults: Arc<FaultInjector>,
}

/// Jobs queued beyond what the workers hold; a caller submitting past it waits (backpressure).
const QUEUE_CAP: usize = 1 << 16;

type OpenGuard<'a> = RwLockReadGuard<'a, Option<queue::JobSender>>;

impl Engine {
    /// Validates the paths, opens a swap file in each, probes the backend and starts the workers.
    pub fn new(mut cfg: EngineConfig) -> Result<Engine> {
        validate(&mut cfg)?;
        let mut notes = Vec::new();
        let direct = match cfg.direct {
            DirectMode::Auto => None,
            DirectMode::On => Some(true),
            DirectMode::Off => Some(false),
        };
        let mut files = Vec::with_capacity(cfg.paths.len());
        for p in &cfg.paths {
            let (f, n) = SwapFile::create(p, direct)?;
            if let Some(why) = n.direct_refused {
                notes.push(format!("direct I/O unavailable, using buffered I/O: {why}"));
            }
            files.push(f);
        }
        let limits = files
            .iter()
            .filter_map(|f| crate::machine::queue_limits(f.raw_fd()))
            .min_by_key(|l| l.max_sectors_kb);
        let zero_copy_reads = match cfg.zero_copy_reads {
            Some(given) => (given, "given"),
            None => files
                .iter()
                .map(|f| {
                    crate::machine::zero_copy_reads(
                        crate::machine::disk_driver(f.raw_fd()).as_deref(),
                    )
                })
                .find(|z| !z.0)
                .unwrap_or(crate::machine::zero_copy_reads(None)),
        };
        let plan = plan_io(limits.as_ref(), crate::buffer::buffer_page());
        let (why_block, why_depth) = pick(&mut cfg, &plan);
        finish_validation(&mut cfg)?;
        let io_align = files.iter().map(SwapFile::io_align).max().unwrap_or(1);
        let mem_align = files.iter().map(SwapFile::mem_align).max().unwrap_or(1);
        let is_direct = files.iter().all(|f| matches!(f.access, Access::Direct(_)));
        if cfg.block_size as u64 % io_align != 0 {
            return Err(Error::InvalidArgument(format!(
                "block_size {} is not a multiple of the direct-I/O alignment {io_align} of the swap paths",
                cfg.block_size
            )));
        }
        let backend = match cfg.backend {
            Backend::Psync => Backend::Psync,
            want => match probe_io_uring() {
                Ok(()) => Backend::IoUring,
                Err(errno) if want == Backend::Auto => {
                    notes.push(format!(
                        "io_uring unavailable ({}), using the psync backend",
                        refusal(errno)
                    ));
                    Backend::Psync
                }
                Err(errno) => {
                    let why = if io_uring_disabled() {
                        "backend 'io_uring' requested but ZSWAP_DISABLE_IO_URING is set".into()
                    } else {
                        "backend 'io_uring' requested but io_uring_setup failed".into()
                    };
                    return Err(Error::Unavailable {
                        feature: Feature::IoUring,
                        errno,
                        why,
                    });
                }
            },
        };
        let (tx, rx) = queue::bounded(QUEUE_CAP);
        let counters = Arc::new(Counters::default());
        let faults = Arc::new(FaultInjector::default());
        let alive = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let ctx = || {
            alive.fetch_add(1, Ordering::AcqRel);
            WorkerCtx {
                rx: rx.clone(),
                counters: counters.clone(),
                faults: faults.clone(),
                alive: alive.clone(),
            }
        };
        let started = workers::start(&cfg, backend, cfg.backend, &ctx, &mut notes)?;
        let resolved = Resolved {
            backend: started.backend,
            direct: is_direct,
            io_align,
            mem_align,
            block_size: cfg.block_size,
            queue_depth: cfg.queue_depth,
            threads: started.threads,
            fixed_refused: started.fixed_refused,
            bounce_pages: started.bounce_pages,
            bounce_bytes: started.bounce_bytes,
            bounce_spare: started.bounce_spare,
            buffer_pages: crate::buffer::buffer_kind(),
            why_block,
            why_depth,
            limits,
            huge_destinations: crate::machine::huge_destinations(),
            zero_copy_reads,
            notes,
        };
        Ok(Engine {
            store: Arc::new(Store::new(files, cfg.block_size as u64)),
            cfg,
            resolved,
            tx: RwLock::new(Some(tx)),
            workers: Mutex::new(started.handles),
            keys: Mutex::new(Keys::default()),
            buffers: BufferRegistry::default(),
            counters,
            faults,
        })
    }

    pub fn resolved(&self) -> &Resolved {
        &self.resolved
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub fn faults(&self) -> &FaultInjector {
        &self.faults
    }

    /// Starts writing `len` bytes at `src` under `key`. The bytes go to a new extent; the key keeps
    /// reading its previous value until this write completes successfully, and keeps it if the write
    /// fails. Allocation errors (ENOSPC) are reported through the returned request, like I/O errors.
    ///
    /// # Safety
    /// `src..src+len` must stay valid and unmodified until the returned request completes.
    pub unsafe fn write(&self, key: &str, src: *const u8, len: usize) -> Result<Arc<Request>> {
        let open = self.open()?;
        self.reclaim();
        let layout = match self.allocate(len as u64) {
            Ok(l) => l,
            Err(e) => {
                self.lock_keys().write_refused(key, e.clone().with_key(key));
                return Ok(Request::failed(key, Op::Write, e, self.counters.clone()));
            }
        };
        let checksums: Option<Checksums> = self
            .cfg
            .checksum
            .then(|| (0..layout.nblocks()).map(|_| AtomicU32::new(0)).collect());
        let req = Request::new(
            key,
            Op::Write,
            len as u64,
            layout.nblocks(),
            self.counters.clone(),
        );
        let jobs = self.jobs(Op::Write, src as *mut u8, &layout, &checksums, &req);
        self.lock_keys().add_pending(
            key,
            Version {
                layout,
                checksums,
                write: req.clone(),
                readers: Vec::new(),
            },
        );
        self.send(&open, jobs);
        Ok(req)
    }

    /// Starts reading `key` into `dst`, which must hold exactly the key's length. Writes of the key
    /// still in flight are waited for first (without holding any lock); if they failed, the previous
    /// value is read.
    ///
    /// # Safety
    /// `dst..dst+len` must stay valid and untouched by others until the returned request completes.
    pub unsafe fn read(&self, key: &str, dst: *mut u8, len: usize) -> Result<Arc<Request>> {
        let open = self.open()?;
        self.reclaim();
        let (target, req) = loop {
            let pending = self.lock_keys().pending_writes(key);
            for w in &pending {
                let _ = w.wait();
            }
            let started = self.lock_keys().start_read(key, len as u64, |layout| {
                Request::new(
                    key,
                    Op::Read,
                    len as u64,
                    layout.nblocks(),
                    self.counters.clone(),
                )
            })?;
            if let Some(t) = started {
                break t;
            }
        };
        let jobs = self.jobs(Op::Read, dst, &target.layout, &target.checksums, &req);
        if self.resolved.huge_destinations.0 && jobs.iter().any(|j| j.bounce) {
            // Caller's memory: let its untouched pages fault in as huge pages (see buffer.rs), where
            // that was measured to be cheaper here.
            crate::buffer::advise_huge_destination(dst as usize, len);
        }
        self.send(&open, jobs);
        Ok(req)
    }

    /// Forgets `key` and returns its space, after the requests still using it complete (waited for
    /// without holding any lock). A key whose writes all failed is forgotten without error.
    pub fn free(&self, key: &str) -> Result<()> {
        let _open = self.open()?;
        let versions = self.lock_keys().remove(key)?;
        for v in &versions {
            for r in v.requests() {
                let _ = r.wait();
            }
        }
        for v in &versions {
            self.store.free(&v.layout);
        }
        self.reclaim();
        Ok(())
    }

    /// Whether `key` holds a value (or a write of one in flight).
    pub fn contains(&self, key: &str) -> Result<bool> {
        let _open = self.open()?;
        Ok(self.lock_keys().contains(key))
    }

    /// Bytes stored under `key` (by its newest write).
    pub fn len_of(&self, key: &str) -> Result<u64> {
        let _open = self.open()?;
        self.lock_keys().len_of(key)
    }

    pub fn keys(&self) -> Result<Vec<String>> {
        let _open = self.open()?;
        Ok(self.lock_keys().names())
    }

    /// A page-aligned, zero-filled buffer of at least `len` bytes; I/O on memory inside it is zero-copy.
    pub fn alloc(&self, len: usize) -> Result<Arc<AlignedBuf>> {
        let _open = self.open()?;
        self.buffers.alloc(len, self.cfg.lock_memory)
    }

    /// Called when the owner of an `alloc` buffer drops it.
    pub fn release_buffer(&self, addr: usize) {
        self.buffers.release(addr);
    }

    /// Whether `[addr, addr + len)` lies inside a live engine buffer (known mapped and writable).
    pub fn owns(&self, addr: usize, len: usize) -> bool {
        self.buffers.find(addr, len).is_some()
    }

    pub fn stats(&self) -> Stats {
        let c = &self.counters;
        if !self.is_closed() {
            self.reclaim();
        }
        let (reserved_bytes, file_bytes) = self.store.usage();
        Stats {
            bytes_read: c.bytes_read.load(Ordering::Relaxed),
            bytes_written: c.bytes_written.load(Ordering::Relaxed),
            reads: c.reads.load(Ordering::Relaxed),
            writes: c.writes.load(Ordering::Relaxed),
            blocks: c.blocks.load(Ordering::Relaxed),
            bounced_blocks: c.bounced_blocks.load(Ordering::Relaxed),
            short_transfers: c.short_transfers.load(Ordering::Relaxed),
            busy_seconds: c.busy_seconds(),
            keys: self.lock_keys().count(),
            reserved_bytes,
            file_bytes,
            allocated_bytes: if self.is_closed() {
                0
            } else {
                self.store.allocated_bytes()
            },
            live_buffers: self.buffers.count(),
        }
    }

    pub fn is_closed(&self) -> bool {
        read_lock(&self.tx).is_none()
    }

    /// Lets queued blocks finish, stops the workers and closes the swap files, which frees their space
    /// at once. Every later call but `stats`/`close` fails with `Error::Closed`. Idempotent.
    pub fn close(&self) {
        let tx = self.tx.write().unwrap_or_else(|e| e.into_inner()).take();
        let Some(tx) = tx else { return };
        drop(tx);
        for w in lock(&self.workers).drain(..) {
            let _ = w.join();
        }
        self.lock_keys().clear();
        // SAFETY: the workers are joined and every call that could queue a job or allocate holds the
        // open guard, which now reports closed: nothing uses the descriptors any more.
        unsafe { self.store.close() };
    }

    fn open(&self) -> Result<OpenGuard<'_>> {
        let g = read_lock(&self.tx);
        if g.is_none() {
            return Err(Error::Closed);
        }
        Ok(g)
    }

    /// Commits completed writes and frees the space of versions no request uses any more.
    fn reclaim(&self) {
        let idle = {
            let mut k = self.lock_keys();
            k.settle_all();
            k.take_idle()
        };
        for l in &idle {
            self.store.free(l);
        }
    }

    /// Gives every free byte of the swap files back to the file system now (after the versions writes
    /// replaced are freed): what a caller done with a set of keys calls so that the space they held does
    /// not stay reserved for reuse.
    pub fn trim(&self) -> Result<()> {
        let _open = self.open()?;
        self.reclaim();
        self.store.trim()
    }

    /// Allocates space for a new version; on ENOSPC first waits for replaced versions still in use
    /// (their readers) to release theirs, then tries once more.
    fn allocate(&self, len: u64) -> Result<Layout> {
        match self.store.allocate(len) {
            Err(Error::Io {
                errno: libc::ENOSPC,
                ..
            }) => {
                let busy = self.lock_keys().busy_retired();
                for r in &busy {
                    let _ = r.wait();
                }
                self.reclaim();
                self.store.allocate(len)
            }
            r => r,
        }
    }

    /// Splits a request into block jobs, choosing per block between zero-copy and a bounce buffer.
    fn jobs(
        &self,
        op: Op,
        mem: *mut u8,
        layout: &Layout,
        checksums: &Option<Checksums>,
        req: &Arc<Request>,
    ) -> Vec<BlockJob> {
        let owner = self.buffers.find(mem as usize, layout.len as usize);
        (0..layout.nblocks())
            .map(|i| {
                let b = layout.block(i);
                let file = &self.store.files[b.path];
                // SAFETY: data_offset < len, inside the caller's range.
                let user = unsafe { mem.add(b.data_offset as usize) };
                let io_len = crate::align::align_up(b.data_len, file.io_align()) as usize;
                let zero_copy = match file.access {
                    Access::Buffered => true,
                    Access::Direct(a) => {
                        // Ordinary (4 KiB-page) memory goes through the huge-page bounce buffers: a
                        // device caps segments per request, so small pages cut every transfer short.
                        // So do reads where the engine measured its bounce buffers faster
                        // (`machine::zero_copy_reads`).
                        (op == Op::Write || self.resolved.zero_copy_reads.0)
                            && owner.as_ref().is_some_and(|buf| {
                                let end = buf.as_ptr() as usize + buf.capacity();
                                (user as usize) % a.mem as usize == 0
                                // Padding past the data is written from (never read into) the buffer.
                                && (io_len == b.data_len as usize
                                    || (op == Op::Write && user as usize + io_len <= end))
                            })
                    }
                };
                BlockJob {
                    op,
                    store: self.store.clone(),
                    path: b.path,
                    file_offset: b.file_offset,
                    io_len,
                    data_len: b.data_len as usize,
                    user,
                    bounce: !zero_copy,
                    block: i,
                    checksums: checksums.clone(),
                    req: req.clone(),
                    _keep: owner.clone(),
                    finished: false,
                }
            })
            .collect()
    }

    /// Queues the jobs. A job the queue refuses (every worker stopped: a failed ring) is dropped,
    /// which completes its block with an error, so no waiter hangs.
    fn send(&self, open: &OpenGuard<'_>, jobs: Vec<BlockJob>) {
        let Some(tx) = open.as_ref() else {
            return; // unreachable while the guard is held; dropping the jobs fails them
        };
        for j in jobs {
            if let Err(crossbeam_channel::SendError(mut j)) = tx.send(j) {
                j.finished = true;
                let dir = self.store.files[j.path].dir.clone();
                let e = Error::io(Op::Submit, libc::EIO, &dir, j.file_offset, j.io_len as u64);
                j.req.complete_block(Err(e));
            }
        }
    }

    fn lock_keys(&self) -> MutexGuard<'_, Keys> {
        lock(&self.keys)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.close();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn read_lock<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_cow;
