//! Record readers: the text (and label) fields of JSON lines, CSV and Parquet files, each
//! value with where it was read, whatever task the records serve.

use super::error::{Error, Field, Result};
use std::path::Path;

/// Which fields of a record hold the text and the label.
#[derive(Debug, Clone)]
pub struct Fields {
    pub text: String,
    pub label: String,
}

impl Default for Fields {
    fn default() -> Self {
        Fields {
            text: "text".into(),
            label: "label".into(),
        }
    }
}

/// A record's text, its label, and where it was read ("file:line").
pub type Record = (String, Label, String);

fn no_field(at: &str, field: Field, name: &str, kind: &'static str) -> Error {
    Error::NoField {
        at: at.into(),
        field,
        name: name.into(),
        kind,
    }
}

/// A record's label as found: a whole number or a name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Label {
    Number(u64),
    Name(String),
}

/// Refuse what is not a regular file: reading a FIFO or device would block.
pub fn regular(path: &Path) -> Result<()> {
    pipewright_core::inputs::regular_file(path)?;
    Ok(())
}

/// Texts and labels of a JSONL or CSV file (by extension: `.csv` is CSV, anything else JSON
/// lines), each with where it was read ("file:line"), and how many lines were not UTF-8 (read
/// with U+FFFD for the bytes that were not: e-mails in Latin-1 are data, not a broken file).
pub fn records(path: &Path, f: &Fields) -> Result<(Vec<Record>, usize)> {
    let name = path.display().to_string();
    regular(path)?;
    let (text, lossy) = match path.extension().is_some_and(|x| x == "parquet") {
        true => (String::new(), 0), // binary: read by its reader
        false => lossy_text(std::fs::read(path).map_err(|e| format!("{name}: cannot read: {e}"))?),
    };
    let ext = path.extension().and_then(|x| x.to_str()).unwrap_or("");
    let rows = match ext {
        "csv" => csv_records(&name, &text, f)?,
        "parquet" => parquet_records(path, f)?,
        _ => jsonl_records(&name, &text, f)?,
    };
    if rows.is_empty() {
        return Err(format!("{name}: no examples (an empty data set)").into());
    }
    Ok((rows, lossy))
}

/// `bytes` as text, and how many of its lines were not UTF-8 (each decoded lossily).
fn lossy_text(bytes: Vec<u8>) -> (String, usize) {
    // Valid UTF-8 (the usual case) becomes the string without a copy.
    let bytes = match String::from_utf8(bytes) {
        Ok(s) => return (s, 0),
        Err(e) => e.into_bytes(),
    };
    let mut bad = 0;
    let lines: Vec<String> = bytes
        .split(|&b| b == b'\n')
        .map(|l| {
            let s = String::from_utf8_lossy(l);
            bad += matches!(s, std::borrow::Cow::Owned(_)) as usize;
            s.into_owned()
        })
        .collect();
    (lines.join("\n"), bad)
}

fn jsonl_records(name: &str, text: &str, f: &Fields) -> Result<Vec<Record>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = format!("{name}:{}", i + 1);
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("{at}: not a JSON object: {e}"))?;
        let field = |k: &str, field| v.get(k).ok_or_else(|| no_field(&at, field, k, "field"));
        let text = field(&f.text, Field::TextField)?
            .as_str()
            .ok_or_else(|| format!("{at}: \"{}\" is not a string", f.text))?;
        let label = match field(&f.label, Field::LabelField)? {
            serde_json::Value::String(s) => Label::Name(s.clone()),
            n => Label::Number(n.as_u64().ok_or_else(|| {
                format!("{at}: label {n} is neither a whole number >= 0 nor a string")
            })?),
        };
        out.push((text.to_string(), label, at));
    }
    Ok(out)
}

fn csv_records(name: &str, text: &str, f: &Fields) -> Result<Vec<Record>> {
    let mut r = csv::Reader::from_reader(text.as_bytes());
    let header = r.headers().map_err(|e| format!("{name}: {e}"))?.clone();
    let col = |k: &str, field| {
        header
            .iter()
            .position(|h| h == k)
            .ok_or_else(|| no_field(name, field, k, "column in the header"))
    };
    let (t, l) = (
        col(&f.text, Field::TextField)?,
        col(&f.label, Field::LabelField)?,
    );
    let mut out = Vec::new();
    for row in r.records() {
        let row = row.map_err(|e| format!("{name}: {e}"))?;
        let line = row.position().map_or(0, |p| p.line());
        let at = format!("{name}:{line}");
        let label = &row[l];
        let label = match label.trim().parse::<u64>() {
            Ok(n) => Label::Number(n),
            Err(_) => Label::Name(label.to_string()),
        };
        out.push((row[t].to_string(), label, at));
    }
    Ok(out)
}

/// The `f.text` and `f.label` columns of a Parquet file's rows (a label column of whole
/// numbers or strings), each with where it was read (row group and row).
fn parquet_records(path: &Path, f: &Fields) -> Result<Vec<Record>> {
    crate::guard::reader(path, "Parquet file", || parquet_rows(path, f))
}

fn parquet_rows(path: &Path, f: &Fields) -> Result<Vec<Record>> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::Field as Value;
    let name = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|e| format!("{name}: cannot read: {e}"))?;
    let reader =
        SerializedFileReader::new(file).map_err(|e| format!("{name}: not a Parquet file: {e}"))?;
    let mut out = Vec::new();
    for g in 0..reader.num_row_groups() {
        let at = |r: usize| format!("{name}: row group {g}, row {r}");
        let group = reader
            .get_row_group(g)
            .map_err(|e| format!("{name}: row group {g}: {e}"))?;
        let rows = group
            .get_row_iter(None)
            .map_err(|e| format!("{name}: row group {g}: {e}"))?;
        for (r, row) in rows.enumerate() {
            let row = row.map_err(|e| format!("{}: {e}", at(r)))?;
            let field = |k: &str, field| {
                row.get_column_iter()
                    .find(|(n, _)| n.as_str() == k)
                    .map(|(_, v)| v.clone())
                    .ok_or_else(|| no_field(&at(r), field, k, "column"))
            };
            let Value::Str(text) = field(&f.text, Field::TextField)? else {
                return Err(format!("{}: \"{}\" is not a string", at(r), f.text).into());
            };
            let label = match field(&f.label, Field::LabelField)? {
                Value::Str(s) => Label::Name(s),
                Value::Int(n) if n >= 0 => Label::Number(n as u64),
                Value::Long(n) if n >= 0 => Label::Number(n as u64),
                Value::UInt(n) => Label::Number(n as u64),
                Value::ULong(n) => Label::Number(n),
                other => {
                    return Err(format!(
                        "{}: label {other} is neither a whole number >= 0 nor a string",
                        at(r)
                    )
                    .into())
                }
            };
            out.push((text, label, at(r)));
        }
    }
    Ok(out)
}

/// The texts of a JSON-lines or Parquet file's `field` (for language modelling: each a
/// document).
pub fn read_texts(path: &Path, field: &str) -> Result<Vec<String>> {
    regular(path)?;
    let f = Fields {
        text: field.into(),
        label: field.into(),
    };
    let name = path.display().to_string();
    match path.extension().is_some_and(|x| x == "parquet") {
        true => parquet_texts(path, field),
        false => {
            let text =
                std::fs::read_to_string(path).map_err(|e| format!("{name}: cannot read: {e}"))?;
            let mut out = Vec::new();
            for (i, line) in text
                .lines()
                .enumerate()
                .filter(|(_, l)| !l.trim().is_empty())
            {
                let v: serde_json::Value = serde_json::from_str(line)
                    .map_err(|e| format!("{name}:{}: not a JSON object: {e}", i + 1))?;
                match v.get(&f.text).and_then(|t| t.as_str()) {
                    Some(t) => out.push(t.to_string()),
                    None => {
                        let at = format!("{name}:{}", i + 1);
                        return Err(no_field(&at, Field::TextField, field, "string field"));
                    }
                }
            }
            Ok(out)
        }
    }
}

/// A Parquet file's string column `field`, row by row.
fn parquet_texts(path: &Path, field: &str) -> Result<Vec<String>> {
    let f = Fields {
        text: field.into(),
        label: field.into(),
    };
    // A text column read as its own label: the records' texts.
    Ok(parquet_records(path, &f)?
        .into_iter()
        .map(|(t, _, _)| t)
        .collect())
}
