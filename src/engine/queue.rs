//! The engine's job queue: block jobs in two FIFO channels, and workers take writes before reads.
//!
//! Why: a write's caller usually waits for it soon (the Python write queue bounds the source bytes in
//! flight, and a training step writes as fast as it computes), while reads are mostly read-ahead queued
//! far ahead of use (the optimizer's record ring, the param prefetch). In one FIFO a write queued behind
//! a few hundred MiB of read-ahead waits for all of it, its caller stalls, stops issuing work, and the
//! disk then idles while it computes. Reordering blocks of different requests is safe: a write goes to a
//! new extent (copy-on-write), a read of a key waits for that key's writes in flight before it is queued,
//! and a free waits for every request using the space (see `Engine`). Writes cannot starve reads for
//! long: their sources are memory that callers bound.

use crossbeam_channel::{Receiver, Select, SendError, Sender};

use super::job::BlockJob;
use crate::error::Op;

/// What the queue orders by: whether a job is served first.
pub(crate) trait Urgent {
    fn urgent(&self) -> bool;
}

impl Urgent for BlockJob {
    fn urgent(&self) -> bool {
        self.op == Op::Write
    }
}

/// The sending side, held by the engine while it is open; dropping it closes the queue.
pub(crate) struct JobSender<T = BlockJob> {
    writes: Sender<T>,
    reads: Sender<T>,
}

/// The receiving side, one clone per worker.
pub(crate) struct JobReceiver<T = BlockJob> {
    writes: Receiver<T>,
    reads: Receiver<T>,
}

impl<T> Clone for JobReceiver<T> {
    fn clone(&self) -> Self {
        JobReceiver {
            writes: self.writes.clone(),
            reads: self.reads.clone(),
        }
    }
}

/// A queue holding up to `cap` jobs of each kind; a sender past it waits (backpressure).
pub(crate) fn bounded<T>(cap: usize) -> (JobSender<T>, JobReceiver<T>) {
    let (wt, wr) = crossbeam_channel::bounded(cap);
    let (rt, rr) = crossbeam_channel::bounded(cap);
    (
        JobSender {
            writes: wt,
            reads: rt,
        },
        JobReceiver {
            writes: wr,
            reads: rr,
        },
    )
}

impl<T: Urgent> JobSender<T> {
    pub fn send(&self, job: T) -> Result<(), SendError<T>> {
        if job.urgent() {
            self.writes.send(job)
        } else {
            self.reads.send(job)
        }
    }
}

impl<T> JobReceiver<T> {
    /// The next job without waiting: the oldest write, else the oldest read.
    pub fn try_recv(&self) -> Option<T> {
        self.writes
            .try_recv()
            .or_else(|_| self.reads.try_recv())
            .ok()
    }

    /// The next job, waiting for one; `None` once the queue is closed and drained.
    pub fn recv(&self) -> Option<T> {
        if let Some(job) = self.try_recv() {
            return Some(job);
        }
        let mut sel = Select::new();
        let w = sel.recv(&self.writes);
        sel.recv(&self.reads);
        let ready = sel.select();
        let got = if ready.index() == w {
            ready.recv(&self.writes)
        } else {
            ready.recv(&self.reads)
        };
        match got {
            Ok(job) => Some(job),
            // Both senders drop together (`JobSender`): one side closed means no job will arrive on
            // either, so what is left is drained without waiting.
            Err(_) => self.try_recv(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Job(bool, u32);
    impl Urgent for Job {
        fn urgent(&self) -> bool {
            self.0
        }
    }

    fn take(rx: &JobReceiver<Job>) -> Vec<u32> {
        std::iter::from_fn(|| rx.try_recv().map(|j| j.1)).collect()
    }

    #[test]
    fn writes_are_served_before_reads_queued_earlier_each_kind_in_order() {
        let (tx, rx) = bounded(8);
        for (urgent, id) in [(false, 1), (false, 2), (true, 3), (false, 4), (true, 5)] {
            tx.send(Job(urgent, id)).map_err(|_| "closed").unwrap();
        }
        assert_eq!(take(&rx), [3, 5, 1, 2, 4]);
    }

    #[test]
    fn recv_waits_for_either_kind_and_ends_once_closed_and_drained() {
        let (tx, rx) = bounded::<Job>(4);
        let waiter = {
            let rx = rx.clone();
            std::thread::spawn(move || rx.recv().map(|j| j.1))
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        tx.send(Job(false, 7)).map_err(|_| "closed").unwrap();
        assert_eq!(waiter.join().unwrap(), Some(7));
        tx.send(Job(false, 8)).map_err(|_| "closed").unwrap();
        tx.send(Job(true, 9)).map_err(|_| "closed").unwrap();
        drop(tx);
        assert_eq!(rx.recv().map(|j| j.1), Some(9));
        assert_eq!(rx.recv().map(|j| j.1), Some(8));
        assert!(rx.recv().is_none());
        assert!(rx.try_recv().is_none());
    }
}
