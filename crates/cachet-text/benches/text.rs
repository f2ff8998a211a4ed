//! Per-push cost of the stop matcher by number and length of stop strings (against the naive
//! per-stop matcher it replaced), and per-token cost of the detokenizer by output length.
//!
//! `cargo bench -p cachet-text --bench text`. Configurations run interleaved, round after
//! round (this VM drifts within a minute); each line gives the median over rounds and the
//! min-max spread, in nanoseconds per push (per token for the detokenizer).

use std::hint::black_box;
use std::time::Instant;

use cachet_text::{ByteTokenizer, IncrementalDetokenizer, StopMatcher, TextTokenizer};

const ROUNDS: usize = 9;

/// The matcher cachet-server had before (every stop searched, every prefix tried).
struct Naive {
    stops: Vec<String>,
    pending: String,
}

impl Naive {
    fn push(&mut self, text: &str) -> (usize, bool) {
        self.pending.push_str(text);
        let mut best: Option<(usize, usize)> = None;
        for (i, stop) in self.stops.iter().enumerate() {
            if let Some(pos) = self.pending.find(stop.as_str()) {
                if best.is_none_or(|(bp, bi)| {
                    pos < bp || (pos == bp && stop.len() > self.stops[bi].len())
                }) {
                    best = Some((pos, i));
                }
            }
        }
        if best.is_some() {
            return (0, true);
        }
        let mut hold = 0;
        for stop in &self.stops {
            let max = (stop.len() - 1).min(self.pending.len());
            for k in (hold + 1..=max).rev() {
                if stop.is_char_boundary(k)
                    && self.pending.as_bytes().ends_with(&stop.as_bytes()[..k])
                {
                    hold = k;
                    break;
                }
            }
        }
        let cut = self.pending.len() - hold;
        self.pending.drain(..cut);
        (cut, false)
    }
}

/// Generated-looking text: words of 2-8 letters from a small alphabet.
fn deltas(n: usize) -> Vec<String> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..n)
        .map(|_| {
            let len = 2 + (next() % 7) as usize;
            let mut w = String::from(" ");
            for _ in 0..len {
                w.push((b'a' + (next() % 6) as u8) as char);
            }
            w
        })
        .collect()
}

fn stops(count: usize, len: usize) -> Vec<String> {
    // Stops that share prefixes with the text (so hold-back happens) but never match it:
    // they end in 'z', which the text never contains.
    (0..count)
        .map(|i| {
            let mut s = String::from(" ");
            for k in 0..len.saturating_sub(2) {
                s.push((b'a' + ((i + k) % 6) as u8) as char);
            }
            s.push('z');
            s
        })
        .collect()
}

fn time_fast(stops: &[String], text: &[String]) -> f64 {
    let mut m = StopMatcher::new(stops.to_vec()).expect("within limits");
    let t = Instant::now();
    for d in text {
        black_box(m.push(black_box(d)));
    }
    t.elapsed().as_nanos() as f64 / text.len() as f64
}

fn time_naive(stops: &[String], text: &[String]) -> f64 {
    let mut m = Naive {
        stops: stops.to_vec(),
        pending: String::new(),
    };
    let t = Instant::now();
    for d in text {
        black_box(m.push(black_box(d)));
    }
    t.elapsed().as_nanos() as f64 / text.len() as f64
}

fn time_detok(ids: &[u32]) -> f64 {
    let tok = ByteTokenizer;
    let mut d = IncrementalDetokenizer::new(&tok as &dyn TextTokenizer, true);
    let t = Instant::now();
    for id in ids {
        black_box(d.push(std::slice::from_ref(id)).expect("in vocabulary"));
    }
    t.elapsed().as_nanos() as f64 / ids.len() as f64
}

fn summary(mut v: Vec<f64>) -> String {
    v.sort_by(f64::total_cmp);
    format!(
        "{:>9.0} ns  ({:.0}-{:.0})",
        v[v.len() / 2],
        v[0],
        v[v.len() - 1]
    )
}

fn main() {
    let text = deltas(20_000);
    let configs: Vec<(String, Vec<String>)> = vec![
        ("1 stop of 8 B".into(), stops(1, 8)),
        ("4 stops of 8 B".into(), stops(4, 8)),
        ("64 stops of 8 B".into(), stops(64, 8)),
        ("64 stops of 128 B".into(), stops(64, 128)),
        ("16 stops of 512 B".into(), stops(16, 512)),
    ];
    let mut fast: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    let mut naive: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    for _ in 0..ROUNDS {
        for (i, (_, s)) in configs.iter().enumerate() {
            fast[i].push(time_fast(s, &text));
            naive[i].push(time_naive(s, &text[..2_000]));
        }
    }
    println!("stop matcher, per push of a ~6-byte delta (median of {ROUNDS}, min-max):");
    println!(
        "{:<20} {:>28} {:>28}",
        "stops", "automaton", "naive (before)"
    );
    for (i, (name, _)) in configs.iter().enumerate() {
        println!(
            "{:<20} {:>28} {:>28}",
            name,
            summary(fast[i].clone()),
            summary(naive[i].clone())
        );
    }

    let valid: Vec<u32> = ByteTokenizer
        .encode(&"Café 😀 日本語 ok. ".repeat(800), false)
        .expect("encode");
    let garbage: Vec<u32> = vec![0x80 + ByteTokenizer::OFFSET; 30_000];
    let cases: Vec<(&str, &[u32])> = vec![
        ("100 tokens of text", &valid[..100]),
        ("10,000 tokens of text", &valid[..10_000]),
        ("1,000 invalid bytes", &garbage[..1_000]),
        ("3,000 invalid bytes", &garbage[..3_000]),
        ("10,000 invalid bytes", &garbage[..10_000]),
        ("30,000 invalid bytes", &garbage),
    ];
    let mut det: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for _ in 0..ROUNDS {
        for (i, (_, ids)) in cases.iter().enumerate() {
            det[i].push(time_detok(ids));
        }
    }
    println!("\nincremental detokenizer (byte tokens), per token:");
    for (i, (name, _)) in cases.iter().enumerate() {
        println!("{:<24} {}", name, summary(det[i].clone()));
    }
}
