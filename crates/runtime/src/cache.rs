//! AutoCache (PipeTransformer): the frozen prefix's output for each training sample, so that
//! later epochs skip the frozen layers. Entries stay in memory up to a byte budget and spill
//! to one unnamed temporary file after that (deleted when the cache goes). Each entry records
//! the frozen depth it was computed at: when more layers freeze, only the newly frozen ones run,
//! on the cached tensor. Frozen weights never change, so entries never go stale.

use crate::backend::plain_device;
use crate::batch::MicroBatch;
use crate::model::{Stage, StageInput};
use burn::tensor::{Tensor, TensorData};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Where an entry's bytes are.
enum Place {
    Memory(Vec<u8>),
    Disk(u64),
}

struct Entry {
    /// Layer blocks `0..depth` produced it.
    depth: usize,
    /// Positions it holds (the length of the micro-batch it was computed in).
    positions: usize,
    bytes: usize,
    place: Place,
}

/// What the cache holds and how it served, since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Sample rows served whole from the cache.
    pub hits: u64,
    /// Rows that ran only newly frozen layers on a cached tensor.
    pub extended: u64,
    /// Rows that ran the whole frozen prefix.
    pub misses: u64,
    pub memory_entries: u64,
    pub memory_bytes: u64,
    pub disk_entries: u64,
    /// Bytes of live entries in the spill file (the file may hold older, replaced ones too).
    pub disk_bytes: u64,
    /// Entries past the budget that the spill file could not take (a full disk): they are
    /// not kept, and their samples run the frozen layers again when they come back.
    pub not_kept: u64,
}

struct Inner {
    entries: HashMap<u64, Entry>,
    spill: Option<File>,
    spill_len: u64,
    stats: CacheStats,
    /// Why the spill file stopped taking entries (the first write that failed), if it did.
    spill_failed: Option<String>,
}

/// The frozen-prefix activation cache of one run (shared by the workers that run stage 0).
pub struct PrefixCache {
    /// Bytes of entries kept in memory at most.
    pub budget: u64,
    /// Store values as f16 (half the bytes; outputs rounded to f16).
    pub f16: bool,
    dir: PathBuf,
    inner: Mutex<Inner>,
}

#[derive(Debug, thiserror::Error)]
#[error("frozen-prefix cache in {dir}: {msg}")]
pub struct CacheError {
    dir: String,
    msg: String,
}

impl PrefixCache {
    /// A cache holding at most `budget` bytes in memory, spilling to a file in `dir`.
    pub fn new(budget: u64, f16: bool, dir: &Path) -> Self {
        PrefixCache {
            budget,
            f16,
            dir: dir.to_path_buf(),
            inner: Mutex::new(Inner {
                entries: HashMap::new(),
                spill: None,
                spill_len: 0,
                stats: CacheStats::default(),
                spill_failed: None,
            }),
        }
    }

    /// Make sure the spill file can be created (before training, not at the first spill).
    pub fn check_dir(&self) -> Result<(), CacheError> {
        self.spill_file().map(drop)
    }

    /// A new unnamed spill file in the cache's directory (made if missing).
    fn spill_file(&self) -> Result<File, CacheError> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| self.err(format!("cannot create the directory: {e}")))?;
        tempfile::tempfile_in(&self.dir)
            .map_err(|e| self.err(format!("cannot create a spill file there: {e}")))
    }

    /// Why the spill file stopped taking entries, if it did (see [`CacheStats::not_kept`]).
    pub fn spill_failed(&self) -> Option<String> {
        self.lock().spill_failed.clone()
    }

    pub fn stats(&self) -> CacheStats {
        self.lock().stats
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn err(&self, msg: String) -> CacheError {
        CacheError {
            dir: self.dir.display().to_string(),
            msg,
        }
    }

    fn encode(&self, values: &[f32]) -> Vec<u8> {
        if self.f16 {
            values
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                .collect()
        } else {
            values.iter().flat_map(|v| v.to_le_bytes()).collect()
        }
    }

    fn decode(&self, bytes: &[u8]) -> Vec<f32> {
        if self.f16 {
            bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect()
        } else {
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        }
    }

    /// The cached output of `sample`: the depth it was computed at, its positions, its values.
    pub fn get(&self, sample: u64) -> Result<Option<(usize, usize, Vec<f32>)>, CacheError> {
        let inner = self.lock();
        let Some(e) = inner.entries.get(&sample) else {
            return Ok(None);
        };
        let values = match &e.place {
            Place::Memory(b) => self.decode(b),
            Place::Disk(at) => {
                let mut b = vec![0u8; e.bytes];
                let f = inner.spill.as_ref().expect("a spilled entry has a file");
                f.read_exact_at(&mut b, *at)
                    .map_err(|e| self.err(format!("cannot read a spilled entry back: {e}")))?;
                self.decode(&b)
            }
        };
        Ok(Some((e.depth, e.positions, values)))
    }

    /// Keep `values`, the output of layer blocks `0..depth` at `positions` positions for
    /// `sample` (replacing its entry): in memory while the budget allows, else in the spill
    /// file.
    pub fn put(
        &self,
        sample: u64,
        depth: usize,
        positions: usize,
        values: &[f32],
    ) -> Result<(), CacheError> {
        self.put_encoded(sample, (depth, positions), self.encode(values))
    }

    fn put_encoded(
        &self,
        sample: u64,
        (depth, positions): (usize, usize),
        bytes: Vec<u8>,
    ) -> Result<(), CacheError> {
        let n = bytes.len() as u64;
        let mut guard = self.lock();
        let inner = &mut *guard;
        if let Some(old) = inner.entries.remove(&sample) {
            match old.place {
                Place::Memory(b) => {
                    inner.stats.memory_entries -= 1;
                    inner.stats.memory_bytes -= b.len() as u64;
                }
                Place::Disk(_) => {
                    inner.stats.disk_entries -= 1;
                    inner.stats.disk_bytes -= old.bytes as u64;
                }
            }
        }
        let place = if inner.stats.memory_bytes + n <= self.budget {
            inner.stats.memory_entries += 1;
            inner.stats.memory_bytes += n;
            Place::Memory(bytes)
        } else {
            if inner.spill_failed.is_some() {
                inner.stats.not_kept += 1;
                return Ok(());
            }
            if inner.spill.is_none() {
                inner.spill = Some(self.spill_file()?);
            }
            let at = inner.spill_len;
            let f = inner.spill.as_mut().expect("made above");
            if let Err(e) = f.write_all_at(&bytes, at).and_then(|_| f.flush()) {
                // A full disk costs speed, not the run: this entry and later ones past the
                // budget are not kept (their samples are recomputed); the file's tail past
                // `spill_len` is never read.
                inner.spill_failed = Some(e.to_string());
                inner.stats.not_kept += 1;
                return Ok(());
            }
            inner.spill_len += n;
            inner.stats.disk_entries += 1;
            inner.stats.disk_bytes += n;
            Place::Disk(at)
        };
        inner.entries.insert(
            sample,
            Entry {
                depth,
                positions,
                bytes: n as usize,
                place,
            },
        );
        Ok(())
    }

    fn count(&self, hits: u64, extended: u64, misses: u64) {
        let mut inner = self.lock();
        inner.stats.hits += hits;
        inner.stats.extended += extended;
        inner.stats.misses += misses;
    }

    /// The output of `prefix` (layer blocks `0..k`, no autodiff) for `mb`, on the plain
    /// device: rows cached at depth `k` are read back, rows cached at a lower depth run only
    /// layers from there, the others run the whole prefix; every computed row is cached.
    /// An entry serves a micro-batch as long as it or shorter (its first positions: padding is
    /// masked, so a position's output does not depend on how much padding follows); a longer
    /// micro-batch computes the row again.
    pub fn prefix_output(&self, prefix: &Stage, mb: &MicroBatch) -> Result<Tensor<3>, CacheError> {
        let k = prefix.layers.len();
        let (rows, seq) = (mb.rows, mb.seq_len);
        if mb.samples.len() != rows {
            return Err(self.err(
                "the micro-batch has no sample numbers (the cache needs sampling = \"epochs\")"
                    .into(),
            ));
        }
        let dev = plain_device();
        let mut out: Vec<Option<Vec<f32>>> = vec![None; rows];
        // Rows to compute, by the depth they start from (0: tokens).
        let mut todo: BTreeMap<usize, Vec<(usize, Vec<f32>)>> = BTreeMap::new();
        let mut width = None;
        for (r, &s) in mb.samples.iter().enumerate() {
            match self.get(s)? {
                Some((d, p, mut v)) if d > 0 && d <= k && p >= seq => {
                    let w = v.len() / p.max(1);
                    v.truncate(seq * w);
                    match d == k {
                        true => {
                            width = Some(w);
                            out[r] = Some(v);
                        }
                        false => todo.entry(d).or_default().push((r, v)),
                    }
                }
                _ => todo.entry(0).or_default().push((r, Vec::new())),
            }
        }
        let hits = out.iter().filter(|o| o.is_some()).count() as u64;
        let misses = todo.get(&0).map_or(0, |v| v.len()) as u64;
        self.count(hits, rows as u64 - hits - misses, misses);
        for (d, group) in todo {
            let n = group.len();
            // The group's rows, for their tokens, padding mask and token types.
            let sub = mb.rows_of(&group.iter().map(|(r, _)| *r).collect::<Vec<_>>());
            let input = if d == 0 {
                crate::model::batch_input(&sub, &dev)
            } else {
                let w = group[0].1.len() / seq;
                let vals: Vec<f32> = group.iter().flat_map(|(_, v)| v.iter().copied()).collect();
                StageInput::Hidden(Tensor::<3>::from_data(
                    TensorData::new(vals, [n, seq, w]),
                    &dev,
                ))
            };
            let rest = Stage {
                layers: prefix.layers[d..].to_vec(),
            };
            let y = rest
                .forward_in(input, &crate::model::Ctx::of(&sub, &dev))
                .map_err(|e| self.err(format!("frozen prefix: {e}")))?;
            let w = y.dims()[2];
            width = Some(w);
            let vals = y
                .to_data()
                .try_to_vec::<f32>()
                .map_err(|e| self.err(format!("prefix output is not f32: {e:?}")))?;
            for (i, (r, _)) in group.into_iter().enumerate() {
                let row = &vals[i * seq * w..(i + 1) * seq * w];
                let bytes = self.encode(row);
                // Train on what later epochs will read back (f16-rounded when so stored).
                out[r] = Some(if self.f16 {
                    self.decode(&bytes)
                } else {
                    row.to_vec()
                });
                self.put_encoded(mb.samples[r], (k, seq), bytes)?;
            }
        }
        let w = width.expect("at least one row");
        let all: Vec<f32> = out
            .into_iter()
            .flat_map(|o| o.expect("every row"))
            .collect();
        Ok(Tensor::<3>::from_data(
            TensorData::new(all, [rows, seq, w]),
            &dev,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("pw-cache-{name}-{}", std::process::id()))
    }

    #[test]
    fn memory_stays_within_the_budget_and_spilled_entries_read_back() {
        let row = |s: u64| -> Vec<f32> { (0..100).map(|i| s as f32 * 0.5 + i as f32).collect() };
        // 400 bytes an entry: two fit in 1000 bytes.
        let c = PrefixCache::new(1000, false, &dir("budget"));
        for s in 0..10 {
            c.put(s, 1, 1, &row(s)).unwrap();
            assert!(c.stats().memory_bytes <= 1000);
        }
        let st = c.stats();
        assert_eq!((st.memory_entries, st.disk_entries), (2, 8), "{st:?}");
        assert_eq!((st.memory_bytes, st.disk_bytes), (800, 3200));
        for s in 0..10 {
            assert_eq!(c.get(s).unwrap(), Some((1, 1, row(s))));
        }
        assert_eq!(c.get(10).unwrap(), None);
        // A deeper entry replaces the old one wherever it was.
        c.put(0, 2, 1, &row(7)).unwrap();
        c.put(9, 2, 1, &row(1)).unwrap();
        assert_eq!(c.get(0).unwrap(), Some((2, 1, row(7))));
        assert_eq!(c.get(9).unwrap(), Some((2, 1, row(1))));
        let st = c.stats();
        assert_eq!((st.memory_entries, st.disk_entries), (2, 8), "{st:?}");
        assert!(st.memory_bytes <= 1000);
        // No budget at all: everything on disk.
        let c = PrefixCache::new(0, false, &dir("zero"));
        c.put(3, 1, 1, &row(3)).unwrap();
        assert_eq!(c.get(3).unwrap(), Some((1, 1, row(3))));
        assert_eq!(c.stats().memory_bytes, 0);
    }

    #[test]
    fn f16_halves_the_bytes_and_rounds() {
        let v: Vec<f32> = (0..64).map(|i| (i as f32 - 30.0) * 0.173).collect();
        let c = PrefixCache::new(1 << 20, true, &dir("f16"));
        c.put(1, 3, 1, &v).unwrap();
        assert_eq!(c.stats().memory_bytes, 128);
        let (d, _, back) = c.get(1).unwrap().unwrap();
        assert_eq!(d, 3);
        for (a, b) in v.iter().zip(&back) {
            assert!((a - b).abs() <= a.abs() * 1e-3 + 1e-4, "{a} vs {b}");
        }
    }

    #[test]
    fn an_unwritable_spill_directory_is_named() {
        let c = PrefixCache::new(0, false, Path::new("/proc/no-such-dir"));
        let e = c.put(0, 1, 1, &[1.0]).unwrap_err().to_string();
        assert!(e.contains("/proc/no-such-dir"), "{e}");
    }

    /// A full disk (here /dev/full, whose writes fail with ENOSPC) stops the spill, not the
    /// run: entries past the budget are then not kept (their samples are recomputed), those
    /// kept still read back, and the reason is kept for the summary.
    #[test]
    fn a_full_disk_stops_the_spill_not_the_run() {
        let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
            return;
        };
        let row = |s: u64| -> Vec<f32> { (0..100).map(|i| s as f32 + i as f32).collect() };
        let c = PrefixCache::new(800, false, &dir("full"));
        c.lock().spill = Some(full);
        for s in 0..5 {
            c.put(s, 1, 1, &row(s)).unwrap();
        }
        let st = c.stats();
        assert_eq!(
            (st.memory_entries, st.disk_entries, st.not_kept),
            (2, 0, 3),
            "{st:?}"
        );
        assert_eq!(c.get(0).unwrap(), Some((1, 1, row(0))));
        assert_eq!(c.get(4).unwrap(), None, "not kept: computed again");
        let why = c.spill_failed().expect("the failure is kept");
        assert!(why.contains("space"), "{why}");
    }
}
