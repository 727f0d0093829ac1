//! One `write` or `read` of a key: counts its outstanding blocks, keeps the first error, wakes waiters.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use crate::error::{Error, Op, Result};

struct State {
    remaining: usize,
    error: Option<Error>,
}

/// Completion of one engine call. `wait` blocks until every block has completed and returns the first
/// error, with the key attached; it may be called any number of times, from any thread.
pub struct Request {
    key: String,
    op: Op,
    bytes: u64,
    state: Mutex<State>,
    cv: Condvar,
    counters: Arc<Counters>,
}

impl Request {
    pub(crate) fn new(
        key: &str,
        op: Op,
        bytes: u64,
        blocks: usize,
        counters: Arc<Counters>,
    ) -> Arc<Self> {
        counters.begin();
        let r = Arc::new(Request {
            key: key.to_owned(),
            op,
            bytes,
            state: Mutex::new(State {
                remaining: blocks,
                error: None,
            }),
            cv: Condvar::new(),
            counters,
        });
        if blocks == 0 {
            r.finish();
        }
        r
    }

    /// A request that failed before any I/O was issued (allocation, for instance).
    pub(crate) fn failed(key: &str, op: Op, err: Error, counters: Arc<Counters>) -> Arc<Self> {
        let r = Request::new(key, op, 0, 1, counters);
        r.complete_block(Err(err));
        r
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn op(&self) -> Op {
        self.op
    }

    /// Blocks until the request is complete; returns its first error.
    pub fn wait(&self) -> Result<()> {
        let mut s = self.lock();
        while s.remaining > 0 {
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        match &s.error {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    pub fn is_done(&self) -> bool {
        self.lock().remaining == 0
    }

    /// The error of a completed request, `None` while running or after success.
    pub fn error(&self) -> Option<Error> {
        let s = self.lock();
        if s.remaining == 0 {
            s.error.clone()
        } else {
            None
        }
    }

    /// Records one block's outcome; the last one wakes the waiters.
    pub(crate) fn complete_block(&self, r: Result<()>) {
        let mut s = self.lock();
        if let Err(e) = r {
            if s.error.is_none() {
                s.error = Some(e.with_key(&self.key));
            }
        }
        s.remaining = s.remaining.saturating_sub(1);
        if s.remaining == 0 {
            let ok = s.error.is_none();
            drop(s);
            if ok {
                self.counters.add_bytes(self.op, self.bytes);
            }
            self.finish();
        }
    }

    fn finish(&self) {
        self.counters.end();
        self.cv.notify_all();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Engine-wide counters behind `stats()`.
#[derive(Default)]
pub struct Counters {
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub blocks: AtomicU64,
    pub bounced_blocks: AtomicU64,
    pub short_transfers: AtomicU64,
    busy: Mutex<Busy>,
}

#[derive(Default)]
struct Busy {
    active: usize,
    since: Option<Instant>,
    total_ns: u128,
}

impl Counters {
    fn add_bytes(&self, op: Op, n: u64) {
        let (b, c) = match op {
            Op::Read => (&self.bytes_read, &self.reads),
            _ => (&self.bytes_written, &self.writes),
        };
        b.fetch_add(n, Ordering::Relaxed);
        c.fetch_add(1, Ordering::Relaxed);
    }

    fn begin(&self) {
        let mut b = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        if b.active == 0 {
            b.since = Some(Instant::now());
        }
        b.active += 1;
    }

    fn end(&self) {
        let mut b = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        b.active = b.active.saturating_sub(1);
        if b.active == 0 {
            if let Some(t) = b.since.take() {
                b.total_ns += t.elapsed().as_nanos();
            }
        }
    }

    /// Seconds during which at least one request was outstanding.
    pub fn busy_seconds(&self) -> f64 {
        let b = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        let open = b.since.map_or(0, |t| t.elapsed().as_nanos());
        (b.total_ns + open) as f64 / 1e9
    }
}
