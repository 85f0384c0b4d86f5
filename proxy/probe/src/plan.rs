//! What the probe sends: short canary requests (at most 32 words, the secret first), over-long
//! prompts and clients that leave mid-stream, over every endpoint, streamed and not, from every
//! tenant, interleaved.

use crate::canary::Secrets;

/// An API the probe speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum)]
pub enum Api {
    /// `POST /v1/chat/completions` (gRPC: `Chat`).
    Chat,
    /// `POST /v1/completions`.
    Completions,
    /// `POST /generate` (SGLang-native; gRPC: `Generate`).
    Generate,
}

impl Api {
    /// Its HTTP path.
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
            Api::Generate => "/generate",
        }
    }

    /// `chat stream`, `grpc generate`, ...: the row its requests in this mode are counted in.
    pub fn endpoint(self, stream: bool, grpc: bool) -> String {
        let mode = if grpc {
            "grpc"
        } else if stream {
            "stream"
        } else {
            "json"
        };
        format!("{} {mode}", self.name())
    }

    fn name(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Completions => "completions",
            Api::Generate => "generate",
        }
    }
}

/// What kind of request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// A short request carrying a secret.
    Short,
    /// A prompt longer than the model's context.
    OverLong,
    /// A short streamed request whose client leaves after the first content.
    Leave,
}

/// One request to send.
#[derive(Debug, Clone)]
pub struct Job {
    /// The API.
    pub api: Api,
    /// Streamed or not.
    pub stream: bool,
    /// What kind.
    pub shape: Shape,
    /// Which tenant sends it (an index into the keys, or an anonymous tenant).
    pub tenant: usize,
    /// The prompt.
    pub prompt: String,
    /// Its secret (short and leaving requests).
    pub secret: Option<String>,
}

impl Job {
    /// `chat stream`, `grpc generate`, ...: the row it is counted in.
    pub fn endpoint(&self, grpc: bool) -> String {
        self.api.endpoint(self.stream, grpc)
    }
}

/// Short prompts: the secret is the first word; at most 32 words in all.
const SHORT: [&str; 3] = [
    "is a secret word. Repeat the secret word exactly once and say nothing else.",
    "is the code. Write the code back to me, then one short sentence about the sea.",
    "was given to you. Say it again, then count from one to five.",
];

/// The filler word of over-long prompts: one token or more in every tokenizer.
const FILLER: &str = "cat";

/// What a round holds: for every tenant, every API and both modes a short request; for every
/// API a streamed request that is left mid-stream; and, when over-long prompts are on, one per
/// API and mode. Interleaved so that tenants and shapes alternate.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The APIs to use.
    pub apis: Vec<Api>,
    /// Whether streaming exists (gRPC always streams).
    pub modes: Vec<bool>,
    /// Tenants.
    pub tenants: usize,
    /// Words of an over-long prompt (`None`: none sent).
    pub long_words: Option<u64>,
}

impl Plan {
    /// One round of jobs, each short one with a fresh secret from `secrets`.
    pub fn round(&self, secrets: &Secrets, round: usize) -> Vec<Job> {
        let mut out = Vec::new();
        let mut n = round;
        for t in 0..self.tenants {
            for &api in &self.apis {
                for &stream in &self.modes {
                    out.push(short(secrets, api, stream, t, n));
                    n += 1;
                }
            }
        }
        let mut extra = Vec::new();
        for (i, &api) in self.apis.iter().enumerate() {
            if self.modes.contains(&true) {
                let mut j = short(secrets, api, true, (round + i) % self.tenants.max(1), n);
                j.shape = Shape::Leave;
                extra.push(j);
                n += 1;
            }
            if let Some(words) = self.long_words {
                for &stream in &self.modes {
                    extra.push(Job {
                        api,
                        stream,
                        shape: Shape::OverLong,
                        tenant: (round + i) % self.tenants.max(1),
                        prompt: vec![FILLER; words as usize].join(" "),
                        secret: None,
                    });
                }
            }
        }
        // Spread the extras among the short ones.
        let every = (out.len() / extra.len().max(1)).max(1);
        let mut mixed = Vec::with_capacity(out.len() + extra.len());
        let mut extra = extra.into_iter();
        for (i, j) in out.into_iter().enumerate() {
            mixed.push(j);
            if (i + 1) % every == 0
                && let Some(e) = extra.next()
            {
                mixed.push(e);
            }
        }
        mixed.extend(extra);
        mixed
    }
}

fn short(secrets: &Secrets, api: Api, stream: bool, tenant: usize, n: usize) -> Job {
    let secret = secrets.issue();
    Job {
        api,
        stream,
        shape: Shape::Short,
        tenant,
        prompt: format!("{secret} {}", SHORT[n % SHORT.len()]),
        secret: Some(secret),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_covers_every_combination_within_the_prompt_rules() {
        let secrets = Secrets::default();
        let plan = Plan {
            apis: vec![Api::Chat, Api::Completions, Api::Generate],
            modes: vec![false, true],
            tenants: 2,
            long_words: Some(50),
        };
        let round = plan.round(&secrets, 0);
        let shorts: Vec<&Job> = round.iter().filter(|j| j.shape == Shape::Short).collect();
        assert_eq!(shorts.len(), 2 * 3 * 2);
        assert_eq!(round.iter().filter(|j| j.shape == Shape::Leave).count(), 3);
        assert_eq!(
            round.iter().filter(|j| j.shape == Shape::OverLong).count(),
            6
        );
        for j in &round {
            let words: Vec<&str> = j.prompt.split_whitespace().collect();
            match j.shape {
                Shape::OverLong => assert_eq!(words.len(), 50),
                _ => {
                    assert!(words.len() <= 32, "{}", j.prompt);
                    let s = j.secret.as_deref().expect("secret");
                    assert!(words[..8].contains(&s));
                }
            }
        }
        // Every secret is distinct, and over-long prompts are spread, not bunched at the end.
        let mut all: Vec<&str> = round.iter().filter_map(|j| j.secret.as_deref()).collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 15);
        assert!(
            round[..round.len() / 2]
                .iter()
                .any(|j| j.shape != Shape::Short)
        );
    }
}
