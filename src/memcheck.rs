//! Is `[addr, addr + len)` mapped, readable (the source of a write) or writable (the destination of a
//! read)? Asked of the kernel before any byte moves, so a bad address becomes an error instead of a
//! SIGSEGV in a worker's copy or a silent EFAULT half-way through a transfer.
//!
//! The kernel keeps one VMA per mapping; a range is fine when consecutive VMAs cover it without a gap
//! and each has the protection needed. Cost per call: one `ioctl(PROCMAP_QUERY)` per VMA the range
//! spans (Linux 6.11+: an O(log n) lookup, no text), else one read of `/proc/self/maps` — never anything
//! per byte. Ranges inside engine buffers skip this (the engine mapped them read-write itself).
//!
//! What it cannot see: a shared file mapping past the end of its (truncated) file faults with SIGBUS on
//! access though its VMA is intact; and memory unmapped by another thread after the check. Both are the
//! caller breaking the contract that the tensor stays valid.

use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::sync::OnceLock;

use crate::error::{Error, Result};

/// What the transfer does to the memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// The engine reads it (a `write` of a key).
    Read,
    /// The engine writes it (a `read` of a key).
    Write,
}

/// Checks `[addr, addr + len)` for `access`; `what` names the memory in the error.
pub fn check(what: &str, addr: usize, len: usize, access: Access) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    if addr == 0 {
        return Err(Error::Memory(format!(
            "{what}: address 0 for {len} bytes (a meta or fake tensor has no memory)"
        )));
    }
    let Some(end) = addr.checked_add(len) else {
        return Err(Error::Memory(format!(
            "{what}: {len} bytes at {addr:#x} run past the end of the address space"
        )));
    };
    let mut at = addr;
    while at < end {
        let vma = match query(at) {
            Some(Ok(v)) => v,
            Some(Err(())) => return Err(unmapped(what, addr, len, at)),
            None => return check_by_maps(what, addr, len, access),
        };
        if let Some(e) = refused(what, addr, len, at, &vma, access) {
            return Err(e);
        }
        at = vma.end as usize;
    }
    Ok(())
}

struct Vma {
    start: u64,
    end: u64,
    readable: bool,
    writable: bool,
}

fn refused(
    what: &str,
    addr: usize,
    len: usize,
    at: usize,
    v: &Vma,
    access: Access,
) -> Option<Error> {
    let ok = match access {
        Access::Read => v.readable,
        Access::Write => v.readable && v.writable,
    };
    (!ok).then(|| {
        let need = match access {
            Access::Read => "readable",
            Access::Write => "writable",
        };
        Error::Memory(format!(
            "{what}: {len} bytes at {addr:#x} include {at:#x}, which is not {need} \
             (mapping {:#x}-{:#x}){}",
            v.start,
            v.end,
            if access == Access::Write {
                "; a read needs a writable destination tensor"
            } else {
                ""
            }
        ))
    })
}

fn unmapped(what: &str, addr: usize, len: usize, at: usize) -> Error {
    Error::Memory(format!(
        "{what}: {len} bytes at {addr:#x} include {at:#x}, which is not mapped (the tensor's storage \
         is smaller than its size says, or was freed)"
    ))
}

/// `struct procmap_query` of `<linux/fs.h>` (Linux 6.11).
#[repr(C)]
#[derive(Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

const PROCMAP_QUERY_VMA_READABLE: u64 = 0x01;
const PROCMAP_QUERY_VMA_WRITABLE: u64 = 0x02;
/// `_IOWR('f', 17, struct procmap_query)`.
const PROCMAP_QUERY: u64 =
    (3 << 30) | ((std::mem::size_of::<ProcmapQuery>() as u64) << 16) | ((b'f' as u64) << 8) | 17;

/// `/proc/self/maps`, opened once, when `PROCMAP_QUERY` works on it.
fn maps_fd() -> Option<&'static File> {
    static MAPS: OnceLock<Option<File>> = OnceLock::new();
    static ANCHOR: u8 = 0;
    MAPS.get_or_init(|| {
        let f = File::open("/proc/self/maps").ok()?;
        // Works (an answer or ENOENT) → the ioctl exists; ENOTTY/EINVAL → older kernel.
        let mut q = ProcmapQuery {
            size: std::mem::size_of::<ProcmapQuery>() as u64,
            query_addr: &ANCHOR as *const u8 as u64,
            ..Default::default()
        };
        // SAFETY: PROCMAP_QUERY reads and writes exactly the struct we pass (its size is in `size`);
        // no name or build-id buffer is requested.
        let rc = unsafe { libc::ioctl(f.as_raw_fd(), PROCMAP_QUERY as _, &mut q) };
        (rc == 0).then_some(f)
    })
    .as_ref()
}

/// The VMA containing `addr`: `Some(Ok)`, `Some(Err)` when none does, `None` when the ioctl is missing.
fn query(addr: usize) -> Option<std::result::Result<Vma, ()>> {
    let f = maps_fd()?;
    let mut q = ProcmapQuery {
        size: std::mem::size_of::<ProcmapQuery>() as u64,
        query_addr: addr as u64,
        ..Default::default()
    };
    // SAFETY: as in `maps_fd`.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), PROCMAP_QUERY as _, &mut q) };
    if rc != 0 {
        return Some(Err(()));
    }
    Some(Ok(Vma {
        start: q.vma_start,
        end: q.vma_end,
        readable: q.vma_flags & PROCMAP_QUERY_VMA_READABLE != 0,
        writable: q.vma_flags & PROCMAP_QUERY_VMA_WRITABLE != 0,
    }))
}

/// The same check by reading `/proc/self/maps` (kernels before 6.11).
fn check_by_maps(what: &str, addr: usize, len: usize, access: Access) -> Result<()> {
    let mut text = String::new();
    File::open("/proc/self/maps")
        .and_then(|mut f| f.read_to_string(&mut text))
        .map_err(|e| Error::Memory(format!("{what}: cannot read /proc/self/maps: {e}")))?;
    let end = addr + len;
    let mut at = addr;
    for line in text.lines() {
        let Some(v) = parse_maps_line(line) else {
            continue;
        };
        if (v.end as usize) <= at {
            continue;
        }
        if (v.start as usize) > at {
            break;
        }
        if let Some(e) = refused(what, addr, len, at, &v, access) {
            return Err(e);
        }
        at = v.end as usize;
        if at >= end {
            return Ok(());
        }
    }
    Err(unmapped(what, addr, len, at))
}

/// `start-end perms ...` → the VMA.
fn parse_maps_line(line: &str) -> Option<Vma> {
    let mut it = line.split_whitespace();
    let (range, perms) = (it.next()?, it.next()?.as_bytes());
    let (s, e) = range.split_once('-')?;
    Some(Vma {
        start: u64::from_str_radix(s, 16).ok()?,
        end: u64::from_str_radix(e, 16).ok()?,
        readable: perms.first() == Some(&b'r'),
        writable: perms.get(1) == Some(&b'w'),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An anonymous mapping of `pages` pages with `prot`, unmapped on drop.
    struct Map(*mut u8, usize);
    impl Map {
        fn new(pages: usize, prot: i32) -> Map {
            let len = pages * 4096;
            // SAFETY: anonymous mapping, result checked.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    prot,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            Map(p.cast(), len)
        }
    }
    impl Drop for Map {
        fn drop(&mut self) {
            // SAFETY: our own mapping.
            unsafe { libc::munmap(self.0.cast(), self.1) };
        }
    }

    fn both(addr: usize, len: usize, access: Access) -> (bool, bool) {
        let fast = check("t", addr, len, access).is_ok();
        let slow = check_by_maps("t", addr, len, access).is_ok();
        (fast, slow)
    }

    #[test]
    fn writable_readonly_unmapped_and_null() {
        let rw = Map::new(4, libc::PROT_READ | libc::PROT_WRITE);
        let a = rw.0 as usize;
        assert_eq!(both(a, 4 * 4096, Access::Write), (true, true));
        let ro = Map::new(2, libc::PROT_READ);
        let r = ro.0 as usize;
        assert_eq!(both(r, 8192, Access::Read), (true, true));
        assert_eq!(both(r, 8192, Access::Write), (false, false));
        let none = Map::new(1, libc::PROT_NONE);
        assert_eq!(both(none.0 as usize, 1, Access::Read), (false, false));
        // A hole: map three pages, unmap the middle one.
        let m = Map::new(3, libc::PROT_READ | libc::PROT_WRITE);
        // SAFETY: unmapping a page of our own mapping; Map's drop unmaps the whole range again, which
        // is allowed for already unmapped parts.
        unsafe { libc::munmap(m.0.add(4096).cast(), 4096) };
        let b = m.0 as usize;
        assert_eq!(both(b, 4096, Access::Write), (true, true));
        assert_eq!(both(b, 4097, Access::Read), (false, false));
        assert!(check("t", 0, 8, Access::Read).is_err());
        assert!(check("t", 0, 0, Access::Write).is_ok());
        let e = check("out", r, 10, Access::Write).unwrap_err().to_string();
        assert!(
            e.starts_with("out: 10 bytes at ") && e.contains("not writable"),
            "{e}"
        );
    }

    #[test]
    fn heap_memory_is_fine() {
        let v = vec![0u8; 3 << 20];
        assert_eq!(
            both(v.as_ptr() as usize, v.len(), Access::Write),
            (true, true)
        );
    }
}
