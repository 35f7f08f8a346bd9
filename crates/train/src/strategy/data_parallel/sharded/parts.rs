//! How ZeRO-2/3 split the model's flat buffers: by *unit* (the ranges the
//! backward hands over as they become final: the embeddings, each block's
//! MLP and attention, the head), each unit over the ranks on its own as
//! ZeRO-1 splits the whole buffer, a rank's shards of all the units one
//! after the other in its *flat shard*. A *part* (the embeddings, a block,
//! the head: what the model runs and stage 3 gathers) is one or more
//! consecutive units, whose shards therefore lie one after the other in
//! the flat shard too. Pure bookkeeping of ranges: it never communicates
//! and never touches the model.

use std::ops::Range;

use cohort_engine::optim::DecayMask;
use cohort_gpt::checkpoint::Piece;

use super::super::zero1::{shard_mask, Shard};
use crate::error::TrainError;

/// One unit's place in the flat buffer and this rank's shard of it: what
/// one reduce-scatter carries.
#[derive(Debug, Clone)]
pub(super) struct UnitShard {
    /// The unit's range of the model's flat buffers.
    pub(super) range: Range<usize>,
    /// This rank's shard of the unit (`n` is the unit's length).
    pub(super) shard: Shard,
    /// Where the shard starts in the flat shard.
    pub(super) offset: usize,
}

impl UnitShard {
    /// This rank's shard of the unit, in the flat shard.
    pub(super) fn own(&self) -> Range<usize> {
        self.offset..self.offset + self.shard.len
    }

    /// The model (not padding) elements of this rank's shard, in the
    /// model's buffer.
    pub(super) fn real_in_model(&self) -> Range<usize> {
        let r = self.shard.real();
        self.range.start + r.start..self.range.start + r.end
    }

    /// Whether the unit does not divide into the ranks, so that its
    /// reduce-scatter goes through a padded staging buffer.
    pub(super) fn padded(&self) -> bool {
        self.shard.padded() != self.shard.n
    }
}

/// One part's place in the flat buffer: what one all-gather carries. Each
/// rank sends its shards of the part's units, one after the other (`len`
/// elements, contiguous in its flat shard), so the gathered buffer holds,
/// for each rank in turn, its shards of the units; [`PartShards::unpack`]
/// puts them where they belong in the model.
#[derive(Debug, Clone)]
pub(super) struct PartShard {
    /// The part's range of the model's flat buffers.
    pub(super) range: Range<usize>,
    /// Its units, as indices into [`PartShards::units`].
    pub(super) units: Range<usize>,
    /// Where its shards start in the flat shard.
    pub(super) offset: usize,
    /// Elements of its shards on each rank, padding included.
    pub(super) len: usize,
    /// Ranks.
    pub(super) world: usize,
}

impl PartShard {
    /// This rank's shards of the part, in the flat shard.
    pub(super) fn own(&self) -> Range<usize> {
        self.offset..self.offset + self.len
    }

    /// Elements of the gathered part: every rank's shards of it.
    pub(super) fn padded(&self) -> usize {
        self.len * self.world
    }
}

/// How the units and parts of a flat buffer are split over the ranks.
#[derive(Debug, Clone)]
pub(super) struct PartShards {
    pub(super) units: Vec<UnitShard>,
    pub(super) parts: Vec<PartShard>,
    /// Elements of the flat shard: the sum of the units' shard lengths.
    pub(super) len: usize,
    /// Elements of the whole buffer.
    pub(super) n: usize,
}

impl PartShards {
    /// The parts `parts` (which partition `0..n` in order), each cut into
    /// units at every boundary of `cuts` (the ranges the backward hands
    /// over) that falls inside it, split over `world` ranks as rank `rank`
    /// holds them. A part without a cut inside is one unit.
    pub(super) fn new(
        parts: &[Range<usize>],
        cuts: &[Range<usize>],
        world: usize,
        rank: usize,
    ) -> PartShards {
        let mut bounds: Vec<usize> = cuts.iter().flat_map(|r| [r.start, r.end]).collect();
        bounds.sort_unstable();
        bounds.dedup();
        let mut shards = PartShards {
            units: Vec::new(),
            parts: Vec::new(),
            len: 0,
            n: parts.last().map_or(0, |r| r.end),
        };
        for range in parts {
            let (first, offset) = (shards.units.len(), shards.len);
            let inner = bounds.iter().copied();
            let ends = inner.filter(|&b| range.start < b && b < range.end);
            let mut start = range.start;
            for end in ends.chain([range.end]) {
                let shard = Shard::new(end - start, world, rank);
                shards.units.push(UnitShard {
                    range: start..end,
                    shard,
                    offset: shards.len,
                });
                shards.len += shard.len;
                start = end;
            }
            shards.parts.push(PartShard {
                range: range.clone(),
                units: first..shards.units.len(),
                offset,
                len: shards.len - offset,
                world,
            });
        }
        shards
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

    /// The unit whose range holds `range`: the range the backward hands
    /// over, a unit or one inside it (a block of a tied wte's rows, or wpe).
    pub(super) fn holding(&self, range: &Range<usize>) -> Result<&UnitShard, TrainError> {
        self.units
            .iter()
            .find(|u| u.range.start <= range.start && range.end <= u.range.end)
            .ok_or(TrainError::UnknownPart {
                start: range.start,
                end: range.end,
            })
    }

    /// The units of part `p`, in order.
    pub(super) fn units_of(&self, p: &PartShard) -> &[UnitShard] {
        &self.units[p.units.clone()]
    }

    /// Whether part `p`'s all-gathers can land straight in the model's
    /// buffer: units that all divide into the ranks, so that each unit's
    /// gathered shards are the unit in order.
    pub(super) fn direct(&self, p: &PartShard) -> bool {
        self.units_of(p).iter().all(|u| !u.padded())
    }

    /// `range` (inside part `p`) of the model, from `whole`, the part's
    /// all-gather (each rank's shards of the units, rank after rank), into
    /// `dest`: each rank's shard of each unit copied to its place, padding
    /// left out.
    pub(super) fn unpack(
        &self,
        p: &PartShard,
        whole: &[f32],
        range: &Range<usize>,
        dest: &mut [f32],
    ) {
        for u in self.units_of(p) {
            let s = u.shard.len;
            for q in 0..p.world {
                let owned = u.range.start + q * s..(u.range.start + (q + 1) * s).min(u.range.end);
                let (lo, hi) = (owned.start.max(range.start), owned.end.min(range.end));
                if lo >= hi {
                    continue;
                }
                let at = q * p.len + (u.offset - p.offset) + (lo - owned.start);
                dest[lo - range.start..hi - range.start].copy_from_slice(&whole[at..at + hi - lo]);
            }
        }
    }

    /// This rank's flat shard of the whole buffer `full` (padding zero).
    pub(super) fn take(&self, full: &[f32]) -> Vec<f32> {
        let mut flat = vec![0f32; self.len];
        for u in &self.units {
            let real = u.real_in_model();
            flat[u.offset..u.offset + real.len()].copy_from_slice(&full[real]);
        }
        flat
    }

    /// The weight-decay mask of the flat shard, given the whole buffer's.
    pub(super) fn mask(&self, full: &DecayMask) -> Result<DecayMask, TrainError> {
        let mut exempt = Vec::new();
        for u in &self.units {
            let real = u.real_in_model();
            let m = shard_mask(full, real.clone());
            exempt.extend(
                m.segments()
                    .iter()
                    .filter(|(_, decayed)| !decayed)
                    .map(|(r, _)| u.offset + r.start..u.offset + r.end),
            );
            exempt.push(u.offset + real.len()..u.offset + u.shard.len);
        }
        exempt.retain(|r| r.start < r.end);
        Ok(DecayMask::with_exempt(self.len, exempt)?)
    }

    /// Where this rank's shards of the units lie: each unit's model
    /// elements in the model's buffer, at their place in the flat shard.
    pub(super) fn pieces(&self) -> Vec<Piece> {
        (self.units.iter())
            .map(|u| {
                let real = u.real_in_model();
                Piece {
                    start: real.start,
                    end: real.end,
                    at: u.offset,
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

    /// The largest gathered part but one (a block, on a GPT): the largest
    /// buffer of a collective in flight worth keeping for the next part.
    pub(super) fn second_largest_padded(&self) -> usize {
        let mut lens: Vec<_> = self.parts.iter().map(|p| p.padded()).collect();
        lens.sort_unstable();
        lens.iter().rev().nth(1).copied().unwrap_or(0)
    }

    /// The largest gathered part: what the staging buffer may have to hold
    /// (a unit's padded reduce-scatter is never larger than its part's).
    pub(super) fn largest_padded(&self) -> usize {
        self.parts.iter().map(|p| p.padded()).max().unwrap_or(0)
    }
}

/// The sizes of the split that a memory estimate needs (rank 0's, whose
/// shards are the longest), from the same split the strategy makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SplitSizes {
    /// Elements of the flat shard.
    pub(crate) flat: usize,
    /// Elements of the largest unit's shard: a reduce-scatter's scratch.
    pub(crate) largest_unit_shard: usize,
    /// Each part's gathered length (padding included), and whether its
    /// gather goes through a staging copy (not one unit that divides).
    pub(crate) parts: Vec<(usize, bool)>,
}

/// [`SplitSizes`] of `parts` cut at `cuts` over `world` ranks (see
/// [`PartShards::new`]).
pub(crate) fn split_sizes(
    parts: &[Range<usize>],
    cuts: &[Range<usize>],
    world: usize,
) -> SplitSizes {
    let s = PartShards::new(parts, cuts, world.max(1), 0);
    SplitSizes {
        flat: s.len,
        largest_unit_shard: s.units.iter().map(|u| u.shard.len).max().unwrap_or(0),
        parts: s.parts.iter().map(|p| (p.padded(), !s.direct(p))).collect(),
    }
}

impl UnitShard {
    /// For each rank that owns some of `range` (inside the unit), in rank
    /// order: the rank, that part of `range` (in the model's buffer) and,
    /// for this rank, where it lies in the flat shard (empty for another).
    pub(super) fn owners(
        &self,
        range: &Range<usize>,
    ) -> impl Iterator<Item = (usize, Range<usize>, Range<usize>)> + '_ {
        let (s, start, end) = (self.shard.len, self.range.start, self.range.end);
        let range = range.clone();
        (0..self.shard.world).filter_map(move |root| {
            let owned = start + root * s..(start + (root + 1) * s).min(end);
            let (lo, hi) = (owned.start.max(range.start), owned.end.min(range.end));
            if lo >= hi {
                return None;
            }
            let at = self.offset + (lo - owned.start);
            let own = if root == self.shard.rank {
                at..at + (hi - lo)
            } else {
                0..0
            };
            Some((root, lo..hi, own))
        })
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
            .map(|r| PartShards::new(&ranges, &[], world, r))
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
            let m = PartShards::new(&ranges, &[], 3, rank).mask(&full).unwrap();
            assert_eq!(&decayed(&m), want, "rank {rank}");
        }
    }

    #[test]
    fn cut_parts_shard_by_unit_and_unpack_a_gathered_part_in_model_order() {
        // Parts of 5 and 9 elements; the second cut at 9 (units 5..9 and
        // 9..14, as a block's attention and MLP) over 3 ranks: shards of 2,
        // then 2 + 2 for the cut part.
        let (ranges, cuts) = ([0..5, 5..14], [9..14, 5..9, 0..5]);
        let full: Vec<f32> = (0..14).map(|i| i as f32 + 1.0).collect();
        let world = 3;
        let shards: Vec<_> = (0..world)
            .map(|r| PartShards::new(&ranges, &cuts, world, r))
            .collect();
        let s = &shards[0];
        let units: Vec<_> = s.units.iter().map(|u| u.range.clone()).collect();
        assert_eq!(units, [0..5, 5..9, 9..14]);
        assert_eq!(
            (s.len, s.parts[1].units.clone(), s.parts[1].len),
            (6, 1..3, 4)
        );
        assert_eq!(s.parts[1].own(), 2..6);
        assert!(!s.direct(&s.parts[1]) && !s.direct(&s.parts[0]));
        // The part's all-gather: each rank's own range of its flat shard.
        let p = s.parts[1].clone();
        let whole: Vec<f32> = shards
            .iter()
            .flat_map(|sh| sh.take(&full)[p.own()].to_vec())
            .collect();
        assert_eq!(whole.len(), p.padded());
        let mut dest = vec![0f32; 9];
        s.unpack(&p, &whole, &(5..14), &mut dest);
        assert_eq!(dest, full[5..14]);
        // A slice of it, across the cut.
        let mut dest = vec![0f32; 4];
        s.unpack(&p, &whole, &(7..11), &mut dest);
        assert_eq!(dest, full[7..11]);
        // The pieces put every unit's shard back where it belongs.
        let mut back = vec![0f32; 14];
        for sh in &shards {
            let flat = sh.take(&full);
            for piece in sh.pieces() {
                back[piece.start..piece.end]
                    .copy_from_slice(&flat[piece.at..piece.at + piece.end - piece.start]);
            }
        }
        assert_eq!(back, full);
        assert!(s.holding(&(5..9)).is_ok() && s.holding(&(6..8)).is_ok());
        assert!(s.holding(&(5..14)).is_err(), "across a cut");
    }
}
