//! Page-aligned memory owned by the engine: bounce buffers and the buffers behind `SwapEngine.empty`.
//!
//! A block device caps the memory segments one request may carry (`queue/max_segments`); with 4 KiB
//! pages a request is cut at about `max_segments × 4 KiB`. Backing buffers with 2 MiB pages lets a
//! request reach `max_sectors_kb`, so large buffers ask for huge pages: `MAP_HUGETLB` when hugetlb pages
//! are reserved (`/proc/sys/vm/nr_hugepages`), else `madvise(MADV_HUGEPAGE)` for transparent huge pages,
//! which needs no reservation and is honoured when THP is `always` or `madvise`.
//!
//! Every buffer is populated when it is made (`MADV_POPULATE_WRITE`, else one write per page): a page's
//! first touch costs a fault, a zeroed page, on a VM often a host-side fault too, and with THP maybe a
//! compaction — measured here at 0.14–2.3 GB/s, far below the disk. Paid at allocation it stays off the
//! I/O path; paid inside the first read into a fresh buffer it cut that read to 0.13 × fio.

use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock};

use crate::error::{Error, Result};
use crate::machine::Thp;

/// Size of a huge page on x86-64 and aarch64 (4 KiB base pages).
pub const HUGE_PAGE: usize = 2 << 20;
/// Smallest buffer worth rounding up to a huge-page multiple.
const HUGE_MIN: usize = HUGE_PAGE;

/// How a buffer's pages were obtained, reported in stats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageKind {
    /// Reserved hugetlb pages (`MAP_HUGETLB`).
    HugeTlb,
    /// Ordinary pages advised `MADV_HUGEPAGE`.
    Thp,
    /// Ordinary 4 KiB pages.
    Small,
}

/// An anonymous, page-aligned, zero-filled mapping, unmapped on drop.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    map_len: usize,
    kind: PageKind,
    locked: bool,
}

// SAFETY: the mapping is plain memory owned by this value; nothing in it is tied to a thread.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references hand out only raw pointers; callers synchronise access to the bytes.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Maps at least `len` bytes (at least one page). With `lock`, tries `mlock` and records whether
    /// it held; a refused lock (RLIMIT_MEMLOCK) is not an error.
    pub fn new(len: usize, lock: bool) -> Result<Self> {
        let want = len.max(1);
        let (map_len, huge) = if want >= HUGE_MIN {
            (round_up(want, HUGE_PAGE), true)
        } else {
            (round_up(want, page_size()), false)
        };
        let base = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        let mut kind = PageKind::Small;
        let mut p = libc::MAP_FAILED;
        if huge {
            // SAFETY: anonymous mapping with no address hint; the result is checked below.
            p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    map_len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    base | libc::MAP_HUGETLB,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED {
                kind = PageKind::HugeTlb;
            }
        }
        if p == libc::MAP_FAILED {
            // THP backs only 2 MiB-aligned virtual ranges, and kernels before 6.7 place anonymous
            // mappings at any page boundary: map a huge page more and keep the aligned part.
            let extra = if huge { HUGE_PAGE } else { 0 };
            // SAFETY: as above.
            p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    map_len + extra,
                    libc::PROT_READ | libc::PROT_WRITE,
                    base,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED && extra > 0 {
                p = trim_to_alignment(p.cast(), map_len, extra).cast();
            }
            if p == libc::MAP_FAILED {
                let errno = std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::ENOMEM);
                return Err(Error::OutOfMemory {
                    what: format!("cannot map {map_len} bytes of buffer memory"),
                    errno,
                });
            }
            // SAFETY: `p` is a mapping of `map_len` bytes we own; madvise only changes paging policy.
            // The call succeeds even where THP is off, so the policy decides what is reported.
            if huge
                && unsafe { libc::madvise(p, map_len, libc::MADV_HUGEPAGE) } == 0
                && thp().usable()
            {
                kind = PageKind::Thp;
            }
        }
        // SAFETY: mlock on our own mapping; failure leaves it unlocked, which is allowed.
        let locked = lock && unsafe { libc::mlock(p, map_len) } == 0;
        // mlock faulted every page in already.
        if !locked {
            if let Err(errno) = populate(p.cast(), map_len) {
                // SAFETY: unmapping the mapping made above, which nothing else refers to yet.
                unsafe { libc::munmap(p, map_len) };
                return Err(Error::OutOfMemory {
                    what: format!("cannot populate {map_len} bytes of buffer memory"),
                    errno,
                });
            }
        }
        Ok(AlignedBuf {
            // SAFETY: mmap returned a non-null address (MAP_FAILED was excluded above).
            ptr: unsafe { NonNull::new_unchecked(p.cast()) },
            len: want,
            map_len,
            kind,
            locked,
        })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Requested length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Mapped length: `len` rounded up to the page size used; direct I/O may use all of it.
    pub fn capacity(&self) -> usize {
        self.map_len
    }

    pub fn page_kind(&self) -> PageKind {
        self.kind
    }

    pub fn locked(&self) -> bool {
        self.locked
    }

    /// The whole mapping as a byte slice.
    ///
    /// # Safety
    /// No other thread or the kernel may write the buffer while the slice lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        std::slice::from_raw_parts(self.ptr.as_ptr(), self.map_len)
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `new`; owners guarantee no I/O still targets it
        // (the engine holds an `Arc` to every buffer with I/O in flight).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.map_len);
        }
    }
}

/// Of a fresh mapping of `len + extra` bytes at `p`, unmaps the head below the first `extra`-aligned
/// address and the tail past `len` bytes from it; returns that aligned address. `extra` is a power of
/// two, at least a page.
fn trim_to_alignment(p: *mut u8, len: usize, extra: usize) -> *mut u8 {
    let start = round_up(p as usize, extra);
    let head = start - p as usize;
    let tail = extra - head;
    // SAFETY: both ranges lie inside the mapping just made (head + len + tail = len + extra), are
    // page-aligned (p and start are, extra and len are page multiples), and nothing refers to them.
    unsafe {
        if head > 0 {
            libc::munmap(p.cast(), head);
        }
        if tail > 0 {
            libc::munmap((start + len) as *mut libc::c_void, tail);
        }
    }
    start as *mut u8
}

/// Linux 5.14's `MADV_POPULATE_WRITE` (not in every libc crate version).
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// Faults in every page of `[p, p + len)` for writing without changing a byte, so later transfers into
/// the range do not stall on first-touch faults. Kernels before 5.14 (EINVAL) get one write per page
/// instead. Err(errno) where the kernel could not provide the memory (ENOMEM, EFAULT...).
///
/// Only for memory this module mapped: the fallback writes a zero into each page.
fn populate(p: *mut u8, len: usize) -> std::result::Result<(), i32> {
    if madvise_populate(p, len) {
        return Ok(());
    }
    let errno = crate::store::last_errno();
    if errno != libc::EINVAL {
        return Err(errno);
    }
    let step = page_size();
    for off in (0..len).step_by(step) {
        // SAFETY: `p..p+len` is a fresh zero-filled mapping we own; writing the zero it holds changes
        // nothing but makes the kernel back the page now.
        unsafe { std::ptr::write_volatile(p.add(off), 0) };
    }
    Ok(())
}

fn madvise_populate(p: *mut u8, len: usize) -> bool {
    // SAFETY: madvise with MADV_POPULATE_WRITE only faults pages in (as a write would, without
    // modifying them); an unmapped or read-only range is refused with an errno, not touched.
    unsafe { libc::madvise(p.cast(), len, MADV_POPULATE_WRITE) == 0 }
}

/// Best effort, for a read's destination in ordinary (caller's) memory: advises the 2 MiB-aligned
/// interior of `[addr, addr + len)` `MADV_HUGEPAGE`, so its untouched pages fault in as huge pages
/// (one fault per 2 MiB instead of 512). Only whole huge pages inside the range are advised, and the
/// read overwrites every byte of them, so no memory is added to what the caller asked for.
pub fn advise_huge_destination(addr: usize, len: usize) {
    let start = round_up(addr, HUGE_PAGE);
    let end = (addr + len) / HUGE_PAGE * HUGE_PAGE;
    if end > start {
        // SAFETY: madvise only changes the paging policy of the caller's range (no byte changes); an
        // error (a mapping that cannot take it) leaves the range as it was.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
}

/// Best effort, for a read's destination in ordinary memory: faults its pages in now (on the ring
/// thread, while the block's transfer is in flight) rather than in the copy out of the bounce buffer
/// after it completes. Contents are not changed; failure (an old kernel) leaves the faults to the copy.
///
/// madvise takes a page-aligned start (EINVAL otherwise) and torch's allocator hands out 64-byte
/// aligned memory, so the range is widened to whole pages: the pages at either end hold some of the
/// destination's bytes, so they are mapped, and populating never changes a byte of them.
pub fn prefault_destination(p: *mut u8, len: usize) {
    if len > 0 {
        let (start, span) = page_span(p as usize, len, page_size());
        madvise_populate(start as *mut u8, span);
    }
}

/// The whole pages covering `[addr, addr + len)`: (first page's address, bytes).
fn page_span(addr: usize, len: usize, page: usize) -> (usize, usize) {
    let start = addr / page * page;
    (start, round_up(addr + len, page) - start)
}

/// The THP policy, read once per process.
fn thp() -> Thp {
    static THP: OnceLock<Thp> = OnceLock::new();
    *THP.get_or_init(Thp::read)
}

/// What pages a large `alloc` buffer gets when nothing runs short: reserved hugetlb pages when at
/// least 64 MiB are free, else transparent huge pages when the policy allows, else base pages.
pub fn buffer_kind() -> PageKind {
    if crate::machine::hugetlb_free() >= 64 << 20 {
        PageKind::HugeTlb
    } else if thp().usable() {
        PageKind::Thp
    } else {
        PageKind::Small
    }
}

/// The page size that bounds one physically contiguous run of engine memory (for `plan_io`).
pub fn buffer_page() -> usize {
    match buffer_kind() {
        PageKind::Small => page_size(),
        _ => HUGE_PAGE,
    }
}

fn round_up(n: usize, a: usize) -> usize {
    n.div_ceil(a) * a
}

pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// The engine's live user-facing buffers, by address, so a write or read can tell whether a pointer
/// lies in engine memory (aligned, padded: eligible for zero-copy direct I/O).
#[derive(Default)]
pub struct BufferRegistry {
    by_addr: Mutex<BTreeMap<usize, Arc<AlignedBuf>>>,
}

impl BufferRegistry {
    pub fn alloc(&self, len: usize, lock: bool) -> Result<Arc<AlignedBuf>> {
        let b = Arc::new(AlignedBuf::new(len, lock)?);
        self.lock().insert(b.as_ptr() as usize, b.clone());
        Ok(b)
    }

    /// Forget a buffer: called when its Python owner is dropped. I/O still in flight keeps its own `Arc`.
    pub fn release(&self, addr: usize) {
        self.lock().remove(&addr);
    }

    /// The buffer containing `[addr, addr + len)`, if any.
    pub fn find(&self, addr: usize, len: usize) -> Option<Arc<AlignedBuf>> {
        let map = self.lock();
        let (&start, b) = map.range(..=addr).next_back()?;
        (addr + len <= start + b.capacity()).then(|| b.clone())
    }

    pub fn count(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, Arc<AlignedBuf>>> {
        // A panic while holding this lock cannot leave the map half-updated; keep going.
        self.by_addr.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_and_huge_buffers_are_aligned_and_zeroed() {
        for len in [1, 4095, 4097, HUGE_PAGE + 1] {
            let b = AlignedBuf::new(len, false).unwrap();
            assert_eq!(b.as_ptr() as usize % page_size(), 0);
            if len >= HUGE_MIN {
                // Whatever the kernel's placement, huge-page candidates start on a huge page.
                assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0);
            }
            assert!(b.capacity() >= len);
            assert!(unsafe { b.as_slice() }.iter().all(|&x| x == 0));
        }
    }

    /// Pages of `b` the kernel reports resident (`mincore`).
    fn resident_pages(b: &AlignedBuf) -> usize {
        let ps = page_size();
        let mut vec = vec![0u8; b.capacity().div_ceil(ps)];
        // SAFETY: `vec` has one byte per page of the mapping, as mincore requires.
        let rc = unsafe { libc::mincore(b.as_ptr().cast(), b.capacity(), vec.as_mut_ptr()) };
        assert_eq!(rc, 0);
        vec.iter().filter(|&&v| v & 1 == 1).count()
    }

    #[test]
    fn buffers_are_populated_when_made() {
        for len in [4096 * 3, HUGE_PAGE * 3 + 5] {
            let b = AlignedBuf::new(len, false).unwrap();
            assert_eq!(resident_pages(&b), b.capacity() / page_size(), "len {len}");
            assert!(unsafe { b.as_slice() }.iter().all(|&x| x == 0));
        }
    }

    #[test]
    fn prefaulting_a_destination_keeps_its_bytes() {
        let b = AlignedBuf::new(HUGE_PAGE * 3, false).unwrap();
        // SAFETY: the buffer is ours and nothing else uses it.
        unsafe { std::ptr::write_bytes(b.as_ptr(), 7, b.capacity()) };
        advise_huge_destination(b.as_ptr() as usize + 100, b.capacity() - 200);
        prefault_destination(b.as_ptr(), b.capacity());
        assert!(unsafe { b.as_slice() }.iter().all(|&x| x == 7));
    }

    #[test]
    fn page_span_covers_unaligned_ranges() {
        assert_eq!(page_span(4096, 4096, 4096), (4096, 4096));
        assert_eq!(page_span(4096 + 64, 4096, 4096), (4096, 8192));
        assert_eq!(page_span(64, 1, 4096), (0, 4096));
        assert_eq!(page_span(8191, 2, 4096), (4096, 8192));
    }

    #[test]
    fn prefaulting_an_unaligned_destination_populates_it() {
        // Ordinary memory: the mapping is made without populating, as torch's allocator does.
        let len = 64 * page_size();
        // SAFETY: anonymous mapping, checked, unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let resident = || {
            let mut v = vec![0u8; len / page_size()];
            // SAFETY: one byte per page of the mapping.
            assert_eq!(unsafe { libc::mincore(p, len, v.as_mut_ptr()) }, 0);
            v.iter().filter(|&&x| x & 1 == 1).count()
        };
        assert_eq!(resident(), 0);
        // SAFETY: inside the mapping.
        prefault_destination(unsafe { p.cast::<u8>().add(64) }, len - 128);
        let probe_ok = madvise_populate(p.cast(), page_size());
        if probe_ok {
            assert_eq!(resident(), len / page_size());
        }
        // SAFETY: unmapping the mapping made above.
        unsafe { libc::munmap(p, len) };
    }

    #[test]
    fn registry_finds_interior_pointers_only() {
        let r = BufferRegistry::default();
        let b = r.alloc(10_000, false).unwrap();
        let a = b.as_ptr() as usize;
        assert!(r.find(a, 10_000).is_some());
        assert!(r.find(a + 100, b.capacity() - 100).is_some());
        assert!(r.find(a + 100, b.capacity()).is_none());
        r.release(a);
        assert!(r.find(a, 1).is_none());
    }
}
