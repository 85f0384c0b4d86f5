//! lockstep-prompt: a model's prompt, exactly as its workers will see it. The chat template and
//! the real tokenizer with the fit check ([`codec`]), the byte-level BPE fast path ([`bpe`]) with
//! its pretokenizer and word cache, the segment cache for long prompts ([`segments`]), and the
//! low-priority threads long prompts are tokenized on ([`background`]) with their CPU placement.

pub mod background;
pub mod bpe;
pub mod codec;
mod placement;
mod pretokenize;
pub mod segments;
mod token_bytes;
mod words;

pub use codec::{ChatMessage, Detok, PromptCodec, check_fits};
