//! The key table: which stored version each key reads, which writes of it are still in flight, and the
//! versions replaced or freed whose space returns once no request uses them.
//!
//! Copy-on-write: a write of a key goes to a new extent and is queued as *pending*; the key keeps
//! reading its *current* version until the pending write completes successfully, which commits it (the
//! old version is then retired). A failed write is dropped and changes nothing: the previous value stays
//! readable. Pending writes commit in the order they were issued, so a slow older write can never
//! overwrite a newer one.
//!
//! Nothing here waits: the table is only touched with the engine's keys mutex held, and every wait for
//! I/O happens after the caller has released it (`Engine::read`, `Engine::free`).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use super::job::Checksums;
use super::request::Request;
use crate::error::{Error, Result};
use crate::store::Layout;

/// One stored value of a key: where its bytes are and which requests use them.
pub(super) struct Version {
    pub layout: Layout,
    pub checksums: Option<Checksums>,
    pub write: Arc<Request>,
    pub readers: Vec<Arc<Request>>,
}

impl Version {
    fn busy(&self) -> bool {
        !self.write.is_done() || self.readers.iter().any(|r| !r.is_done())
    }

    /// Every request still possibly using this version's space.
    pub fn requests(&self) -> impl Iterator<Item = &Arc<Request>> {
        std::iter::once(&self.write).chain(self.readers.iter())
    }
}

#[derive(Default)]
struct Slot {
    /// The last committed value.
    current: Option<Version>,
    /// Writes in flight, oldest first.
    pending: VecDeque<Version>,
    /// Why the key holds nothing: its writes all failed and no earlier value exists.
    failed: Option<Error>,
}

impl Slot {
    fn is_empty(&self) -> bool {
        self.current.is_none() && self.pending.is_empty() && self.failed.is_none()
    }

    fn has_data(&self) -> bool {
        self.current.is_some() || !self.pending.is_empty()
    }
}

/// What a reader gets: the version's placement and its registered request.
pub(super) struct ReadTarget {
    pub layout: Layout,
    pub checksums: Option<Checksums>,
}

#[derive(Default)]
pub(super) struct Keys {
    map: HashMap<String, Slot>,
    /// Keys that may have pending writes, so a sweep need not visit every key.
    unsettled: HashSet<String>,
    retired: Vec<Version>,
}

impl Keys {
    /// Queues a write of `key` as pending.
    pub fn add_pending(&mut self, key: &str, v: Version) {
        let slot = self.map.entry(key.to_owned()).or_default();
        slot.pending.push_back(v);
        if !self.unsettled.contains(key) {
            self.unsettled.insert(key.to_owned());
        }
    }

    /// Records a write that failed before any I/O (allocation): it changes nothing, except that a key
    /// with no value at all now reports why.
    pub fn write_refused(&mut self, key: &str, err: Error) {
        let slot = self.map.entry(key.to_owned()).or_default();
        if !slot.has_data() {
            slot.failed = Some(err);
        }
    }

    /// Commits or drops the completed pending writes of every key that has some, oldest first.
    pub fn settle_all(&mut self) {
        let keys = std::mem::take(&mut self.unsettled);
        for k in keys {
            if self.settle(&k) {
                self.unsettled.insert(k);
            }
        }
    }

    /// Commits or drops `key`'s completed pending writes, in order; true while some remain in flight.
    fn settle(&mut self, key: &str) -> bool {
        let Some(slot) = self.map.get_mut(key) else {
            return false;
        };
        while slot.pending.front().is_some_and(|v| v.write.is_done()) {
            let Some(v) = slot.pending.pop_front() else {
                break;
            };
            match v.write.error() {
                None => {
                    slot.failed = None;
                    if let Some(old) = slot.current.replace(v) {
                        self.retired.push(old);
                    }
                }
                Some(e) => {
                    if slot.current.is_none() {
                        slot.failed = Some(e);
                    }
                    self.retired.push(v);
                }
            }
        }
        let more = !slot.pending.is_empty();
        if slot.is_empty() {
            self.map.remove(key);
        }
        more
    }

    /// The retired versions no request uses any more: their space can be freed.
    pub fn take_idle(&mut self) -> Vec<Layout> {
        let mut idle = Vec::new();
        self.retired.retain(|v| {
            if v.busy() {
                true
            } else {
                idle.push(v.layout.clone());
                false
            }
        });
        idle
    }

    /// Requests of retired versions still running (waited for before an allocation is retried).
    pub fn busy_retired(&self) -> Vec<Arc<Request>> {
        self.retired
            .iter()
            .flat_map(|v| v.requests())
            .filter(|r| !r.is_done())
            .cloned()
            .collect()
    }

    /// The write requests a read of `key` must wait for before choosing what to read.
    pub fn pending_writes(&self, key: &str) -> Vec<Arc<Request>> {
        self.map.get(key).map_or_else(Vec::new, |s| {
            s.pending
                .iter()
                .filter(|v| !v.write.is_done())
                .map(|v| v.write.clone())
                .collect()
        })
    }

    /// Registers `reader` on `key`'s current version. `Ok(None)`: the key has no value yet but writes
    /// in flight (wait for them and ask again). Errors: the key is unknown, holds nothing because its
    /// writes failed, or holds another length than `len`.
    pub fn start_read(
        &mut self,
        key: &str,
        len: u64,
        reader: impl FnOnce(&Layout) -> Arc<Request>,
    ) -> Result<Option<(ReadTarget, Arc<Request>)>> {
        self.settle(key);
        let slot = self
            .map
            .get_mut(key)
            .ok_or_else(|| Error::UnknownKey(key.to_owned()))?;
        let Some(v) = slot.current.as_mut() else {
            if !slot.pending.is_empty() {
                return Ok(None);
            }
            return Err(match &slot.failed {
                Some(cause) => Error::Poisoned {
                    key: key.to_owned(),
                    cause: Box::new(cause.clone()),
                },
                None => Error::UnknownKey(key.to_owned()),
            });
        };
        if v.layout.len != len {
            return Err(Error::Memory(format!(
                "key {key:?} holds {} bytes but the destination holds {len}",
                v.layout.len
            )));
        }
        let req = reader(&v.layout);
        v.readers.retain(|r| !r.is_done());
        v.readers.push(req.clone());
        Ok(Some((
            ReadTarget {
                layout: v.layout.clone(),
                checksums: v.checksums.clone(),
            },
            req,
        )))
    }

    /// Forgets `key`, handing back every version it had for the caller to wait on and free.
    pub fn remove(&mut self, key: &str) -> Result<Vec<Version>> {
        self.settle(key);
        let slot = self
            .map
            .remove(key)
            .ok_or_else(|| Error::UnknownKey(key.to_owned()))?;
        self.unsettled.remove(key);
        Ok(slot.current.into_iter().chain(slot.pending).collect())
    }

    pub fn contains(&mut self, key: &str) -> bool {
        self.settle(key);
        self.map.get(key).is_some_and(Slot::has_data)
    }

    /// Bytes `key` will read: its newest pending write's, else its current value's.
    pub fn len_of(&mut self, key: &str) -> Result<u64> {
        self.settle(key);
        let slot = self
            .map
            .get(key)
            .ok_or_else(|| Error::UnknownKey(key.to_owned()))?;
        if let Some(v) = slot.pending.back().or(slot.current.as_ref()) {
            return Ok(v.layout.len);
        }
        Err(match &slot.failed {
            Some(cause) => Error::Poisoned {
                key: key.to_owned(),
                cause: Box::new(cause.clone()),
            },
            None => Error::UnknownKey(key.to_owned()),
        })
    }

    pub fn names(&mut self) -> Vec<String> {
        self.settle_all();
        self.map
            .iter()
            .filter(|(_, s)| s.has_data())
            .map(|(k, _)| k.clone())
            .collect()
    }

    pub fn count(&mut self) -> usize {
        self.settle_all();
        self.map.values().filter(|s| s.has_data()).count()
    }

    /// Drops everything (close): the caller has made sure no request is running.
    pub fn clear(&mut self) {
        self.map.clear();
        self.unsettled.clear();
        self.retired.clear();
    }
}
