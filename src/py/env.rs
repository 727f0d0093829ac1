//! Probes behind `zswap env` (`zswap/envreport.py`): the same checks the engine makes when it opens a
//! swap file or a ring, run on their own so the report says what the engine *will* do here. Everything
//! that is a plain file under /proc or /sys is read on the Python side; only what needs a syscall the
//! standard library lacks (an io_uring setup, an O_DIRECT open and transfer, statx) lives here.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::convert::to_pyerr;
use crate::store::{Access, SwapFile};

/// The crate version (Cargo.toml's, the one version number of the package); also `_zswap.__version__`.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// The errno with which io_uring setup is refused here (ENOSYS, EPERM, ENOMEM...), `None` when a ring
/// can be set up and does READ/WRITE. Honours `ZSWAP_DISABLE_IO_URING` like the engine.
#[pyfunction]
fn io_uring_errno() -> Option<i32> {
    crate::engine::probe_io_uring().err()
}

/// Opens a swap file in `path` exactly as the engine does with `direct=None` (O_DIRECT tried, proved by
/// one aligned write and read, buffered I/O otherwise) and reports the outcome: `direct` (bool),
/// `reason` (why not, or None), `offset_align` / `mem_align` (bytes; 1 when buffered) and
/// `statx_dioalign` (whether the kernel answered `statx(STATX_DIOALIGN)` for the file, Linux 6.1+; else
/// the alignment is the device's logical block size). The file is unlinked and freed on return.
/// A missing or unwritable `path` raises like `SwapEngine` does (FileNotFoundError, PermissionError...).
#[pyfunction]
fn probe_direct_io<'py>(py: Python<'py>, path: std::path::PathBuf) -> PyResult<Bound<'py, PyDict>> {
    let (file, notes) = py
        .detach(|| SwapFile::create(&path, None))
        .map_err(|e| to_pyerr(py, e))?;
    let d = PyDict::new(py);
    d.set_item("direct", matches!(file.access, Access::Direct(_)))?;
    d.set_item("reason", notes.direct_refused)?;
    d.set_item("offset_align", file.io_align())?;
    d.set_item("mem_align", file.mem_align())?;
    d.set_item("statx_dioalign", statx_dioalign(file.raw_fd()))?;
    Ok(d)
}

/// Whether the kernel reports STATX_DIOALIGN for `fd` (it does not before Linux 6.1, nor on some file
/// systems).
fn statx_dioalign(fd: std::os::fd::RawFd) -> bool {
    // SAFETY: statx writes at most size_of::<statx>() bytes into `st`, which lives on this stack frame;
    // the empty path with AT_EMPTY_PATH makes it describe `fd`, a descriptor the caller keeps open.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    let rc = unsafe {
        libc::statx(
            fd,
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut st,
        )
    };
    rc == 0 && st.stx_mask & libc::STATX_DIOALIGN != 0
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", version())?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(io_uring_errno, m)?)?;
    m.add_function(wrap_pyfunction!(probe_direct_io, m)?)?;
    Ok(())
}
