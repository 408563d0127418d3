//! A job's key-value store: the operations of torch's c10d `Store` (set, get, add, append,
//! compare_set, check, delete, num_keys, wait) over the coordinator's [`Store`], so that it
//! lives in etcd when the coordinator does and outlives any replica.
//!
//! Every operation composes the backend's own primitives (reads, compare-and-swap
//! transactions, prefix watches), which both backends implement atomically; no replica keeps
//! any of it in memory. Keys live at [`keys::kv_key`] (`/cohort/v1/kv/<job>/<scope>/<key>`),
//! on no lease, and are deleted with the job ([`crate::ops::end_job`]). Every write compares
//! the job's `ended` record absent, so nothing is written into a job that has ended.
//!
//! Bounds: [`MAX_KEY_LEN`], [`MAX_VALUE_LEN`], [`MAX_KEYS_PER_JOB`], [`MAX_WAIT_KEYS`],
//! [`MAX_WAIT`] (checked by the service before anything is read).

use crate::keys;
use crate::store::{Compare, KeyValue, Store, StoreError, Txn, TxnOp, WatchEvent};
use futures::StreamExt;
use std::collections::HashSet;
use std::time::Duration;
use tokio::time::Instant;

/// Longest key, in bytes.
pub const MAX_KEY_LEN: usize = 1024;
/// Largest value, in bytes (1 MiB: etcd refuses requests over 1.5 MiB).
pub const MAX_VALUE_LEN: usize = 1 << 20;
/// Most keys one job's store holds, in all scopes together; a write that would create one
/// more is refused.
pub const MAX_KEYS_PER_JOB: u64 = 65_536;
/// Most keys one `check` or `wait` names.
pub const MAX_WAIT_KEYS: usize = 1024;
/// Longest a `get` or `wait` is held, whatever the client asks (the client calls again).
pub const MAX_WAIT: Duration = Duration::from_secs(30);
/// Most compare-and-swap attempts of one write under contention before it answers
/// [`KvError::Contended`] (the client retries).
const CAS_ATTEMPTS: usize = 64;

/// Why a key-value operation failed.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// The backend failed; retrying may help.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// `add` on a value that is not a decimal integer.
    #[error("store key {key:?} holds a value that is not an integer; add needs one")]
    NotAnInteger {
        /// The caller's key.
        key: String,
    },
    /// `add` would overflow a signed 64-bit integer.
    #[error("adding {delta} to store key {key:?} overflows a 64-bit integer")]
    Overflow {
        /// The caller's key.
        key: String,
        /// The addend.
        delta: i64,
    },
    /// The write would create a key past [`MAX_KEYS_PER_JOB`].
    #[error("job {job} already holds {held} store keys (at most {MAX_KEYS_PER_JOB}); delete some first")]
    TooManyKeys {
        /// The job.
        job: String,
        /// How many it holds.
        held: u64,
    },
    /// The job has ended: its store is gone and takes no writes.
    #[error("job {job} has ended; its store takes no writes")]
    Ended {
        /// The job.
        job: String,
    },
    /// `append` would make the value longer than [`MAX_VALUE_LEN`]; nothing was written.
    #[error("appending {adding} bytes to store key {key:?} ({held} bytes) would pass the value bound (at most 1 MiB, {MAX_VALUE_LEN} bytes); nothing written")]
    TooLong {
        /// The caller's key.
        key: String,
        /// The bytes it holds.
        held: usize,
        /// The bytes appended.
        adding: usize,
    },
    /// Other writers kept changing the key; nothing was written (retry).
    #[error("store key {key:?} changed under {CAS_ATTEMPTS} attempts in a row; nothing written, retry")]
    Contended {
        /// The caller's key.
        key: String,
    },
}

/// One job scope's key-value store.
pub struct Kv<'a> {
    store: &'a dyn Store,
    job: &'a str,
    scope: &'a str,
}

impl<'a> Kv<'a> {
    /// The store of `scope` in `job` (both already validated).
    pub fn new(store: &'a dyn Store, job: &'a str, scope: &'a str) -> Self {
        Self { store, job, scope }
    }

    fn key(&self, key: &str) -> String {
        keys::kv_key(self.job, self.scope, key)
    }

    /// Reads `key` now.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    pub async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, KvError> {
        Ok(self.store.get(&self.key(key)).await?.map(|kv| kv.value))
    }

    /// The read-modify-write every write is: reads `key`, asks `decide` for the value to
    /// write (`None`: write nothing) and the answer, and writes it by a transaction that
    /// compares the key unchanged and the job not ended; retried (up to [`CAS_ATTEMPTS`]) when
    /// another writer got there first. A new key is refused past [`MAX_KEYS_PER_JOB`] (the
    /// count is read before the transaction, so concurrent creators may pass it by a few).
    ///
    /// # Cancel safety
    /// Cancel safe: each write is one transaction, applied whole or not at all.
    async fn update<R>(
        &self,
        key: &str,
        mut decide: impl FnMut(Option<&KeyValue>) -> Result<(Option<Vec<u8>>, R), KvError>,
    ) -> Result<R, KvError> {
        let full = self.key(key);
        let ended = keys::ended(self.job);
        for _ in 0..CAS_ATTEMPTS {
            let current = self.store.get(&full).await?;
            let (write, answer) = decide(current.as_ref())?;
            let Some(value) = write else { return Ok(answer) };
            let guard = match &current {
                Some(kv) => Compare::ModRevision(full.clone(), kv.mod_revision),
                None => {
                    let held = self.store.count_prefix(&keys::kv_prefix(self.job)).await?;
                    if held >= MAX_KEYS_PER_JOB {
                        return Err(KvError::TooManyKeys { job: self.job.to_string(), held });
                    }
                    Compare::Absent(full.clone())
                }
            };
            let txn = Txn {
                compares: vec![Compare::Absent(ended.clone()), guard],
                success: vec![TxnOp::Put { key: full.clone(), value, lease: None }],
                failure: vec![],
            };
            if self.store.txn(txn).await?.succeeded {
                return Ok(answer);
            }
            if self.store.get(&ended).await?.is_some() {
                return Err(KvError::Ended { job: self.job.to_string() });
            }
        }
        Err(KvError::Contended { key: key.to_string() })
    }

    /// Writes `value` under `key`.
    ///
    /// # Cancel safety
    /// Cancel safe (each write is one transaction, applied whole or not at all).
    pub async fn set(&self, key: &str, value: Vec<u8>) -> Result<(), KvError> {
        self.update(key, |_| Ok((Some(value.clone()), ()))).await
    }

    /// Adds `delta` to the decimal integer under `key` (absent: 0) and answers the sum.
    ///
    /// # Cancel safety
    /// Cancel safe (each write is one transaction, applied whole or not at all); but a caller
    /// that retries an add whose answer it lost may add twice, as with torch's own stores.
    pub async fn add(&self, key: &str, delta: i64) -> Result<i64, KvError> {
        self.update(key, |current| {
            let now = match current {
                None => 0,
                Some(kv) => std::str::from_utf8(&kv.value)
                    .ok()
                    .and_then(|s| s.trim().parse::<i64>().ok())
                    .ok_or_else(|| KvError::NotAnInteger { key: key.to_string() })?,
            };
            let sum = now.checked_add(delta).ok_or_else(|| KvError::Overflow { key: key.to_string(), delta })?;
            Ok((Some(sum.to_string().into_bytes()), sum))
        })
        .await
    }

    /// Appends `value` to the bytes under `key` (absent: empty), in one compare-and-swap, so
    /// concurrent appends are each applied once; refused ([`KvError::TooLong`]) when the
    /// result would pass [`MAX_VALUE_LEN`].
    ///
    /// # Cancel safety
    /// Cancel safe (each write is one transaction, applied whole or not at all); but a caller
    /// that retries an append whose answer it lost may append twice, as an add.
    pub async fn append(&self, key: &str, value: &[u8]) -> Result<(), KvError> {
        self.update(key, |current| {
            let held = current.map_or(&[][..], |kv| &kv.value[..]);
            if held.len() + value.len() > MAX_VALUE_LEN {
                return Err(KvError::TooLong { key: key.to_string(), held: held.len(), adding: value.len() });
            }
            Ok((Some([held, value].concat()), ()))
        })
        .await
    }

    /// torch's compare_set: writes `desired` if `key` holds `expected`, or is absent and
    /// `expected` is empty; answers the value stored now, or `expected` for an absent key and a
    /// non-empty `expected` (TCPStore's answer).
    ///
    /// # Cancel safety
    /// Cancel safe (each write is one transaction, applied whole or not at all).
    pub async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>, KvError> {
        self.update(key, |current| {
            Ok(match current {
                None if expected.is_empty() => (Some(desired.to_vec()), desired.to_vec()),
                None => (None, expected.to_vec()),
                Some(kv) if kv.value == expected => (Some(desired.to_vec()), desired.to_vec()),
                Some(kv) => (None, kv.value.clone()),
            })
        })
        .await
    }

    /// Deletes `key`; answers whether it existed.
    ///
    /// # Cancel safety
    /// Cancel safe (one request).
    pub async fn delete(&self, key: &str) -> Result<bool, KvError> {
        Ok(self.store.delete(&self.key(key)).await?)
    }

    /// How many keys the scope holds.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    pub async fn num_keys(&self) -> Result<u64, KvError> {
        Ok(self.store.count_prefix(&keys::kv_scope_prefix(self.job, self.scope)).await?)
    }

    /// Whether every key exists now.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    pub async fn check(&self, names: &[String]) -> Result<bool, KvError> {
        for name in names {
            if self.store.get(&self.key(name)).await?.is_none() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Waits until every key exists, at most `wait`: answers `false` when the wait ran out.
    /// It watches the keys' longest common prefix (registered before the keys are read, so no
    /// write between the read and the watch is missed); a watch the backend drops is opened
    /// again and the keys read again.
    ///
    /// # Cancel safety
    /// Cancel safe (read only): dropping it drops the watch.
    pub async fn wait(&self, names: &[String], wait: Duration) -> Result<bool, KvError> {
        let deadline = Instant::now() + wait;
        let full: Vec<String> = names.iter().map(|n| self.key(n)).collect();
        let wanted: HashSet<&str> = full.iter().map(String::as_str).collect();
        let prefix = common_prefix(&full);
        loop {
            let watch = tokio::time::timeout_at(deadline, self.store.watch_prefix(&prefix, 0)).await;
            let Ok(watch) = watch else { return Ok(false) };
            let mut stream = watch?;
            let mut missing: HashSet<&str> = HashSet::new();
            for key in &wanted {
                if self.store.get(key).await?.is_none() {
                    missing.insert(key);
                }
            }
            loop {
                if missing.is_empty() {
                    return Ok(true);
                }
                let event = match tokio::time::timeout_at(deadline, stream.next()).await {
                    Err(_) => return Ok(false),
                    Ok(Some(Ok(event))) => event,
                    // The watch ended or failed: open it again and read the keys again.
                    Ok(Some(Err(e))) => {
                        tracing::debug!(error = %e, "store wait: watch failed; watching again");
                        break;
                    }
                    Ok(None) => break,
                };
                match event {
                    WatchEvent::Put(kv) => {
                        missing.remove(kv.key.as_str());
                    }
                    WatchEvent::Delete { key, .. } => {
                        if let Some(k) = wanted.get(key.as_str()) {
                            missing.insert(k);
                        }
                    }
                }
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            // A backend that keeps dropping watches is not polled in a hot loop.
            tokio::time::sleep(Duration::from_millis(50).min(deadline.saturating_duration_since(Instant::now()))).await;
        }
    }
}

/// The longest common prefix of `keys` (which share at least the scope's prefix), cut back to
/// a character boundary.
fn common_prefix(keys: &[String]) -> String {
    let Some(first) = keys.first() else { return String::new() };
    let mut len = first.len();
    for k in &keys[1..] {
        len = len.min(first.bytes().zip(k.bytes()).take_while(|(a, b)| a == b).count());
    }
    while !first.is_char_boundary(len) {
        len -= 1;
    }
    first[..len].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_prefixes() {
        assert_eq!(common_prefix(&["/a/bc".into(), "/a/bd".into()]), "/a/b");
        assert_eq!(common_prefix(&["/a/x".into()]), "/a/x");
        assert_eq!(common_prefix(&["/a/é".into(), "/a/è".into()]), "/a/");
        assert_eq!(common_prefix(&[]), "");
    }
}
