//! PyO3 bindings: the only Rust that knows Python. Torch stays on the Python side (`zswap/swap.py`
//! hands us addresses and byte counts of tensors it has validated, plus the tensor to keep alive).

mod adam;
mod convert;
mod crc;
mod env;

use std::sync::{Arc, Mutex, Weak};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::buffer::AlignedBuf;
use crate::engine::{Backend, DirectMode, Engine, EngineConfig, Fault, Request};
use crate::error::{Error, Op};
use crate::memcheck;
use convert::to_pyerr;

/// Tensors whose Handle was dropped before its I/O finished; released (under the GIL) once done.
type Orphans = Arc<Mutex<Vec<(Arc<Request>, Py<PyAny>)>>>;

#[pyclass(module = "zswap._zswap", name = "Engine", frozen)]
struct PyEngine {
    inner: Arc<Engine>,
    orphans: Orphans,
    /// The process that opened it: in a forked child every call is refused and nothing is torn down
    /// (joining worker threads that were never copied would panic).
    pid: u32,
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(signature = (paths, *, block_size=None, queue_depth=None, threads=None, backend="auto",
                        direct=None, checksum=false, pinned_memory_budget=None, lock_memory=false,
                        zero_copy_reads=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        paths: Vec<std::path::PathBuf>,
        block_size: Option<usize>,
        queue_depth: Option<usize>,
        threads: Option<usize>,
        backend: &str,
        direct: Option<bool>,
        checksum: bool,
        pinned_memory_budget: Option<usize>,
        lock_memory: bool,
        zero_copy_reads: Option<bool>,
    ) -> PyResult<Self> {
        // 0 is the engine's "pick from the drive"; a caller's 0 is an error, not a request for that.
        if block_size == Some(0) {
            let m = "block_size must be a power of two from 4096 to 64 MiB, got 0";
            return Err(to_pyerr(py, Error::InvalidArgument(m.into())));
        }
        if queue_depth == Some(0) {
            let m = "queue_depth must be from 1 to 4096, got 0";
            return Err(to_pyerr(py, Error::InvalidArgument(m.into())));
        }
        let cfg = EngineConfig {
            paths,
            block_size: block_size.unwrap_or(0),
            queue_depth: queue_depth.unwrap_or(0),
            threads: threads.unwrap_or(0),
            backend: match backend {
                "auto" => Backend::Auto,
                "io_uring" => Backend::IoUring,
                "psync" => Backend::Psync,
                other => {
                    return Err(to_pyerr(
                        py,
                        Error::InvalidArgument(format!(
                            "backend must be 'auto', 'io_uring' or 'psync', got {other:?}"
                        )),
                    ))
                }
            },
            direct: match direct {
                None => DirectMode::Auto,
                Some(true) => DirectMode::On,
                Some(false) => DirectMode::Off,
            },
            checksum,
            pinned_memory_budget,
            lock_memory,
            zero_copy_reads,
        };
        // Opening and probing swap files does I/O: let other Python threads run meanwhile.
        let inner = py
            .detach(|| Engine::new(cfg))
            .map_err(|e| to_pyerr(py, e))?;
        Ok(PyEngine {
            inner: Arc::new(inner),
            orphans: Arc::default(),
            pid: std::process::id(),
        })
    }

    /// Starts writing `nbytes` at address `ptr` under `key`; `keep` (the tensor) is held until done.
    fn write(
        &self,
        py: Python<'_>,
        key: &str,
        ptr: usize,
        nbytes: usize,
        keep: Py<PyAny>,
    ) -> PyResult<PyHandle> {
        self.owned(py)?;
        self.sweep(py);
        let e = &self.inner;
        self.check_memory(py, "write source", ptr, nbytes, memcheck::Access::Read)?;
        // SAFETY: `ptr..ptr+nbytes` is the tensor `keep`, which the returned Handle (or the orphan list,
        // if the Handle is dropped first) holds until the request completes; the caller promises not to
        // modify it meanwhile (SwapEngine.write's documented contract). Blocking parts (waiting for a
        // previous write of the key) run without the GIL.
        let req = py.detach(|| unsafe { e.write(key, ptr as *const u8, nbytes) });
        self.handle(py, req, keep)
    }

    /// Starts reading `key` into `nbytes` at `ptr`; `keep` (the tensor) is held until done.
    fn read(
        &self,
        py: Python<'_>,
        key: &str,
        ptr: usize,
        nbytes: usize,
        keep: Py<PyAny>,
    ) -> PyResult<PyHandle> {
        self.owned(py)?;
        self.sweep(py);
        let e = &self.inner;
        self.check_memory(py, "read destination", ptr, nbytes, memcheck::Access::Write)?;
        // SAFETY: as in `write`; the destination tensor is kept alive by the Handle or the orphan list.
        let req = py.detach(|| unsafe { e.read(key, ptr as *mut u8, nbytes) });
        self.handle(py, req, keep)
    }

    fn free(&self, py: Python<'_>, key: &str) -> PyResult<()> {
        self.owned(py)?;
        let e = &self.inner;
        py.detach(|| e.free(key)).map_err(|e| to_pyerr(py, e))
    }

    fn trim(&self, py: Python<'_>) -> PyResult<()> {
        self.owned(py)?;
        let e = &self.inner;
        py.detach(|| e.trim()).map_err(|e| to_pyerr(py, e))
    }

    fn contains(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        self.owned(py)?;
        self.inner.contains(key).map_err(|e| to_pyerr(py, e))
    }

    fn nbytes(&self, py: Python<'_>, key: &str) -> PyResult<u64> {
        self.owned(py)?;
        self.inner.len_of(key).map_err(|e| to_pyerr(py, e))
    }

    fn keys(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        self.owned(py)?;
        self.inner.keys().map_err(|e| to_pyerr(py, e))
    }

    /// A zero-filled, page-aligned buffer of `nbytes` exposing the buffer protocol.
    fn alloc(&self, py: Python<'_>, nbytes: usize) -> PyResult<PyBuffer> {
        self.owned(py)?;
        let buf = self.inner.alloc(nbytes).map_err(|e| to_pyerr(py, e))?;
        Ok(PyBuffer {
            buf,
            len: nbytes,
            engine: Arc::downgrade(&self.inner),
            pid: self.pid,
        })
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("bytes_read", s.bytes_read)?;
        d.set_item("bytes_written", s.bytes_written)?;
        d.set_item("reads", s.reads)?;
        d.set_item("writes", s.writes)?;
        d.set_item("blocks", s.blocks)?;
        d.set_item("bounced_blocks", s.bounced_blocks)?;
        d.set_item("short_transfers", s.short_transfers)?;
        d.set_item("busy_seconds", s.busy_seconds)?;
        d.set_item("keys", s.keys)?;
        d.set_item("reserved_bytes", s.reserved_bytes)?;
        d.set_item("file_bytes", s.file_bytes)?;
        d.set_item("allocated_bytes", s.allocated_bytes)?;
        d.set_item("live_buffers", s.live_buffers)?;
        Ok(d)
    }

    /// The settings in force after probing (backend, direct I/O, alignment, ...).
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = self.inner.resolved();
        let d = PyDict::new(py);
        d.set_item(
            "backend",
            match r.backend {
                Backend::Psync => "psync",
                _ => "io_uring",
            },
        )?;
        d.set_item("direct", r.direct)?;
        d.set_item("io_align", r.io_align)?;
        d.set_item("mem_align", r.mem_align)?;
        d.set_item("block_size", r.block_size)?;
        d.set_item("queue_depth", r.queue_depth)?;
        d.set_item("threads", r.threads)?;
        d.set_item("fixed_buffers", r.fixed_refused.is_none())?;
        d.set_item(
            "fixed_buffers_reason",
            r.fixed_refused.as_deref().unwrap_or(""),
        )?;
        d.set_item(
            "bounce_pages",
            format!("{:?}", r.bounce_pages).to_lowercase(),
        )?;
        d.set_item("bounce_bytes", r.bounce_bytes)?;
        d.set_item("bounce_spare", r.bounce_spare)?;
        d.set_item(
            "buffer_pages",
            format!("{:?}", r.buffer_pages).to_lowercase(),
        )?;
        d.set_item("block_size_reason", &r.why_block)?;
        d.set_item("queue_depth_reason", &r.why_depth)?;
        d.set_item("huge_destinations", r.huge_destinations.0)?;
        d.set_item("huge_destinations_reason", r.huge_destinations.1)?;
        d.set_item("zero_copy_reads", r.zero_copy_reads.0)?;
        d.set_item("zero_copy_reads_reason", r.zero_copy_reads.1)?;
        match &r.limits {
            Some(l) => {
                let q = PyDict::new(py);
                q.set_item("max_sectors_kb", l.max_sectors_kb)?;
                q.set_item("max_segments", l.max_segments)?;
                q.set_item("max_segment_size", l.max_segment_size)?;
                q.set_item("nr_requests", l.nr_requests)?;
                d.set_item("queue_limits", q)?;
            }
            None => d.set_item("queue_limits", py.None())?,
        }
        d.set_item("checksum", self.inner.config().checksum)?;
        let paths: Vec<String> = self
            .inner
            .config()
            .paths
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        d.set_item("paths", paths)?;
        d.set_item("notes", r.notes.clone())?;
        Ok(d)
    }

    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// Finishes queued I/O, stops the workers and closes (and so frees) the swap files. In a forked
    /// child it does nothing: the files and threads are the parent's.
    fn close(&self, py: Python<'_>) {
        if self.owned(py).is_err() {
            return;
        }
        let e = &self.inner;
        py.detach(|| e.close());
        self.orphans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// Test hook: make the next completions of `op` ("read"/"write") fail with an errno ("errno"),
    /// come back short ("short", `value` bytes), for reads arrive corrupted ("corrupt"), for writes be
    /// lost ("lost": reported complete, never written); or make an io_uring worker's next
    /// `io_uring_enter` fail (`op="submit"`, "errno").
    #[pyo3(signature = (op, kind, value=0, skip=0, count=1))]
    fn inject_fault(
        &self,
        py: Python<'_>,
        op: &str,
        kind: &str,
        value: i64,
        skip: usize,
        count: usize,
    ) -> PyResult<()> {
        let bad = |m: String| Err(to_pyerr(py, Error::InvalidArgument(m)));
        let op = match op {
            "read" => Op::Read,
            "write" => Op::Write,
            "submit" => Op::Submit,
            _ => {
                return bad(format!(
                    "op must be 'read', 'write' or 'submit', got {op:?}"
                ))
            }
        };
        let fault = match kind {
            "errno" => Fault::Errno(value as i32),
            "short" => Fault::Short(value.max(0) as usize),
            "corrupt" => Fault::Corrupt,
            "lost" => Fault::Lost,
            _ => return bad(format!("unknown fault kind {kind:?}")),
        };
        self.inner.faults().add(op, fault, skip, count);
        Ok(())
    }

    fn clear_faults(&self) {
        self.inner.faults().clear();
    }
}

impl Drop for PyEngine {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // A forked child's copy: the engine's threads were not copied, so its teardown (joining
            // them) would panic, and its files are the parent's to free. Leaking one reference keeps
            // `Engine::drop` from ever running here; the child's exit returns the memory.
            std::mem::forget(Arc::clone(&self.inner));
        }
    }
}

impl PyEngine {
    /// `Error::Forked` in a process forked from the one that opened the engine.
    fn owned(&self, py: Python<'_>) -> PyResult<()> {
        let now = std::process::id();
        if now == self.pid {
            return Ok(());
        }
        let owner = self.pid;
        Err(to_pyerr(py, Error::Forked { owner, now }))
    }

    /// Refuses memory the transfer cannot use (null, unmapped, read-only for a read) before any byte
    /// moves. Engine buffers are known good; the closed check comes first so a closed engine always
    /// says so.
    fn check_memory(
        &self,
        py: Python<'_>,
        what: &str,
        ptr: usize,
        nbytes: usize,
        access: memcheck::Access,
    ) -> PyResult<()> {
        if self.inner.is_closed() {
            return Err(to_pyerr(py, Error::Closed));
        }
        if nbytes > 0 && ptr != 0 && self.inner.owns(ptr, nbytes) {
            return Ok(());
        }
        memcheck::check(what, ptr, nbytes, access).map_err(|e| to_pyerr(py, e))
    }

    fn handle(
        &self,
        py: Python<'_>,
        req: crate::Result<Arc<Request>>,
        keep: Py<PyAny>,
    ) -> PyResult<PyHandle> {
        let req = req.map_err(|e| to_pyerr(py, e))?;
        Ok(PyHandle {
            req,
            keep: Mutex::new(Some(keep)),
            orphans: self.orphans.clone(),
        })
    }

    /// Drops the tensors of orphaned requests that have finished (we hold the GIL here).
    fn sweep(&self, _py: Python<'_>) {
        let mut o = self.orphans.lock().unwrap_or_else(|e| e.into_inner());
        if !o.is_empty() {
            o.retain(|(r, _)| !r.is_done());
        }
    }
}

/// The completion of one write or read.
#[pyclass(module = "zswap._zswap", name = "Handle", frozen)]
struct PyHandle {
    req: Arc<Request>,
    keep: Mutex<Option<Py<PyAny>>>,
    orphans: Orphans,
}

#[pymethods]
impl PyHandle {
    /// Blocks (without the GIL) until the transfer is complete; raises its error, every time it is
    /// called. After it returns the tensor is the caller's again.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        let req = &self.req;
        let r = py.detach(|| req.wait());
        drop(self.keep.lock().unwrap_or_else(|e| e.into_inner()).take());
        r.map_err(|e| to_pyerr(py, e))
    }

    fn done(&self) -> bool {
        self.req.is_done()
    }

    #[getter]
    fn key(&self) -> String {
        self.req.key().to_owned()
    }
}

impl Drop for PyHandle {
    fn drop(&mut self) {
        // A Handle dropped mid-flight must not free the tensor the kernel is still using.
        let keep = self
            .keep
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(k) = keep {
            if !self.req.is_done() {
                self.orphans
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push((self.req.clone(), k));
            }
        }
    }
}

/// Engine memory behind `SwapEngine.empty`: page-aligned (huge pages when large), writable. Python wraps
/// `address`/`len` as a tensor without a copy (`zswap/_memview.py`), keeping this object alive: the
/// buffer protocol is not in the stable ABI before 3.11, and the extension is built for abi3-py310.
#[pyclass(module = "zswap._zswap", name = "Buffer", frozen)]
struct PyBuffer {
    buf: Arc<AlignedBuf>,
    len: usize,
    engine: Weak<Engine>,
    pid: u32,
}

#[pymethods]
impl PyBuffer {
    fn __len__(&self) -> usize {
        self.len
    }

    #[getter]
    fn address(&self) -> usize {
        self.buf.as_ptr() as usize
    }

    #[getter]
    fn capacity(&self) -> usize {
        self.buf.capacity()
    }

    #[getter]
    fn page_kind(&self) -> String {
        format!("{:?}", self.buf.page_kind()).to_lowercase()
    }
}

impl Drop for PyBuffer {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            return; // a forked child's copy: the engine's registry is the parent's (`PyEngine::drop`)
        }
        if let Some(e) = self.engine.upgrade() {
            e.release_buffer(self.buf.as_ptr() as usize);
        }
    }
}

#[pymodule]
fn _zswap(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngine>()?;
    m.add_class::<PyHandle>()?;
    m.add_class::<PyBuffer>()?;
    m.add_function(wrap_pyfunction!(io_uring_available, m)?)?;
    m.add_function(wrap_pyfunction!(raw_io_uring_baseline, m)?)?;
    adam::register(m)?;
    env::register(m)?;
    crc::register(m)?;
    Ok(())
}

/// `None` when io_uring can be set up here, else the reason (strerror of the refusal).
#[pyfunction]
fn io_uring_available() -> Option<String> {
    crate::engine::probe_io_uring()
        .err()
        .map(crate::error::strerror)
}

/// Seconds to write then read `size` bytes with the bare io_uring loop of `baseline.rs` (O_DIRECT,
/// huge-page buffers) in a fresh unlinked file in `path`: the raw-disk figure when fio is absent.
#[pyfunction]
fn raw_io_uring_baseline(
    py: Python<'_>,
    path: std::path::PathBuf,
    size: u64,
    block_size: usize,
    queue_depth: usize,
) -> PyResult<(f64, f64)> {
    let r = py.detach(|| crate::baseline::raw_io_uring(&path, size, block_size, queue_depth));
    let (w, r) = r.map_err(|e| to_pyerr(py, e))?;
    Ok((w.as_secs_f64(), r.as_secs_f64()))
}
