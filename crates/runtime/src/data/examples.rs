//! Labelled examples for a task head: texts with a class each, read from JSON lines or CSV,
//! tokenized, cut to the model's sequence length and padded on the right; or images with a
//! class each, from a folder per class.
//!
//! Right padding keeps a causal model's real tokens unaffected by the padding (they never
//! attend forward), and its classifier reads the last real token, as transformers'
//! `*ForSequenceClassification` does; a bidirectional model (bert) masks the padding.

use super::error::Result;
use super::records::{records, regular, Fields, Label, Record};
use super::tokenizer::Tokenizer;
use std::collections::BTreeMap;
use std::path::Path;

/// Fixed examples: `len()` rows of `seq_len` token ids, their padding mask (1: a token), and
/// one class each.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Examples {
    pub seq_len: usize,
    pub tokens: Vec<i64>,
    pub mask: Vec<i64>,
    pub labels: Vec<i64>,
    /// Texts longer than `seq_len` tokens, cut to it.
    pub truncated: usize,
    /// Lines of the file that were not UTF-8, read lossily.
    pub lossy: usize,
    /// Images instead of texts: `len()` of `[c, h, w]` values each, row-major.
    pub pixels: Vec<f32>,
    pub image: Option<[usize; 3]>,
    /// Targets per example in `labels`: 1 (a class) or 2 (an answer's first and last token);
    /// 0 counts as 1.
    pub target_len: usize,
    /// Question answering: each token's segment, and what scoring each answer needs.
    pub token_types: Vec<i64>,
    pub spans: Vec<Span>,
}

/// What scoring a predicted answer span needs: the context, each token's byte range in it
/// (None outside the context), and the gold answers.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Span {
    pub context: String,
    pub offsets: Vec<Option<(usize, usize)>>,
    pub answers: Vec<String>,
}

/// How labels in the data become classes: integers as they are, names in sorted order.
#[derive(Debug, Clone, PartialEq)]
pub enum Classes {
    Numbered(usize),
    Named(Vec<String>),
}

impl Classes {
    pub fn count(&self) -> usize {
        match self {
            Classes::Numbered(n) => *n,
            Classes::Named(v) => v.len(),
        }
    }
}

/// The classes labels of `rows` make: the largest number + 1, or the names sorted. Numbers and
/// names mixed are refused.
fn classes_of(rows: &[Record]) -> Result<Classes> {
    let names: BTreeMap<&str, &str> = rows
        .iter()
        .filter_map(|(_, l, at)| match l {
            Label::Name(n) => Some((n.as_str(), at.as_str())),
            _ => None,
        })
        .collect();
    match (
        names.is_empty(),
        rows.iter().find(|(_, l, _)| matches!(l, Label::Number(_))),
    ) {
        (true, _) => {
            let most = rows.iter().filter_map(|(_, l, at)| match l {
                Label::Number(n) => Some((*n, at)),
                _ => None,
            });
            let (n, at) = most.max_by_key(|(n, _)| *n).expect("rows are not empty");
            match n < 1 << 20 {
                true => Ok(Classes::Numbered(n as usize + 1)),
                false => Err(format!(
                    "{at}: label {n} asks for more classes than a head can hold (2^20)"
                )
                .into()),
            }
        }
        (false, None) => Ok(Classes::Named(
            names.keys().map(|s| s.to_string()).collect(),
        )),
        (false, Some((_, _, at))) => Err(format!(
            "{at}: a numbered label where others are names (e.g. {:?} at {}); use one kind",
            names.keys().next().unwrap_or(&""),
            names.values().next().unwrap_or(&"")
        )
        .into()),
    }
}

impl Examples {
    /// The examples of `path` as `tok` reads them (special tokens, such as BERT's [CLS] and
    /// [SEP], added as the tokenizer defines). `classes`: the labels' classes when known (the
    /// training set's, or the model's head); none: found from this file.
    pub fn load(
        path: &Path,
        tok: &Tokenizer,
        fields: &Fields,
        seq_len: usize,
        classes: Option<&Classes>,
    ) -> Result<(Examples, Classes)> {
        let (rows, lossy) = records(path, fields)?;
        let found = classes_of(&rows)?;
        let classes = classes.cloned().unwrap_or(found);
        let mut ex = Examples {
            seq_len,
            lossy,
            ..Examples::default()
        };
        let pad = tok.eot().unwrap_or(0) as i64;
        for (text, label, at) in rows {
            let class = match (&label, &classes) {
                (Label::Number(n), Classes::Numbered(c)) if (*n as usize) < *c => *n as i64,
                (Label::Name(n), Classes::Named(names)) if names.contains(n) => {
                    names.binary_search(n).map_err(|_| "sorted")? as i64
                }
                _ => {
                    return Err(format!(
                        "{at}: label {} is outside the classes ({})",
                        match &label {
                            Label::Number(n) => n.to_string(),
                            Label::Name(n) => format!("{n:?}"),
                        },
                        match &classes {
                            Classes::Numbered(c) => format!("0-{}", c.saturating_sub(1)),
                            Classes::Named(v) => v.join(", "),
                        }
                    )
                    .into())
                }
            };
            let (ids, cut) = tok.encode_example(&text, seq_len)?;
            if ids.is_empty() {
                return Err(format!("{at}: the text is empty").into());
            }
            ex.truncated += cut as usize;
            let n = ids.len();
            ex.tokens.extend(ids[..n].iter().map(|&i| i as i64));
            ex.tokens.extend(std::iter::repeat_n(pad, seq_len - n));
            ex.mask.extend((0..seq_len).map(|i| (i < n) as i64));
            ex.labels.push(class);
        }
        Ok((ex, classes))
    }

    pub fn len(&self) -> usize {
        self.labels.len() / self.target_len.max(1)
    }

    /// Leave out the last example.
    pub fn truncate_last(&mut self) {
        let n = self.len().saturating_sub(1);
        let t = self.seq_len;
        self.tokens.truncate(n * t);
        self.mask.truncate(n * t);
        self.token_types.truncate(if self.token_types.is_empty() {
            0
        } else {
            n * t
        });
        self.labels.truncate(n * self.target_len.max(1));
        self.spans.truncate(n);
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Each example's length: its positions up to the last real token (by the mask; all
    /// `seq_len` without one).
    pub fn lengths(&self) -> Vec<usize> {
        let t = self.seq_len.max(1);
        match self.mask.is_empty() {
            true => vec![self.seq_len; self.len()],
            false => self.mask.chunks(t).map(crate::batch::real_length).collect(),
        }
    }

    /// The largest token id + 1 (what a model's vocabulary must cover).
    pub fn id_bound(&self) -> usize {
        self.tokens.iter().max().map_or(0, |&m| m as usize + 1)
    }

    /// The examples `idx`, in that order.
    pub fn select(&self, idx: &[usize]) -> Examples {
        let t = self.seq_len;
        let px = self.image.map_or(0, |[c, h, w]| c * h * w);
        let k = self.target_len.max(1);
        let mut e = Examples {
            seq_len: t,
            image: self.image,
            target_len: self.target_len,
            ..Examples::default()
        };
        for &i in idx {
            if self.image.is_none() {
                e.tokens.extend_from_slice(&self.tokens[i * t..(i + 1) * t]);
                e.mask.extend_from_slice(&self.mask[i * t..(i + 1) * t]);
            }
            if !self.token_types.is_empty() {
                e.token_types
                    .extend_from_slice(&self.token_types[i * t..(i + 1) * t]);
            }
            e.pixels
                .extend_from_slice(&self.pixels[i * px..(i + 1) * px]);
            e.labels.extend_from_slice(&self.labels[i * k..(i + 1) * k]);
            if let Some(s) = self.spans.get(i) {
                e.spans.push(s.clone());
            }
        }
        e
    }

    /// Images from `dir`, a folder per class (classes: the folder names, sorted; or `classes`,
    /// those of the training set), each decoded (PNG or JPEG), resized to `size` x `size`,
    /// made RGB (`channels` 3) or grey (1), and scaled as transformers' ViT image processor
    /// does: x / 255, then (x - 0.5) / 0.5. `seq_len`: the model's patches and class token.
    pub fn load_images(
        dir: &Path,
        size: usize,
        channels: usize,
        seq_len: usize,
        classes: Option<&Classes>,
    ) -> Result<(Examples, Classes)> {
        let name = dir.display().to_string();
        let list = |d: &Path| -> Result<Vec<std::path::PathBuf>> {
            let mut v: Vec<_> = std::fs::read_dir(d)
                .map_err(|e| format!("{}: cannot list: {e}", d.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .collect();
            v.sort();
            Ok(v)
        };
        let folders: Vec<_> = list(dir)?.into_iter().filter(|p| p.is_dir()).collect();
        let found = Classes::Named(
            folders
                .iter()
                .map(|p| {
                    p.file_name()
                        .unwrap_or_default()
                        .to_string_lossy()
                        .into_owned()
                })
                .collect(),
        );
        let classes = classes.cloned().unwrap_or(found);
        let Classes::Named(names) = &classes else {
            return Err(format!("{name}: images take their classes from folder names").into());
        };
        let mut ex = Examples {
            seq_len,
            image: Some([channels, size, size]),
            ..Examples::default()
        };
        for folder in &folders {
            let class = folder.file_name().unwrap_or_default().to_string_lossy();
            let Some(label) = names.iter().position(|n| *n == class) else {
                return Err(format!(
                    "{}: class {class:?} is not one of the training classes ({})",
                    folder.display(),
                    names.join(", ")
                )
                .into());
            };
            for file in list(folder)?.into_iter().filter(|p| p.is_file()) {
                ex.pixels.extend(image_values(&file, size, channels)?);
                ex.labels.push(label as i64);
            }
        }
        if ex.is_empty() {
            return Err(format!(
                "{name}: no images (expected a folder per class holding PNG or JPEG files)"
            )
            .into());
        }
        Ok((ex, classes))
    }
}

/// One image file as `[channels, size, size]` values, scaled to [-1, 1].
fn image_values(file: &Path, size: usize, channels: usize) -> Result<Vec<f32>> {
    regular(file)?;
    let img = crate::guard::reader(file, "image", || {
        image::ImageReader::open(file)
            .and_then(|r| r.with_guessed_format())
            .map_err(|e| format!("{}: cannot read: {e}", file.display()))?
            .decode()
            .map_err(|e| format!("{}: not an image that decodes: {e}", file.display()))
    })?;
    scaled_values(&img, size, channels)
}

/// An image resized to `size` x `size`, as `[channels, size, size]` values scaled to [-1, 1].
fn scaled_values(img: &image::DynamicImage, size: usize, channels: usize) -> Result<Vec<f32>> {
    let (s, f) = (size as u32, image::imageops::FilterType::Triangle);
    let scaled = |v: u8| (v as f32 / 255.0 - 0.5) / 0.5;
    let hw = size * size;
    let mut out = vec![0f32; channels * hw];
    match channels {
        1 => {
            let g = image::imageops::resize(&img.to_luma8(), s, s, f);
            for (i, p) in g.pixels().enumerate() {
                out[i] = scaled(p.0[0]);
            }
        }
        3 => {
            let rgb = image::imageops::resize(&img.to_rgb8(), s, s, f);
            for (i, p) in rgb.pixels().enumerate() {
                for c in 0..3 {
                    out[c * hw + i] = scaled(p.0[c]);
                }
            }
        }
        c => return Err(format!("images of {c} channels: only 1 (grey) or 3 (RGB)").into()),
    }
    Ok(out)
}

/// CIFAR's binary records: CIFAR-10's 1 label byte, or CIFAR-100's coarse and fine label bytes
/// (the fine one is the class), then 32 x 32 red, green and blue planes.
const CIFAR_PIXELS: usize = 3 * 32 * 32;

impl Examples {
    /// The images of CIFAR-10 or CIFAR-100 binary files (`data_batch_*.bin` / `test_batch.bin`:
    /// 10 classes; `train.bin` / `test.bin`: 100), resized and scaled as
    /// [`Examples::load_images`]. Returns them and their classes.
    pub fn load_cifar(
        files: &[std::path::PathBuf],
        size: usize,
        channels: usize,
        seq_len: usize,
    ) -> Result<(Examples, Classes)> {
        let mut ex = Examples {
            seq_len,
            image: Some([channels, size, size]),
            ..Examples::default()
        };
        let mut classes = 10;
        for f in files {
            let name = f.file_name().unwrap_or_default().to_string_lossy();
            let hundred = matches!(name.as_ref(), "train.bin" | "test.bin");
            let (head, n) = if hundred { (2, 100) } else { (1, 10) };
            classes = n;
            regular(f)?;
            let bytes =
                std::fs::read(f).map_err(|e| format!("{}: cannot read: {e}", f.display()))?;
            let record = head + CIFAR_PIXELS;
            if bytes.is_empty() || bytes.len() % record != 0 {
                return Err(format!(
                    "{}: {} bytes is not a whole number of CIFAR-{n} records of {record} bytes",
                    f.display(),
                    bytes.len()
                )
                .into());
            }
            for (i, r) in bytes.chunks(record).enumerate() {
                let label = r[head - 1] as usize;
                if label >= n {
                    return Err(format!(
                        "{}: record {i} has label {label}, outside CIFAR-{n}'s classes",
                        f.display()
                    )
                    .into());
                }
                let px = &r[head..];
                let img = image::RgbImage::from_fn(32, 32, |x, y| {
                    let at = (y * 32 + x) as usize;
                    image::Rgb([px[at], px[1024 + at], px[2048 + at]])
                });
                ex.pixels
                    .extend(scaled_values(&img.into(), size, channels)?);
                ex.labels.push(label as i64);
            }
        }
        if ex.is_empty() {
            return Err("no CIFAR files given".into());
        }
        Ok((ex, Classes::Numbered(classes)))
    }
}

/// The CIFAR binary files at `path`: the file itself, or a directory's `data_batch_*.bin`
/// (else `train.bin`) for training, `test_batch.bin` (else `test.bin`) with `test`. None when
/// `path` holds none (image folders, say).
pub fn cifar_files(path: &Path, test: bool) -> Option<Vec<std::path::PathBuf>> {
    if path.is_file() {
        return path
            .extension()
            .is_some_and(|x| x == "bin")
            .then(|| vec![path.to_path_buf()]);
    }
    let mut v: Vec<_> = std::fs::read_dir(path)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let n = p
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            match test {
                true => n == "test_batch.bin",
                false => n.starts_with("data_batch_") && n.ends_with(".bin"),
            }
        })
        .collect();
    if v.is_empty() {
        let one = path.join(if test { "test.bin" } else { "train.bin" });
        if one.is_file() {
            v = vec![one];
        }
    }
    v.sort();
    (!v.is_empty()).then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::records::read_texts;

    fn write(name: &str, text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join(name);
        std::fs::write(&p, text).unwrap();
        (d, p)
    }

    #[test]
    fn jsonl_and_csv_give_the_same_padded_examples() {
        let (_a, j) = write(
            "t.jsonl",
            "{\"text\": \"ab\", \"label\": 1}\n\n{\"text\": \"abcdef\", \"label\": 0}\n",
        );
        let (_b, c) = write("t.csv", "label,text\n1,ab\n0,\"abcdef\"\n");
        let f = Fields::default();
        let (x, classes) = Examples::load(&j, &Tokenizer::Bytes, &f, 4, None).unwrap();
        assert_eq!(classes, Classes::Numbered(2));
        assert_eq!(x.tokens, vec![97, 98, 0, 0, 97, 98, 99, 100]);
        assert_eq!(x.mask, vec![1, 1, 0, 0, 1, 1, 1, 1]);
        assert_eq!((x.labels.clone(), x.truncated), (vec![1, 0], 1));
        let (y, _) = Examples::load(&c, &Tokenizer::Bytes, &f, 4, None).unwrap();
        assert_eq!(x, y);
    }

    /// An e-mail in Latin-1 inside a JSON-lines file is read, its stray bytes as U+FFFD, and
    /// counted; the other lines are untouched.
    #[test]
    fn lines_that_are_not_utf8_are_read_lossily_and_counted() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("mail.jsonl");
        let mut bytes = b"{\"text\": \"caf\xe9 au lait\", \"label\": \"ham\"}\n".to_vec();
        bytes.extend_from_slice("{\"text\": \"naïve\", \"label\": \"spam\"}\n".as_bytes());
        std::fs::write(&p, &bytes).unwrap();
        let (x, _) = Examples::load(&p, &Tokenizer::Bytes, &Fields::default(), 16, None).unwrap();
        assert_eq!(x.lossy, 1);
        let caf: Vec<i64> = "caf\u{fffd} au".bytes().map(i64::from).collect();
        assert_eq!(x.tokens[..caf.len()], caf[..]);
        let naive: Vec<i64> = "naïve".bytes().map(i64::from).collect();
        assert_eq!(x.tokens[16..16 + naive.len()], naive[..]);
    }

    #[test]
    fn named_labels_are_sorted_and_val_labels_must_be_known() {
        let (_a, p) = write(
            "t.jsonl",
            "{\"t\":\"x\",\"y\":\"spam\"}\n{\"t\":\"y\",\"y\":\"ham\"}\n",
        );
        let f = Fields {
            text: "t".into(),
            label: "y".into(),
        };
        let (x, c) = Examples::load(&p, &Tokenizer::Bytes, &f, 2, None).unwrap();
        assert_eq!(c, Classes::Named(vec!["ham".into(), "spam".into()]));
        assert_eq!(x.labels, vec![1, 0]);
        let only = Classes::Named(vec!["spam".into()]);
        let e = Examples::load(&p, &Tokenizer::Bytes, &f, 2, Some(&only))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("t.jsonl:2: label \"ham\" is outside the classes (spam)"),
            "{e}"
        );
    }

    #[test]
    fn bad_records_are_named_with_their_line() {
        let f = Fields::default();
        let cases = [
            (
                "{\"text\": \"a\", \"label\": 0}\n{\"text\": \"a\", \"label\": 0,}\n",
                "t.jsonl:2: not a JSON object",
            ),
            (
                "{\"text\": \"a\", \"label\": -1}\n",
                "t.jsonl:1: label -1 is neither",
            ),
            ("{\"text\": \"a\"}\n", "t.jsonl:1: no \"label\" field"),
            (
                "{\"text\": 3, \"label\": 0}\n",
                "t.jsonl:1: \"text\" is not a string",
            ),
            (
                "{\"text\": \"\", \"label\": 0}\n",
                "t.jsonl:1: the text is empty",
            ),
            (
                "{\"text\": \"a\", \"label\": 0}\n{\"text\": \"b\", \"label\": \"x\"}\n",
                "a numbered label where others are names",
            ),
            ("\n\n", "no examples"),
            (
                "{\"text\": \"a\", \"label\": 1000000000000}\n",
                "t.jsonl:1: label 1000000000000 asks for more",
            ),
        ];
        for (text, want) in cases {
            let (_d, p) = write("t.jsonl", text);
            let e = Examples::load(&p, &Tokenizer::Bytes, &f, 4, None)
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{text:?}: {e}");
        }
        let (_d, p) = write("t.csv", "text,label\na,0\nb\n");
        let e = Examples::load(&p, &Tokenizer::Bytes, &f, 4, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("t.csv"), "{e}");
        let (_d, p) = write("t.csv", "text,class\na,0\n");
        let e = Examples::load(&p, &Tokenizer::Bytes, &f, 4, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no \"label\" column"), "{e}");
        let e = Examples::load(&p, &Tokenizer::Bytes, &f, 4, Some(&Classes::Numbered(1)));
        assert!(e.is_err());
    }

    #[test]
    fn image_folders_give_scaled_channel_first_pixels_and_named_classes() {
        let d = tempfile::tempdir().unwrap();
        for class in ["cat", "dog"] {
            std::fs::create_dir(d.path().join(class)).unwrap();
        }
        let img = image::RgbImage::from_fn(2, 2, |x, y| {
            image::Rgb([(x * 255) as u8, (y * 255) as u8, 51])
        });
        img.save(d.path().join("dog").join("a.png")).unwrap();
        let (e, c) = Examples::load_images(d.path(), 2, 3, 5, None).unwrap();
        assert_eq!(c, Classes::Named(vec!["cat".into(), "dog".into()]));
        assert_eq!((e.labels.clone(), e.image), (vec![1], Some([3, 2, 2])));
        // Red is x, green is y, blue 51 = 0.2: scaled to (v - 0.5) / 0.5.
        let want = [
            -1.0, 1.0, -1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -0.6, -0.6, -0.6, -0.6,
        ];
        assert!(
            e.pixels.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6),
            "{:?}",
            e.pixels
        );
        assert_eq!(e.select(&[0, 0]).pixels.len(), 24);
        // A class the training set lacks, a file that is no image, no images at all.
        let only = Classes::Named(vec!["dog".into()]);
        let err = Examples::load_images(d.path(), 2, 3, 5, Some(&only))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("class \"cat\" is not one of the training classes (dog)"),
            "{err}"
        );
        std::fs::write(d.path().join("cat").join("b.png"), b"no").unwrap();
        let err = Examples::load_images(d.path(), 2, 3, 5, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("b.png: not an image that decodes"), "{err}");
        let empty = tempfile::tempdir().unwrap();
        let err = Examples::load_images(empty.path(), 2, 3, 5, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no images"), "{err}");
    }

    #[test]
    fn cifar_records_read_as_their_planes_and_labels() {
        let d = tempfile::tempdir().unwrap();
        // Two CIFAR-10 records: label 3 all red, label 9 all blue.
        let mut bytes = vec![3u8];
        bytes.extend(std::iter::repeat_n(255u8, 1024));
        bytes.extend(std::iter::repeat_n(0u8, 2048));
        bytes.push(9);
        bytes.extend(std::iter::repeat_n(0u8, 2048));
        bytes.extend(std::iter::repeat_n(255u8, 1024));
        std::fs::write(d.path().join("data_batch_1.bin"), &bytes).unwrap();
        let files = cifar_files(d.path(), false).unwrap();
        let (e, c) = Examples::load_cifar(&files, 4, 3, 5).unwrap();
        assert_eq!((e.labels.clone(), c), (vec![3, 9], Classes::Numbered(10)));
        assert_eq!(e.pixels[..16], [1.0; 16]); // red plane of image 0
        assert_eq!(e.pixels[16..48], [-1.0; 32]);
        assert_eq!(e.pixels[48 + 32..], [1.0; 16]); // blue plane of image 1
        assert!(cifar_files(d.path(), true).is_none());
        std::fs::write(d.path().join("data_batch_2.bin"), &bytes[..100]).unwrap();
        let err = Examples::load_cifar(&cifar_files(d.path(), false).unwrap(), 4, 3, 5)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("data_batch_2.bin: 100 bytes is not a whole number of CIFAR-10 records"),
            "{err}"
        );
        bytes[0] = 10;
        std::fs::write(d.path().join("data_batch_2.bin"), &bytes).unwrap();
        let err = Examples::load_cifar(&cifar_files(d.path(), false).unwrap(), 4, 3, 5)
            .unwrap_err()
            .to_string();
        assert!(err.contains("record 0 has label 10"), "{err}");
    }

    /// A Parquet file of `text` (UTF-8) and `label` (int64) columns, one row group.
    fn parquet_file(path: &Path, texts: &[&str], labels: &[i64]) {
        use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
        use parquet::file::{properties::WriterProperties, writer::SerializedFileWriter};
        let schema = "message m { required binary text (UTF8); required int64 label; }";
        let schema =
            std::sync::Arc::new(parquet::schema::parser::parse_message_type(schema).unwrap());
        let props = std::sync::Arc::new(WriterProperties::builder().build());
        let file = std::fs::File::create(path).unwrap();
        let mut w = SerializedFileWriter::new(file, schema, props).unwrap();
        let mut rg = w.next_row_group().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let values: Vec<ByteArray> = texts.iter().map(|&t| ByteArray::from(t)).collect();
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
    }

    #[test]
    fn parquet_rows_read_as_jsonl_lines_do() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t.parquet");
        parquet_file(&p, &["ab", "abcdef"], &[1, 0]);
        let f = Fields::default();
        let (x, classes) = Examples::load(&p, &Tokenizer::Bytes, &f, 4, None).unwrap();
        assert_eq!(classes, Classes::Numbered(2));
        assert_eq!(x.tokens, vec![97, 98, 0, 0, 97, 98, 99, 100]);
        assert_eq!(x.labels, vec![1, 0]);
        assert_eq!(read_texts(&p, "text").unwrap(), vec!["ab", "abcdef"]);
        let j = d.path().join("t.jsonl");
        std::fs::write(&j, "{\"text\": \"ab\"}\n{\"text\": \"abcdef\"}\n").unwrap();
        assert_eq!(
            read_texts(&j, "text").unwrap(),
            read_texts(&p, "text").unwrap()
        );
        let e = read_texts(&p, "body").unwrap_err().to_string();
        assert!(e.contains("row group 0, row 0: no \"body\" column"), "{e}");
        parquet_file(&p, &["ab"], &[-3]);
        let e = Examples::load(&p, &Tokenizer::Bytes, &f, 4, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("row group 0, row 0: label -3 is neither"), "{e}");
        std::fs::write(&p, b"PAR1 not really").unwrap();
        let e = Examples::load(&p, &Tokenizer::Bytes, &f, 4, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("t.parquet: not a Parquet file"), "{e}");
    }
}
