//! One swap file: opened already unlinked, probed for direct I/O with a single aligned block, grown with
//! `fallocate`, given back to the file system with `FALLOC_FL_PUNCH_HOLE`, closed on demand.
//!
//! Files are opened with `O_TMPFILE | O_EXCL` (or created and unlinked at once where the file system
//! lacks O_TMPFILE), mode 0600: the space belongs to the open descriptor, so close, a crash or `kill -9`
//! returns it and leaves nothing on the drive. `O_EXCL` makes the kernel refuse `linkat` of the
//! descriptor, so the file can never be given a name through `/proc/self/fd/N` either.

use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use super::extent::ExtentAllocator;
use super::UNIT;
use crate::align::{align_up, cpath, probe_dio_align, DioAlign};
use crate::buffer::AlignedBuf;
use crate::error::{Error, Feature, Op, Result};

/// Files grow by at least this much (or the current size, whichever is larger, up to 1 GiB) so
/// `fallocate` is not called per write.
const GROW_MIN: u64 = 64 << 20;
const GROW_MAX: u64 = 1 << 30;

/// Bytes a file of `size` bytes grows by at once (`ensure_size`): its size, within [64 MiB, 1 GiB], so a
/// growing file calls `fallocate` a logarithmic number of times.
pub fn growth_step(size: u64) -> u64 {
    size.clamp(GROW_MIN, GROW_MAX)
}

/// How a swap file is accessed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// `O_DIRECT` with the given alignment.
    Direct(DioAlign),
    /// Through the page cache.
    Buffered,
}

/// One unlinked swap file.
pub struct SwapFile {
    /// Our descriptor until `close`; the engine guarantees no transfer uses it after that.
    fd: RawFd,
    closed: AtomicBool,
    /// The directory (the file itself has no name); used in messages.
    pub dir: PathBuf,
    pub access: Access,
    size: AtomicU64,
    pub alloc: Mutex<ExtentAllocator>,
    grow_lock: Mutex<()>,
}

/// What opening a swap file had to fall back from, for the caller to warn about.
#[derive(Debug, Default)]
pub struct OpenNotes {
    pub direct_refused: Option<String>,
}

static NAME_SEQ: AtomicUsize = AtomicUsize::new(0);

impl SwapFile {
    /// Opens a new unlinked file in `dir`. `direct`: `Some(true)` requires O_DIRECT, `Some(false)` avoids
    /// it, `None` tries it and falls back to buffered I/O (reported in the notes) — but only when the
    /// file system refuses direct I/O itself; ENOSPC, EIO and the like are errors either way.
    pub fn create(dir: &Path, direct: Option<bool>) -> Result<(SwapFile, OpenNotes)> {
        check_dir(dir)?;
        let mut notes = OpenNotes::default();
        let want_direct = direct != Some(false);
        let refused = |why: String| Error::Unavailable {
            feature: Feature::DirectIo,
            errno: libc::EINVAL,
            why: format!("{}: {why}", dir.display()),
        };
        let fd = match open_unlinked(dir, want_direct) {
            Err(libc::EINVAL) if want_direct && direct.is_none() => {
                notes.direct_refused =
                    Some(format!("{}: O_DIRECT refused (EINVAL)", dir.display()));
                open_unlinked(dir, false)
            }
            Err(libc::EINVAL) if want_direct => {
                return Err(refused("open with O_DIRECT failed".into()))
            }
            r => r,
        }
        .map_err(|errno| Error::io(Op::Open, errno, dir, 0, 0))?;
        let opened_direct = want_direct && notes.direct_refused.is_none();
        let mut file = SwapFile {
            fd,
            closed: AtomicBool::new(false),
            dir: dir.to_path_buf(),
            access: Access::Buffered,
            size: AtomicU64::new(0),
            alloc: Mutex::new(ExtentAllocator::new(UNIT)),
            grow_lock: Mutex::new(()),
        };
        if opened_direct {
            match file.probe_direct()? {
                Ok(a) => {
                    file.access = Access::Direct(a);
                    file.alloc = Mutex::new(ExtentAllocator::new(UNIT.max(a.offset)));
                }
                Err(why) if direct.is_none() => {
                    notes.direct_refused = Some(format!("{}: {why}", dir.display()));
                    file.set_direct(false)?;
                }
                Err(why) => return Err(refused(why)),
            }
        }
        Ok((file, notes))
    }

    pub fn raw_fd(&self) -> RawFd {
        self.fd
    }

    /// Closes the descriptor, which frees the file's space at once. Idempotent.
    ///
    /// # Safety
    /// No transfer, allocation or punch may use the file any more (the engine has stopped its workers
    /// and refuses new calls): the descriptor number may be reused by anyone after this.
    pub unsafe fn close(&self) {
        if !self.closed.swap(true, Ordering::AcqRel) {
            libc::close(self.fd);
        }
    }

    /// Offset alignment of transfers on this file (1 for buffered).
    pub fn io_align(&self) -> u64 {
        match self.access {
            Access::Direct(a) => a.offset,
            Access::Buffered => 1,
        }
    }

    /// Memory alignment a zero-copy transfer needs (1 for buffered).
    pub fn mem_align(&self) -> u64 {
        match self.access {
            Access::Direct(a) => a.mem,
            Access::Buffered => 1,
        }
    }

    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    /// Allocation granularity: offsets and reservations are multiples of it.
    pub fn unit(&self) -> u64 {
        UNIT.max(self.io_align())
    }

    /// Makes the file at least `need` bytes long with `fallocate`, growing by `growth_step`; on ENOSPC
    /// retries with exactly what is needed before failing.
    pub fn ensure_size(&self, need: u64) -> Result<()> {
        if need <= self.size() {
            return Ok(());
        }
        let _g = self.grow_lock.lock().unwrap_or_else(|e| e.into_inner());
        let cur = self.size();
        if need <= cur {
            return Ok(());
        }
        let generous = align_up(need.max(cur + growth_step(cur)), UNIT);
        let mut target = generous;
        loop {
            let errno = match self.fallocate(0, cur, target - cur) {
                Ok(()) => break,
                Err(errno) => errno,
            };
            // A refused fallocate may have allocated part of the range and grown the file over it (ext4
            // keeps the extents it made before ENOSPC): cut the file back to `cur`, or that part would
            // stay taken from the file system, unused, until the engine closes. Best effort: where the
            // truncate fails the file keeps that part, as it did before.
            // SAFETY: ftruncate on our own descriptor; nothing lies past `cur`, which the allocator has
            // not been given (the size is published below, under `grow_lock`).
            unsafe { libc::ftruncate(self.fd, cur as i64) };
            match errno {
                // Growth ahead of need refused (a full disk, a file-size limit): just what is needed.
                libc::ENOSPC | libc::EFBIG if target > need => target = need,
                _ => return Err(Error::io(Op::Allocate, errno, &self.dir, cur, need - cur)),
            }
        }
        self.size.store(target, Ordering::Release);
        Ok(())
    }

    /// Allocates `[off, off + len)` again after it was punched (it lies below the file size).
    pub fn fill(&self, off: u64, len: u64) -> Result<()> {
        self.fallocate(0, off, len)
            .map_err(|errno| Error::io(Op::Allocate, errno, &self.dir, off, len))
    }

    /// Returns the given free ranges to the file system and truncates the file to `keep` bytes (the
    /// allocator's high-water mark). A file system without hole punching (EOPNOTSUPP) keeps the space,
    /// which costs nothing but disk; any other failure is the first error, after every range was tried
    /// (the space stays allocated, the data is untouched). The caller holds the allocator, so none of the
    /// ranges is in use.
    pub fn give_back(&self, ranges: &[(u64, u64)], keep: u64) -> Result<()> {
        let mut first = None;
        for &(off, len) in ranges {
            let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
            match self.fallocate(punch, off, len) {
                Ok(()) | Err(libc::EOPNOTSUPP) => {}
                Err(errno) => {
                    first
                        .get_or_insert_with(|| Error::io(Op::Allocate, errno, &self.dir, off, len));
                }
            }
        }
        let _g = self.grow_lock.lock().unwrap_or_else(|e| e.into_inner());
        let keep = align_up(keep, UNIT);
        let size = self.size();
        if keep < size {
            // SAFETY: ftruncate on our own open descriptor; no memory is passed.
            if unsafe { libc::ftruncate(self.fd, keep as i64) } == 0 {
                self.size.store(keep, Ordering::Release);
            } else {
                let e = Error::io(Op::Allocate, last_errno(), &self.dir, keep, size - keep);
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Bytes the file system holds for this file (`st_blocks × 512`).
    pub fn allocated_bytes(&self) -> u64 {
        // SAFETY: fstat fills the zeroed struct we pass; the result is checked.
        unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(self.fd, &mut st) == 0 {
                st.st_blocks as u64 * 512
            } else {
                0
            }
        }
    }

    fn fallocate(&self, mode: i32, off: u64, len: u64) -> std::result::Result<(), i32> {
        // SAFETY: fallocate on a descriptor we own; no memory is passed.
        let rc = unsafe { libc::fallocate(self.fd, mode, off as i64, len as i64) };
        if rc == 0 {
            return Ok(());
        }
        let errno = last_errno();
        if errno == libc::EOPNOTSUPP && mode == 0 {
            // No preallocation here (some network and FUSE file systems): a sparse extension still
            // reserves the range, and ENOSPC then surfaces at write time, where it is reported too.
            if off + len <= self.size() {
                return Ok(());
            }
            // SAFETY: as above.
            let rc = unsafe { libc::ftruncate(self.fd, (off + len) as i64) };
            return if rc == 0 { Ok(()) } else { Err(last_errno()) };
        }
        Err(errno)
    }

    /// Reads the file's direct-I/O alignment and proves it with one aligned write and read (some file
    /// systems accept the flag at open and refuse the I/O), then truncates the file back to empty.
    /// `Ok(Err(why))`: the file system refuses direct I/O; `Err`: a real fault (ENOSPC, EIO...).
    fn probe_direct(&self) -> Result<std::result::Result<DioAlign, String>> {
        let Some(a) = probe_dio_align(self.fd) else {
            return Ok(Err("the file system reports no direct I/O support".into()));
        };
        let len = a.offset.max(UNIT) as usize;
        let buf = AlignedBuf::new(len, false)?;
        let outcome = (|| {
            // SAFETY: `buf` is a live page-aligned mapping of at least `len` bytes.
            let w = unsafe { libc::pwrite(self.fd, buf.as_ptr().cast(), len, 0) };
            self.probe_result(Op::Write, w, len)?;
            // SAFETY: as above; the kernel writes at most `len` bytes into the buffer.
            let r = unsafe { libc::pread(self.fd, buf.as_ptr().cast(), len, 0) };
            self.probe_result(Op::Read, r, len)
        })();
        // SAFETY: ftruncate on our own descriptor: the probe block is not kept.
        unsafe { libc::ftruncate(self.fd, 0) };
        Ok(match outcome {
            Ok(()) => Ok(a),
            Err(Probe::Refused(why)) => Err(why),
            Err(Probe::Fault(e)) => return Err(e),
        })
    }

    fn probe_result(&self, op: Op, rc: isize, len: usize) -> std::result::Result<(), Probe> {
        if rc == len as isize {
            return Ok(());
        }
        if rc >= 0 {
            return Err(Probe::Refused(format!(
                "O_DIRECT probe {op} transferred {rc} of {len} bytes"
            )));
        }
        match last_errno() {
            // What a file system that cannot do direct I/O answers.
            e @ (libc::EINVAL | libc::EOPNOTSUPP) => Err(Probe::Refused(format!(
                "O_DIRECT probe {op} failed: {}",
                crate::error::strerror(e)
            ))),
            e => Err(Probe::Fault(Error::io(op, e, &self.dir, 0, len as u64))),
        }
    }

    fn set_direct(&self, on: bool) -> Result<()> {
        // SAFETY: fcntl flag manipulation on our own descriptor.
        let flags = unsafe { libc::fcntl(self.fd, libc::F_GETFL) };
        let new = if on {
            flags | libc::O_DIRECT
        } else {
            flags & !libc::O_DIRECT
        };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(self.fd, libc::F_SETFL, new) } < 0 {
            return Err(Error::io(Op::Open, last_errno(), &self.dir, 0, 0));
        }
        Ok(())
    }
}

impl Drop for SwapFile {
    fn drop(&mut self) {
        // SAFETY: dropping means nobody holds the file any more.
        unsafe { self.close() };
    }
}

enum Probe {
    Refused(String),
    Fault(Error),
}

pub(crate) fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Missing → ENOENT, not a directory → ENOTDIR, not writable → EACCES; each names the path.
pub fn check_dir(dir: &Path) -> Result<()> {
    let meta = std::fs::metadata(dir).map_err(|e| Error::from_io(Op::Open, &e, dir))?;
    if !meta.is_dir() {
        return Err(Error::io(Op::Open, libc::ENOTDIR, dir, 0, 0));
    }
    let c = cpath(dir).map_err(|e| Error::from_io(Op::Open, &e, dir))?;
    // SAFETY: `c` is a valid NUL-terminated path.
    if unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
        return Err(Error::io(Op::Open, last_errno(), dir, 0, 0));
    }
    Ok(())
}

fn open_unlinked(dir: &Path, direct: bool) -> std::result::Result<RawFd, i32> {
    let extra = if direct { libc::O_DIRECT } else { 0 };
    let c = cpath(dir).map_err(|_| libc::EINVAL)?;
    // SAFETY: valid path; the returned descriptor is checked and then owned by the SwapFile.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_TMPFILE | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC | extra,
            0o600,
        )
    };
    if fd >= 0 {
        return Ok(fd);
    }
    let errno = last_errno();
    // O_TMPFILE unsupported by this file system (EOPNOTSUPP) or kernel (EISDIR): name, then unlink.
    if !matches!(errno, libc::EOPNOTSUPP | libc::EISDIR) {
        return Err(errno);
    }
    let seq = NAME_SEQ.fetch_add(1, Ordering::Relaxed);
    let name = dir.join(format!(".zswap-{}-{seq}.swap", std::process::id()));
    let cn = cpath(&name).map_err(|_| libc::EINVAL)?;
    // SAFETY: valid path; result checked.
    let fd = unsafe {
        libc::open(
            cn.as_ptr(),
            libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC | extra,
            0o600,
        )
    };
    if fd < 0 {
        return Err(last_errno());
    }
    // SAFETY: valid path. Unlinking at once means the space lives only as long as the descriptor.
    if unsafe { libc::unlink(cn.as_ptr()) } != 0 {
        let e = last_errno();
        // SAFETY: our fresh descriptor, not handed out.
        unsafe { libc::close(fd) };
        return Err(e);
    }
    Ok(fd)
}
