//! The one place engine errors become Python exceptions (the classes live in `zswap/errors.py`).

use pyo3::exceptions::{
    PyFileNotFoundError, PyNotADirectoryError, PyPermissionError, PyValueError,
};
use pyo3::prelude::*;

use crate::error::{strerror, Error, Op};

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
        // Problems with the swap directory itself surface as the built-in types users already catch.
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
            let args = (*errno, strerror(*errno), path_str(path));
            match *errno {
                libc::ENOENT => PyFileNotFoundError::new_err(args),
                libc::ENOTDIR => PyNotADirectoryError::new_err(args),
                _ => PyPermissionError::new_err(args),
            }
        }
        Error::Io {
            op,
            errno,
            path,
            offset,
            length,
            key,
        } => swap_io(
            &class("SwapIOError")?,
            *errno,
            format!("{op} failed: {}", strerror(*errno)),
            path_str(path),
            *offset,
            *length,
            key.clone(),
            None,
        )?,
        Error::UnexpectedEof {
            path,
            offset,
            length,
            key,
        } => swap_io(
            &class("SwapIOError")?,
            libc::EIO,
            "read hit the end of the swap file".into(),
            path_str(path),
            *offset,
            *length,
            key.clone(),
            None,
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
            &class("SwapIOError")?,
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
        Error::UnknownKey(_) => {
            PyErr::from_value(class("UnknownKeyError")?.call1((e.to_string(),))?)
        }
        Error::Closed => PyErr::from_value(class("EngineClosedError")?.call1((e.to_string(),))?),
        Error::InvalidArgument(m) => PyValueError::new_err(m.clone()),
    })
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
