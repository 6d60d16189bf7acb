//! Extractive question answering on SQuAD-format JSON: each question and its context encoded as
//! a pair (BERT's [CLS] question [SEP] context [SEP], segments 0 and 1), the answer as the
//! first and last context token it covers; and SQuAD's exact match and F1 of predicted spans.

use super::error::Result;
use super::examples::{Examples, Span};
use super::tokenizer::Tokenizer;
use std::path::Path;

/// The questions of a SQuAD 1.1 file as examples of `seq_len` tokens (contexts cut to fit).
/// A question whose answer was cut away is left out of `training`; returns the examples and
/// how many were left out.
pub fn load(
    path: &Path,
    tok: &Tokenizer,
    seq_len: usize,
    training: bool,
) -> Result<(Examples, usize)> {
    let name = path.display().to_string();
    super::records::regular(path)?;
    let text = std::fs::read_to_string(path).map_err(|e| format!("{name}: cannot read: {e}"))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{name}: not JSON: {e}"))?;
    let data = v["data"]
        .as_array()
        .ok_or_else(|| format!("{name}: no \"data\" list (expected SQuAD's format)"))?;
    let mut ex = Examples {
        seq_len,
        target_len: 2,
        ..Examples::default()
    };
    let mut dropped = 0;
    for (a, article) in data.iter().enumerate() {
        let paragraphs = article["paragraphs"].as_array().into_iter().flatten();
        for (p, para) in paragraphs.enumerate() {
            let at = format!("{name}: data[{a}].paragraphs[{p}]");
            let context = para["context"]
                .as_str()
                .ok_or_else(|| format!("{at}: no \"context\" string"))?;
            for (q, qa) in para["qas"].as_array().into_iter().flatten().enumerate() {
                let at = format!("{at}.qas[{q}]");
                let kept = push(&mut ex, tok, context, qa, &at)?;
                if !kept && training {
                    ex.truncate_last();
                    dropped += 1;
                }
            }
        }
    }
    if ex.is_empty() {
        return Err(format!("{name}: no questions (an empty data set)").into());
    }
    Ok((ex, dropped))
}

/// One question as an example; false if its answer lies outside the tokens kept.
fn push(
    ex: &mut Examples,
    tok: &Tokenizer,
    context: &str,
    qa: &serde_json::Value,
    at: &str,
) -> Result<bool> {
    let question = qa["question"]
        .as_str()
        .ok_or_else(|| format!("{at}: no \"question\" string"))?;
    let answers: Vec<(String, usize)> = qa["answers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|x| {
            Some((
                x["text"].as_str()?.to_string(),
                x["answer_start"].as_u64()? as usize,
            ))
        })
        .collect();
    let Some((first, start)) = answers.first().cloned() else {
        return Err(format!("{at}: no answer with \"text\" and \"answer_start\"").into());
    };
    // answer_start counts characters (Python's indices); offsets here count bytes.
    let start = context
        .char_indices()
        .nth(start)
        .map_or(usize::MAX, |(b, _)| b);
    let end = start.saturating_add(first.len());
    if context.get(start..end) != Some(first.as_str()) {
        let chars = qa["answers"][0]["answer_start"].as_u64().unwrap_or(0);
        return Err(
            format!("{at}: answer {first:?} is not at character {chars} of its context").into(),
        );
    }
    let (ids, types, offsets) = tok.encode_pair(question, context)?;
    let n = ids.len().min(ex.seq_len);
    let t = ex.seq_len;
    ex.tokens.extend(ids[..n].iter().map(|&i| i as i64));
    ex.tokens.extend(std::iter::repeat_n(0, t - n));
    ex.token_types.extend(types[..n].iter().map(|&i| i as i64));
    ex.token_types.extend(std::iter::repeat_n(0, t - n));
    ex.mask.extend((0..t).map(|i| (i < n) as i64));
    let mut offs = offsets[..n].to_vec();
    offs.resize(t, None);
    // The answer's tokens: the first that ends after its start, the last that starts before
    // its end (0, [CLS], when it was cut away).
    let s = offs.iter().position(|o| o.is_some_and(|(_, b)| b > start));
    let e = offs.iter().rposition(|o| o.is_some_and(|(a, _)| a < end));
    // Kept only whole (else the row learns to point at [CLS], position 0).
    let kept = match (s, e) {
        (Some(s), Some(e)) => {
            s <= e && offs[s].is_some_and(|o| o.0 <= start) && offs[e].is_some_and(|o| o.1 >= end)
        }
        _ => false,
    };
    let (s, e) = if kept {
        (s.unwrap_or(0), e.unwrap_or(0))
    } else {
        (0, 0)
    };
    ex.labels.extend([s as i64, e as i64]);
    ex.truncated += (ids.len() > t) as usize;
    ex.spans.push(Span {
        context: context.to_string(),
        offsets: offs,
        answers: answers.into_iter().map(|(a, _)| a).collect(),
    });
    Ok(kept)
}

/// The best answer span of start and end logits over a row's context tokens: the highest
/// start + end score with start <= end < start + 30 (as SQuAD's reference scripts bound it).
pub fn best_span(start: &[f32], end: &[f32], span: &Span) -> String {
    let mut best = (f32::NEG_INFINITY, 0, 0);
    let inside = |i: usize| span.offsets.get(i).copied().flatten();
    for s in (0..start.len()).filter(|&i| inside(i).is_some()) {
        for e in (s..end.len().min(s + 30)).filter(|&i| inside(i).is_some()) {
            if start[s] + end[e] > best.0 {
                best = (start[s] + end[e], s, e);
            }
        }
    }
    match (inside(best.1), inside(best.2)) {
        (Some((a, _)), Some((_, b))) => span.context.get(a..b).unwrap_or("").to_string(),
        _ => String::new(),
    }
}

/// SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces.
fn normalize(s: &str) -> Vec<String> {
    let lower: String = s
        .to_lowercase()
        .chars()
        .filter(|c| !c.is_ascii_punctuation())
        .collect();
    lower
        .split_whitespace()
        .filter(|w| !matches!(*w, "a" | "an" | "the"))
        .map(str::to_string)
        .collect()
}

/// Exact match and F1 of `prediction` against the best of `answers` (SQuAD 1.1's metrics).
pub fn score(prediction: &str, answers: &[String]) -> (f64, f64) {
    let p = normalize(prediction);
    let mut best = (0.0f64, 0.0f64);
    for a in answers {
        let g = normalize(a);
        let em = (p == g) as u8 as f64;
        let mut left = g.clone();
        let common = p
            .iter()
            .filter(|w| match left.iter().position(|x| x == *w) {
                Some(i) => {
                    left.remove(i);
                    true
                }
                None => false,
            })
            .count() as f64;
        let f1 = match common > 0.0 {
            true => {
                let (pr, rc) = (common / p.len() as f64, common / g.len() as f64);
                2.0 * pr * rc / (pr + rc)
            }
            false => 0.0,
        };
        best = (best.0.max(em), best.1.max(f1));
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn squad_metrics_normalise_as_the_reference_script() {
        let gold = vec!["The Eiffel Tower".to_string(), "Eiffel tower!".to_string()];
        assert_eq!(score("eiffel tower", &gold), (1.0, 1.0));
        let (em, f1) = score("the tall Eiffel", &gold);
        assert_eq!(em, 0.0);
        assert!((f1 - 0.5).abs() < 1e-12, "{f1}"); // 1 common of 2 and of 2 words
        assert_eq!(score("", &gold), (0.0, 0.0));
    }

    #[test]
    fn answers_map_to_their_tokens_and_back() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("s.json");
        let squad = r#"{"data": [{"title": "t", "paragraphs": [{"context": "abc def ghi",
            "qas": [{"id": "1", "question": "q?", "answers": [{"text": "def", "answer_start": 4}]},
                    {"id": "2", "question": "q?", "answers": [{"text": "ghi", "answer_start": 8}]}]}]}]}"#;
        std::fs::write(&f, squad).unwrap();
        // Bytes: "q?" then the context; 10 positions keep the first answer only ("abc def g").
        let (e, dropped) = load(&f, &Tokenizer::Bytes, 10, true).unwrap();
        assert_eq!((e.len(), dropped), (1, 1));
        assert_eq!(e.labels, vec![6, 8]); // "q?" is 2 tokens, "abc " 4: "def" at 6..=8
        assert_eq!(e.token_types[..4], [0, 0, 1, 1]);
        let mut start = vec![0.0f32; 10];
        let mut end = vec![0.0f32; 10];
        (start[6], end[8], start[1]) = (5.0, 5.0, 9.0); // the question is never an answer
        assert_eq!(best_span(&start, &end, &e.spans[0]), "def");
        // 8 positions would cut "def": the question is left out of training.
        assert!(load(&f, &Tokenizer::Bytes, 8, true)
            .unwrap_err()
            .to_string()
            .contains("no questions"));
        let (all, _) = load(&f, &Tokenizer::Bytes, 16, false).unwrap();
        assert_eq!((all.len(), all.labels.clone()), (2, vec![6, 8, 10, 12]));
        std::fs::write(
            &f,
            squad.replace("\"answer_start\": 4", "\"answer_start\": 5"),
        )
        .unwrap();
        let err = load(&f, &Tokenizer::Bytes, 16, false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("qas[0]: answer \"def\" is not at character 5"),
            "{err}"
        );
    }
}
