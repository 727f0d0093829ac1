//! `crc32c`: the Castagnoli CRC (hardware SSE4.2 / ARMv8 CRC instructions via the `crc32c` crate) over
//! memory that Python hands over as an address and a byte count. Checkpoints (`zswap/checkpoint/`) use it
//! to checksum their files while streaming them.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// CRC-32C of `nbytes` bytes at `address`, continuing from `seed` (the CRC of the bytes before them;
/// 0 to start), so a file can be checksummed piece by piece. Runs without the GIL.
#[pyfunction]
#[pyo3(name = "crc32c", signature = (address, nbytes, seed=0))]
fn crc32c_of(py: Python<'_>, address: usize, nbytes: usize, seed: u32) -> PyResult<u32> {
    if nbytes == 0 {
        return Ok(seed);
    }
    if address == 0 || address.checked_add(nbytes).is_none() {
        return Err(PyValueError::new_err(format!(
            "crc32c: address {address:#x} with {nbytes} bytes is null or past the address space"
        )));
    }
    // SAFETY: the caller (zswap/checkpoint/_crc.py) passes the address and size of a CPU tensor or
    // buffer it holds a reference to for the whole (synchronous) call, so the memory stays mapped and
    // nobody frees it while this reads it; reading bytes has no alignment requirement.
    let data = unsafe { std::slice::from_raw_parts(address as *const u8, nbytes) };
    Ok(py.detach(|| ::crc32c::crc32c_append(seed, data)))
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(crc32c_of, m)?)
}
