//! Best-fit allocator of aligned extents inside one swap file, with coalescing and a record of which
//! free space was returned to the file system (punched), so reusing it first allocates it again.

use std::collections::{BTreeMap, BTreeSet};

use crate::align::align_up;

/// One free extent: its size, and whether it may contain holes punched into the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Free {
    size: u64,
    punched: bool,
}

/// An allocation: where it starts and whether (part of) it lies on punched space, so the caller must
/// `fallocate` it before writing (else a full file system would fail the write, not the allocation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Alloc {
    pub off: u64,
    pub needs_fill: bool,
}

/// Freed space is reused before the file grows, and space freed at the end lowers the high-water mark,
/// so fragmentation stays bounded by the free extents between live ones.
#[derive(Debug)]
pub struct ExtentAllocator {
    unit: u64,
    by_off: BTreeMap<u64, Free>,
    by_size: BTreeSet<(u64, u64)>,
    end: u64,
    /// `[end, holes_below)` may contain punched holes: the high-water mark fell over punched extents.
    holes_below: u64,
}

impl ExtentAllocator {
    pub fn new(unit: u64) -> Self {
        assert!(unit.is_power_of_two());
        ExtentAllocator {
            unit,
            by_off: BTreeMap::new(),
            by_size: BTreeSet::new(),
            end: 0,
            holes_below: 0,
        }
    }

    /// Reserves `len` bytes (rounded up to the unit).
    pub fn alloc(&mut self, len: u64) -> Alloc {
        let len = align_up(len.max(1), self.unit);
        if let Some(&(size, off)) = self.by_size.range((len, 0)..).next() {
            let f = self.remove_free(off, size);
            if size > len {
                self.insert_free(off + len, size - len, f.punched);
            }
            return Alloc {
                off,
                needs_fill: f.punched,
            };
        }
        // Extend a free tail extent rather than leaving it stranded below the new allocation.
        let mut off = self.end;
        let mut needs_fill = false;
        if let Some((&o, &f)) = self.by_off.iter().next_back() {
            if o + f.size == self.end {
                self.remove_free(o, f.size);
                off = o;
                needs_fill = f.punched;
            }
        }
        needs_fill |= off < self.holes_below;
        self.end = off + len;
        Alloc { off, needs_fill }
    }

    /// Returns `[off, off + len)` (as given to or returned by `alloc`) to the free space.
    pub fn free(&mut self, off: u64, len: u64) {
        let mut start = off;
        let mut size = align_up(len.max(1), self.unit);
        let mut punched = false;
        if let Some((&p_off, &p)) = self.by_off.range(..off).next_back() {
            if p_off + p.size == off {
                self.remove_free(p_off, p.size);
                start = p_off;
                size += p.size;
                punched |= p.punched;
            }
        }
        if let Some(&n) = self.by_off.get(&(start + size)) {
            self.remove_free(start + size, n.size);
            size += n.size;
            punched |= n.punched;
        }
        if start + size == self.end {
            self.end = start;
            if punched {
                self.holes_below = self.holes_below.max(start + size);
            }
        } else {
            self.insert_free(start, size, punched);
        }
    }

    /// High-water mark: the file must be at least this long.
    pub fn end(&self) -> u64 {
        self.end
    }

    /// Bytes in free extents below the high-water mark.
    pub fn free_bytes(&self) -> u64 {
        self.by_off.values().map(|f| f.size).sum()
    }

    /// Bytes in free extents not yet returned to the file system.
    pub fn unpunched_bytes(&self) -> u64 {
        self.by_off
            .values()
            .filter(|f| !f.punched)
            .map(|f| f.size)
            .sum()
    }

    pub fn free_extents(&self) -> usize {
        self.by_off.len()
    }

    /// Marks every free extent punched and returns those that were not, for the caller to punch while
    /// it still holds the allocator (so none of them is handed out meanwhile).
    pub fn take_unpunched(&mut self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for (&off, f) in self.by_off.iter_mut() {
            if !f.punched {
                f.punched = true;
                out.push((off, f.size));
            }
        }
        out
    }

    /// Marks every free extent punched and returns them all: blocks freed next to an extent already
    /// punched merge into it, marked punched, though they still hold data; only punching it all returns
    /// them.
    pub fn take_all(&mut self) -> Vec<(u64, u64)> {
        self.by_off
            .iter_mut()
            .map(|(&off, f)| {
                f.punched = true;
                (off, f.size)
            })
            .collect()
    }

    /// The file was truncated to `len` (≥ `end`): nothing above it can hold a hole any more.
    pub fn truncated_to(&mut self, len: u64) {
        self.holes_below = self.holes_below.min(len);
    }

    fn insert_free(&mut self, off: u64, size: u64, punched: bool) {
        self.by_off.insert(off, Free { size, punched });
        self.by_size.insert((size, off));
    }

    fn remove_free(&mut self, off: u64, size: u64) -> Free {
        self.by_size.remove(&(size, off));
        self.by_off.remove(&off).unwrap_or(Free {
            size,
            punched: true,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::UNIT;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn allocations_never_overlap_and_space_returns(ops in prop::collection::vec((1u64..200_000, 0u8..4), 1..200)) {
            let mut a = ExtentAllocator::new(UNIT);
            let mut live: Vec<(u64, u64)> = Vec::new();
            // Bytes a model file says are holes: every allocation touching one must be told to fill.
            let mut holes: BTreeSet<u64> = BTreeSet::new();
            for (len, what) in ops {
                if what == 0 && !live.is_empty() {
                    let (o, l) = live.swap_remove(len as usize % live.len());
                    a.free(o, l);
                } else if what == 1 {
                    for (o, l) in a.take_unpunched() {
                        holes.extend((o..o + l).step_by(UNIT as usize));
                    }
                } else {
                    let r = a.alloc(len);
                    let o = r.off;
                    prop_assert_eq!(o % UNIT, 0);
                    let l = align_up(len, UNIT);
                    for &(o2, l2) in &live {
                        prop_assert!(o + l <= o2 || o2 + align_up(l2, UNIT) <= o, "overlap");
                    }
                    prop_assert!(o + l <= a.end());
                    let touched: Vec<u64> = holes.range(o..o + l).copied().collect();
                    prop_assert!(touched.is_empty() || r.needs_fill, "hole reused unfilled");
                    if r.needs_fill {
                        for h in touched {
                            holes.remove(&h);
                        }
                    }
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
    fn take_all_returns_merged_extents_take_unpunched_passes_over() {
        let mut a = ExtentAllocator::new(UNIT);
        let x = a.alloc(1 << 20);
        let y = a.alloc(1 << 20);
        let _z = a.alloc(1 << 20);
        a.free(x.off, 1 << 20);
        assert_eq!(a.take_unpunched(), vec![(x.off, 1 << 20)]);
        // y's blocks hold data; freed next to the punched x they merge into one extent marked punched.
        a.free(y.off, 1 << 20);
        assert!(a.take_unpunched().is_empty());
        assert_eq!(a.take_all(), vec![(x.off, 2 << 20)]);
        assert_eq!(a.take_all(), vec![(x.off, 2 << 20)]); // every free byte, each time
    }

    #[test]
    fn freed_hole_is_reused_before_growth() {
        let mut a = ExtentAllocator::new(UNIT);
        let x = a.alloc(1 << 20).off;
        let _y = a.alloc(1 << 20);
        a.free(x, 1 << 20);
        let end = a.end();
        assert_eq!(a.alloc(4096).off, x);
        assert_eq!(a.alloc(1 << 19).off, x + 4096);
        assert_eq!(a.end(), end);
    }

    #[test]
    fn punched_space_must_be_filled_on_reuse() {
        let mut a = ExtentAllocator::new(UNIT);
        let x = a.alloc(1 << 20);
        let y = a.alloc(1 << 20);
        assert!(!x.needs_fill && !y.needs_fill);
        a.free(x.off, 1 << 20);
        assert_eq!(a.take_unpunched(), vec![(x.off, 1 << 20)]);
        assert!(a.take_unpunched().is_empty());
        assert_eq!(a.unpunched_bytes(), 0);
        assert_eq!(
            a.alloc(4096),
            Alloc {
                off: 0,
                needs_fill: true
            }
        );
        // The high-water mark falls over punched space: growing back into it must fill too.
        a.free(y.off, 1 << 20);
        a.free(0, 4096);
        assert_eq!(a.end(), 0);
        assert!(a.alloc(8192).needs_fill);
        a.truncated_to(8192);
        assert!(!a.alloc(4096).needs_fill);
    }
}
