//! Deterministic synthetic workloads: English-like text from a word list, sized in tokens.
//!
//! A workload is a list of [`Session`]s. A session is a chat: one system prompt and a sequence
//! of user turns; turn `t` is sent with the whole history before it (the user's earlier
//! messages and the assistant's answers to them), so a session's requests are sequential.
//! `few-shot` and `unique` sessions have one turn each.

use serde::Serialize;

use crate::rng::Rng;

/// ~1.3 tokens per word for this generator's text when the server has no `/tokenize`.
pub const DEFAULT_TOKENS_PER_WORD: f64 = 1.3;

const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "had",
    "they",
    "you",
    "were",
    "their",
    "one",
    "all",
    "we",
    "can",
    "her",
    "has",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "time",
    "people",
    "year",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "government",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
    "car",
    "city",
    "community",
    "name",
    "president",
    "team",
    "minute",
    "idea",
    "body",
    "information",
    "back",
    "parent",
    "face",
    "others",
    "level",
    "office",
    "door",
    "health",
    "person",
    "art",
    "war",
    "history",
    "party",
    "result",
    "change",
    "morning",
    "reason",
    "research",
    "girl",
    "guy",
    "moment",
    "air",
    "teacher",
    "force",
    "education",
    "good",
    "new",
    "first",
    "last",
    "long",
    "great",
    "little",
    "own",
    "other",
    "old",
    "big",
    "high",
    "different",
    "small",
    "large",
    "next",
    "early",
    "young",
    "important",
    "few",
    "public",
    "bad",
    "same",
    "able",
    "make",
    "know",
    "take",
    "see",
    "come",
    "think",
    "look",
    "want",
    "give",
    "use",
    "find",
    "tell",
    "ask",
    "seem",
    "feel",
    "try",
    "leave",
    "call",
    "river",
    "mountain",
    "garden",
    "music",
    "market",
    "bridge",
    "winter",
    "summer",
    "light",
    "stone",
    "paper",
    "window",
    "letter",
    "train",
    "forest",
    "energy",
    "island",
    "village",
    "quietly",
    "often",
    "always",
    "never",
    "slowly",
    "together",
    "however",
    "because",
    "while",
];

/// `n` words of English-like text from `rng`: sentences of 6 to 15 words, capitalised, with
/// full stops and the occasional comma.
pub fn words(rng: &mut Rng, n: usize) -> String {
    let mut out = String::with_capacity(n * 7);
    let mut left_in_sentence = 0u64;
    for i in 0..n {
        let w = WORDS[rng.below(WORDS.len() as u64) as usize];
        if left_in_sentence == 0 {
            if i > 0 {
                out.push_str(". ");
            }
            left_in_sentence = 6 + rng.below(10);
            let mut c = w.chars();
            if let Some(f) = c.next() {
                out.extend(f.to_uppercase());
                out.push_str(c.as_str());
            }
        } else {
            if rng.below(12) == 0 {
                out.push(',');
            }
            out.push(' ');
            out.push_str(w);
        }
        left_in_sentence -= 1;
    }
    if n > 0 {
        out.push('.');
    }
    out
}

/// About `tokens` tokens of text, given the measured tokens-per-word ratio.
pub fn text_of_tokens(rng: &mut Rng, tokens: usize, tokens_per_word: f64) -> String {
    let n = ((tokens as f64) / tokens_per_word).round().max(1.0) as usize;
    words(rng, n)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// U users, T turns each, one system prompt of S tokens shared by all users.
    SharedPrefix,
    /// Many single-turn requests sharing a long few-shot prefix, each with its own question.
    FewShot,
    /// Single-turn requests with no shared prefix.
    Unique,
}

impl WorkloadKind {
    pub fn as_str(self) -> &'static str {
        match self {
            WorkloadKind::SharedPrefix => "shared-prefix",
            WorkloadKind::FewShot => "few-shot",
            WorkloadKind::Unique => "unique",
        }
    }
}

/// Sizes of a workload (all token counts approximate).
#[derive(Clone, Debug, Serialize, clap::Args)]
pub struct WorkloadParams {
    /// Seed of every generated text and of the Poisson arrivals.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// shared-prefix: users (U).
    #[arg(long, default_value_t = 8)]
    pub users: usize,
    /// shared-prefix: turns per user (T).
    #[arg(long, default_value_t = 4)]
    pub turns: usize,
    /// shared-prefix: tokens of the system prompt shared by all users (S).
    #[arg(long, default_value_t = 1500)]
    pub system_tokens: usize,
    /// Tokens of each user message (shared-prefix turns, few-shot and unique questions).
    #[arg(long, default_value_t = 24)]
    pub user_tokens: usize,
    /// few-shot: tokens of the shared examples prefix.
    #[arg(long, default_value_t = 1500)]
    pub prefix_tokens: usize,
    /// few-shot and unique: number of requests.
    #[arg(long, default_value_t = 32)]
    pub num_requests: usize,
    /// unique: tokens of each request's own (unshared) context.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
}

impl Default for WorkloadParams {
    fn default() -> Self {
        WorkloadParams {
            seed: 0,
            users: 8,
            turns: 4,
            system_tokens: 1500,
            user_tokens: 24,
            prefix_tokens: 1500,
            num_requests: 32,
            prompt_tokens: 512,
        }
    }
}

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Message {
    pub role: &'static str,
    pub content: String,
}

/// A chat sent turn by turn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Session {
    pub id: usize,
    pub system: String,
    pub user_turns: Vec<String>,
}

impl Session {
    /// The messages of turn `turn` given the assistant's answers to the earlier turns
    /// (`answers.len() >= turn`).
    pub fn messages(&self, turn: usize, answers: &[String]) -> Vec<Message> {
        let mut m = Vec::with_capacity(2 * turn + 2);
        m.push(Message {
            role: "system",
            content: self.system.clone(),
        });
        for (user, answer) in self.user_turns.iter().zip(answers).take(turn) {
            m.push(Message {
                role: "user",
                content: user.clone(),
            });
            m.push(Message {
                role: "assistant",
                content: answer.clone(),
            });
        }
        m.push(Message {
            role: "user",
            content: self.user_turns[turn].clone(),
        });
        m
    }
}

#[derive(Clone, Debug)]
pub struct Workload {
    pub kind: WorkloadKind,
    pub sessions: Vec<Session>,
}

impl Workload {
    pub fn num_requests(&self) -> usize {
        self.sessions.iter().map(|s| s.user_turns.len()).sum()
    }
}

fn question(rng: &mut Rng, tokens: usize, tpw: f64) -> String {
    let body = text_of_tokens(rng, tokens.saturating_sub(3).max(1), tpw);
    format!(
        "Question: {} What does this mean?",
        body.trim_end_matches('.')
    )
}

/// Builds the workload deterministically from `p.seed`.
pub fn generate(kind: WorkloadKind, p: &WorkloadParams, tokens_per_word: f64) -> Workload {
    let tpw = tokens_per_word;
    let sessions = match kind {
        WorkloadKind::SharedPrefix => {
            let system = format!(
                "You are a helpful assistant. Use the following background.\n\n{}",
                text_of_tokens(&mut Rng::derive(p.seed, &[1]), p.system_tokens, tpw)
            );
            (0..p.users)
                .map(|u| Session {
                    id: u,
                    system: system.clone(),
                    user_turns: (0..p.turns)
                        .map(|t| {
                            let mut r = Rng::derive(p.seed, &[2, u as u64, t as u64]);
                            question(&mut r, p.user_tokens, tpw)
                        })
                        .collect(),
                })
                .collect()
        }
        WorkloadKind::FewShot => {
            let mut r = Rng::derive(p.seed, &[3]);
            let mut prefix = String::from("Answer the question in the style of the examples.\n\n");
            let per_example = 60usize;
            let n_examples = (p.prefix_tokens / per_example).max(1);
            for i in 0..n_examples {
                let q = text_of_tokens(&mut r, per_example / 3, tpw);
                let a = text_of_tokens(&mut r, per_example - per_example / 3 - 6, tpw);
                prefix.push_str(&format!("Example {}:\nQ: {q}\nA: {a}\n\n", i + 1));
            }
            (0..p.num_requests)
                .map(|i| Session {
                    id: i,
                    system: prefix.clone(),
                    user_turns: vec![question(
                        &mut Rng::derive(p.seed, &[4, i as u64]),
                        p.user_tokens,
                        tpw,
                    )],
                })
                .collect()
        }
        WorkloadKind::Unique => (0..p.num_requests)
            .map(|i| {
                let mut r = Rng::derive(p.seed, &[5, i as u64]);
                // Start with the request number so not even the first words are shared.
                let system = format!("{i} {}", text_of_tokens(&mut r, p.prompt_tokens, tpw));
                Session {
                    id: i,
                    system,
                    user_turns: vec![question(&mut r, p.user_tokens, tpw)],
                }
            })
            .collect(),
    };
    Workload { kind, sessions }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> WorkloadParams {
        WorkloadParams {
            system_tokens: 300,
            prefix_tokens: 300,
            prompt_tokens: 100,
            num_requests: 5,
            ..Default::default()
        }
    }

    #[test]
    fn words_are_deterministic_and_english_like() {
        let a = words(&mut Rng::new(1), 50);
        let b = words(&mut Rng::new(1), 50);
        let c = words(&mut Rng::new(2), 50);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.split_whitespace().count(), 50);
        assert!(a.chars().next().unwrap().is_uppercase());
        assert!(a.ends_with('.'));
    }

    #[test]
    fn generators_are_deterministic_given_seed() {
        for kind in [
            WorkloadKind::SharedPrefix,
            WorkloadKind::FewShot,
            WorkloadKind::Unique,
        ] {
            let a = generate(kind, &params(), 1.3);
            let b = generate(kind, &params(), 1.3);
            assert_eq!(a.sessions, b.sessions, "{kind:?}");
            let mut p = params();
            p.seed = 9;
            let c = generate(kind, &p, 1.3);
            assert_ne!(a.sessions, c.sessions, "{kind:?}");
        }
    }

    #[test]
    fn shared_prefix_histories_grow_with_identical_system_prompt() {
        let p = params();
        let w = generate(WorkloadKind::SharedPrefix, &p, 1.3);
        assert_eq!(w.sessions.len(), p.users);
        assert_eq!(w.num_requests(), p.users * p.turns);
        let sys = &w.sessions[0].system;
        // ~300 tokens at 1.3 tokens/word is ~231 words plus the fixed header.
        let n = sys.split_whitespace().count();
        assert!((231..250).contains(&n), "{n}");
        for s in &w.sessions {
            assert_eq!(&s.system, sys);
        }
        // Users ask different questions.
        assert_ne!(w.sessions[0].user_turns[0], w.sessions[1].user_turns[0]);
        let s = &w.sessions[3];
        let answers: Vec<String> = (0..p.turns).map(|t| format!("answer {t}")).collect();
        let mut prev: Option<Vec<Message>> = None;
        for t in 0..p.turns {
            let m = s.messages(t, &answers);
            assert_eq!(m.len(), 2 * t + 2);
            assert_eq!(m[0].content, *sys);
            assert_eq!(m.last().unwrap().content, s.user_turns[t]);
            if let Some(prev) = prev {
                // The previous turn's messages are a prefix, followed by the assistant's answer.
                assert_eq!(&m[..prev.len()], &prev[..]);
                assert_eq!(m[prev.len()].role, "assistant");
                assert_eq!(m[prev.len()].content, answers[t - 1]);
            }
            prev = Some(m);
        }
    }

    #[test]
    fn few_shot_shares_prefix_and_unique_does_not() {
        let w = generate(WorkloadKind::FewShot, &params(), 1.3);
        assert!(w.sessions.iter().all(|s| s.system == w.sessions[0].system));
        assert_ne!(w.sessions[0].user_turns, w.sessions[1].user_turns);
        let u = generate(WorkloadKind::Unique, &params(), 1.3);
        for i in 0..u.sessions.len() {
            for j in i + 1..u.sessions.len() {
                let (a, b) = (&u.sessions[i].system, &u.sessions[j].system);
                let common = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
                assert!(common < 3, "{i} {j} share {common} bytes");
            }
        }
    }
}
