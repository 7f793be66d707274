//! Minimum selection with uniform random tie-breaks, the rule AIBrix gets from shuffling
//! candidates before a strict-less-than scan.

/// Keeps the minimum of a stream of scored items; NaN scores are skipped.
pub struct MinPicker {
    pub best: Option<(f64, usize)>,
    ties: u32,
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
        }
    }

    /// Offers `item` with `score`; among equal minima each is kept with equal probability
    /// (reservoir sampling), without shuffling or allocating.
    pub fn offer(&mut self, score: f64, item: usize, rng: &mut fastrand::Rng) {
        if score.is_nan() {
            return;
        }
        match self.best {
            Some((best, _)) if score > best => {}
            Some((best, _)) if score == best => {
                self.ties += 1;
                if rng.u32(0..self.ties) == 0 {
                    self.best = Some((score, item));
                }
            }
            _ => {
                self.best = Some((score, item));
                self.ties = 1;
            }
        }
    }

    pub fn item(&self) -> Option<usize> {
        self.best.map(|(_, i)| i)
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
        let mut p = MinPicker::new();
        p.offer(f64::NAN, 0, &mut rng);
        assert_eq!(p.item(), None);
    }
}
