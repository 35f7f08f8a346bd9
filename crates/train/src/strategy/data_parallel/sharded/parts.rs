//! How ZeRO-2/3 split the model's flat buffers: by part (embeddings, each
//! block, the head), each part over the ranks on its own as ZeRO-1 splits
//! the whole buffer, a rank's shards of all the parts one after the other
//! in its *flat shard*. Pure bookkeeping of ranges: it never communicates
//! and never touches the model.

use std::ops::Range;

use cohort_engine::optim::DecayMask;
use cohort_gpt::checkpoint::Piece;

use super::super::zero1::{shard_mask, Shard};
use crate::error::TrainError;

/// One part's place in the flat buffer and this rank's shard of it.
#[derive(Debug, Clone)]
pub(super) struct PartShard {
    /// The part's range of the model's flat buffers.
    pub(super) range: Range<usize>,
    /// This rank's shard of the part (`n` is the part's length).
    pub(super) shard: Shard,
    /// Where the shard starts in the flat shard.
    pub(super) offset: usize,
}

impl PartShard {
    /// This rank's shard of the part, in the flat shard.
    pub(super) fn own(&self) -> Range<usize> {
        self.offset..self.offset + self.shard.len
    }

    /// The model (not padding) elements of this rank's shard, in the
    /// model's buffer.
    pub(super) fn real_in_model(&self) -> Range<usize> {
        let r = self.shard.real();
        self.range.start + r.start..self.range.start + r.end
    }

    /// Whether the part does not divide into the ranks, so that its
    /// collectives go through a padded staging buffer.
    pub(super) fn padded(&self) -> bool {
        self.shard.padded() != self.shard.n
    }
}

/// How the parts of a flat buffer are split over the ranks.
#[derive(Debug, Clone)]
pub(super) struct PartShards {
    pub(super) parts: Vec<PartShard>,
    /// Elements of the flat shard: the sum of the parts' shard lengths.
    pub(super) len: usize,
    /// Elements of the whole buffer.
    pub(super) n: usize,
}

impl PartShards {
    /// The parts `ranges` (which partition `0..n` in order) split over
    /// `world` ranks, as rank `rank` holds them.
    pub(super) fn new(ranges: &[Range<usize>], world: usize, rank: usize) -> PartShards {
        let mut offset = 0;
        let parts = ranges
            .iter()
            .map(|range| {
                let shard = Shard::new(range.len(), world, rank);
                let part = PartShard {
                    range: range.clone(),
                    shard,
                    offset,
                };
                offset += shard.len;
                part
            })
            .collect();
        PartShards {
            parts,
            len: offset,
            n: ranges.last().map_or(0, |r| r.end),
        }
    }

    /// The part whose range holds `range`.
    pub(super) fn find(&self, range: &Range<usize>) -> Result<&PartShard, TrainError> {
        self.parts
            .iter()
            .find(|p| p.range.start <= range.start && range.end <= p.range.end)
            .ok_or(TrainError::UnknownPart {
                start: range.start,
                end: range.end,
            })
    }

    /// This rank's flat shard of the whole buffer `full` (padding zero).
    pub(super) fn take(&self, full: &[f32]) -> Vec<f32> {
        let mut flat = vec![0f32; self.len];
        for p in &self.parts {
            let real = p.real_in_model();
            flat[p.offset..p.offset + real.len()].copy_from_slice(&full[real]);
        }
        flat
    }

    /// The weight-decay mask of the flat shard, given the whole buffer's.
    pub(super) fn mask(&self, full: &DecayMask) -> Result<DecayMask, TrainError> {
        let mut exempt = Vec::new();
        for p in &self.parts {
            let real = p.real_in_model();
            let m = shard_mask(full, real.clone());
            exempt.extend(
                m.segments()
                    .iter()
                    .filter(|(_, decayed)| !decayed)
                    .map(|(r, _)| p.offset + r.start..p.offset + r.end),
            );
            exempt.push(p.offset + real.len()..p.offset + p.shard.len);
        }
        exempt.retain(|r| r.start < r.end);
        Ok(DecayMask::with_exempt(self.len, exempt)?)
    }

    /// Where this rank's shards of the parts lie: each part's model elements in the
    /// model's buffer, at their place in the flat shard.
    pub(super) fn pieces(&self) -> Vec<Piece> {
        (self.parts.iter())
            .map(|p| {
                let real = p.real_in_model();
                Piece {
                    start: real.start,
                    end: real.end,
                    at: p.offset,
                }
            })
            .collect()
    }

    /// The elements of the second-largest part (the largest being the
    /// embeddings, which run once a pass): a block, on a GPT.
    pub(super) fn second_largest(&self) -> usize {
        let mut lens: Vec<_> = self.parts.iter().map(|p| p.range.len()).collect();
        lens.sort_unstable();
        lens.iter().rev().nth(1).copied().unwrap_or(0)
    }

    /// The largest padded part but one (a block, on a GPT): the largest
    /// buffer of a collective in flight worth keeping for the next part.
    pub(super) fn second_largest_padded(&self) -> usize {
        let mut lens: Vec<_> = self.parts.iter().map(|p| p.shard.padded()).collect();
        lens.sort_unstable();
        lens.iter().rev().nth(1).copied().unwrap_or(0)
    }

    /// The largest padded part: what the staging buffer may have to hold.
    pub(super) fn largest_padded(&self) -> usize {
        self.parts
            .iter()
            .map(|p| p.shard.padded())
            .max()
            .unwrap_or(0)
    }
}

/// The first `len` elements of `buf`, grown to that length if shorter.
pub(super) fn staged(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    &mut buf[..len]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_shards_take_and_pieces_are_inverse_with_padding_per_part() {
        // Parts of 5, 7 and 4 elements over 3 ranks: shards of 2, 3 and 2.
        let ranges = [0..5, 5..12, 12..16];
        let full: Vec<f32> = (0..16).map(|i| i as f32 + 1.0).collect();
        let world = 3;
        let shards: Vec<_> = (0..world)
            .map(|r| PartShards::new(&ranges, world, r))
            .collect();
        assert_eq!(shards[0].len, 7);
        let gathered: Vec<f32> = shards.iter().flat_map(|s| s.take(&full)).collect();
        assert_eq!(&gathered[..7], &[1.0, 2.0, 6.0, 7.0, 8.0, 13.0, 14.0]);
        // The last rank's shards end in padding.
        assert_eq!(&gathered[14..], &[5.0, 0.0, 12.0, 0.0, 0.0, 0.0, 0.0]);
        // Every rank's pieces put back where they belong make the whole buffer.
        let mut back = vec![0f32; 16];
        for (rank, shard) in shards.iter().enumerate() {
            let flat = &gathered[rank * 7..(rank + 1) * 7];
            for p in shard.pieces() {
                back[p.start..p.end].copy_from_slice(&flat[p.at..p.at + p.end - p.start]);
            }
        }
        assert_eq!(back, full);
    }

    #[test]
    fn the_flat_shards_mask_is_each_parts_cut_with_padding_exempt() {
        let ranges = [0..5, 5..12];
        let full = DecayMask::with_exempt(12, std::iter::once(3..6)).unwrap();
        let decayed = |m: &DecayMask| -> Vec<bool> {
            m.segments()
                .iter()
                .flat_map(|(r, d)| std::iter::repeat_n(*d, r.len()))
                .collect()
        };
        let want = [
            // rank 0: 0,1 | 5,6,7 ; rank 1: 2,3 | 8,9,10 ; rank 2: 4,pad | 11,pad,pad
            vec![true, true, false, true, true],
            vec![true, false, true, true, true],
            vec![false, false, true, false, false],
        ];
        for (rank, want) in want.iter().enumerate() {
            let m = PartShards::new(&ranges, 3, rank).mask(&full).unwrap();
            assert_eq!(&decayed(&m), want, "rank {rank}");
        }
    }
}
