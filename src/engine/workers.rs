//! Starting the worker threads: every io_uring ring is set up before any thread starts, so a refusal of
//! any one of them (ENOMEM over RLIMIT_MEMLOCK, EPERM under seccomp, ENOSYS) can still fall back to the
//! psync pool under `backend="auto"`, or be reported naming what was refused under `"io_uring"`.

use std::thread::JoinHandle;

use super::{psync, uring, Backend, EngineConfig, WorkerCtx};
use crate::buffer::PageKind;
use crate::error::{Error, Feature, Result};

/// psync threads at most: each blocks in one pread/pwrite; past this many a drive gains nothing and
/// the process pays a stack per thread.
pub const PSYNC_MAX_THREADS: usize = 64;

/// What the started workers are, for `Resolved`.
pub(super) struct Started {
    pub backend: Backend,
    pub handles: Vec<JoinHandle<()>>,
    pub threads: usize,
    /// Why the bounce buffers are not registered io_uring buffers (`None`: they are).
    pub fixed_refused: Option<String>,
    pub bounce_pages: PageKind,
    pub bounce_bytes: usize,
    /// Bounce buffers each ring holds beyond one per slot (0 for psync).
    pub bounce_spare: usize,
}

/// Starts the workers of `backend` (already probed: `IoUring` or `Psync`). `want` is what the user
/// asked for: under `Auto` a refused ring falls back to psync, adding a note.
pub(super) fn start(
    cfg: &EngineConfig,
    backend: Backend,
    want: Backend,
    ctx: &dyn Fn() -> WorkerCtx,
    notes: &mut Vec<String>,
) -> Result<Started> {
    let budget = cfg.pinned_memory_budget.unwrap_or(default_budget(cfg));
    if backend == Backend::IoUring {
        match rings(cfg, budget) {
            Ok(rings) => return spawn_rings(rings, ctx, cfg.lock_memory, notes),
            Err(Error::Unavailable { errno, why, .. }) if want == Backend::Auto => {
                notes.push(format!(
                    "io_uring unavailable ({}: {why}), using the psync backend",
                    crate::error::strerror(errno)
                ));
            }
            Err(e) => return Err(e),
        }
    }
    let threads = cfg
        .queue_depth
        .min(budget / cfg.block_size)
        .clamp(1, PSYNC_MAX_THREADS);
    let mut s = Started {
        backend: Backend::Psync,
        handles: Vec::new(),
        threads,
        fixed_refused: Some("the psync backend has no io_uring ring to register them with".into()),
        bounce_pages: PageKind::Small,
        bounce_bytes: 0,
        bounce_spare: 0,
    };
    let mut locked = true;
    for i in 0..threads {
        let w = psync::PsyncWorker::new(cfg.block_size, cfg.lock_memory)?;
        s.bounce_pages = w.page_kind();
        s.bounce_bytes += cfg.block_size;
        locked &= w.locked();
        s.handles
            .push(spawn(format!("zswap-psync-{i}"), ctx(), move |c| w.run(c))?);
    }
    if cfg.lock_memory && !locked {
        notes.push(unlocked_note(s.bounce_bytes));
    }
    Ok(s)
}

/// Bounce buffers a ring holds beyond one per slot, when the budget allows: the next block's copy is
/// made while every slot is in flight (see `uring::UringWorker`). More than one measured no better.
const SPARE_BUFFERS: usize = 1;

/// The bounce-buffer budget when the user sets none: a block per slot and the rings' spares.
fn default_budget(cfg: &EngineConfig) -> usize {
    let threads = cfg.threads.max(1);
    (cfg.queue_depth.div_ceil(threads) + SPARE_BUFFERS) * threads * cfg.block_size
}

/// Sets up every ring (none started yet).
fn rings(cfg: &EngineConfig, budget: usize) -> Result<Vec<uring::UringWorker>> {
    let threads = cfg.threads;
    let per_ring = budget / (threads * cfg.block_size);
    let depth = cfg.queue_depth.div_ceil(threads).min(per_ring).max(1);
    let spare = per_ring.saturating_sub(depth).min(SPARE_BUFFERS);
    (0..threads)
        .map(|i| {
            uring::UringWorker::new(depth, spare, cfg.block_size, cfg.lock_memory).map_err(|e| {
                match e {
                    Error::Unavailable {
                        feature,
                        errno,
                        why,
                    } => Error::Unavailable {
                        feature,
                        errno,
                        why: format!("ring {} of {threads}: {why}", i + 1),
                    },
                    e => e,
                }
            })
        })
        .collect()
}

fn spawn_rings(
    rings: Vec<uring::UringWorker>,
    ctx: &dyn Fn() -> WorkerCtx,
    lock: bool,
    notes: &mut Vec<String>,
) -> Result<Started> {
    let mut s = Started {
        backend: Backend::IoUring,
        handles: Vec::new(),
        threads: rings.len(),
        fixed_refused: None,
        bounce_pages: PageKind::Small,
        bounce_bytes: 0,
        bounce_spare: 0,
    };
    let total: usize = rings.iter().map(uring::UringWorker::bounce_bytes).sum();
    let mut locked = true;
    for (i, w) in rings.into_iter().enumerate() {
        if let (Some(errno), None) = (w.fixed_refusal(), &s.fixed_refused) {
            s.fixed_refused = Some(format!(
                "registering the {} MiB of bounce buffers failed: {} (errno {errno}){}; plain io_uring \
                 reads and writes instead (the same data path, a little more CPU per request)",
                total >> 20,
                crate::error::strerror(errno),
                if errno == libc::ENOMEM { memlock_hint(Some(total)) } else { String::new() },
            ));
        }
        locked &= w.locked();
        s.bounce_pages = w.page_kind();
        s.bounce_bytes += w.bounce_bytes();
        s.bounce_spare = w.spare();
        s.handles
            .push(spawn(format!("zswap-uring-{i}"), ctx(), move |c| w.run(c))?);
    }
    if lock && !locked {
        notes.push(unlocked_note(total));
    }
    Ok(s)
}

/// RLIMIT_MEMLOCK's soft limit in bytes (`None`: unlimited or unreadable).
fn memlock_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills the struct we pass.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } == 0;
    (ok && lim.rlim_cur != libc::RLIM_INFINITY).then_some(lim.rlim_cur)
}

/// Why memory the kernel pins (`need` bytes, where known) was refused, where RLIMIT_MEMLOCK is the
/// likely cause.
pub(super) fn memlock_hint(need: Option<usize>) -> String {
    let Some(limit) = memlock_limit() else {
        return String::new();
    };
    let need = need.map_or(String::new(), |n| format!(", {} KiB needed", n / 1024));
    format!(
        ": pinned memory is charged to RLIMIT_MEMLOCK ({} KiB here{need}) without CAP_IPC_LOCK; raise \
         it (ulimit -l unlimited, LimitMEMLOCK=, docker --ulimit memlock=-1)",
        limit / 1024
    )
}

/// The note (a Python `ZswapWarning`) for `lock_memory` that locked nothing.
fn unlocked_note(bytes: usize) -> String {
    format!(
        "lock_memory: the {} MiB of bounce buffers could not be locked (mlock refused{}), so they may be \
         swapped out",
        bytes >> 20,
        memlock_hint(Some(bytes))
    )
}

/// Why a ring of `entries` was refused, with the memlock limit when that is the likely cause.
pub(super) fn ring_refusal(entries: u32, errno: i32) -> Error {
    let mut why = format!("io_uring_setup of a {entries}-entry ring failed");
    let hint = if errno == libc::ENOMEM {
        memlock_hint(None)
    } else {
        String::new()
    };
    if !hint.is_empty() {
        why.push_str(&format!("{hint}, or lower aio.queue_depth"));
    }
    Error::Unavailable {
        feature: Feature::IoUring,
        errno,
        why,
    }
}

fn spawn<F>(name: String, ctx: WorkerCtx, f: F) -> Result<JoinHandle<()>>
where
    F: FnOnce(WorkerCtx) + Send + 'static,
{
    std::thread::Builder::new()
        .name(name.clone())
        .spawn(move || f(ctx))
        .map_err(|e| Error::Spawn {
            errno: e.raw_os_error().unwrap_or(libc::EAGAIN),
            what: name,
        })
}
