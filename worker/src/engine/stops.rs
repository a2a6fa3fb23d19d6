//! Stop strings over streamed text.
//!
//! Text that might be the beginning of a stop string is held back until it is known
//! not to be, so a client never sees part of a stop string.

/// Outcome of feeding a piece of text.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopOutcome {
    /// Text that is now safe to emit.
    pub emit: String,
    /// A stop string was found: `emit` ends right before it, and generation must stop.
    pub stopped: bool,
}

/// Watches streamed text for any of a set of stop strings.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet emitted: a suffix that may start a stop string.
    pending: String,
}

impl StopMatcher {
    /// Matches the given stop strings; empty strings are ignored.
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
        }
    }

    /// Feeds the next piece of text.
    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.stops.is_empty() {
            return StopOutcome {
                emit: text.to_owned(),
                stopped: false,
            };
        }
        self.pending.push_str(text);
        // The earliest complete stop string wins.
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = hit {
            let emit = self.pending[..at].to_owned();
            self.pending.clear();
            return StopOutcome {
                emit,
                stopped: true,
            };
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let mut hold = 0;
        for s in &self.stops {
            for (i, _) in self.pending.char_indices() {
                let tail = &self.pending[i..];
                if tail.len() < s.len() && s.starts_with(tail) {
                    hold = hold.max(tail.len());
                    break;
                }
            }
        }
        let cut = self.pending.len() - hold;
        let emit = self.pending[..cut].to_owned();
        self.pending.drain(..cut);
        StopOutcome {
            emit,
            stopped: false,
        }
    }

    /// Text still held back, released when generation ends for another reason.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let o = m.push(p);
            out.push_str(&o.emit);
            if o.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stops_inside_and_across_pieces() {
        assert_eq!(
            run(&["\n\n"], &["Hello", " world\n", "\nmore"]),
            ("Hello world".into(), true)
        );
        assert_eq!(run(&["END"], &["aE", "N", "Db"]), ("a".into(), true));
        assert_eq!(run(&["x", "abc"], &["zab", "cx"]), ("z".into(), true));
        assert_eq!(run(&["x", "abd"], &["zab", "cx"]), ("zabc".into(), true));
    }

    #[test]
    fn false_starts_are_released() {
        assert_eq!(run(&["END"], &["aE", "N", "d"]), ("aENd".into(), false));
        assert_eq!(run(&["END"], &["aEN"]), ("aEN".into(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn held_back_text_is_not_emitted_early() {
        let mut m = StopMatcher::new(&["STOP".to_string()]);
        assert_eq!(m.push("go ST").emit, "go ");
        assert_eq!(m.push("éO").emit, "STéO");
    }
}
