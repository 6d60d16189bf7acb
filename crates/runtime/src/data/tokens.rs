//! Token sequences a corpus is made of: the bytes of a text, ids from a tokenizer, or token
//! shards on disk, memory-mapped so that a corpus larger than memory costs none. A
//! [`Tokens`] is a window `start..end` into shared storage, so splitting off the held-out
//! part copies nothing.

use super::error::Result;
use std::path::Path;
use std::sync::Arc;

/// llm.c's shard header: 256 int32, the first three magic, version, token count.
pub const SHARD_MAGIC: i32 = 20240520;
pub const SHARD_HEADER_BYTES: usize = 256 * 4;

enum Storage {
    Bytes(Vec<u8>),
    Ids(Vec<u32>),
    /// Shards: each a mapped file, where its tokens start, their width (2 or 4 bytes), and
    /// the first token index of the corpus it holds.
    Shards(Vec<Shard>),
}

struct Shard {
    map: memmap2::Mmap,
    offset: usize,
    width: usize,
    first: usize,
    len: usize,
}

impl Shard {
    fn get(&self, i: usize) -> u32 {
        let at = self.offset + i * self.width;
        match self.width {
            2 => u16::from_le_bytes([self.map[at], self.map[at + 1]]) as u32,
            _ => u32::from_le_bytes(self.map[at..at + 4].try_into().expect("4 bytes")),
        }
    }
}

/// A window `start..end` of a token sequence.
#[derive(Clone)]
pub struct Tokens {
    data: Arc<Storage>,
    start: usize,
    end: usize,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokens({} tokens)", self.len())
    }
}

impl PartialEq for Tokens {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && (0..self.len()).all(|i| self.get(i) == other.get(i))
    }
}

impl Tokens {
    /// The bytes of a text, each a token.
    pub fn bytes(b: Vec<u8>) -> Self {
        let end = b.len();
        Tokens {
            data: Arc::new(Storage::Bytes(b)),
            start: 0,
            end,
        }
    }

    /// Token ids (from a tokenizer).
    pub fn ids(v: Vec<u32>) -> Self {
        let end = v.len();
        Tokens {
            data: Arc::new(Storage::Ids(v)),
            start: 0,
            end,
        }
    }

    /// Token shards, in order, as one sequence: llm.c's (a 256 x int32 header with magic
    /// 20240520, version 1 for uint16 tokens or 2 for uint32, and the token count) or
    /// nanoGPT's headerless uint16 `.bin`. Each file is mapped, not read.
    pub fn shards(paths: &[std::path::PathBuf]) -> Result<Self> {
        let mut shards = Vec::new();
        let mut first = 0;
        for p in paths {
            let shard = map_shard(p, first)?;
            first += shard.len;
            shards.push(shard);
        }
        Ok(Tokens {
            data: Arc::new(Storage::Shards(shards)),
            start: 0,
            end: first,
        })
    }

    pub fn len(&self) -> usize {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Token `i` of this window.
    pub fn get(&self, i: usize) -> u32 {
        let i = self.start + i;
        match &*self.data {
            Storage::Bytes(b) => b[i] as u32,
            Storage::Ids(v) => v[i],
            Storage::Shards(s) => {
                let k = s.partition_point(|sh| sh.first + sh.len <= i);
                s[k].get(i - s[k].first)
            }
        }
    }

    /// Tokens `at..at + n` as ids.
    pub fn window(&self, at: usize, n: usize) -> Vec<i64> {
        match &*self.data {
            Storage::Bytes(b) => b[self.start + at..self.start + at + n]
                .iter()
                .map(|&x| x as i64)
                .collect(),
            Storage::Ids(v) => v[self.start + at..self.start + at + n]
                .iter()
                .map(|&x| x as i64)
                .collect(),
            Storage::Shards(_) => (at..at + n).map(|i| self.get(i) as i64).collect(),
        }
    }

    /// The window `range` of this one (sharing its storage).
    pub fn slice(&self, range: std::ops::Range<usize>) -> Tokens {
        assert!(range.end <= self.len(), "slice past the tokens");
        Tokens {
            data: self.data.clone(),
            start: self.start + range.start,
            end: self.start + range.end,
        }
    }

    /// Every token, in order.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.len()).map(move |i| self.get(i))
    }

    /// One more than the largest id (0 when empty).
    pub fn id_bound(&self) -> usize {
        self.iter().map(|x| x as usize + 1).max().unwrap_or(0)
    }
}

/// Map one shard file and find its tokens.
fn map_shard(path: &Path, first: usize) -> Result<Shard> {
    let name = path.display();
    // Checked before the open, which would block on a FIFO.
    super::records::regular(path)?;
    let file = std::fs::File::open(path).map_err(|e| format!("{name}: cannot read shard: {e}"))?;
    if !file.metadata().is_ok_and(|m| m.is_file()) {
        return Err(format!("{name}: not a regular file").into());
    }
    // SAFETY: the map is read only; a shard changed underneath a run is the user's to avoid,
    // as with any mapped data set (it reads wrong tokens, it does not break memory safety of
    // the bounds-checked reads here).
    let map =
        unsafe { memmap2::Mmap::map(&file) }.map_err(|e| format!("{name}: cannot map: {e}"))?;
    let header: Option<[i32; 3]> = (map.len() >= SHARD_HEADER_BYTES).then(|| {
        let w = |k: usize| i32::from_le_bytes(map[4 * k..4 * k + 4].try_into().expect("4"));
        [w(0), w(1), w(2)]
    });
    let (offset, width, len) = match header {
        Some([SHARD_MAGIC, version, count]) => {
            let width = match version {
                1 => 2,
                2 => 4,
                v => {
                    return Err(format!(
                        "{name}: llm.c shard version {v} (1: uint16 tokens, 2: uint32)"
                    )
                    .into())
                }
            };
            let have = (map.len() - SHARD_HEADER_BYTES) / width;
            if count < 0
                || count as usize != have
                || !(map.len() - SHARD_HEADER_BYTES).is_multiple_of(width)
            {
                return Err(format!(
                    "{name}: the header says {count} tokens, the file holds {} bytes after it ({width}-byte tokens)",
                    map.len() - SHARD_HEADER_BYTES
                ).into());
            }
            (SHARD_HEADER_BYTES, width, have)
        }
        _ => {
            if !map.len().is_multiple_of(2) {
                return Err(format!(
                    "{name}: {} bytes is not a whole number of uint16 tokens (nanoGPT's headerless .bin)",
                    map.len()
                ).into());
            }
            (0, 2, map.len() / 2)
        }
    };
    Ok(Shard {
        map,
        offset,
        width,
        first,
        len,
    })
}

/// Write tokens as an llm.c shard: version 1 (uint16) when every id fits, else 2 (uint32).
pub fn shard_bytes(ids: &[u32]) -> Vec<u8> {
    let wide = ids.iter().any(|&x| x > u16::MAX as u32);
    let mut out = vec![0u8; SHARD_HEADER_BYTES];
    for (k, v) in [SHARD_MAGIC, if wide { 2 } else { 1 }, ids.len() as i32]
        .iter()
        .enumerate()
    {
        out[4 * k..4 * k + 4].copy_from_slice(&v.to_le_bytes());
    }
    for &x in ids {
        if wide {
            out.extend_from_slice(&x.to_le_bytes());
        } else {
            out.extend_from_slice(&(x as u16).to_le_bytes());
        }
    }
    out
}
