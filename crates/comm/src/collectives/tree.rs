//! Tree shapes for rooted collectives (broadcast and reduce).
//!
//! Ranks are renumbered relative to the root (v = r - root mod N) so that
//! the root is always v = 0.
//! - Binomial tree: the parent of v clears v's lowest set bit; v's children
//!   are v + m for the powers of two m below that bit. Depth ceil(log2 N):
//!   few latencies, for small messages.
//! - Chain: the parent of v is v - 1 and its child v + 1. Depth N - 1, but
//!   with segments pipelined along it every link carries the buffer once and
//!   every rank sends it at most once: bandwidth-optimal, for large messages.
//!
//! Children are listed largest subtree first, so that the longest path
//! starts first.

/// One rank's place in a tree, in absolute ranks.
pub(crate) struct Tree {
    pub parent: Option<usize>,
    pub children: Vec<usize>,
}

pub(crate) fn binomial(rank: usize, n: usize, root: usize) -> Tree {
    let v = (rank + n - root) % n;
    let abs = |v: usize| (v + root) % n;
    let low = if v == 0 {
        n.next_power_of_two()
    } else {
        1 << v.trailing_zeros()
    };
    let mut children = Vec::new();
    let mut m = low >> 1;
    while m > 0 {
        if v + m < n {
            children.push(abs(v + m));
        }
        m >>= 1;
    }
    Tree {
        parent: (v != 0).then(|| abs(v - low)),
        children,
    }
}

pub(crate) fn chain(rank: usize, n: usize, root: usize) -> Tree {
    let v = (rank + n - root) % n;
    let abs = |v: usize| (v + root) % n;
    Tree {
        parent: (v != 0).then(|| abs(v - 1)),
        children: if v + 1 < n {
            vec![abs(v + 1)]
        } else {
            Vec::new()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(shape: fn(usize, usize, usize) -> Tree) {
        for n in 1..=9 {
            for root in 0..n {
                let mut parents = 0;
                for r in 0..n {
                    let t = shape(r, n, root);
                    assert_eq!(t.parent.is_none(), r == root);
                    for c in &t.children {
                        assert_eq!(shape(*c, n, root).parent, Some(r));
                        parents += 1;
                    }
                }
                assert_eq!(parents, n - 1, "every non-root has exactly one parent");
            }
        }
    }

    #[test]
    fn shapes_are_spanning_trees() {
        check(binomial);
        check(chain);
        assert_eq!(binomial(0, 8, 0).children, vec![4, 2, 1]);
    }
}
