//! Minimum selection with uniform random tie-breaks, the rule AIBrix gets from shuffling
//! candidates before a strict-less-than scan.

/// Keeps the minimum of a stream of scored items; NaN scores are skipped.
///
/// Ties are broken by reservoir sampling with skips: rather than one random draw per tied
/// item (511 draws when all 512 rolesets of an idle fleet tie), it draws the position of the
/// next tie that replaces the kept one. After `n` ties the next replacement comes at tie `m`
/// with `P(m > j) = n / j`, i.e. `m = floor(n / u) + 1` for `u` uniform in (0, 1]: the same
/// 1/i chance of being kept as one draw per tie, with about ln(ties) draws.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MinPicker {
    pub best: Option<(f64, usize)>,
    /// Items tied at the current minimum so far.
    ties: u32,
    /// The tie count at which the next tied item replaces the kept one; 0 = not drawn yet.
    next: u32,
}

impl Default for MinPicker {
    fn default() -> Self {
        Self::new()
    }
}

impl MinPicker {
    pub fn new() -> Self {
        MinPicker {
            best: None,
            ties: 0,
            next: 0,
        }
    }

    /// Offers `item` with `score`; among equal minima each is kept with equal probability,
    /// without shuffling or allocating.
    pub fn offer(&mut self, score: f64, item: usize, rng: &mut fastrand::Rng) {
        if score.is_nan() {
            return;
        }
        match self.best {
            Some((best, _)) if score > best => {}
            Some((best, _)) if score == best => {
                self.ties += 1;
                if self.next == 0 {
                    self.next = next_replacement(self.ties - 1, rng);
                }
                if self.ties == self.next {
                    self.best = Some((score, item));
                    self.next = next_replacement(self.ties, rng);
                }
            }
            _ => {
                self.best = Some((score, item));
                self.ties = 1;
                self.next = 0;
            }
        }
    }

    pub fn item(&self) -> Option<usize> {
        self.best.map(|(_, i)| i)
    }
}

/// The tie count at which the next replacement happens after `n` ties (see [`MinPicker`]).
fn next_replacement(n: u32, rng: &mut fastrand::Rng) -> u32 {
    let u = 1.0 - rng.f64(); // (0, 1]
    let m = (f64::from(n) / u).floor() + 1.0;
    if m >= f64::from(u32::MAX) {
        u32::MAX
    } else {
        m as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimum_wins_and_ties_spread_evenly() {
        let mut rng = fastrand::Rng::with_seed(11);
        let mut hits = [0u32; 3];
        for _ in 0..3000 {
            let mut p = MinPicker::new();
            for (i, score) in [1.0, 1.0, 1.0, 2.0, f64::NAN].into_iter().enumerate() {
                p.offer(score, i, &mut rng);
            }
            hits[p.item().unwrap()] += 1;
        }
        assert!(hits.iter().all(|&h| (850..1150).contains(&h)), "{hits:?}");
        // Many ties, and ties that start after a strictly better item resets the count.
        let mut hits = [0u32; 12];
        for _ in 0..24_000 {
            let mut p = MinPicker::new();
            p.offer(5.0, 11, &mut rng);
            for i in 0..10 {
                p.offer(1.0, i, &mut rng);
            }
            p.offer(3.0, 10, &mut rng);
            hits[p.item().unwrap()] += 1;
        }
        assert!(
            hits[..10].iter().all(|&h| (2_100..2_700).contains(&h)) && hits[10..] == [0, 0],
            "{hits:?}"
        );
        let mut p = MinPicker::new();
        p.offer(f64::NAN, 0, &mut rng);
        assert_eq!(p.item(), None);
    }
}
