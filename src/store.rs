//! Swap space: one preallocated, already-unlinked file per path, an extent allocator over each, and the
//! layout that stripes a key's blocks across paths.
//!
//! Files are opened with `O_TMPFILE` (or created and unlinked at once where the file system lacks it),
//! mode 0600: the space belongs to the open descriptor, so close, a crash or `kill -9` returns it and
//! leaves nothing on the drive.

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::align::{align_up, cpath, probe_dio_align, DioAlign};
use crate::buffer::AlignedBuf;
use crate::error::{Error, Op, Result};

/// Allocation granularity and the smallest file offset alignment zswap uses.
pub const UNIT: u64 = 4096;
/// Files grow by at least this much (or the current size, whichever is larger, up to 1 GiB) so
/// `fallocate` is not called per write.
const GROW_MIN: u64 = 64 << 20;
const GROW_MAX: u64 = 1 << 30;

/// Best-fit allocator of aligned extents with coalescing. Freed space is reused before the file grows,
/// and space freed at the end shrinks the high-water mark, so fragmentation stays bounded by the free
/// extents between live ones.
#[derive(Debug)]
pub struct ExtentAllocator {
    unit: u64,
    by_off: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
    end: u64,
}

impl ExtentAllocator {
    pub fn new(unit: u64) -> Self {
        assert!(unit.is_power_of_two());
        ExtentAllocator {
            unit,
            by_off: BTreeMap::new(),
            by_size: BTreeSet::new(),
            end: 0,
        }
    }

    /// Reserves `len` bytes (rounded up to the unit) and returns their offset.
    pub fn alloc(&mut self, len: u64) -> u64 {
        let len = align_up(len.max(1), self.unit);
        if let Some(&(size, off)) = self.by_size.range((len, 0)..).next() {
            self.remove_free(off, size);
            if size > len {
                self.insert_free(off + len, size - len);
            }
            return off;
        }
        // Extend a free tail extent rather than leaving it stranded below the new allocation.
        if let Some((&off, &size)) = self.by_off.iter().next_back() {
            if off + size == self.end {
                self.remove_free(off, size);
                self.end = off + len;
                return off;
            }
        }
        let off = self.end;
        self.end += len;
        off
    }

    /// Returns `[off, off + len)` (as given to or returned by `alloc`) to the free space.
    pub fn free(&mut self, off: u64, len: u64) {
        let mut start = off;
        let mut size = align_up(len.max(1), self.unit);
        if let Some((&p_off, &p_size)) = self.by_off.range(..off).next_back() {
            if p_off + p_size == off {
                self.remove_free(p_off, p_size);
                start = p_off;
                size += p_size;
            }
        }
        if let Some(&n_size) = self.by_off.get(&(start + size)) {
            self.remove_free(start + size, n_size);
            size += n_size;
        }
        if start + size == self.end {
            self.end = start;
        } else {
            self.insert_free(start, size);
        }
    }

    /// High-water mark: the file must be at least this long.
    pub fn end(&self) -> u64 {
        self.end
    }

    /// Bytes in free extents below the high-water mark.
    pub fn free_bytes(&self) -> u64 {
        self.by_off.values().sum()
    }

    pub fn free_extents(&self) -> usize {
        self.by_off.len()
    }

    fn insert_free(&mut self, off: u64, size: u64) {
        self.by_off.insert(off, size);
        self.by_size.insert((size, off));
    }

    fn remove_free(&mut self, off: u64, size: u64) {
        self.by_off.remove(&off);
        self.by_size.remove(&(size, off));
    }
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
    fd: OwnedFd,
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
    /// it, `None` tries it and falls back to buffered I/O (reported in the notes).
    pub fn create(dir: &Path, direct: Option<bool>) -> Result<(SwapFile, OpenNotes)> {
        check_dir(dir)?;
        let mut notes = OpenNotes::default();
        let want_direct = direct != Some(false);
        let fd = match open_unlinked(dir, want_direct) {
            Err(libc::EINVAL) if want_direct && direct.is_none() => {
                notes.direct_refused =
                    Some(format!("{}: O_DIRECT refused (EINVAL)", dir.display()));
                open_unlinked(dir, false)
            }
            Err(libc::EINVAL) if want_direct => {
                return Err(Error::InvalidArgument(format!(
                    "direct I/O requested but refused in {}: open with O_DIRECT failed (EINVAL)",
                    dir.display()
                )))
            }
            r => r,
        }
        .map_err(|errno| Error::io(Op::Open, errno, dir, 0, 0))?;
        let opened_direct = want_direct && notes.direct_refused.is_none();
        let mut file = SwapFile {
            fd,
            dir: dir.to_path_buf(),
            access: Access::Buffered,
            size: AtomicU64::new(0),
            alloc: Mutex::new(ExtentAllocator::new(UNIT)),
            grow_lock: Mutex::new(()),
        };
        if opened_direct {
            match file.probe_direct() {
                Ok(a) => {
                    file.access = Access::Direct(a);
                    file.alloc = Mutex::new(ExtentAllocator::new(UNIT.max(a.offset)));
                }
                Err(why) if direct.is_none() => {
                    notes.direct_refused = Some(format!("{}: {why}", dir.display()));
                    file.set_direct(false)?;
                }
                Err(why) => {
                    return Err(Error::InvalidArgument(format!(
                        "direct I/O requested but refused in {}: {why}",
                        dir.display()
                    )))
                }
            }
        }
        Ok((file, notes))
    }

    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
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

    /// Makes the file at least `need` bytes long with `fallocate`, growing in large steps; on ENOSPC
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
        let generous = align_up(need.max(cur + cur.clamp(GROW_MIN, GROW_MAX)), UNIT);
        let mut target = generous;
        loop {
            match self.fallocate(cur, target - cur) {
                Ok(()) => break,
                Err(libc::ENOSPC) if target > need => target = need,
                Err(errno) => {
                    return Err(Error::io(Op::Allocate, errno, &self.dir, cur, need - cur))
                }
            }
        }
        self.size.store(target, Ordering::Release);
        Ok(())
    }

    fn fallocate(&self, off: u64, len: u64) -> std::result::Result<(), i32> {
        // SAFETY: fallocate on a descriptor we own; no memory is passed.
        let rc = unsafe { libc::fallocate(self.raw_fd(), 0, off as i64, len as i64) };
        if rc == 0 {
            return Ok(());
        }
        let errno = last_errno();
        if errno == libc::EOPNOTSUPP {
            // No preallocation here (some network and FUSE file systems): a sparse extension still
            // reserves the range, and ENOSPC then surfaces at write time, where it is reported too.
            // SAFETY: as above.
            let rc = unsafe { libc::ftruncate(self.raw_fd(), (off + len) as i64) };
            return if rc == 0 { Ok(()) } else { Err(last_errno()) };
        }
        Err(errno)
    }

    /// Reads the file's direct-I/O alignment and proves it with one aligned write and read, since some
    /// file systems accept the flag at open and refuse the I/O.
    fn probe_direct(&self) -> std::result::Result<DioAlign, String> {
        let a = probe_dio_align(self.raw_fd())
            .ok_or("the file system reports no direct I/O support")?;
        let len = a.offset.max(UNIT) as usize;
        let buf = AlignedBuf::new(len, false).map_err(|e| e.to_string())?;
        self.ensure_size(len as u64).map_err(|e| e.to_string())?;
        // SAFETY: `buf` is a live page-aligned mapping of at least `len` bytes.
        let w = unsafe { libc::pwrite(self.raw_fd(), buf.as_ptr().cast(), len, 0) };
        if w != len as isize {
            return Err(format!("O_DIRECT probe write failed: {}", errno_text(w)));
        }
        // SAFETY: as above; the kernel writes at most `len` bytes into the buffer.
        let r = unsafe { libc::pread(self.raw_fd(), buf.as_ptr().cast(), len, 0) };
        if r != len as isize {
            return Err(format!("O_DIRECT probe read failed: {}", errno_text(r)));
        }
        Ok(a)
    }

    fn set_direct(&self, on: bool) -> Result<()> {
        // SAFETY: fcntl flag manipulation on our own descriptor.
        let flags = unsafe { libc::fcntl(self.raw_fd(), libc::F_GETFL) };
        let new = if on {
            flags | libc::O_DIRECT
        } else {
            flags & !libc::O_DIRECT
        };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(self.raw_fd(), libc::F_SETFL, new) } < 0 {
            return Err(Error::io(Op::Open, last_errno(), &self.dir, 0, 0));
        }
        Ok(())
    }
}

fn errno_text(rc: isize) -> String {
    if rc < 0 {
        crate::error::strerror(last_errno())
    } else {
        format!("transferred {rc} bytes")
    }
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

fn open_unlinked(dir: &Path, direct: bool) -> std::result::Result<OwnedFd, i32> {
    let extra = if direct { libc::O_DIRECT } else { 0 };
    let c = cpath(dir).map_err(|_| libc::EINVAL)?;
    // SAFETY: valid path; the returned descriptor is checked and then owned by OwnedFd.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_TMPFILE | libc::O_RDWR | libc::O_CLOEXEC | extra,
            0o600,
        )
    };
    if fd >= 0 {
        // SAFETY: `fd` was just returned by open and is owned by nobody else.
        return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
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
    // SAFETY: fresh descriptor, owned from here on.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: valid path. Unlinking at once means the space lives only as long as the descriptor.
    if unsafe { libc::unlink(cn.as_ptr()) } != 0 {
        return Err(last_errno());
    }
    Ok(owned)
}

/// Where one key's bytes live: blocks of `block_size` bytes dealt round-robin over the paths starting at
/// `first`, each path's share in one contiguous extent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub len: u64,
    pub block_size: u64,
    pub first: usize,
    pub npaths: usize,
    /// `(path index, offset, reserved length)` for each path used.
    pub extents: Vec<(usize, u64, u64)>,
}

/// One block of a layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockPos {
    pub index: usize,
    pub path: usize,
    /// Offset of the block's data within the key.
    pub data_offset: u64,
    pub data_len: u64,
    pub file_offset: u64,
}

impl Layout {
    pub fn nblocks(&self) -> usize {
        self.len.div_ceil(self.block_size) as usize
    }

    pub fn block(&self, i: usize) -> BlockPos {
        let used = self.extents.len();
        let slot = i % used;
        let (path, base, _) = self.extents[slot];
        let data_offset = i as u64 * self.block_size;
        BlockPos {
            index: i,
            path,
            data_offset,
            data_len: self.block_size.min(self.len - data_offset),
            file_offset: base + (i / used) as u64 * self.block_size,
        }
    }
}

/// The swap files of all paths of one engine.
pub struct Store {
    pub files: Vec<SwapFile>,
    block_size: u64,
    rotor: AtomicUsize,
}

impl Store {
    pub fn new(files: Vec<SwapFile>, block_size: u64) -> Self {
        Store {
            files,
            block_size,
            rotor: AtomicUsize::new(0),
        }
    }

    /// Reserves space for `len` bytes, growing files as needed. Consecutive keys start on different
    /// paths so small keys spread over all drives too.
    pub fn allocate(&self, len: u64) -> Result<Layout> {
        let np = self.files.len();
        let nblocks = len.div_ceil(self.block_size).max(1) as usize;
        let used = nblocks.min(np);
        let first = self.rotor.fetch_add(1, Ordering::Relaxed) % np;
        let mut extents = Vec::with_capacity(used);
        for slot in 0..used {
            let path = (first + slot) % np;
            // Blocks slot, slot+used, ...; only the key's last block may be partial.
            let count = (nblocks - slot).div_ceil(used) as u64;
            let last = slot + (count as usize - 1) * used;
            let last_len = self
                .block_size
                .min(len.saturating_sub(last as u64 * self.block_size));
            let file = &self.files[path];
            let reserve = (count - 1) * self.block_size + align_up(last_len.max(1), file.unit());
            let off = lock(&file.alloc).alloc(reserve);
            let end = off + reserve;
            if let Err(e) = file.ensure_size(end) {
                lock(&file.alloc).free(off, reserve);
                self.free_extents(&extents);
                return Err(e);
            }
            extents.push((path, off, reserve));
        }
        Ok(Layout {
            len,
            block_size: self.block_size,
            first,
            npaths: np,
            extents,
        })
    }

    pub fn free(&self, layout: &Layout) {
        self.free_extents(&layout.extents);
    }

    fn free_extents(&self, extents: &[(usize, u64, u64)]) {
        for &(path, off, len) in extents {
            lock(&self.files[path].alloc).free(off, len);
        }
    }

    /// Bytes reserved in files (sum of high-water marks) and bytes preallocated.
    pub fn usage(&self) -> (u64, u64) {
        self.files
            .iter()
            .fold((0, 0), |(u, s), f| (u + lock(&f.alloc).end(), s + f.size()))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn allocations_never_overlap_and_space_returns(ops in prop::collection::vec((1u64..200_000, any::<bool>()), 1..200)) {
            let mut a = ExtentAllocator::new(UNIT);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (len, free_one) in ops {
                if free_one && !live.is_empty() {
                    let (o, l) = live.swap_remove(len as usize % live.len());
                    a.free(o, l);
                } else {
                    let o = a.alloc(len);
                    prop_assert_eq!(o % UNIT, 0);
                    let l = align_up(len, UNIT);
                    for &(o2, l2) in &live {
                        prop_assert!(o + l <= o2 || o2 + align_up(l2, UNIT) <= o, "overlap");
                    }
                    prop_assert!(o + l <= a.end());
                    live.push((o, len));
                }
                let live_bytes: u64 = live.iter().map(|&(_, l)| align_up(l, UNIT)).sum();
                // Every byte below the high-water mark is live or in a free extent.
                prop_assert_eq!(live_bytes + a.free_bytes(), a.end());
            }
            for (o, l) in live.drain(..) {
                a.free(o, l);
            }
            prop_assert_eq!(a.end(), 0);
            prop_assert_eq!(a.free_extents(), 0);
        }
    }

    #[test]
    fn freed_hole_is_reused_before_growth() {
        let mut a = ExtentAllocator::new(UNIT);
        let x = a.alloc(1 << 20);
        let _y = a.alloc(1 << 20);
        a.free(x, 1 << 20);
        let end = a.end();
        assert_eq!(a.alloc(4096), x);
        assert_eq!(a.alloc(1 << 19), x + 4096);
        assert_eq!(a.end(), end);
    }

    #[test]
    fn layout_stripes_blocks_round_robin() {
        let l = Layout {
            len: 5 * 100 + 7,
            block_size: 100,
            first: 1,
            npaths: 3,
            extents: vec![(1, 1000, 200), (2, 2000, 200), (0, 0, 200)],
        };
        assert_eq!(l.nblocks(), 6);
        let b = l.block(4);
        assert_eq!(
            (b.path, b.file_offset, b.data_offset, b.data_len),
            (2, 2100, 400, 100)
        );
        let b = l.block(5);
        assert_eq!((b.path, b.file_offset, b.data_len), (0, 100, 7));
    }

    #[test]
    fn swap_file_is_unlinked_and_checks_dir() {
        let d = tempfile::tempdir().unwrap();
        let (f, _) = SwapFile::create(d.path(), None).unwrap();
        f.ensure_size(1 << 20).unwrap();
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
        let missing = d.path().join("nope");
        match SwapFile::create(&missing, None) {
            Err(Error::Io { errno, path, .. }) => {
                assert_eq!(errno, libc::ENOENT);
                assert_eq!(path, missing);
            }
            _ => panic!("expected ENOENT"),
        }
    }
}
