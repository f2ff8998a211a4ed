//! Stop strings over a stream of text deltas.
//!
//! Text that could still turn out to be the start of a stop string is held back; the matched
//! stop string and everything after it are never emitted.

/// What one [`StopMatcher::push`] lets through.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StopOutcome {
    /// Text safe to emit now.
    pub emit: String,
    /// Index of the stop string that matched; the request must end.
    pub matched: Option<usize>,
}

/// Finds the earliest occurrence of any stop string in the generated text.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet emitted: always a possible prefix of a stop string.
    pending: String,
    done: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored.
    pub fn new(stops: Vec<String>) -> Self {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        StopMatcher {
            stops,
            pending: String::new(),
            done: false,
        }
    }

    pub fn stops(&self) -> &[String] {
        &self.stops
    }

    /// Feeds newly decoded text.
    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.done {
            return StopOutcome::default();
        }
        if self.stops.is_empty() {
            return StopOutcome {
                emit: text.to_string(),
                matched: None,
            };
        }
        self.pending.push_str(text);
        // Earliest match wins; at the same position the longest stop string.
        let mut best: Option<(usize, usize)> = None;
        for (i, stop) in self.stops.iter().enumerate() {
            if let Some(pos) = self.pending.find(stop.as_str()) {
                let better = match best {
                    None => true,
                    Some((bpos, bi)) => {
                        pos < bpos || (pos == bpos && stop.len() > self.stops[bi].len())
                    }
                };
                if better {
                    best = Some((pos, i));
                }
            }
        }
        if let Some((pos, i)) = best {
            let emit = self.pending[..pos].to_string();
            self.pending.clear();
            self.done = true;
            return StopOutcome {
                emit,
                matched: Some(i),
            };
        }
        let hold = self.holdback();
        let cut = self.pending.len() - hold;
        let emit = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        StopOutcome {
            emit,
            matched: None,
        }
    }

    /// The request ended without a match: release what was held back.
    pub fn flush(&mut self) -> String {
        if self.done {
            return String::new();
        }
        self.done = true;
        std::mem::take(&mut self.pending)
    }

    /// Longest suffix of `pending` that is a proper prefix of some stop string.
    fn holdback(&self) -> usize {
        let mut best = 0;
        for stop in &self.stops {
            let max = (stop.len() - 1).min(self.pending.len());
            for k in (best + 1..=max).rev() {
                if stop.is_char_boundary(k)
                    && self.pending.as_bytes().ends_with(&stop.as_bytes()[..k])
                {
                    best = k;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, Option<usize>) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let o = m.push(p);
            out.push_str(&o.emit);
            if o.matched.is_some() {
                return (out, o.matched);
            }
        }
        out.push_str(&m.flush());
        (out, None)
    }

    #[test]
    fn match_across_pieces_is_not_emitted() {
        assert_eq!(
            run(&["END"], &["abc E", "N", "D tail"]),
            ("abc ".to_string(), Some(0))
        );
    }

    #[test]
    fn partial_prefix_is_held_then_released() {
        let mut m = StopMatcher::new(vec!["STOP".into()]);
        assert_eq!(m.push("hello ST").emit, "hello ");
        assert_eq!(m.push("AR").emit, "STAR");
        assert_eq!(m.push("S").emit, "");
        assert_eq!(m.flush(), "S");
    }

    #[test]
    fn earliest_match_wins() {
        assert_eq!(
            run(&["world", "lo"], &["hello world"]),
            ("hel".to_string(), Some(1))
        );
    }

    #[test]
    fn no_stops_passes_through() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".to_string(), None));
        assert_eq!(run(&[""], &["a", "b"]), ("ab".to_string(), None));
    }

    #[test]
    fn unicode_boundaries() {
        assert_eq!(
            run(&["é!"], &["caf", "é", "?é", "!"]),
            ("café?".to_string(), Some(0))
        );
        assert_eq!(run(&["éa"], &["é", "é"]), ("éé".to_string(), None));
    }

    #[test]
    fn after_match_nothing_more() {
        let mut m = StopMatcher::new(vec!["x".into()]);
        assert_eq!(m.push("axb").emit, "a");
        assert_eq!(m.push("more").emit, "");
        assert_eq!(m.flush(), "");
    }
}
