//! The metrics rows as TensorBoard event files, so that
//! `tensorboard --logdir DIR` can watch a run. An event file is TFRecord framing (length, its
//! masked CRC-32C, the record, its masked CRC-32C) around `Event` protocol buffers, as
//! TensorFlow's `event.proto` and `summary.proto` define them; only the messages a scalar needs
//! are declared here (prost encodes them, crc32c checks them).

use std::io::Write;
use std::path::{Path, PathBuf};

/// `tensorflow.Event`: a wall time, a step, and what happened.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    #[prost(oneof = "What", tags = "3, 5")]
    pub what: Option<What>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum What {
    /// The first event of a file: `brain.Event:2`.
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `tensorflow.Summary`: values of one step.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<Value>,
}

/// `tensorflow.Summary.Value` holding a scalar (`simple_value`). The scalar is one case of a
/// `oneof` there, so it is written even when 0 (a plain proto3 float of 0 would be left out,
/// and TensorBoard would see a value without a number).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Value {
    #[prost(string, tag = "1")]
    pub tag: String,
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
}

/// TFRecord's checksum: CRC-32C, rotated and offset so that a CRC of CRCs stays strong.
pub fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c::crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord: the record's length, its masked CRC, the record, its masked CRC.
pub fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// The scalars of a metrics row (a JSON object; see `StepRow::to_json`): every number but
/// the step, tagged `train/...`, or `val/...` for held-out figures.
pub fn scalars(row: &serde_json::Value) -> Vec<Value> {
    let mut out = Vec::new();
    for (k, v) in row.as_object().into_iter().flatten() {
        let Some(x) = v.as_f64().filter(|_| k != "step") else {
            continue;
        };
        let tag = match k.strip_prefix("val_") {
            Some(rest) => format!("val/{rest}"),
            None if matches!(k.as_str(), "accuracy" | "f1") => format!("val/{k}"),
            None => format!("train/{k}"),
        };
        out.push(Value {
            tag,
            simple_value: Some(x as f32),
        });
    }
    out
}

/// An event file being written.
pub struct EventFile {
    path: PathBuf,
    file: std::fs::File,
}

impl EventFile {
    /// A new event file in `dir` (created if missing), named as TensorFlow names them.
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let path = dir.join(format!(
            "events.out.tfevents.{now:010}.{host}.{}.pipewright",
            std::process::id()
        ));
        let file = std::fs::File::create(&path)?;
        let mut f = EventFile { path, file };
        f.write(0, What::FileVersion("brain.Event:2".into()))?;
        Ok(f)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One event, written through (TensorBoard reads the file while the run goes on).
    pub fn write(&mut self, step: u64, what: What) -> std::io::Result<()> {
        let wall_time = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let event = Event {
            wall_time,
            step: i64::try_from(step).unwrap_or(i64::MAX),
            what: Some(what),
        };
        self.file
            .write_all(&record(&prost::Message::encode_to_vec(&event)))?;
        self.file.flush()
    }

    /// A metrics row's scalars at its step.
    pub fn write_row(&mut self, row: &serde_json::Value) -> std::io::Result<()> {
        let step = row["step"].as_u64().unwrap_or(0);
        let value = scalars(row);
        if value.is_empty() {
            return Ok(());
        }
        self.write(step, What::Summary(Summary { value }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    /// Records read back: each length and record checked against its masked CRC, and decoded.
    fn read_events(bytes: &[u8]) -> Vec<Event> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let len = &bytes[at..at + 8];
            let crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
            assert_eq!(crc, masked_crc(len));
            let n = u64::from_le_bytes(len.try_into().unwrap()) as usize;
            let data = &bytes[at + 12..at + 12 + n];
            let crc = u32::from_le_bytes(bytes[at + 12 + n..at + 16 + n].try_into().unwrap());
            assert_eq!(crc, masked_crc(data));
            out.push(Event::decode(data).unwrap());
            at += 16 + n;
        }
        out
    }

    /// CRC-32C of "123456789" is 0xE3069283 (the standard check value); TensorFlow masks it.
    #[test]
    fn the_checksum_is_masked_crc32c() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(
            masked_crc(b"123456789"),
            0xe306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8)
        );
    }

    /// A scalar event against its protobuf wire bytes, worked out by hand, for
    /// `Event { wall_time: 0, step: 3, summary { value { tag: "a", simple_value: 1.0 } } }`.
    #[test]
    fn a_scalar_event_encodes_as_tensorflow_declares_it() {
        let e = Event {
            wall_time: 0.0,
            step: 3,
            what: Some(What::Summary(Summary {
                value: vec![Value {
                    tag: "a".into(),
                    simple_value: Some(1.0),
                }],
            })),
        };
        // field 2 varint 3; field 5 (len 10) { field 1 (len 8) { field 1 "a"; field 2 f32 1.0 } }
        let want = [
            0x10, 3, 0x2a, 10, 0x0a, 8, 0x0a, 1, b'a', 0x15, 0, 0, 0x80, 0x3f,
        ];
        assert_eq!(e.encode_to_vec(), want);
        // A scalar of 0 is written too (as TensorFlow's oneof writes it).
        let zero = Value {
            tag: "a".into(),
            simple_value: Some(0.0),
        };
        assert_eq!(zero.encode_to_vec(), [0x0a, 1, b'a', 0x15, 0, 0, 0, 0]);
    }

    #[test]
    fn a_file_holds_the_version_then_each_rows_scalars() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = EventFile::create(&dir.path().join("tb")).unwrap();
        let row = serde_json::json!({"step": 7, "loss": 2.5, "val_loss": 2.25, "accuracy": null,
            "busy": [0.1], "mfu": 0.4});
        f.write_row(&row).unwrap();
        let events = read_events(&std::fs::read(f.path()).unwrap());
        assert_eq!(events.len(), 2);
        assert_eq!(
            events[0].what,
            Some(What::FileVersion("brain.Event:2".into()))
        );
        assert_eq!(events[1].step, 7);
        let Some(What::Summary(s)) = &events[1].what else {
            panic!("{:?}", events[1]);
        };
        let mut got: Vec<(String, f32)> = s
            .value
            .iter()
            .map(|v| (v.tag.clone(), v.simple_value.unwrap()))
            .collect();
        got.sort_by(|a, b| a.0.cmp(&b.0));
        let want = [("train/loss", 2.5), ("train/mfu", 0.4), ("val/loss", 2.25)];
        let want: Vec<(String, f32)> = want.iter().map(|(t, v)| (t.to_string(), *v)).collect();
        assert_eq!(got, want);
    }
}
