//! Fault injection for tests: rewrites the result of chosen completions (an errno, a short count) or
//! corrupts data read back, so error paths and short-transfer handling run against real files.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};

use crate::error::Op;

/// What an armed rule does to a matching completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The completion fails with this errno.
    Errno(i32),
    /// The completion reports at most this many bytes (a short transfer; the rest must be reissued).
    Short(usize),
    /// The data of a completed read has its first byte flipped (checksum tests).
    Corrupt,
    /// A write is reported complete without reaching the file (a lost write: checksum tests).
    Lost,
    /// The worker holds the block before its I/O until `release` (lock and concurrency tests).
    Hold,
}

struct Rule {
    op: Op,
    skip: usize,
    remaining: usize,
    fault: Fault,
}

/// A list of rules, each firing on the completions of `op` after skipping `skip` of them, `count` times.
/// Rules for `Op::Submit` make an io_uring worker's `io_uring_enter` fail with their errno.
#[derive(Default)]
pub struct FaultInjector {
    armed: AtomicBool,
    rules: Mutex<Vec<Rule>>,
    /// Blocks held by `Fault::Hold` wait for this to turn true.
    released: Mutex<bool>,
    gate: Condvar,
}

impl FaultInjector {
    pub fn add(&self, op: Op, fault: Fault, skip: usize, count: usize) {
        let mut r = self.rules.lock().unwrap_or_else(|e| e.into_inner());
        r.push(Rule {
            op,
            skip,
            remaining: count,
            fault,
        });
        self.armed.store(true, Ordering::Release);
    }

    /// Lets every held block (and every later one a `Hold` rule catches) proceed.
    pub fn release(&self) {
        *self.released.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.gate.notify_all();
    }

    /// Blocks the calling worker while a `Hold` rule catches this block of `op` and `release` has not
    /// been called.
    pub(crate) fn hold(&self, op: Op) {
        if self.next(op, |f| f == Fault::Hold).is_none() {
            return;
        }
        let mut r = self.released.lock().unwrap_or_else(|e| e.into_inner());
        while !*r {
            r = self.gate.wait(r).unwrap_or_else(|e| e.into_inner());
        }
    }

    pub fn clear(&self) {
        self.rules.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.armed.store(false, Ordering::Release);
    }

    /// The fault to apply to the next completion of `op` that `applies` accepts, if a rule fires.
    /// Completions a rule would not change (a short count at or under its cap, a result fault asked
    /// about corruption) neither fire it nor count as skipped, so tests get exactly what they ask for.
    fn next(&self, op: Op, applies: impl Fn(Fault) -> bool) -> Option<Fault> {
        if !self.armed.load(Ordering::Acquire) {
            return None;
        }
        let mut rules = self.rules.lock().unwrap_or_else(|e| e.into_inner());
        let rule = rules
            .iter_mut()
            .find(|r| r.op == op && r.remaining > 0 && applies(r.fault))?;
        if rule.skip > 0 {
            rule.skip -= 1;
            return None;
        }
        rule.remaining -= 1;
        Some(rule.fault)
    }

    /// Whether the data of the next completed read of `op` is to be corrupted.
    pub(crate) fn corrupt(&self, op: Op) -> bool {
        self.next(op, |f| f == Fault::Corrupt).is_some()
    }

    /// Whether the next block of `op` is to be lost: completed as successful without any I/O.
    pub(crate) fn lose(&self, op: Op) -> bool {
        self.next(op, |f| f == Fault::Lost).is_some()
    }

    /// The errno the next `io_uring_enter` of a worker is to fail with, if a rule fires.
    pub(crate) fn submit_errno(&self) -> Option<i32> {
        match self.next(Op::Submit, |f| matches!(f, Fault::Errno(_))) {
            Some(Fault::Errno(e)) => Some(e),
            _ => None,
        }
    }

    /// Applies a result fault to a raw completion value (bytes, or -errno).
    pub(crate) fn adjust(&self, op: Op, res: i64) -> i64 {
        let applies = |f| match f {
            Fault::Errno(_) => true,
            Fault::Short(n) => res > n as i64,
            Fault::Corrupt | Fault::Lost | Fault::Hold => false,
        };
        match self.next(op, applies) {
            Some(Fault::Errno(e)) => -i64::from(e),
            Some(Fault::Short(n)) => n as i64,
            _ => res,
        }
    }
}
