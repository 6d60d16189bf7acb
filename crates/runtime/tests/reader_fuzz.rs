//! Mutated Parquet and PNG files (bytes flipped, runs overwritten, cut short) through the
//! readers that training uses: each read ends in examples or in a one-line error naming the
//! file, never a panic, and no error line quotes the data (a fixed seed: the same cases on
//! every run).

use pipewright_runtime::data::tokenizer::Tokenizer;
use pipewright_runtime::data::{examples::Examples, records::Fields};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};
use std::path::Path;

/// A Parquet file of `text` (UTF-8) and `label` (int64) columns, one row group.
fn parquet_bytes(texts: &[&[u8]], labels: &[i64]) -> Vec<u8> {
    use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
    use parquet::file::{properties::WriterProperties, writer::SerializedFileWriter};
    let schema = "message m { required binary text (UTF8); required int64 label; }";
    let schema = std::sync::Arc::new(parquet::schema::parser::parse_message_type(schema).unwrap());
    let props = std::sync::Arc::new(WriterProperties::builder().build());
    let mut out = Vec::new();
    let mut w = SerializedFileWriter::new(&mut out, schema, props).unwrap();
    let mut rg = w.next_row_group().unwrap();
    let mut col = rg.next_column().unwrap().unwrap();
    let values: Vec<ByteArray> = texts.iter().map(|&t| ByteArray::from(t.to_vec())).collect();
    col.typed::<ByteArrayType>()
        .write_batch(&values, None, None)
        .unwrap();
    col.close().unwrap();
    let mut col = rg.next_column().unwrap().unwrap();
    col.typed::<Int64Type>()
        .write_batch(labels, None, None)
        .unwrap();
    col.close().unwrap();
    rg.close().unwrap();
    w.close().unwrap();
    out
}

fn png_bytes() -> Vec<u8> {
    let img =
        image::RgbImage::from_fn(8, 8, |x, y| image::Rgb([(x * 30) as u8, (y * 30) as u8, 7]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

/// `base` with each (position, byte, run) written over it, then cut to `keep` of its length.
fn mutated(base: &[u8], edits: &[(usize, u8, usize)], keep: f64) -> Vec<u8> {
    let mut b = base.to_vec();
    for &(at, byte, run) in edits {
        let at = at % b.len();
        let end = (at + run).min(b.len());
        b[at..end].iter_mut().for_each(|x| *x = byte);
    }
    b.truncate(((b.len() as f64 * keep) as usize).max(1));
    b
}

/// An error a user reads: one line, naming the file, no longer than a few hundred characters.
fn check_error(e: &str, file: &Path) {
    assert!(!e.contains('\n'), "{e}");
    assert!(e.contains(&file.display().to_string()), "{e}");
    assert!(
        e.chars().count() < 700,
        "{} characters: {e}",
        e.chars().count()
    );
}

fn cases() -> Config {
    Config {
        cases: 160,
        rng_seed: RngSeed::Fixed(46),
        failure_persistence: None,
        ..Config::default()
    }
}

fn edits() -> impl Strategy<Value = (Vec<(usize, u8, usize)>, f64)> {
    (
        prop::collection::vec((any::<usize>(), any::<u8>(), 1usize..16), 1..4),
        prop_oneof![Just(1.0), 0.05f64..1.0],
    )
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn mutated_parquet_files_are_read_or_refused_by_name((e, keep) in edits()) {
        let base = parquet_bytes(&[b"ab", b"abcdef", b"xyz"], &[1, 0, 1]);
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t.parquet");
        std::fs::write(&p, mutated(&base, &e, keep)).unwrap();
        match Examples::load(&p, &Tokenizer::Bytes, &Fields::default(), 8, None) {
            Ok((x, _)) => prop_assert!(x.labels.len() <= 3),
            Err(err) => check_error(&err.to_string(), &p),
        }
    }

    #[test]
    fn mutated_png_files_are_read_or_refused_by_name((e, keep) in edits()) {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("a")).unwrap();
        let p = d.path().join("a").join("x.png");
        std::fs::write(&p, mutated(&png_bytes(), &e, keep)).unwrap();
        match Examples::load_images(d.path(), 4, 3, 17, None) {
            Ok((x, _)) => prop_assert_eq!(x.labels.len(), 1),
            Err(err) => check_error(&err.to_string(), &p),
        }
    }
}

/// A value that is not UTF-8 in a UTF-8 column: refused naming the file, in a short line (the
/// reader's own message lists every byte).
#[test]
fn a_long_non_utf8_parquet_value_gives_a_short_error() {
    let bad: Vec<u8> = (0..20_000)
        .map(|i| if i % 2 == 0 { 0xff } else { b'a' })
        .collect();
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("t.parquet");
    std::fs::write(&p, parquet_bytes(&[&bad], &[0])).unwrap();
    let err = Examples::load(&p, &Tokenizer::Bytes, &Fields::default(), 8, None)
        .unwrap_err()
        .to_string();
    check_error(&err, &p);
}
