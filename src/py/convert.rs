//! The one place engine errors become Python exceptions. The classes live in `zswap/errors.py`; each is
//! a `ZswapError` and also the built-in a caller would catch (the tree is in that module's docstring).

use pyo3::prelude::*;

use crate::error::{strerror, Error, Feature, Op};

pub(crate) fn to_pyerr(py: Python<'_>, e: Error) -> PyErr {
    match build(py, &e) {
        Ok(err) => err,
        // zswap.errors failed to import (a broken install): still raise something truthful.
        Err(import_err) => import_err,
    }
}

fn build(py: Python<'_>, e: &Error) -> PyResult<PyErr> {
    let errors = py.import("zswap.errors")?;
    let class = |name: &str| errors.getattr(name);
    let path_str = |p: &std::path::Path| p.to_string_lossy().into_owned();
    Ok(match e {
        // Problems with the swap directory itself: a config error that is also the OSError subclass
        // users already catch (`except FileNotFoundError` keeps working).
        Error::Io {
            op: Op::Open,
            errno,
            path,
            ..
        } if matches!(
            *errno,
            libc::ENOENT | libc::EACCES | libc::EPERM | libc::ENOTDIR | libc::EROFS
        ) =>
        {
            // ENOENT from creating a file in a directory that exists: a pseudo file system (/proc).
            let there = *errno == libc::ENOENT && path.is_dir();
            let name = match *errno {
                libc::ENOENT if !there => "NvmePathMissing",
                libc::ENOTDIR => "NvmePathNotADirectory",
                _ => "NvmePathNotWritable",
            };
            let what = match *errno {
                libc::ENOENT if there => format!(
                    "swap directory exists, but its file system refused a new file in it ({}; /proc \
                     and /sys, for instance, take none)",
                    strerror(libc::ENOENT)
                ),
                libc::ENOENT => "swap directory does not exist (zswap never creates it)".to_owned(),
                libc::ENOTDIR => "swap path is not a directory".to_owned(),
                e => format!("swap directory is not writable ({})", strerror(e)),
            };
            make(&class(name)?, (*errno, what, path_str(path)))?
        }
        Error::Io {
            op,
            errno,
            path,
            offset,
            length,
            key,
            block,
        } => swap_io(
            &class("SwapIOError")?,
            *errno,
            format!("{op} failed: {}", strerror(*errno)),
            path_str(path),
            *offset,
            *length,
            key.clone(),
            *block,
        )?,
        Error::UnexpectedEof {
            path,
            offset,
            length,
            key,
            block,
        } => swap_io(
            &class("SwapIOError")?,
            libc::EIO,
            "read hit the end of the swap file".into(),
            path_str(path),
            *offset,
            *length,
            key.clone(),
            *block,
        )?,
        Error::Checksum {
            key,
            block,
            path,
            offset,
            length,
            expected,
            found,
        } => swap_io(
            &class("ChecksumError")?,
            libc::EIO,
            format!("checksum mismatch: crc32c {found:#010x}, expected {expected:#010x}"),
            path_str(path),
            *offset,
            *length,
            Some(key.clone()),
            Some(*block),
        )?,
        Error::Poisoned { key, cause } => {
            let (path, offset, length) = match cause.as_ref() {
                Error::Io {
                    path,
                    offset,
                    length,
                    ..
                } => (Some(path_str(path)), Some(*offset), Some(*length)),
                _ => (None, None, None),
            };
            let args = (
                cause.errno().unwrap_or(libc::EIO),
                format!("key holds no data: its last write failed ({cause})"),
                path,
                offset,
                length,
                key.clone(),
            );
            PyErr::from_value(class("SwapIOError")?.call1(args)?)
        }
        Error::UnknownKey(_) => make(&class("UnknownKeyError")?, (e.to_string(),))?,
        Error::Closed => make(&class("EngineClosedError")?, (e.to_string(),))?,
        Error::Forked { .. } => make(&class("ZswapError")?, (e.to_string(),))?,
        Error::InvalidArgument(m) => make(&class("ConfigError")?, (m.clone(),))?,
        Error::Memory(m) => make(&class("InvalidTensorError")?, (m.clone(),))?,
        Error::Unavailable { feature, errno, .. } => {
            let name = match feature {
                Feature::IoUring => "BackendUnavailable",
                Feature::DirectIo => "DirectIOUnavailable",
            };
            make(&class(name)?, (*errno, e.to_string()))?
        }
        Error::OutOfMemory { errno, .. } => {
            make(&class("SwapMemoryError")?, (e.to_string(), *errno))?
        }
        Error::Spawn { errno, .. } => make(&class("ThreadStartError")?, (e.to_string(), *errno))?,
    })
}

fn make<'py>(class: &Bound<'py, PyAny>, args: impl pyo3::call::PyCallArgs<'py>) -> PyResult<PyErr> {
    Ok(PyErr::from_value(class.call1(args)?))
}

#[allow(clippy::too_many_arguments)]
fn swap_io(
    class: &Bound<'_, PyAny>,
    errno: i32,
    msg: String,
    path: String,
    offset: u64,
    length: u64,
    key: Option<String>,
    block: Option<usize>,
) -> PyResult<PyErr> {
    Ok(PyErr::from_value(
        class.call1((errno, msg, path, offset, length, key, block))?,
    ))
}
