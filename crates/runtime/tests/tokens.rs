//! Tokenizers and token shards: round trips, ids as their own libraries give them, shards
//! read back as written (llm.c's and nanoGPT's), and damaged shards refused by name.

use pipewright_runtime::data::tokenizer::Tokenizer;
use pipewright_runtime::data::tokens::{shard_bytes, Tokens};
use pipewright_runtime::data::Corpus;
use std::path::{Path, PathBuf};

const TEXT: &str = "Pipelines cut a model into stages; héllo wörld, 3+4=7.\n\tdone. 日本語";

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pw-tokens-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn every_tokenizer_round_trips_and_knows_its_vocabulary() {
    let hf = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
    for (spec, vocab) in [("bytes", 256), ("gpt2", 50257), ("cl100k", 100277)] {
        let t = Tokenizer::load(spec).unwrap();
        assert_eq!(t.vocab_size(), vocab, "{spec}");
        assert!(t.round_trips(TEXT).unwrap(), "{spec} does not round-trip");
    }
    // GPT-2's ids as OpenAI's tiktoken gives them: "hello world" is [31373, 995].
    assert_eq!(
        Tokenizer::load("gpt2")
            .unwrap()
            .encode("hello world")
            .unwrap(),
        [31373, 995]
    );
    // A Hugging Face tokenizer.json (a directory holding one works too): the ids the Python
    // library gives (scripts/hf-fixtures), and the text back.
    for spec in [hf.join("tokenizer.json"), hf.clone()] {
        let t = Tokenizer::load(spec.to_str().unwrap()).unwrap();
        assert_eq!(t.vocab_size(), 300);
        let ids = t.encode("the lazy fox, stage by stage").unwrap();
        assert_eq!(ids, [83, 263, 293, 88, 290, 87, 11, 270, 265, 88, 270]);
        assert!(t.round_trips(TEXT).unwrap());
    }
    let e = Tokenizer::load("no-such-tokenizer")
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("no-such-tokenizer"), "{e}");
    let t = Tokenizer::load("gpt2").unwrap();
    assert!(t.check_fits(50257).is_ok());
    let e = t.check_fits(256).unwrap_err().to_string();
    assert!(
        e.contains("ids reach 50256") && e.contains("vocabulary of 256"),
        "{e}"
    );
}

#[test]
fn shards_read_back_as_written() {
    let d = scratch("shards");
    let narrow: Vec<u32> = (0..1000).map(|i| (i * 7919) % 50257).collect();
    let wide: Vec<u32> = (0..500).map(|i| 70_000 + i).collect();
    std::fs::write(d.join("a.bin"), shard_bytes(&narrow)).unwrap();
    std::fs::write(d.join("b.bin"), shard_bytes(&wide)).unwrap();
    // nanoGPT's headerless uint16 tokens.
    let plain: Vec<u8> = narrow[..300]
        .iter()
        .flat_map(|&x| (x as u16).to_le_bytes())
        .collect();
    std::fs::write(d.join("c.bin"), plain).unwrap();
    let t = Tokens::shards(&[d.join("a.bin"), d.join("b.bin"), d.join("c.bin")]).unwrap();
    let all: Vec<u32> = narrow
        .iter()
        .chain(&wide)
        .chain(&narrow[..300])
        .copied()
        .collect();
    assert_eq!(t.len(), all.len());
    assert!(t.iter().eq(all.iter().copied()));
    // A window across two shards.
    let w = t.window(995, 10);
    assert_eq!(
        w,
        all[995..1005].iter().map(|&x| x as i64).collect::<Vec<_>>()
    );
    assert_eq!(t.id_bound(), 70_500);
    // A directory: `val` shards are held out.
    std::fs::rename(d.join("c.bin"), d.join("val_000000.bin")).unwrap();
    let c = Corpus::open(&d, &Tokenizer::Bytes).unwrap();
    assert_eq!((c.train.len(), c.val.len(), c.ids), (1500, 300, 70_500));
}

#[test]
fn damaged_shards_are_refused_by_name() {
    let d = scratch("bad");
    std::fs::write(d.join("odd.bin"), [1u8, 2, 3]).unwrap();
    let e = Tokens::shards(&[d.join("odd.bin")])
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("odd.bin") && e.contains("whole number"), "{e}");
    let mut short = shard_bytes(&[1, 2, 3, 4]);
    short.truncate(short.len() - 2);
    std::fs::write(d.join("short.bin"), short).unwrap();
    let e = Tokens::shards(&[d.join("short.bin")])
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("short.bin") && e.contains("header says 4 tokens"),
        "{e}"
    );
    let e = Tokens::shards(&[d.join("missing.bin")])
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("missing.bin"), "{e}");
    let e = Corpus::open(&scratch("empty"), &Tokenizer::Bytes)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no .txt or .bin files"), "{e}");
}

/// The files of `dir`, name -> bytes.
fn files(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            (
                e.file_name().into_string().unwrap(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

/// A tokenize stopped after any batch resumes to exactly the shards (and manifest) of an
/// uninterrupted run; the shards decode back to the documents, each after its end-of-text
/// token, the held-out part last; a changed input refuses the resume by name.
#[test]
fn tokenize_resumes_to_the_same_shards_and_round_trips() {
    use pipewright_runtime::data::shards::{run, Input, Outcome, Settings};
    let src = scratch("tokenize-src");
    let mut texts = Vec::new();
    for i in 0..7 {
        let t = format!("{}{i}\n", TEXT.repeat(1 + i % 3));
        std::fs::write(src.join(format!("{i}.txt")), &t).unwrap();
        texts.push(t);
    }
    let tok = Tokenizer::load("gpt2").unwrap();
    let inputs: Vec<Input> = (0..7)
        .map(|i| Input::of(&src.join(format!("{i}.txt"))).unwrap())
        .collect();
    let settings = Settings {
        tokenizer: tok.name(),
        inputs,
        text_field: "text".into(),
        val_fraction: 0.3,
        shard_tokens: 40,
    };
    let batch = 200; // bytes: a batch of one to three files
    let whole = scratch("tokenize-whole");
    let done = run(&settings, &tok, &whole, batch, &|_| {}, None).unwrap();
    assert!(matches!(done, Outcome::Done { resumed: false, .. }));
    // Stopped after any batch (a resume restarts at the file where the tokens not yet in a
    // shard begin), then run to the end.
    let mut stops = 0;
    for stop in 1..8 {
        let part = scratch(&format!("tokenize-part{stop}"));
        match run(&settings, &tok, &part, batch, &|_| {}, Some(stop)).unwrap() {
            Outcome::Stopped => stops += 1,
            Outcome::Done { .. } => break,
        }
        let done = run(&settings, &tok, &part, batch, &|_| {}, None).unwrap();
        assert!(matches!(done, Outcome::Done { resumed: true, .. }));
        let (got, want) = (files(&part), files(&whole));
        let differ: Vec<&String> = want
            .keys()
            .filter(|k| got.get(*k) != want.get(*k))
            .collect();
        assert!(
            differ.is_empty() && got.len() == want.len(),
            "stopped after {stop} batches: {differ:?} differ; {:?} against {:?}",
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>()
        );
    }
    assert!(stops >= 3, "{stops} batches");
    // Train shards then val shards decode to the documents in order.
    let mut names: Vec<String> = files(&whole)
        .into_keys()
        .filter(|n| n.ends_with(".bin"))
        .collect();
    names.sort_by_key(|n| (n.starts_with("val"), n.clone()));
    assert!(
        names.iter().filter(|n| n.starts_with("train")).count() > 2,
        "{names:?}"
    );
    assert!(names.iter().any(|n| n.starts_with("val")), "{names:?}");
    let paths: Vec<PathBuf> = names.iter().map(|n| whole.join(n)).collect();
    let ids: Vec<u32> = Tokens::shards(&paths).unwrap().iter().collect();
    let want: String = texts.iter().map(|t| format!("<|endoftext|>{t}")).collect();
    assert_eq!(tok.decode(&ids).unwrap(), want);
    // A changed input is named, and nothing is written.
    std::fs::write(src.join("3.txt"), "changed").unwrap();
    let changed = Settings {
        inputs: (0..7)
            .map(|i| Input::of(&src.join(format!("{i}.txt"))).unwrap())
            .collect(),
        ..settings.clone()
    };
    let part = scratch("tokenize-changed");
    assert_eq!(
        run(&settings, &tok, &part, batch, &|_| {}, Some(1)).unwrap(),
        Outcome::Stopped
    );
    let before = files(&part);
    let err = run(&changed, &tok, &part, batch, &|_| {}, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("3.txt") && err.contains("changed"), "{err}");
    assert!(files(&part) == before, "a refused resume changed files");
}

/// A model's own WordPiece tokenizer (all-MiniLM-L6-v2's tokenizer.json) gives the ids
/// transformers' AutoTokenizer gives (scripts/wordpiece-fixture): [CLS] and [SEP] added, BERT's
/// normaliser on accents, Chinese characters, e-mail headers and very long words, and a long
/// text cut to a window before [SEP] is added. The padding to 128 the file carries is not
/// applied (transformers pads per call, pipewright per micro-batch).
#[test]
fn wordpiece_ids_equal_transformers_autotokenizer() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wordpiece");
    let t = Tokenizer::load(dir.join("tokenizer.json").to_str().unwrap()).unwrap();
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let cases = expected["cases"].as_array().unwrap();
    assert!(cases.len() >= 12);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want: Vec<u32> = c["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let max = c["max_length"].as_u64().map_or(usize::MAX, |m| m as usize);
        let (ids, cut) = t.encode_example(text, max).unwrap();
        assert_eq!(ids, want, "{text:?} at max_length {max}");
        let whole = t.encode_example(text, usize::MAX).unwrap().0;
        assert_eq!(cut, whole.len() > max, "{text:?}: cut");
        assert_eq!((ids[0], *ids.last().unwrap()), (101, 102), "[CLS] .. [SEP]");
    }
}

/// A long text is read from a prefix once that prefix gives more tokens than the window keeps:
/// the ids and the cut flag are those of the whole text, for windows from 3 tokens up, on
/// texts whose words, spaces and line breaks fall anywhere around the prefix's end.
#[test]
fn a_long_text_cut_from_a_prefix_gives_the_whole_texts_ids() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wordpiece");
    let t = Tokenizer::load(dir.join("tokenizer.json").to_str().unwrap()).unwrap();
    let mail = "Subject: Re: [ILUG] Café naïve résumé\r\n\r\nDear friend,\tCLICK http://example.com/?a=1&b=2 \
                NOW!!! 中文分词 supercalifragilisticexpialidocious ";
    for reps in [1usize, 7, 40, 400] {
        let text = mail.repeat(reps) + &"x".repeat(reps);
        let whole = t.encode(&text).unwrap();
        for max in [3usize, 16, 128, 512] {
            let (ids, cut) = t.encode_example(&text, max).unwrap();
            let room = max - 2;
            let mut want = vec![101];
            want.extend(&whole[..whole.len().min(room)]);
            want.push(102);
            assert_eq!(ids, want, "{reps} copies, max {max}");
            assert_eq!(cut, whole.len() > room, "{reps} copies, max {max}");
        }
    }
}

/// A model directory's tokenizer.json that is a FIFO or a directory is refused by name; it was
/// once passed over, and the model trained on bytes. No tokenizer.json at all: bytes.
#[test]
fn a_model_dirs_tokenizer_that_is_not_a_file_is_refused() {
    let d = scratch("model-dir-tok");
    assert!(Tokenizer::of_model_dir(&d).is_none());
    std::fs::create_dir(d.join("tokenizer.json")).unwrap();
    let e = Tokenizer::of_model_dir(&d)
        .unwrap()
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("tokenizer.json") && e.contains("not a regular file"),
        "{e}"
    );
    std::fs::remove_dir(d.join("tokenizer.json")).unwrap();
    let fifo = d.join("tokenizer.json");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let e = Tokenizer::of_model_dir(&d)
        .unwrap()
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("not a regular file"), "{e}");
}
