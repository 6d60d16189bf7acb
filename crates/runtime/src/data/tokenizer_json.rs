//! A run's tokenizer as a Hugging Face `tokenizer.json`, for `export`: transformers'
//! `AutoTokenizer` then reads text into the ids pipewright trained on.
//!
//! - GPT-2's BPE (tiktoken's ranks) becomes a byte-level BPE whose merges reproduce the ranks:
//!   each token's merge is the pair it splits into when only lower ranks may merge.
//! - Bytes become a byte-level BPE of 256 tokens and no merges (id = the byte).
//! - A `tokenizer.json` is written back as loaded.
//! - cl100k has none here: its pre-tokenizer is not GPT-2's byte-level one.

use super::error::Result;
use super::tokenizer::Tokenizer;
use std::collections::HashMap;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::AddedToken;

/// The byte-level BPE's alphabet: a printable stand-in for each byte. Printable Latin-1 bytes
/// stand for themselves; the others, in byte order, for the code points from 256 on (GPT-2's
/// `bytes_to_unicode`).
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| matches!(b, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff);
    let mut next = 256;
    (0..256u32)
        .map(|b| {
            let c = if printable(b) { b } else { next };
            next += u32::from(!printable(b));
            char::from_u32(c).expect("below 512")
        })
        .collect()
}

/// `token`'s pieces when BPE may only merge pairs ranked below `max`: for a token of rank
/// `max`, the pair whose merge makes it.
fn split_below(token: &[u8], ranks: &HashMap<Vec<u8>, u32>, max: u32) -> Vec<Vec<u8>> {
    let mut parts: Vec<Vec<u8>> = token.iter().map(|&b| vec![b]).collect();
    loop {
        let best = parts
            .windows(2)
            .enumerate()
            .filter_map(|(i, w)| {
                let r = *ranks.get(&[w[0].as_slice(), w[1].as_slice()].concat())?;
                (r < max).then_some((r, i))
            })
            .min();
        let Some((_, i)) = best else { return parts };
        let right = parts.remove(i + 1);
        parts[i].extend(right);
    }
}

/// The vocabulary and merges of tiktoken's `bpe` over its first `ordinary` ranks.
fn tiktoken_vocab(
    bpe: &tiktoken_rs::CoreBPE,
    ordinary: u32,
) -> Result<(Vocab, Vec<(String, String)>)> {
    let chars = byte_chars();
    let text = |b: &[u8]| b.iter().map(|&x| chars[x as usize]).collect::<String>();
    let tokens = (0..ordinary)
        .map(|id| {
            bpe.decode_bytes(&[id])
                .map_err(|e| format!("BPE token {id}: {e:?}"))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let ranks: HashMap<Vec<u8>, u32> = tokens.iter().cloned().zip(0..).collect();
    let mut merges = Vec::new();
    for (id, t) in (0..).zip(&tokens).filter(|(_, t)| t.len() > 1) {
        match split_below(t, &ranks, id).as_slice() {
            [l, r] => merges.push((text(l), text(r))),
            parts => {
                return Err(format!(
                    "BPE token {id} is no merge of two lower ranks ({} pieces)",
                    parts.len()
                )
                .into())
            }
        }
    }
    let vocab = tokens.iter().map(|t| text(t)).zip(0..).collect();
    Ok((vocab, merges))
}

/// `tok` as a Hugging Face `tokenizer.json` (pretty JSON); `None` where it has none here.
pub fn tokenizer_json(tok: &Tokenizer) -> Result<Option<String>> {
    let fail = |e: tokenizers::Error| format!("tokenizer.json: {e}");
    let (vocab, merges, special): (Vocab, _, _) = match tok {
        Tokenizer::Hf { tok, .. } => return Ok(Some(tok.to_string(true).map_err(fail)?)),
        Tokenizer::Bpe {
            name: "gpt2", bpe, ..
        } => {
            let (v, m) = tiktoken_vocab(bpe, 50256)?;
            (v, m, Some("<|endoftext|>"))
        }
        Tokenizer::Bpe { .. } => return Ok(None),
        Tokenizer::Bytes => {
            let v = byte_chars()
                .into_iter()
                .map(String::from)
                .zip(0..)
                .collect();
            (v, Vec::new(), None)
        }
    };
    let model = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(fail)?;
    let mut t = tokenizers::Tokenizer::new(model);
    t.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    t.with_decoder(Some(ByteLevel::default()));
    if let Some(s) = special {
        t.add_special_tokens([AddedToken::from(s, true)])
            .map_err(fail)?;
    }
    Ok(Some(t.to_string(true).map_err(fail)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXTS: &[&str] = &[
        "Hello, world! It's 2026 and the pipeline's bubble is 12.5%.",
        "  indented\tcode(x)\n\n  return {'a': [1, 2]}\r\n",
        "Ünïcödé: naïve café, 中文字符, emoji 🙂, ﬁ ligature",
    ];

    /// Written as tokenizer.json and read back by the `tokenizers` crate (what transformers'
    /// fast tokenizers are), each exported tokenizer gives pipewright's ids. (Not for a text
    /// that spells `<|endoftext|>`: a Hugging Face tokenizer reads it as the special token.)
    #[test]
    fn exported_tokenizers_give_the_same_ids() {
        for spec in ["gpt2", "bytes"] {
            let ours = Tokenizer::load(spec).unwrap();
            let json = tokenizer_json(&ours).unwrap().unwrap();
            let back: tokenizers::Tokenizer = json.parse().unwrap();
            for text in TEXTS {
                let want = ours.encode(text).unwrap();
                let got = back.encode(*text, false).unwrap().get_ids().to_vec();
                assert_eq!(got, want, "{spec}: {text:?}");
                assert_eq!(back.decode(&got, false).unwrap(), *text, "{spec}");
            }
        }
        let gpt2 = tokenizer_json(&Tokenizer::load("gpt2").unwrap())
            .unwrap()
            .unwrap();
        let back: tokenizers::Tokenizer = gpt2.parse().unwrap();
        assert_eq!(back.token_to_id("<|endoftext|>"), Some(50256));
        assert_eq!(back.get_vocab_size(true), 50257);
        assert!(tokenizer_json(&Tokenizer::load("cl100k").unwrap())
            .unwrap()
            .is_none());
    }

    #[test]
    fn the_byte_alphabet_is_gpt2s() {
        let c = byte_chars();
        assert_eq!(
            (c[b'a' as usize], c[b' ' as usize], c[b'\n' as usize]),
            ('a', 'Ġ', 'Ċ')
        );
        assert_eq!(c[0], 'Ā');
        let mut sorted = c.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 256);
    }
}
