//! Fault injection for tests: rewrites the result of chosen completions (an errno, a short count) or
//! corrupts data read back, so error paths and short-transfer handling run against real files.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

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
}

struct Rule {
    op: Op,
    skip: usize,
    remaining: usize,
    fault: Fault,
}

/// A list of rules, each firing on the completions of `op` after skipping `skip` of them, `count` times.
#[derive(Default)]
pub struct FaultInjector {
    armed: AtomicBool,
    rules: Mutex<Vec<Rule>>,
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

    /// Applies a result fault to a raw completion value (bytes, or -errno).
    pub(crate) fn adjust(&self, op: Op, res: i64) -> i64 {
        let applies = |f| match f {
            Fault::Errno(_) => true,
            Fault::Short(n) => res > n as i64,
            Fault::Corrupt => false,
        };
        match self.next(op, applies) {
            Some(Fault::Errno(e)) => -i64::from(e),
            Some(Fault::Short(n)) => n as i64,
            _ => res,
        }
    }
}
