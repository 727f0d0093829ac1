//! The engine: keys → layouts in the swap files, requests split into blocks, and worker threads (io_uring
//! rings or a pread/pwrite pool) that move the blocks.
//!
//! Contract for `write`/`read`: the caller's memory must stay valid, and must not be written (by a write)
//! or touched at all (by a read), until the returned request completes. `src/py/` keeps the tensor
//! alive for that long.

mod fault;
mod job;
mod psync;
mod request;
mod uring;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

pub use fault::{Fault, FaultInjector};
use job::{BlockJob, Checksums};
pub use request::{Counters, Request};

use crate::buffer::{AlignedBuf, BufferRegistry, PageKind};
use crate::error::{Error, Op, Result};
use crate::store::{Access, Layout, Store, SwapFile};

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
    /// Default 1 MiB.
    pub block_size: usize,
    /// Blocks in flight across the whole engine (fio's `iodepth` for one job). Default 16.
    pub queue_depth: usize,
    /// Worker threads: io_uring rings (each with `queue_depth / threads` slots), or for psync the
    /// number of threads doing blocking calls is `queue_depth`. Default: 2 rings, at least one per path.
    pub threads: usize,
    pub backend: Backend,
    pub direct: DirectMode,
    /// Record a CRC32C per block on write and check it on read.
    pub checksum: bool,
    /// Bytes of bounce buffers the engine may hold: at least `threads × block_size`. Default
    /// `queue_depth × block_size`.
    pub pinned_memory_budget: Option<usize>,
    /// `mlock` engine buffers (bounce and `alloc`) where RLIMIT_MEMLOCK allows.
    pub lock_memory: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            paths: Vec::new(),
            block_size: 1 << 20,
            queue_depth: 16,
            threads: 0,
            backend: Backend::Auto,
            direct: DirectMode::Auto,
            checksum: false,
            pinned_memory_budget: None,
            lock_memory: false,
        }
    }
}

/// `Ok` when this kernel and sandbox allow io_uring, else the errno of the refusal. Setting
/// `ZSWAP_DISABLE_IO_URING=1` refuses it with EPERM: an escape hatch around a misbehaving kernel, and
/// how the fallback path is tested on machines where io_uring works.
pub fn probe_io_uring() -> std::result::Result<(), i32> {
    if std::env::var_os("ZSWAP_DISABLE_IO_URING").is_some_and(|v| !v.is_empty() && v != "0") {
        return Err(libc::EPERM);
    }
    uring::probe()
}

/// What a worker thread needs besides its own ring or buffer.
pub(crate) struct WorkerCtx {
    pub rx: Receiver<BlockJob>,
    pub counters: Arc<Counters>,
    pub faults: Arc<FaultInjector>,
}

/// Where a key's bytes are and which requests still use them.
struct Entry {
    layout: Layout,
    checksums: Option<Checksums>,
    write: Arc<Request>,
    readers: Vec<Arc<Request>>,
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
    pub fixed_buffers: bool,
    pub bounce_pages: PageKind,
    pub bounce_bytes: usize,
    /// Fallbacks taken, one line each, for the caller to warn about.
    pub notes: Vec<String>,
}

pub struct Engine {
    cfg: EngineConfig,
    resolved: Resolved,
    store: Arc<Store>,
    tx: Mutex<Option<Sender<BlockJob>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    keys: Mutex<HashMap<String, Entry>>,
    buffers: BufferRegistry,
    counters: Arc<Counters>,
    faults: Arc<FaultInjector>,
}

/// Jobs queued beyond what the workers hold; a caller submitting past it waits (backpressure).
const QUEUE_CAP: usize = 1 << 16;

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
                        crate::error::strerror(errno)
                    ));
                    Backend::Psync
                }
                Err(errno) => {
                    return Err(Error::InvalidArgument(format!(
                    "backend 'io_uring' requested but io_uring_setup failed: {} (errno {errno})",
                    crate::error::strerror(errno)
                )))
                }
            },
        };
        let (tx, rx) = crossbeam_channel::bounded(QUEUE_CAP);
        let counters = Arc::new(Counters::default());
        let faults = Arc::new(FaultInjector::default());
        let ctx = || WorkerCtx {
            rx: rx.clone(),
            counters: counters.clone(),
            faults: faults.clone(),
        };
        let budget = cfg
            .pinned_memory_budget
            .unwrap_or(cfg.queue_depth * cfg.block_size);
        let mut workers = Vec::new();
        let mut fixed_buffers = true;
        let mut bounce_pages = PageKind::Small;
        let mut bounce_bytes = 0;
        let threads;
        match backend {
            Backend::IoUring => {
                threads = cfg.threads;
                let depth = cfg
                    .queue_depth
                    .div_ceil(threads)
                    .min(budget / (threads * cfg.block_size));
                for i in 0..threads {
                    let w = uring::UringWorker::new(depth, cfg.block_size, cfg.lock_memory)?;
                    fixed_buffers &= w.fixed_buffers();
                    bounce_pages = w.page_kind();
                    bounce_bytes += depth * cfg.block_size;
                    workers.push(spawn(format!("zswap-uring-{i}"), ctx(), move |c| w.run(c))?);
                }
            }
            _ => {
                fixed_buffers = false;
                threads = cfg.queue_depth.min(budget / cfg.block_size);
                for i in 0..threads {
                    let w = psync::PsyncWorker::new(cfg.block_size, cfg.lock_memory)?;
                    bounce_pages = w.page_kind();
                    bounce_bytes += cfg.block_size;
                    workers.push(spawn(format!("zswap-psync-{i}"), ctx(), move |c| w.run(c))?);
                }
            }
        }
        let resolved = Resolved {
            backend,
            direct: is_direct,
            io_align,
            mem_align,
            block_size: cfg.block_size,
            queue_depth: cfg.queue_depth,
            threads,
            fixed_buffers,
            bounce_pages,
            bounce_bytes,
            notes,
        };
        Ok(Engine {
            store: Arc::new(Store::new(files, cfg.block_size as u64)),
            cfg,
            resolved,
            tx: Mutex::new(Some(tx)),
            workers: Mutex::new(workers),
            keys: Mutex::new(HashMap::new()),
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

    /// Starts writing `len` bytes at `src` under `key`, replacing what the key held. Allocation errors
    /// (ENOSPC) are reported through the returned request, like I/O errors.
    ///
    /// # Safety
    /// `src..src+len` must stay valid and unmodified until the returned request completes.
    pub unsafe fn write(&self, key: &str, src: *const u8, len: usize) -> Result<Arc<Request>> {
        self.check_open()?;
        if let Some(old) = self.lock_keys().remove(key) {
            self.retire(old);
        }
        let layout = match self.store.allocate(len as u64) {
            Ok(l) => l,
            Err(e) => return Ok(Request::failed(key, Op::Write, e, self.counters.clone())),
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
        self.lock_keys().insert(
            key.to_owned(),
            Entry {
                layout,
                checksums,
                write: req.clone(),
                readers: Vec::new(),
            },
        );
        self.send(jobs)?;
        Ok(req)
    }

    /// Starts reading `key` into `dst`, which must hold exactly the key's length. A write of the key
    /// still in flight is waited for first.
    ///
    /// # Safety
    /// `dst..dst+len` must stay valid and untouched by others until the returned request completes.
    pub unsafe fn read(&self, key: &str, dst: *mut u8, len: usize) -> Result<Arc<Request>> {
        self.check_open()?;
        let (layout, checksums, write, req) = {
            let mut keys = self.lock_keys();
            let e = keys
                .get_mut(key)
                .ok_or_else(|| Error::UnknownKey(key.to_owned()))?;
            if e.layout.len != len as u64 {
                return Err(Error::InvalidArgument(format!(
                    "key {key:?} holds {} bytes but the destination holds {len}",
                    e.layout.len
                )));
            }
            let req = Request::new(
                key,
                Op::Read,
                len as u64,
                e.layout.nblocks(),
                self.counters.clone(),
            );
            e.readers.retain(|r| !r.is_done());
            e.readers.push(req.clone());
            (e.layout.clone(), e.checksums.clone(), e.write.clone(), req)
        };
        if let Err(cause) = write.wait() {
            // The reader registered above must still complete, or `free` would wait on it forever.
            let err = Error::Poisoned {
                key: key.to_owned(),
                cause: Box::new(cause),
            };
            for _ in 0..layout.nblocks() {
                req.complete_block(Err(err.clone()));
            }
            return Err(err);
        }
        let jobs = self.jobs(Op::Read, dst, &layout, &checksums, &req);
        self.send(jobs)?;
        Ok(req)
    }

    /// Forgets `key` and returns its space, after the requests still using it complete.
    pub fn free(&self, key: &str) -> Result<()> {
        self.check_open()?;
        let e = self
            .lock_keys()
            .remove(key)
            .ok_or_else(|| Error::UnknownKey(key.to_owned()))?;
        self.retire(e);
        Ok(())
    }

    pub fn contains(&self, key: &str) -> bool {
        self.lock_keys().contains_key(key)
    }

    /// Bytes stored under `key`.
    pub fn len_of(&self, key: &str) -> Result<u64> {
        self.lock_keys()
            .get(key)
            .map(|e| e.layout.len)
            .ok_or_else(|| Error::UnknownKey(key.to_owned()))
    }

    pub fn keys(&self) -> Vec<String> {
        self.lock_keys().keys().cloned().collect()
    }

    /// A page-aligned, zero-filled buffer of at least `len` bytes; I/O on memory inside it is zero-copy.
    pub fn alloc(&self, len: usize) -> Result<Arc<AlignedBuf>> {
        self.buffers.alloc(len, self.cfg.lock_memory)
    }

    /// Called when the owner of an `alloc` buffer drops it.
    pub fn release_buffer(&self, addr: usize) {
        self.buffers.release(addr);
    }

    pub fn stats(&self) -> Stats {
        let c = &self.counters;
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
            keys: self.lock_keys().len(),
            reserved_bytes,
            file_bytes,
            live_buffers: self.buffers.count(),
        }
    }

    pub fn is_closed(&self) -> bool {
        lock(&self.tx).is_none()
    }

    /// Lets queued blocks finish, stops the workers and closes the swap files (which frees their space).
    /// Idempotent.
    pub fn close(&self) {
        drop(lock(&self.tx).take());
        for w in lock(&self.workers).drain(..) {
            let _ = w.join();
        }
        self.lock_keys().clear();
    }

    fn check_open(&self) -> Result<()> {
        if self.is_closed() {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }

    /// Waits until no request uses `e`'s space, then frees it.
    fn retire(&self, e: Entry) {
        let _ = e.write.wait();
        for r in &e.readers {
            let _ = r.wait();
        }
        self.store.free(&e.layout);
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
                        owner.as_ref().is_some_and(|buf| {
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
                }
            })
            .collect()
    }

    fn send(&self, jobs: Vec<BlockJob>) -> Result<()> {
        let tx = lock(&self.tx).clone().ok_or(Error::Closed)?;
        for j in jobs {
            // Err only if every worker is gone, which `close` alone causes; finish the block so waiters
            // do not hang.
            if let Err(crossbeam_channel::SendError(j)) = tx.send(j) {
                j.finish(Err(Error::Closed), &self.counters);
            }
        }
        Ok(())
    }

    fn lock_keys(&self) -> MutexGuard<'_, HashMap<String, Entry>> {
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

fn spawn<F>(name: String, ctx: WorkerCtx, f: F) -> Result<JoinHandle<()>>
where
    F: FnOnce(WorkerCtx) + Send + 'static,
{
    std::thread::Builder::new()
        .name(name)
        .spawn(move || f(ctx))
        .map_err(|e| Error::InvalidArgument(format!("cannot start an engine thread: {e}")))
}

/// Fills defaults and rejects unusable settings, naming the setting and the value.
fn validate(cfg: &mut EngineConfig) -> Result<()> {
    let bad = |m: String| Err(Error::InvalidArgument(m));
    if cfg.paths.is_empty() {
        return bad("at least one swap path is required".into());
    }
    let bs = cfg.block_size;
    if !bs.is_power_of_two() || !(4096..=64 << 20).contains(&bs) {
        return bad(format!(
            "block_size must be a power of two from 4096 to 64 MiB, got {bs}"
        ));
    }
    if !(1..=4096).contains(&cfg.queue_depth) {
        return bad(format!(
            "queue_depth must be from 1 to 4096, got {}",
            cfg.queue_depth
        ));
    }
    if cfg.threads == 0 {
        cfg.threads = cfg.paths.len().max(2);
    }
    cfg.threads = cfg.threads.min(cfg.queue_depth);
    if cfg.threads > 256 {
        return bad(format!("threads must be at most 256, got {}", cfg.threads));
    }
    if let Some(b) = cfg.pinned_memory_budget {
        if b < cfg.threads * bs {
            return bad(format!(
                "pinned_memory_budget {b} bytes is too small: the engine needs at least threads × block_size \
                 = {} × {bs} = {} bytes of bounce buffers; raise the budget or lower block_size/threads",
                cfg.threads,
                cfg.threads * bs
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
