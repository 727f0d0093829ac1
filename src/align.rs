//! Alignment arithmetic and the direct-I/O alignment probe.
//!
//! `O_DIRECT` needs the file offset and length to be multiples of the file's offset alignment and the
//! memory address to be a multiple of its memory alignment. Both are read from the file itself — never
//! assumed to be 512.

use std::ffi::CString;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Rounds `n` up to a multiple of `align` (any non-zero `align`).
pub fn align_up(n: u64, align: u64) -> u64 {
    debug_assert!(align > 0);
    n.div_ceil(align) * align
}

/// Rounds `n` down to a multiple of `align` (any non-zero `align`).
pub fn align_down(n: u64, align: u64) -> u64 {
    debug_assert!(align > 0);
    n / align * align
}

/// Whether `n` is a multiple of `align`.
pub fn is_aligned(n: u64, align: u64) -> bool {
    n % align == 0
}

/// Direct-I/O constraints of one open file, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DioAlign {
    /// Required alignment of user memory addresses.
    pub mem: u64,
    /// Required alignment of file offsets and transfer lengths.
    pub offset: u64,
}

impl DioAlign {
    /// Page-size alignment: what buffered I/O and the allocator's granularity use.
    pub const PAGE: DioAlign = DioAlign {
        mem: 1,
        offset: 4096,
    };
}

/// Asks the kernel for `fd`'s direct-I/O alignment: `statx(STATX_DIOALIGN)` (Linux 6.1+), else the
/// logical block size of the device under the file (sysfs), else 4096, which every Linux block device
/// accepts. Returns `None` when the file system reports that it does not support direct I/O at all.
pub fn probe_dio_align(fd: RawFd) -> Option<DioAlign> {
    // SAFETY: statx writes at most size_of::<statx>() bytes into `st`, which lives on this stack frame;
    // the empty path with AT_EMPTY_PATH makes it describe `fd` itself.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    let empty = c"";
    let rc = unsafe {
        libc::statx(
            fd,
            empty.as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut st,
        )
    };
    if rc == 0 && st.stx_mask & libc::STATX_DIOALIGN != 0 {
        if st.stx_dio_offset_align == 0 {
            return None; // the kernel's way of saying "no direct I/O on this file"
        }
        return Some(DioAlign {
            mem: u64::from(st.stx_dio_mem_align.max(1)),
            offset: u64::from(st.stx_dio_offset_align),
        });
    }
    let lbs = if rc == 0 {
        logical_block_size(st.stx_dev_major, st.stx_dev_minor)
    } else {
        None
    };
    let a = lbs.unwrap_or(4096);
    Some(DioAlign { mem: a, offset: a })
}

/// `/sys/dev/block/MAJ:MIN/queue/logical_block_size`, or the same file of the parent device for a
/// partition (a partition's folder has no `queue/`).
fn logical_block_size(major: u32, minor: u32) -> Option<u64> {
    let base = format!("/sys/dev/block/{major}:{minor}");
    for rel in ["queue/logical_block_size", "../queue/logical_block_size"] {
        if let Ok(s) = std::fs::read_to_string(format!("{base}/{rel}")) {
            if let Ok(v) = s.trim().parse::<u64>() {
                if v.is_power_of_two() {
                    return Some(v);
                }
            }
        }
    }
    None
}

/// A path as a C string for libc calls.
pub(crate) fn cpath(p: &Path) -> std::io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn up_and_down_bracket_n(n in 0u64..(1 << 50), shift in 0u32..24, odd in 1u64..5000) {
            for align in [1u64 << shift, odd] {
                let up = align_up(n, align);
                let down = align_down(n, align);
                prop_assert!(is_aligned(up, align) && is_aligned(down, align));
                prop_assert!(down <= n && n <= up);
                prop_assert!(up - down == 0 || up - down == align);
                prop_assert_eq!(up == n, is_aligned(n, align));
            }
        }
    }

    #[test]
    fn probe_on_tmp_reports_power_of_two() {
        let f = tempfile::tempfile().unwrap();
        use std::os::fd::AsRawFd;
        if let Some(a) = probe_dio_align(f.as_raw_fd()) {
            assert!(
                a.offset.is_power_of_two() && a.mem.is_power_of_two(),
                "{a:?}"
            );
        }
    }
}
