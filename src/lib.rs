//! zswap's engine: moves tensor bytes between page-aligned memory and swap files through io_uring
//! (or a pread/pwrite thread pool), plus the bookkeeping of where each key's bytes live.
//!
//! The crate knows bytes, buffers, files and offsets — never torch. `py` (feature `python`) is the only
//! module that imports pyo3, so `cargo test` and `cargo bench` need no libpython.

pub mod adam;
pub mod align;
pub mod baseline;
pub mod buffer;
pub mod copy;
pub mod engine;
pub mod error;
pub mod machine;
pub mod memcheck;
pub mod store;

#[cfg(feature = "python")]
mod py;

pub use engine::{Backend, DirectMode, Engine, EngineConfig, Request};
pub use error::{Error, Result};
