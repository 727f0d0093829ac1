//! Swap space: one preallocated, already-unlinked file per path (`file`), an extent allocator over each
//! (`extent`), and the layout that stripes a key's blocks across paths.
//!
//! Space given back: when a free leaves more than `PUNCH_SLACK` bytes of a file free and not yet
//! returned (free extents plus the preallocated tail past the high-water mark), and more than twice its
//! live bytes plus one growth step (`file::growth_step`, what the file's next growth would add), every
//! free extent is punched (`FALLOC_FL_PUNCH_HOLE`) and the file truncated to its high-water mark. Why
//! twice: copy-on-write keeps one version more of every key a transaction rewrites (a training step
//! rewrites them all, then frees the old ones at once), so a file holding twice its live bytes is the next
//! step's working set, not waste. Punching it would make that step `fallocate` every range again, and
//! `fallocate` waits for all direct I/O in flight on the file (ext4's `inode_dio_wait`), draining the
//! queue at each allocation. Freeing most keys (a dropped model, the end of a run) does trigger it.
//! Punched space is `fallocate`d again when reused.

mod extent;
mod file;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::align::align_up;
use crate::error::Result;
pub use extent::{Alloc, ExtentAllocator};
pub(crate) use file::last_errno;
pub use file::{check_dir, Access, OpenNotes, SwapFile};

/// Allocation granularity and the smallest file offset alignment zswap uses.
pub const UNIT: u64 = 4096;
/// Free space a file may keep before it is returned to the file system (see the module comment).
pub const PUNCH_SLACK: u64 = 128 << 20;

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
            let Alloc { off, needs_fill } = lock(&file.alloc).alloc(reserve);
            let end = off + reserve;
            let grown = file.ensure_size(end).and_then(|()| {
                if needs_fill {
                    // Below the old size the range may hold punched holes; growth filled the rest.
                    let upto = end.min(file.size());
                    if upto > off {
                        return file.fill(off, upto - off);
                    }
                }
                Ok(())
            });
            if let Err(e) = grown {
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
            let file = &self.files[path];
            let mut a = lock(&file.alloc);
            a.free(off, len);
            let live = a.end() - a.free_bytes();
            let idle = a.unpunched_bytes() + file.size().saturating_sub(a.end());
            if idle > PUNCH_SLACK && idle > 2 * live + file::growth_step(a.end()) {
                // Every free extent: one marked punched may have merged with freed blocks that hold data.
                let ranges = a.take_all();
                let keep = a.end();
                // Under the allocator lock, so no punched range is handed out before it is punched.
                // Best effort here, in the middle of a free: what is not given back stays allocated
                // (reused, and returned at close); `trim`, which a caller asks for, reports it.
                let _ = file.give_back(&ranges, keep);
                a.truncated_to(file.size());
            }
        }
    }

    /// Returns every free range of every file to the file system now and truncates each file to its
    /// high-water mark (`free` does so only past `PUNCH_SLACK`, keeping space a rewrite would reuse).
    /// The first failure (`give_back`) once every file was tried.
    pub fn trim(&self) -> Result<()> {
        let mut first = Ok(());
        for file in &self.files {
            let mut a = lock(&file.alloc);
            let ranges = a.take_all();
            let keep = a.end();
            // Under the allocator lock, so no punched range is handed out before it is punched.
            let r = file.give_back(&ranges, keep);
            a.truncated_to(file.size());
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// Closes every file, which frees their space at once.
    ///
    /// # Safety
    /// As `SwapFile::close`: no transfer or allocation may use the files afterwards.
    pub unsafe fn close(&self) {
        for f in &self.files {
            f.close();
        }
    }

    /// Bytes the file systems hold for the swap files.
    pub fn allocated_bytes(&self) -> u64 {
        self.files.iter().map(SwapFile::allocated_bytes).sum()
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
    use crate::error::{Error, Op};

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
    fn a_failed_give_back_is_reported_after_every_range_was_tried() {
        let d = tempfile::tempdir().unwrap();
        let (f, _) = SwapFile::create(d.path(), None).unwrap();
        f.ensure_size(4 << 20).unwrap();
        let before = f.allocated_bytes();
        // A range the kernel refuses (fallocate: EINVAL for a zero length), then one it punches.
        match f.give_back(&[(1 << 20, 0), (2 << 20, 1 << 20)], 4 << 20) {
            Err(Error::Io {
                op: Op::Allocate,
                errno: libc::EINVAL,
                offset,
                length: 0,
                ..
            }) => assert_eq!(offset, 1 << 20),
            other => panic!("expected the EINVAL of the first range, got {other:?}"),
        }
        assert!(
            f.allocated_bytes() <= before - (1 << 20),
            "the second range was punched too"
        );
        assert!(f.give_back(&[(0, 1 << 20)], 0).is_ok());
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

    #[test]
    fn swap_file_cannot_be_linked_back_into_the_namespace() {
        let d = tempfile::tempdir().unwrap();
        let (f, _) = SwapFile::create(d.path(), Some(false)).unwrap();
        // linkat with AT_SYMLINK_FOLLOW on the /proc link is how an O_TMPFILE file gets a name; O_EXCL
        // at open makes the kernel refuse it (ENOENT).
        let src = std::ffi::CString::new(format!("/proc/self/fd/{}", f.raw_fd())).unwrap();
        let dst = std::ffi::CString::new(d.path().join("back").to_str().unwrap()).unwrap();
        // SAFETY: valid NUL-terminated paths.
        let rc = unsafe {
            libc::linkat(
                libc::AT_FDCWD,
                src.as_ptr(),
                libc::AT_FDCWD,
                dst.as_ptr(),
                libc::AT_SYMLINK_FOLLOW,
            )
        };
        assert_eq!(
            rc, -1,
            "an O_TMPFILE swap file was linked into the directory"
        );
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
    }

    #[test]
    fn opening_allocates_nothing_and_close_frees_at_once() {
        let d = tempfile::tempdir().unwrap();
        let (f, _) = SwapFile::create(d.path(), None).unwrap();
        assert_eq!(
            (f.size(), f.allocated_bytes()),
            (0, 0),
            "the direct-I/O probe left space behind"
        );
        f.ensure_size(8 << 20).unwrap();
        assert!(f.allocated_bytes() >= 8 << 20);
        let fd = f.raw_fd();
        // Parallel tests may reuse the number at once: what must be gone is a descriptor naming a
        // file in `d`.
        let target = |fd: i32| std::fs::read_link(format!("/proc/self/fd/{fd}")).ok();
        let before = target(fd).expect("an open swap file has a /proc/self/fd entry");
        assert!(before.starts_with(d.path()), "{before:?}");
        // SAFETY: nothing else uses the file.
        unsafe { f.close() };
        assert_ne!(target(fd), Some(before), "fd {fd} kept open");
    }

    #[test]
    fn a_step_worth_of_old_versions_freed_keeps_its_space_for_the_next_step() {
        let d = tempfile::tempdir().unwrap();
        let (f, _) = SwapFile::create(d.path(), Some(false)).unwrap();
        let store = Store::new(vec![f], 1 << 20);
        let size = PUNCH_SLACK + (64 << 20);
        let old = store.allocate(size).unwrap(); // every record before a step ...
        let new = store.allocate(size).unwrap(); // ... its copy-on-write versions ...
        let grads = store.allocate(64 << 20).unwrap(); // ... and the step's gradients
        let before = store.allocated_bytes();
        store.free(&old); // the commit frees the old versions,
        store.free(&grads); // zero_grad the gradients: more free than live, less than twice
        assert!(
            store.allocated_bytes() + (1 << 20) >= before,
            "punched: {before} -> {} bytes",
            store.allocated_bytes()
        );
        let next = store.allocate(size).unwrap(); // the next step reuses the range, no fallocate
        assert_eq!(next.extents[0].1, old.extents[0].1);
        store.free(&new);
        store.free(&next);
    }

    #[test]
    fn freeing_most_of_a_file_returns_its_space_and_reuse_fills_it_again() {
        let d = tempfile::tempdir().unwrap();
        let (f, _) = SwapFile::create(d.path(), Some(false)).unwrap();
        let store = Store::new(vec![f], 1 << 20);
        let big = store.allocate(PUNCH_SLACK + (32 << 20)).unwrap();
        let small = store.allocate(1 << 20).unwrap();
        let before = store.allocated_bytes();
        assert!(before >= PUNCH_SLACK + (33 << 20));
        store.free(&big);
        let after = store.allocated_bytes();
        assert!(
            after < 40 << 20,
            "freed space kept: {before} -> {after} bytes"
        );
        // Reuse the punched range: it is allocated again, so ENOSPC would surface here, not mid-write.
        let again = store.allocate(64 << 20).unwrap();
        assert_eq!(again.extents[0].1, big.extents[0].1);
        // (st_blocks also counts the file system's extent-tree blocks, which come and go: allow 1 MiB.)
        let refilled = store.allocated_bytes();
        assert!(
            refilled + (1 << 20) >= after + (64 << 20),
            "{before} {after} {refilled}"
        );
        store.free(&again);
        store.free(&small);
    }
}
