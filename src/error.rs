//! One error type for the engine, carrying what a user needs to act on a fault: the errno, the file,
//! the byte range, and the key and block where they are known. `src/py/` converts it to Python once.

use std::fmt;
use std::io;
use std::path::PathBuf;

/// The operation that failed, named in messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    /// `fallocate` growing a swap file.
    Allocate,
    /// Opening or probing a swap directory.
    Open,
    /// `io_uring_enter` submitting or reaping a worker ring.
    Submit,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Allocate => "fallocate",
            Op::Open => "open",
            Op::Submit => "io_uring_enter",
        })
    }
}

/// Every way an engine call can fail.
#[derive(Clone, Debug)]
pub enum Error {
    /// A system call on a swap file failed with `errno`.
    Io {
        op: Op,
        errno: i32,
        path: PathBuf,
        offset: u64,
        length: u64,
        key: Option<String>,
        /// The key's block the transfer was part of (`None` outside a transfer: an allocation, an open).
        block: Option<usize>,
    },
    /// A read returned 0 bytes before the requested range was complete.
    UnexpectedEof {
        path: PathBuf,
        offset: u64,
        length: u64,
        key: Option<String>,
        block: Option<usize>,
    },
    /// A block read back did not match the CRC32C recorded when it was written.
    Checksum {
        key: String,
        block: usize,
        path: PathBuf,
        offset: u64,
        length: u64,
        expected: u32,
        found: u32,
    },
    /// `read`/`free`/`nbytes` of a key that was never written or was freed.
    UnknownKey(String),
    /// The engine was closed.
    Closed,
    /// A caller-supplied setting is unusable (sizes, counts, budgets); the message names it.
    InvalidArgument(String),
    /// Caller memory is unusable for a transfer (null, unmapped, not writable for a read, wrong size);
    /// refused before any byte moves.
    Memory(String),
    /// A kernel facility the caller required was refused: `feature` names it, `errno` and `why` say why.
    Unavailable {
        feature: Feature,
        errno: i32,
        why: String,
    },
    /// The kernel refused memory (ENOMEM): a buffer mapping, or a ring over RLIMIT_MEMLOCK.
    OutOfMemory { what: String, errno: i32 },
    /// An engine thread could not be started.
    Spawn { errno: i32, what: String },
    /// The key's last write failed, so it holds no data.
    Poisoned { key: String, cause: Box<Error> },
    /// The engine was opened in process `owner`; `now` is a fork of it, where its rings and worker
    /// threads do not exist (fork copies only the calling thread).
    Forked { owner: u32, now: u32 },
}

/// A facility `backend="io_uring"` or `direct=True` insists on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Feature {
    IoUring,
    DirectIo,
}

impl fmt::Display for Feature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Feature::IoUring => "io_uring",
            Feature::DirectIo => "direct I/O (O_DIRECT)",
        })
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The errno a Python `OSError` should carry, when the error has one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Io { errno, .. } => Some(*errno),
            Error::UnexpectedEof { .. } => Some(libc::EIO),
            Error::Checksum { .. } => Some(libc::EIO),
            Error::Poisoned { cause, .. } => cause.errno(),
            Error::Unavailable { errno, .. }
            | Error::OutOfMemory { errno, .. }
            | Error::Spawn { errno, .. } => Some(*errno),
            _ => None,
        }
    }

    /// Attach the key of the request an I/O error belongs to.
    pub fn with_key(mut self, k: &str) -> Self {
        match &mut self {
            Error::Io { key, .. } | Error::UnexpectedEof { key, .. } if key.is_none() => {
                *key = Some(k.to_owned());
            }
            _ => {}
        }
        self
    }

    pub(crate) fn io(op: Op, errno: i32, path: &std::path::Path, offset: u64, length: u64) -> Self {
        Error::Io {
            op,
            errno,
            path: path.to_path_buf(),
            offset,
            length,
            key: None,
            block: None,
        }
    }

    /// The same error, naming the key's block it happened in (transfers only).
    pub(crate) fn in_block(mut self, b: usize) -> Self {
        if let Error::Io { block, .. } | Error::UnexpectedEof { block, .. } = &mut self {
            *block = Some(b);
        }
        self
    }

    pub(crate) fn from_io(op: Op, e: &io::Error, path: &std::path::Path) -> Self {
        Error::io(op, e.raw_os_error().unwrap_or(libc::EIO), path, 0, 0)
    }
}

/// `strerror` for an errno, without the "(os error N)" suffix Rust appends.
pub fn strerror(errno: i32) -> String {
    let s = io::Error::from_raw_os_error(errno).to_string();
    match s.find(" (os error") {
        Some(i) => s[..i].to_owned(),
        None => s,
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io {
                op,
                errno,
                path,
                offset,
                length,
                key,
                block,
            } => {
                write!(f, "{op} failed: {} (errno {errno})", strerror(*errno))?;
                if let Some(k) = key {
                    write!(f, ", key={k:?}")?;
                }
                if let Some(b) = block {
                    write!(f, ", block={b}")?;
                }
                write!(f, ", path={path:?}, offset={offset}, length={length}")
            }
            Error::UnexpectedEof {
                path,
                offset,
                length,
                key,
                block,
            } => {
                write!(f, "read hit end of file")?;
                if let Some(k) = key {
                    write!(f, ", key={k:?}")?;
                }
                if let Some(b) = block {
                    write!(f, ", block={b}")?;
                }
                write!(f, ", path={path:?}, offset={offset}, length={length}")
            }
            Error::Checksum {
                key,
                block,
                path,
                offset,
                length,
                expected,
                found,
            } => write!(
                f,
                "checksum mismatch in key {key:?} block {block}: crc32c {found:#010x}, \
                 expected {expected:#010x} (path={path:?}, offset={offset}, length={length})"
            ),
            Error::UnknownKey(k) => write!(f, "unknown key '{k}': never written, or freed"),
            Error::Closed => f.write_str("the swap engine is closed"),
            Error::InvalidArgument(m) | Error::Memory(m) => f.write_str(m),
            Error::Unavailable {
                feature,
                errno,
                why,
            } => write!(
                f,
                "{feature} was required but refused: {why} ({}, errno {errno})",
                strerror(*errno)
            ),
            Error::OutOfMemory { what, errno } => {
                write!(
                    f,
                    "out of memory: {what}: {} (errno {errno})",
                    strerror(*errno)
                )
            }
            Error::Spawn { errno, what } => write!(
                f,
                "cannot start engine thread {what}: {} (errno {errno})",
                strerror(*errno)
            ),
            Error::Poisoned { key, cause } => {
                write!(
                    f,
                    "key {key:?} holds no data: its last write failed: {cause}"
                )
            }
            Error::Forked { owner, now } => write!(
                f,
                "this swap engine was opened in process {owner}, and process {now} is a fork of it: its \
                 io_uring rings and worker threads stay with the parent (fork copies one thread), so it \
                 cannot be used here; open a new one in this process"
            ),
        }
    }
}

impl std::error::Error for Error {}
