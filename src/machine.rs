//! Settings read from the machine rather than fixed: the block size and queue depth from the drive's
//! request limits (sysfs `queue/`), the page size of engine buffers from what huge pages the kernel
//! offers, and whether a read's fresh destination is worth advising onto huge pages (a probe).
//!
//! The parsing and the choice are pure functions of the values read, so they are tested without the
//! machine; the readers only fetch the values.

use std::os::fd::RawFd;
use std::sync::OnceLock;
use std::time::Instant;

use crate::buffer::HUGE_PAGE;

/// A block device's request limits (`/sys/dev/block/MAJ:MIN/queue/`), the ones that decide how big a
/// request reaches the drive in one piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueLimits {
    /// `max_sectors_kb`: the largest request the block layer sends, in KiB.
    pub max_sectors_kb: u64,
    /// `max_segments`: physically contiguous memory runs one request may carry.
    pub max_segments: u64,
    /// `max_segment_size`: bytes one such run may hold.
    pub max_segment_size: u64,
    /// `nr_requests`: requests the scheduler queues per hardware queue.
    pub nr_requests: u64,
}

/// Transparent huge pages as `/sys/kernel/mm/transparent_hugepage/enabled` sets them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Thp {
    Always,
    /// Only for ranges advised `MADV_HUGEPAGE` (what the engine does with its buffers).
    Madvise,
    /// Off, or no THP support in the kernel (the file is absent).
    Never,
}

impl Thp {
    /// Parses the sysfs line, where the active choice is bracketed: `always [madvise] never`.
    pub fn parse(line: &str) -> Thp {
        match line.split_whitespace().find(|w| w.starts_with('[')) {
            Some("[always]") => Thp::Always,
            Some("[madvise]") => Thp::Madvise,
            _ => Thp::Never,
        }
    }

    /// The policy for this process: the system's, or `Never` where the process has THP disabled
    /// (`prctl(PR_SET_THP_DISABLE)`, inherited across fork and exec; some container runtimes set it).
    pub fn read() -> Thp {
        // SAFETY: PR_GET_THP_DISABLE takes no pointers and only reports a flag of this process.
        if unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) } == 1 {
            return Thp::Never;
        }
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .map_or(Thp::Never, |s| Thp::parse(&s))
    }

    /// Whether an `MADV_HUGEPAGE` range gets huge pages.
    pub fn usable(self) -> bool {
        self != Thp::Never
    }
}

/// Free reserved hugetlb memory in bytes, from `/proc/meminfo` (`HugePages_Free` × `Hugepagesize`).
pub fn parse_hugetlb_free(meminfo: &str) -> u64 {
    let field = |name: &str| {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    field("HugePages_Free:") * field("Hugepagesize:") * 1024
}

pub fn hugetlb_free() -> u64 {
    std::fs::read_to_string("/proc/meminfo").map_or(0, |s| parse_hugetlb_free(&s))
}

/// The sysfs folder (`/sys/dev/block/MAJ:MIN`) of the block device holding the file open on `fd`,
/// `None` for a file system with no block device (tmpfs, overlayfs, NFS).
fn sysfs_dev(fd: RawFd) -> Option<String> {
    // SAFETY: statx writes at most size_of::<statx>() bytes into `st`, on this stack frame; the empty
    // path with AT_EMPTY_PATH makes it describe `fd`, which the caller keeps open.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    let rc = unsafe {
        libc::statx(
            fd,
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_BASIC_STATS,
            &mut st,
        )
    };
    if rc != 0 || st.stx_dev_major == 0 {
        return None; // major 0: an anonymous device (tmpfs, overlayfs...)
    }
    Some(format!(
        "/sys/dev/block/{}:{}",
        st.stx_dev_major, st.stx_dev_minor
    ))
}

/// The request limits of the block device holding the file open on `fd`, `None` for a file system
/// with no block device or no readable limits.
pub fn queue_limits(fd: RawFd) -> Option<QueueLimits> {
    let base = sysfs_dev(fd)?;
    // A partition's folder has no queue/; its disk's folder (the parent) has.
    ["queue", "../queue"]
        .iter()
        .find_map(|q| read_limits(&format!("{base}/{q}")))
}

/// The kernel driver of the disk holding the file open on `fd` (`virtio_blk`, `nvme`...), when sysfs
/// names one.
pub fn disk_driver(fd: RawFd) -> Option<String> {
    let base = sysfs_dev(fd)?;
    // A partition's folder has no device/; its disk's folder (the parent) has.
    ["device/driver", "../device/driver"].iter().find_map(|d| {
        let link = std::fs::read_link(format!("{base}/{d}")).ok()?;
        Some(link.file_name()?.to_string_lossy().into_owned())
    })
}

/// Whether direct reads land straight in the caller's memory (`true`) or through the rings'
/// registered bounce buffers, and why, for a disk driven by `driver`.
///
/// A virtio disk's DMA into guest memory is done by the host, which translates guest addresses as it
/// goes. Measured on the bench VM (virtio_blk, 4 MiB reads, depth 4): reading 1 GiB straight into
/// the destination ran at 2.25 GB/s whatever the block size, depth or thread count, while the same
/// reads cycling through 16 MiB of destination ran at 2.87, fio's figure (fio reuses bs × depth of
/// buffer), and through the bounce buffers plus a copy at 2.6-3.0 (the knee lies between 16 and 32
/// MiB of destination). Writes showed no such effect (3.05-3.10 GB/s from 16 MiB or 1 GiB), so they
/// stay zero-copy. The copy costs 0.07-0.09 CPU s/GB on the worker thread.
pub fn zero_copy_reads(driver: Option<&str>) -> (bool, &'static str) {
    if driver == Some("virtio_blk") {
        (
            false,
            "a virtio disk: the host's DMA into more than 16 MiB of guest memory ran at 0.78x \
             of reads through the rings' registered buffers (measured on the bench VM)",
        )
    } else {
        (true, "reads land in engine buffers directly (zero-copy)")
    }
}

fn read_limits(dir: &str) -> Option<QueueLimits> {
    let get = |name: &str| -> Option<u64> {
        std::fs::read_to_string(format!("{dir}/{name}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    Some(QueueLimits {
        max_sectors_kb: get("max_sectors_kb")?,
        max_segments: get("max_segments")?,
        max_segment_size: get("max_segment_size").unwrap_or(u64::MAX),
        nr_requests: get("nr_requests").unwrap_or(0),
    })
}

/// The engine's block size and queue depth for a drive, with the reason for each, as printed by
/// `zswap bench` and `SwapEngine.info`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IoPlan {
    pub block_size: usize,
    pub queue_depth: usize,
    pub why_block: String,
    pub why_depth: String,
}

/// Largest block picked: bounce buffers are `queue_depth × block_size`, and a larger unit gains
/// nothing once one block is one whole request.
pub const MAX_AUTO_BLOCK: usize = 4 << 20;
/// Smallest block picked: below it the per-request cost dominates on every drive.
pub const MIN_AUTO_BLOCK: usize = 64 << 10;
/// Bytes kept in flight by the picked queue depth (the default engine's 16 × 1 MiB).
pub const AUTO_INFLIGHT: usize = 16 << 20;
/// Fewest blocks in flight picked, so a drive always has requests queued behind the one it serves.
pub const MIN_AUTO_DEPTH: usize = 4;

/// Picks the block size and queue depth for a drive with `limits` (`None`: no block device, or its
/// limits unreadable) when buffers are backed by pages of `page` bytes (a huge page where the engine
/// gets them, else the base page). A block is the largest power of two the drive takes as one
/// request: `max_sectors_kb`, and no more physically contiguous runs than `max_segments` (each at
/// most a page, or `max_segment_size`). A block the drive would split costs a second request.
pub fn plan_io(limits: Option<&QueueLimits>, page: usize) -> IoPlan {
    let Some(l) = limits else {
        return IoPlan {
            block_size: 1 << 20,
            queue_depth: AUTO_INFLIGHT >> 20,
            why_block: "1 MiB: no block device under the path (no request limits to follow)".into(),
            why_depth: format!("{}: 16 MiB in flight", AUTO_INFLIGHT >> 20),
        };
    };
    let seg = (page as u64).min(l.max_segment_size.max(512));
    let by_sectors = l.max_sectors_kb.saturating_mul(1024);
    let by_segments = l.max_segments.saturating_mul(seg);
    let whole = by_sectors.min(by_segments).max(MIN_AUTO_BLOCK as u64);
    let pow2 = 1usize << (63 - whole.leading_zeros());
    let block_size = pow2.clamp(MIN_AUTO_BLOCK, MAX_AUTO_BLOCK);
    let limit = if by_segments < by_sectors {
        format!(
            "max_segments {} × {} KiB pages = {} KiB",
            l.max_segments,
            seg >> 10,
            by_segments >> 10
        )
    } else {
        format!("max_sectors_kb {}", l.max_sectors_kb)
    };
    let why_block = format!(
        "{} KiB: the largest power of two the drive takes as one request ({limit}){}",
        block_size >> 10,
        if pow2 > MAX_AUTO_BLOCK {
            format!(", capped at {} MiB", MAX_AUTO_BLOCK >> 20)
        } else {
            String::new()
        }
    );
    let mut queue_depth = (AUTO_INFLIGHT / block_size).max(MIN_AUTO_DEPTH);
    let mut why_depth = format!(
        "{queue_depth}: {} MiB in flight, at least {MIN_AUTO_DEPTH} requests",
        AUTO_INFLIGHT >> 20
    );
    if l.nr_requests > 0 && queue_depth as u64 > l.nr_requests {
        queue_depth = l.nr_requests as usize;
        why_depth = format!("{queue_depth}: the drive's nr_requests");
    }
    IoPlan {
        block_size,
        queue_depth,
        why_block,
        why_depth,
    }
}

/// Whether a bounced read advises its fresh destination `MADV_HUGEPAGE`, and why; decided once per
/// process.
///
/// Usually a huge page costs one fault instead of 512. On a VM whose balloon reports free memory to
/// the host (virtio-balloon free page reporting, feature bit 5, hands back free 2 MiB blocks), a huge
/// page comes from such a block and its first touch makes the host fault every 4 KiB of it back in,
/// while base pages mostly come from fragments the host still backs. Measured on the bench VM, reading
/// 1 GiB into a fresh torch tensor: 0.2-0.65 GB/s (1.7-2.4 s CPU) advised, 0.9-1.5 GB/s (0.4 s)
/// not; faulting in 1 GiB alone: 0.3 GB/s huge, 1.7 GB/s base. A small probe cannot see this (a few
/// MiB find recycled blocks the host still backs), so the balloon feature decides; elsewhere a probe
/// compares first-touch times.
pub fn huge_destinations() -> (bool, &'static str) {
    static ANSWER: OnceLock<(bool, &'static str)> = OnceLock::new();
    *ANSWER.get_or_init(|| {
        if !Thp::read().usable() {
            return (false, "transparent huge pages are off");
        }
        if balloon_reports_free_pages() {
            return (
                false,
                "the VM's balloon reports free memory to the host (virtio-balloon free page \
                 reporting): a fresh huge page is faulted back in 4 KiB at a time",
            );
        }
        if huge_first_touch_pays() {
            (
                true,
                "first touch measured at open: huge pages no slower than base pages",
            )
        } else {
            (
                false,
                "first touch measured at open: huge pages slower than base pages",
            )
        }
    })
}

/// Whether a virtio balloon with free page reporting is bound here (its `features` file lists the
/// device's feature bits as '0'/'1' characters, bit 0 first).
fn balloon_reports_free_pages() -> bool {
    let Ok(dir) = std::fs::read_dir("/sys/bus/virtio/drivers/virtio_balloon") else {
        return false;
    };
    dir.flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("virtio"))
        .any(|e| {
            std::fs::read_to_string(e.path().join("features")).is_ok_and(|f| reports_free_pages(&f))
        })
}

/// VIRTIO_BALLOON_F_REPORTING is feature bit 5 (linux/virtio_balloon.h, Linux 5.8).
pub fn reports_free_pages(features: &str) -> bool {
    features.trim().as_bytes().get(5) == Some(&b'1')
}

/// Faults in fresh mappings as huge pages and as base pages and compares the time. Every probe
/// mapping stays mapped until all are timed, so none reuses memory another just freed.
fn huge_first_touch_pays() -> bool {
    const PROBE: usize = 2 * HUGE_PAGE;
    let mut maps = Vec::new();
    // Total of two each, alternated: either kind's first touch can be slowed by an unrelated stall.
    let (mut huge, mut small) = (0.0, 0.0);
    for _ in 0..2 {
        huge += first_touch(PROBE, true, &mut maps);
        small += first_touch(PROBE, false, &mut maps);
    }
    for m in maps {
        // SAFETY: unmapping a probe mapping made by `first_touch`, which nothing else refers to.
        unsafe { libc::munmap(m.0, m.1) };
    }
    huge.is_finite() && huge <= small
}

/// A probe mapping: address and length, unmapped by the caller.
struct Mapping(*mut libc::c_void, usize);

/// Seconds to fault in a fresh `len`-byte mapping (huge-page advised or not), infinite if it failed.
/// The mapping is left in `maps`.
fn first_touch(len: usize, huge: bool, maps: &mut Vec<Mapping>) -> f64 {
    // Map one huge page more so a 2 MiB-aligned `len` lies inside.
    let map_len = len + HUGE_PAGE;
    // SAFETY: anonymous mapping with no address hint; checked below, unmapped by the caller.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return f64::INFINITY;
    }
    maps.push(Mapping(p, map_len));
    let start = (p as usize).div_ceil(HUGE_PAGE) * HUGE_PAGE;
    let t0 = Instant::now();
    // SAFETY: `start..start+len` lies inside the mapping; madvise changes paging policy only, and
    // MADV_POPULATE_WRITE (23, Linux 5.14) faults pages in without changing a byte.
    let ok = unsafe {
        (!huge || libc::madvise(start as *mut _, len, libc::MADV_HUGEPAGE) == 0)
            && libc::madvise(start as *mut _, len, 23) == 0
    };
    if ok {
        t0.elapsed().as_secs_f64()
    } else {
        f64::INFINITY
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_sectors_kb: u64, max_segments: u64) -> QueueLimits {
        QueueLimits {
            max_sectors_kb,
            max_segments,
            max_segment_size: u64::from(u32::MAX),
            nr_requests: 256,
        }
    }

    #[test]
    fn thp_line_is_parsed_by_its_bracketed_word() {
        assert_eq!(Thp::parse("always [madvise] never\n"), Thp::Madvise);
        assert_eq!(Thp::parse("[always] madvise never"), Thp::Always);
        assert_eq!(Thp::parse("always madvise [never]"), Thp::Never);
        assert_eq!(Thp::parse(""), Thp::Never);
    }

    #[test]
    fn hugetlb_free_is_pages_times_page_size() {
        let m = "MemTotal: 1 kB\nHugePages_Total:      10\nHugePages_Free:        6\nHugepagesize:       2048 kB\n";
        assert_eq!(parse_hugetlb_free(m), 6 * 2048 * 1024);
        assert_eq!(parse_hugetlb_free("MemTotal: 1 kB\n"), 0);
    }

    #[test]
    fn virtio_disk_with_huge_pages_takes_max_sectors() {
        // vda on the bench VM: max_sectors_kb 4096, max_segments 254.
        let p = plan_io(Some(&limits(4096, 254)), HUGE_PAGE);
        assert_eq!((p.block_size, p.queue_depth), (4 << 20, 4));
        assert!(
            p.why_block.contains("max_sectors_kb 4096"),
            "{}",
            p.why_block
        );
    }

    #[test]
    fn small_pages_are_limited_by_segments() {
        // 254 runs of 4 KiB = 1016 KiB: a 1 MiB block would go out as 1016 KiB + 8 KiB.
        let p = plan_io(Some(&limits(4096, 254)), 4096);
        assert_eq!((p.block_size, p.queue_depth), (512 << 10, 32));
        assert!(p.why_block.contains("max_segments 254"), "{}", p.why_block);
    }

    #[test]
    fn nvme_like_limits_and_caps() {
        assert_eq!(
            plan_io(Some(&limits(128, 33)), HUGE_PAGE).block_size,
            128 << 10
        );
        assert_eq!(
            plan_io(Some(&limits(1280, 127)), HUGE_PAGE).block_size,
            1 << 20
        );
        // A drive that takes anything: capped, and so is the bounce memory.
        let big = plan_io(Some(&limits(1 << 30, 1 << 20)), HUGE_PAGE);
        assert_eq!(big.block_size, MAX_AUTO_BLOCK);
        assert!(big.why_block.contains("capped"));
        // A tiny limit: floored.
        assert_eq!(
            plan_io(Some(&limits(4, 1)), 4096).block_size,
            MIN_AUTO_BLOCK
        );
        // Depth never exceeds what the scheduler queues.
        let mut l = limits(128, 128);
        l.nr_requests = 64;
        let p = plan_io(Some(&l), 4096);
        assert_eq!(p.queue_depth, 64);
        assert!(p.why_depth.contains("nr_requests"));
    }

    #[test]
    fn balloon_reporting_is_feature_bit_5() {
        // The bench VM's balloon: STATS_VQ, DEFLATE_ON_OOM, REPORTING.
        assert!(reports_free_pages(
            "0110010100000000000000000000000010000000\n"
        ));
        assert!(!reports_free_pages(
            "0110000100000000000000000000000010000000"
        ));
        assert!(!reports_free_pages("0110"));
    }

    #[test]
    fn virtio_disks_bounce_reads_others_do_not() {
        assert!(!zero_copy_reads(Some("virtio_blk")).0);
        assert!(zero_copy_reads(Some("nvme")).0);
        assert!(zero_copy_reads(None).0);
    }

    #[test]
    fn no_block_device_keeps_the_defaults() {
        let p = plan_io(None, HUGE_PAGE);
        assert_eq!((p.block_size, p.queue_depth), (1 << 20, 16));
    }

    #[test]
    fn limits_of_a_tmp_file_are_read_or_absent() {
        let f = std::fs::File::create(
            std::env::temp_dir().join(format!("zswap-limits-{}", std::process::id())),
        )
        .unwrap();
        use std::os::fd::AsRawFd;
        if let Some(l) = queue_limits(f.as_raw_fd()) {
            assert!(l.max_sectors_kb > 0 && l.max_segments > 0);
        }
        if let Some(d) = disk_driver(f.as_raw_fd()) {
            assert!(!d.is_empty() && !d.contains('/'), "{d}");
        }
        let _ = std::fs::remove_file(
            std::env::temp_dir().join(format!("zswap-limits-{}", std::process::id())),
        );
    }
}
