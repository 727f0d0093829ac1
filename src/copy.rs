//! The bounce-buffer copy: caller memory to a bounce buffer before a write, back after a read.
//!
//! Each block is copied once and not read again by this thread (the disk reads the bounce buffer by
//! DMA; the caller reads its tensor much later), so the copy uses non-temporal stores where the CPU has
//! AVX2: they skip the read-for-ownership of every destination line and keep the copied block from
//! evicting the caller's working set. Measured on the project VM (AMD EPYC, 1 MiB blocks into 4 KiB
//! pages): 3.0 GB/s with `memcpy`, 4.1 with streaming stores. Short copies use `memcpy`.

/// Below this, streaming stores do not pay for their fence.
const STREAM_MIN: usize = 64 << 10;

/// Copies `len` bytes from `src` to `dst`, as `std::ptr::copy_nonoverlapping`.
///
/// # Safety
/// As `copy_nonoverlapping`: `src` readable and `dst` writable for `len` bytes, not overlapping.
pub unsafe fn copy_block(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if len >= STREAM_MIN && std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present (checked above); the ranges are the caller's contract.
            return unsafe { x86::stream_copy(dst, src, len) };
        }
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_sfence};

    const LANE: usize = 32;
    const CHUNK: usize = 4 * LANE;

    /// # Safety
    /// AVX2 must be available; ranges as `copy_block`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn stream_copy(dst: *mut u8, src: *const u8, len: usize) {
        // Streaming stores need 32-byte aligned destinations: copy the head up to that plainly.
        let head = (dst as usize).wrapping_neg() % LANE;
        let head = head.min(len);
        // SAFETY: the caller's ranges cover `len ≥ head` bytes.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        let (d, s, n) = (
            unsafe { dst.add(head) },
            unsafe { src.add(head) },
            len - head,
        );
        let body = n / CHUNK * CHUNK;
        let mut i = 0;
        while i < body {
            // SAFETY: `i + CHUNK ≤ body ≤ n`, inside both ranges; `d + i` is 32-byte aligned (head
            // aligned `d`, `i` is a multiple of 32); loads are unaligned.
            unsafe {
                let s = s.add(i).cast::<__m256i>();
                let d = d.add(i).cast::<__m256i>();
                let (a, b) = (_mm256_loadu_si256(s), _mm256_loadu_si256(s.add(1)));
                let (c, e) = (_mm256_loadu_si256(s.add(2)), _mm256_loadu_si256(s.add(3)));
                _mm256_stream_si256(d, a);
                _mm256_stream_si256(d.add(1), b);
                _mm256_stream_si256(d.add(2), c);
                _mm256_stream_si256(d.add(3), e);
            }
            i += CHUNK;
        }
        // Streaming stores are weakly ordered: fence so the bytes are visible before the block is
        // handed to the kernel (a write) or reported complete (a read).
        _mm_sfence();
        // SAFETY: the remaining `n - body` bytes lie inside both ranges.
        unsafe { std::ptr::copy_nonoverlapping(s.add(body), d.add(body), n - body) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_byte_at_any_alignment_and_length() {
        let src: Vec<u8> = (0..(STREAM_MIN * 2 + 300))
            .map(|i| (i * 7 + i / 251) as u8)
            .collect();
        for (doff, soff, len) in [
            (0, 0, STREAM_MIN * 2),
            (1, 3, STREAM_MIN + 77),
            (31, 0, STREAM_MIN + 128),
            (64, 17, STREAM_MIN * 2 + 1),
            (5, 5, 100),
            (0, 0, 0),
        ] {
            let mut dst = vec![0xAAu8; src.len() + 64];
            // SAFETY: both vectors hold the ranges copied.
            unsafe { copy_block(dst.as_mut_ptr().add(doff), src.as_ptr().add(soff), len) };
            assert_eq!(
                &dst[doff..doff + len],
                &src[soff..soff + len],
                "{doff} {soff} {len}"
            );
            assert!(dst[..doff].iter().all(|&b| b == 0xAA));
            assert!(dst[doff + len..].iter().all(|&b| b == 0xAA));
        }
    }
}
