//! Tokenizers: GPT-2 BPE (tiktoken's r50k_base, offline) and a character-level one for tiny demos.

use std::cell::OnceCell;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use tiktoken_rs::CoreBPE;

/// GPT-2's end-of-text token, appended after every document.
pub const GPT2_EOT: u32 = 50256;
/// GPT-2's vocabulary size (without nanoGPT's padding).
pub const GPT2_VOCAB: usize = 50257;

thread_local! {
    // One encoder per thread: sharing one across threads is slower (its regex cache is shared).
    static BPE: OnceCell<CoreBPE> = const { OnceCell::new() };
}

fn with_bpe<T>(f: impl FnOnce(&CoreBPE) -> T) -> T {
    BPE.with(|cell| {
        // r50k_base is embedded in the crate: building it cannot fail short of a corrupt build.
        let bpe = cell.get_or_init(|| tiktoken_rs::r50k_base().expect("embedded r50k_base ranks"));
        f(bpe)
    })
}

/// A tokenizer, as recorded in a prepared dataset's metadata.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Tokenizer {
    /// GPT-2 BPE; each document ends with EOT 50256.
    Gpt2,
    /// One token per Unicode scalar of `chars` (sorted); EOT is the last id.
    Char { chars: Vec<char> },
}

impl Tokenizer {
    /// A character tokenizer over every character that occurs in `texts`.
    pub fn char_from<'a>(texts: impl IntoIterator<Item = &'a str>) -> Self {
        let mut set = std::collections::BTreeSet::new();
        for t in texts {
            set.extend(t.chars());
        }
        Tokenizer::Char {
            chars: set.into_iter().collect(),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Tokenizer::Gpt2 => "gpt2",
            Tokenizer::Char { .. } => "char",
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Gpt2 => GPT2_VOCAB,
            Tokenizer::Char { chars } => chars.len() + 1,
        }
    }

    pub fn eot(&self) -> u32 {
        match self {
            Tokenizer::Gpt2 => GPT2_EOT,
            Tokenizer::Char { chars } => chars.len() as u32,
        }
    }

    /// Token ids of `text` (no special tokens are recognised in the text, as tiktoken's encode_ordinary).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Gpt2 => Ok(with_bpe(|bpe| bpe.encode_ordinary(text))),
            Tokenizer::Char { chars } => {
                let (mut line, mut col) = (1, 0);
                text.chars()
                    .map(|c| {
                        // This character's own line:column, then the next one's.
                        let at = format!("{line}:{}", col + 1);
                        (line, col) = if c == '\n' { (line + 1, 0) } else { (line, col + 1) };
                        chars.binary_search(&c).map(|i| i as u32).map_err(|_| {
                            crate::bad_input!(
                                "{at}: character {c:?} is not in the char vocabulary of the training data \
                                 ({} characters)",
                                chars.len()
                            )
                        })
                    })
                    .collect()
            }
        }
    }

    /// `text` tokens followed by the end-of-text token: one document of a training file.
    pub fn encode_document(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.encode(text)?;
        ids.push(self.eot());
        Ok(ids)
    }

    /// Text of `ids`; EOT shows as `<|endoftext|>`, invalid byte sequences as U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match self {
            Tokenizer::Gpt2 => {
                if let Some(bad) = ids.iter().find(|&&i| i as usize >= GPT2_VOCAB) {
                    anyhow::bail!("token id {bad} is outside GPT-2's vocabulary of {GPT2_VOCAB}");
                }
                let bytes = with_bpe(|bpe| {
                    let mut out = Vec::new();
                    for chunk in ids.split_inclusive(|&i| i == GPT2_EOT) {
                        let (text, eot) = match chunk.split_last() {
                            Some((&GPT2_EOT, rest)) => (rest, true),
                            _ => (chunk, false),
                        };
                        out.extend(bpe.decode_bytes(text).context("decoding GPT-2 tokens")?);
                        if eot {
                            out.extend_from_slice(b"<|endoftext|>");
                        }
                    }
                    anyhow::Ok(out)
                })?;
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Tokenizer::Char { chars } => ids
                .iter()
                .map(|&i| match chars.get(i as usize) {
                    Some(c) => Ok(c.to_string()),
                    None if i as usize == chars.len() => Ok("<|endoftext|>".to_string()),
                    None => anyhow::bail!(
                        "token id {i} is outside the char vocabulary of {}",
                        chars.len() + 1
                    ),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_round_trips_text() {
        let t = Tokenizer::Gpt2;
        let text = "Hello world! Ünïcödé 🦀 and\ttabs\n";
        let ids = t.encode(text).unwrap();
        assert_eq!(ids[..2], [15496, 995]); // "Hello", " world"
        assert_eq!(t.decode(&ids).unwrap(), text);
        // Special-token text is encoded as ordinary text, never as EOT.
        assert!(!t.encode("<|endoftext|>").unwrap().contains(&GPT2_EOT));
    }

    #[test]
    fn char_tokenizer_round_trips_and_rejects_unknown() {
        let t = Tokenizer::char_from(["abc", "cab d"]);
        assert_eq!(t.vocab_size(), 6);
        let ids = t.encode_document("bad").unwrap();
        assert_eq!(ids, vec![2, 1, 4, 5]);
        assert_eq!(t.decode(&ids[..3]).unwrap(), "bad");
        assert!(t.encode("z").is_err());
    }
}
