//! Sharded checkpoints: a checkpoint written by several ranks at once, each storing only the
//! slices of the model's flat buffers it owns, so that no rank ever holds the whole state to
//! save it.
//!
//! The flat buffers are the model's parameter buffer ([`PARAMS_BUFFER`]) and any further
//! buffers of the same layout a caller keeps (a trainer's optimizer moments). A sharded
//! checkpoint directory holds, beside `config.json` and the caller's further files:
//!
//! ```text
//! shards.json                          the index: world size, buffer names and length, each
//!                                      shard's file, CRC-32C, size and pieces (the ranges of
//!                                      the flat buffers it stores, in order)
//! shard-00000-of-00002.safetensors     rank 0's pieces of every buffer, one 1-D f32 tensor
//! shard-00001-of-00002.safetensors     per buffer (the rank's flat shard, padding and all)
//! CHECKSUMS                            every file above, shards included
//! ```
//!
//! The commit protocol. Rank 0 creates the staging directory `ROOT/.tmp-NAME`
//! ([`begin_sharded`]); after a barrier every rank writes its shard into it and fsyncs it
//! ([`write_shard`]), and hands its [`ShardRecord`] (digest, size) to rank 0; rank 0 then
//! writes the config, the further files, the index and `SHA256SUMS`, renames the directory
//! into place and only then points `latest` at it ([`commit_sharded`]). A checkpoint
//! directory therefore exists only with every shard in it: a crash or `kill -9` of any rank
//! during a save leaves a staging directory that nothing names, and `latest` on the previous
//! complete checkpoint.
//!
//! Reading ([`read_ranges`]) takes any ranges of the flat buffers from whichever shards hold
//! them, each shard file checked against its digest, so a checkpoint written by N ranks is
//! read by M ranks, or as one whole model (`load_params_into` reads sharded checkpoints too).
//!
//! This module never commits a checkpoint before every shard is written, and never returns
//! values of a shard whose bytes contradict its digest: a damaged or missing shard is an error
//! naming the file and the rank that wrote it.

use std::collections::BTreeMap;
use std::ops::Range;

use super::*;

/// The index of a sharded checkpoint.
pub const SHARD_INDEX_FILE: &str = "shards.json";
/// The name of the model's parameter buffer in a sharded checkpoint.
pub const PARAMS_BUFFER: &str = "params";
/// The `format` of the index this module writes (its shards' digests are CRC-32C's).
const FORMAT: &str = "cohort-flat-shards/2";
/// The format of older indexes, still read: the same but for SHA-256 digests, in a field
/// named `sha256`.
const FORMAT_1: &str = "cohort-flat-shards/1";

/// A CRC-32C as a [`ShardRecord`] holds it, from the number a rank hands rank 0.
pub fn crc32c_digest(crc: u32) -> String {
    Digest::Crc32c(crc).to_string()
}

/// The number of a [`ShardRecord`]'s digest when it is a CRC-32C (what a rank hands rank 0).
pub fn digest_crc32c(digest: &str) -> Option<u32> {
    match Digest::parse(digest)? {
        Digest::Crc32c(crc) => Some(crc),
        Digest::Sha256(_) => None,
    }
}

/// The file of rank `rank`'s shard among `world`.
pub fn shard_file_name(rank: usize, world: usize) -> String {
    format!("shard-{rank:05}-of-{world:05}.safetensors")
}

/// A range of the flat buffers that a shard stores, and where in the shard's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    /// The range's first element in the flat buffers.
    pub start: usize,
    /// One past its last.
    pub end: usize,
    /// Where it starts in the shard's tensors.
    pub at: usize,
}

/// What one rank wrote: its file, the file's digest and size, and the ranges of the flat
/// buffers it stores. Its tensors may hold more than the pieces (a sharding's padding), which
/// readers pass over.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardRecord {
    /// The rank that wrote it.
    pub rank: usize,
    /// The file's name in the checkpoint directory.
    pub file: String,
    /// The file's digest: `crc32c:` and 8 hex digits (in an index of format 1, the field
    /// `sha256`: 64 hex digits).
    #[serde(alias = "sha256")]
    pub digest: String,
    /// The file's size in bytes.
    pub bytes: u64,
    /// Elements of each of the shard's tensors.
    pub len: usize,
    /// The ranges of the flat buffers it stores.
    pub pieces: Vec<Piece>,
}

/// The index of a sharded checkpoint: `shards.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardIndex {
    /// The format's name and version.
    pub format: String,
    /// Ranks that wrote the checkpoint, one shard each.
    pub world_size: usize,
    /// Elements of each flat buffer (the model's parameter count).
    pub len: usize,
    /// The buffers every shard stores a piece of ([`PARAMS_BUFFER`] first).
    pub buffers: Vec<String>,
    /// The caller's further facts (a trainer's strategy, optimizer name and step).
    pub metadata: BTreeMap<String, String>,
    /// One record per rank, in rank order.
    pub shards: Vec<ShardRecord>,
}

impl ShardIndex {
    /// The index of `records` (one per rank, in rank order) of `buffers` of `len` elements.
    /// Fails unless the records' pieces cover `0..len` exactly once.
    pub fn new(
        len: usize,
        buffers: Vec<String>,
        metadata: BTreeMap<String, String>,
        shards: Vec<ShardRecord>,
    ) -> Result<ShardIndex, CheckpointError> {
        let index = ShardIndex {
            format: FORMAT.to_string(),
            world_size: shards.len(),
            len,
            buffers,
            metadata,
            shards,
        };
        index.check(Path::new(SHARD_INDEX_FILE))?;
        Ok(index)
    }

    /// Fails unless the shards are in rank order and their pieces tile `0..len`.
    fn check(&self, path: &Path) -> Result<(), CheckpointError> {
        if self.format != FORMAT && self.format != FORMAT_1 {
            return Err(format_err(
                path,
                format!("format {:?}, expected {FORMAT:?}", self.format),
            ));
        }
        if let Some(s) = (self.shards.iter()).find(|s| Digest::parse(&s.digest).is_none()) {
            return Err(format_err(
                path,
                format!("shard {}'s digest {:?} is not one", s.rank, s.digest),
            ));
        }
        if self.shards.len() != self.world_size {
            return Err(format_err(
                path,
                format!(
                    "{} shards listed for a world size of {}",
                    self.shards.len(),
                    self.world_size
                ),
            ));
        }
        let mut pieces: Vec<(usize, usize)> = Vec::new();
        for (rank, shard) in self.shards.iter().enumerate() {
            if shard.rank != rank {
                return Err(format_err(
                    path,
                    format!("shard {rank} is listed as rank {}'s", shard.rank),
                ));
            }
            if let Some(p) = (shard.pieces.iter())
                .find(|p| p.start > p.end || p.at + (p.end - p.start) > shard.len)
            {
                return Err(format_err(
                    path,
                    format!(
                        "shard {rank}'s piece {p:?} lies outside its {} elements",
                        shard.len
                    ),
                ));
            }
            pieces.extend(
                (shard.pieces.iter())
                    .filter(|p| p.start < p.end)
                    .map(|p| (p.start, p.end)),
            );
        }
        pieces.sort_unstable();
        let mut at = 0;
        for (a, b) in pieces {
            if a != at || b > self.len {
                return Err(format_err(
                    path,
                    format!(
                        "the shards' pieces do not cover 0..{} exactly once (at {at}: {a}..{b})",
                        self.len
                    ),
                ));
            }
            at = b;
        }
        if at != self.len {
            return Err(format_err(
                path,
                format!("the shards' pieces end at {at}, not {}", self.len),
            ));
        }
        Ok(())
    }
}

/// Validates a checkpoint name as [`save`] does.
fn check_name(name: &str) -> Result<(), CheckpointError> {
    if name.is_empty() || name.starts_with('.') || name.contains(['/', '\\']) || name == LATEST_FILE
    {
        return Err(CheckpointError::BadName { name: name.into() });
    }
    Ok(())
}

/// The directory the ranks write checkpoint `name` of `root` into before it is committed.
pub fn staging_dir(root: &Path, name: &str) -> PathBuf {
    root.join(format!(".tmp-{name}"))
}

/// Rank 0's first step of a sharded save: a fresh, empty staging directory for checkpoint
/// `name` under `root` (one left by a save that was killed is removed). Returns it.
pub fn begin_sharded(root: &Path, name: &str) -> Result<PathBuf, CheckpointError> {
    check_name(name)?;
    fs::create_dir_all(root).map_err(io("create", root))?;
    let tmp = staging_dir(root, name);
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(io("remove", &tmp))?;
    }
    fs::create_dir(&tmp).map_err(io("create", &tmp))?;
    Ok(tmp)
}

/// Every rank's step of a sharded save: writes rank `rank`'s shard (of `world`) into the
/// staging directory `staging`: `buffers` (name, values; all of one length), of which
/// `pieces` say what ranges of the flat buffers they hold, fsynced. Returns its record.
pub fn write_shard(
    staging: &Path,
    rank: usize,
    world: usize,
    pieces: &[Piece],
    buffers: &[(&str, &[f32])],
) -> Result<ShardRecord, CheckpointError> {
    let file = shard_file_name(rank, world);
    let path = staging.join(&file);
    let len = buffers.first().map_or(0, |(_, b)| b.len());
    if let Some((name, b)) = buffers.iter().find(|(_, b)| b.len() != len) {
        return Err(format_err(
            &path,
            format!(
                "buffer {name:?} has {} elements, the first one {len}",
                b.len()
            ),
        ));
    }
    if let Some(p) = pieces
        .iter()
        .find(|p| p.start > p.end || p.at + (p.end - p.start) > len)
    {
        return Err(format_err(
            &path,
            format!("piece {p:?} lies outside the buffers' {len} elements"),
        ));
    }
    let pieces = pieces.to_vec();
    let tensors = buffers
        .iter()
        .map(|(name, data)| {
            let view = F32View {
                shape: vec![data.len()],
                data,
            };
            (name.to_string(), view)
        })
        .collect();
    let metadata = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        ("rank".to_string(), rank.to_string()),
        ("world_size".to_string(), world.to_string()),
        (
            "pieces".to_string(),
            serde_json::to_string(&pieces).map_err(|e| format_err(&path, e))?,
        ),
    ]);
    let sum = write_safetensors(&path, tensors, metadata)?;
    Ok(ShardRecord {
        rank,
        file,
        digest: sum.digest.to_string(),
        bytes: sum.size.unwrap_or_default(),
        len,
        pieces,
    })
}

/// Rank 0's last step of a sharded save, once every rank's shard is in `staging_dir(root,
/// name)`: writes `config.json` of `config` (with `ckpt.config_extra`), `ckpt`'s further files
/// (its `model` must be `None`: the parameters are in the shards), the index and
/// `CHECKSUMS` (the shards' sums taken from the index), then renames the directory into
/// `root/name` and points `root/latest` at it. Returns the checkpoint's directory.
pub fn commit_sharded(
    root: &Path,
    name: &str,
    config: &GPTConfig,
    ckpt: &Checkpoint<'_>,
    index: &ShardIndex,
) -> Result<PathBuf, CheckpointError> {
    check_name(name)?;
    let tmp = staging_dir(root, name);
    if ckpt.model.is_some() {
        return Err(format_err(
            &tmp,
            "a sharded checkpoint stores its parameters in the shards, not model.safetensors",
        ));
    }
    let result = (|| {
        let config = write_config(&tmp, config, &ckpt.config_extra)?;
        let index_json = serde_json::to_vec_pretty(index).map_err(|e| format_err(&tmp, e))?;
        let mut extra_files: Vec<(&str, &[u8])> = vec![(SHARD_INDEX_FILE, &index_json[..])];
        extra_files.extend(ckpt.extra_files.iter().copied());
        let mut written = vec![(CONFIG_FILE.to_string(), config)];
        for file in &ckpt.tensor_files {
            let sum = write_tensor_file(&tmp, file)?;
            written.push((file.name.to_string(), sum));
        }
        for (file, bytes) in &extra_files {
            if file.contains(['/', '\\'])
                || file.starts_with('.')
                || *file == CHECKSUMS_FILE
                || *file == SHA256SUMS_FILE
            {
                return Err(CheckpointError::BadName {
                    name: file.to_string(),
                });
            }
            let sum = write_bytes(&tmp.join(file), bytes)?;
            written.push((file.to_string(), sum));
        }
        for shard in &index.shards {
            written.push((shard.file.clone(), shard_sum(shard, &tmp)?));
        }
        write_checksums(&tmp, &written)?;
        fsync(&tmp)
    })();
    if let Err(e) = result {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let dest = root.join(name);
    install(root, name, &tmp, &dest)?;
    write_file_atomic(&root.join(LATEST_FILE), format!("{name}\n").as_bytes())?;
    Ok(dest)
}

/// Removes the staging directory of a sharded save that failed on some rank.
pub fn abort_sharded(root: &Path, name: &str) {
    // Nothing names it; the next save of this name or the trainer's pruning removes what a
    // failure here leaves.
    let _ = fs::remove_dir_all(staging_dir(root, name));
}

/// The index of the sharded checkpoint `dir`, checked against its checksums; `None` when `dir`
/// is not sharded.
pub fn read_index(dir: &Path) -> Result<Option<ShardIndex>, CheckpointError> {
    let Some(bytes) = read_file_verified(dir, SHARD_INDEX_FILE)? else {
        return Ok(None);
    };
    let path = dir.join(SHARD_INDEX_FILE);
    let index: ShardIndex = serde_json::from_slice(&bytes).map_err(|e| format_err(&path, e))?;
    index.check(&path)?;
    Ok(Some(index))
}

/// What the index records of `shard`'s file (in checkpoint `dir`), as a checksums file would.
fn shard_sum(shard: &ShardRecord, dir: &Path) -> Result<Sum, CheckpointError> {
    let digest = Digest::parse(&shard.digest).ok_or_else(|| {
        format_err(
            &dir.join(SHARD_INDEX_FILE),
            format!(
                "shard {}'s digest {:?} is not one",
                shard.rank, shard.digest
            ),
        )
    })?;
    Ok(Sum {
        digest,
        size: Some(shard.bytes),
    })
}

/// The error of shard `rank`'s file, naming the rank.
fn shard_err(index: &ShardIndex, rank: usize) -> impl Fn(CheckpointError) -> CheckpointError {
    let world = index.world_size;
    move |source| CheckpointError::Shard {
        rank,
        world,
        source: Box::new(source),
    }
}

/// The values of `ranges` (of the flat buffers) of each buffer of `names`, concatenated in
/// the order of `ranges`, read from the shards of checkpoint `dir` that hold them (each shard
/// file read once and checked against its digest). One vector per name.
pub fn read_ranges(
    dir: &Path,
    index: &ShardIndex,
    names: &[&str],
    ranges: &[Range<usize>],
) -> Result<Vec<Vec<f32>>, CheckpointError> {
    let index_path = dir.join(SHARD_INDEX_FILE);
    for name in names {
        if !index.buffers.iter().any(|b| b == name) {
            return Err(format_err(
                &index_path,
                format!("no buffer {name:?} (it has {:?})", index.buffers),
            ));
        }
    }
    if let Some(r) = ranges.iter().find(|r| r.end > index.len) {
        return Err(format_err(
            &index_path,
            format!("range {r:?} lies past the buffers' {} elements", index.len),
        ));
    }
    let total: usize = ranges.iter().map(|r| r.len()).sum();
    let mut out = vec![vec![0f32; total]; names.len()];
    for shard in &index.shards {
        // Where each of this shard's pieces overlaps a wanted range: (offset in the shard,
        // offset in the output, length).
        let mut copies = Vec::new();
        for p in &shard.pieces {
            let mut out_at = 0;
            for r in ranges {
                let (lo, hi) = (p.start.max(r.start), p.end.min(r.end));
                if lo < hi {
                    copies.push((p.at + lo - p.start, out_at + lo - r.start, hi - lo));
                }
                out_at += r.len();
            }
        }
        if copies.is_empty() {
            continue;
        }
        let err = shard_err(index, shard.rank);
        let path = dir.join(&shard.file);
        let bytes = read_file(&path).map_err(&err)?;
        (shard_sum(shard, dir).map_err(&err)?)
            .check(&path, SHARD_INDEX_FILE, &bytes)
            .map_err(&err)?;
        let st = parse_safetensors(&path, &bytes).map_err(&err)?;
        for (name, dst) in names.iter().zip(out.iter_mut()) {
            let t = st.tensor(name).map_err(|e| err(format_err(&path, e)))?;
            if t.dtype() != Dtype::F32 || t.shape() != [shard.len] {
                return Err(err(format_err(
                    &path,
                    format!(
                        "tensor {name:?} is {:?} {:?}, expected F32 [{}]",
                        t.dtype(),
                        t.shape(),
                        shard.len
                    ),
                )));
            }
            let data = t.data();
            for &(from, to, len) in &copies {
                copy_f32(&mut dst[to..to + len], &data[from * 4..(from + len) * 4]);
            }
        }
    }
    Ok(out)
}

/// Loads the parameters of the sharded checkpoint `dir` (index `index`) into `model`.
pub(super) fn load_sharded_params(
    dir: &Path,
    index: &ShardIndex,
    model: &mut GPT,
) -> Result<(), CheckpointError> {
    let n = model.num_params();
    if index.len != n {
        return Err(format_err(
            &dir.join(SHARD_INDEX_FILE),
            format!(
                "the shards hold {} parameters, the model of config.json has {n}",
                index.len
            ),
        ));
    }
    let params = read_ranges(dir, index, &[PARAMS_BUFFER], std::slice::from_ref(&(0..n)))?;
    model.params_mut().copy_from_slice(&params[0]);
    if let Some(i) = model.params().iter().position(|x| !x.is_finite()) {
        return Err(format_err(
            &dir.join(SHARD_INDEX_FILE),
            format!("parameter {i} is non-finite in the shards"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> GPTConfig {
        GPTConfig {
            vocab_size: 11,
            max_position_embeddings: 8,
            n_layers: 1,
            n_heads: 2,
            d_model: 8,
            d_ff: 16,
            ..GPTConfig::default()
        }
    }

    /// Two ranks, each holding two pieces of a model's buffer with padding between them,
    /// write, commit and read back any ranges; the index refuses pieces that overlap.
    #[test]
    fn shards_written_by_two_ranks_read_back_by_any_ranges() {
        let model = GPT::new(tiny(), 1).unwrap();
        let n = model.num_params();
        let full: Vec<f32> = model.params().to_vec();
        let moment: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let half = n / 2;
        // Rank r holds [r*h/2 .. (r+1)*h/2) and [h + r*(n-h)/2 ..) at offsets 0 and 1000.
        let cut = |a: usize, b: usize, r: usize| {
            let m = a + (b - a) / 2;
            if r == 0 {
                a..m
            } else {
                m..b
            }
        };
        let root = tempfile::tempdir().unwrap();
        let staging = begin_sharded(root.path(), "step-1").unwrap();
        let mut records = Vec::new();
        for rank in 0..2 {
            let (p, q) = (cut(0, half, rank), cut(half, n, rank));
            let mut params = vec![0f32; 1000 + q.len()];
            let mut m = vec![0f32; 1000 + q.len()];
            params[..p.len()].copy_from_slice(&full[p.clone()]);
            params[1000..].copy_from_slice(&full[q.clone()]);
            m[..p.len()].copy_from_slice(&moment[p.clone()]);
            m[1000..].copy_from_slice(&moment[q.clone()]);
            let pieces = [
                Piece {
                    start: p.start,
                    end: p.end,
                    at: 0,
                },
                Piece {
                    start: q.start,
                    end: q.end,
                    at: 1000,
                },
            ];
            let buffers = [(PARAMS_BUFFER, &params[..]), ("m", &m[..])];
            records.push(write_shard(&staging, rank, 2, &pieces, &buffers).unwrap());
        }
        let names = vec![PARAMS_BUFFER.to_string(), "m".to_string()];
        let mut overlapping = records.clone();
        overlapping[1].pieces[0].start -= 1;
        let err = ShardIndex::new(n, names.clone(), BTreeMap::new(), overlapping).unwrap_err();
        assert!(err.to_string().contains("exactly once"), "{err}");
        let index = ShardIndex::new(n, names, BTreeMap::new(), records).unwrap();
        let dir = commit_sharded(
            root.path(),
            "step-1",
            model.config(),
            &Checkpoint::default(),
            &index,
        )
        .unwrap();
        assert!(verify(&dir).unwrap());
        assert_eq!(read_index(&dir).unwrap(), Some(index.clone()));
        let (loaded, _) = load_model(root.path()).unwrap();
        assert!(loaded.params() == model.params());
        let ranges = [3..half + 5, n - 4..n, 0..2];
        let got = read_ranges(&dir, &index, &["m", PARAMS_BUFFER], &ranges).unwrap();
        let want =
            |b: &[f32]| -> Vec<f32> { ranges.iter().flat_map(|r| b[r.clone()].to_vec()).collect() };
        assert_eq!(got[0], want(&moment));
        assert_eq!(got[1], want(&full));
    }
}
