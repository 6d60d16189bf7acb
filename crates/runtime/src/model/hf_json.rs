//! Reading and writing the fields of a Hugging Face `config.json`: each value checked, each
//! error naming its key. Every family's conversion uses these.

use super::TaskHead;
use serde_json::{json, Value};

pub(crate) fn usize_field(v: &Value, key: &str) -> Result<Option<usize>, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| format!("{key} must be a non-negative integer, found {x}")),
    }
}

/// What a JSON value is, for messages.
pub(crate) fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A true/false field, `default` when absent or null.
pub(crate) fn bool_field(v: &Value, key: &str, default: bool) -> Result<bool, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x
            .as_bool()
            .ok_or_else(|| format!("{key} must be true or false, found {x}")),
    }
}

pub(crate) fn need(v: &Value, key: &str) -> Result<usize, String> {
    usize_field(v, key)?.ok_or_else(|| format!("{key} is missing"))
}

pub(crate) fn f64_field(v: &Value, key: &str) -> Result<Option<f64>, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_f64()
            .map(Some)
            .ok_or_else(|| format!("{key} must be a number, found {x}")),
    }
}

/// Refuse a field whose value would change the computation in a way not implemented.
pub(crate) fn refuse_unless(
    v: &Value,
    key: &str,
    ok: impl Fn(&Value) -> bool,
) -> Result<(), String> {
    // The family by its own name (every config that reaches here has a model_type).
    let family = v
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("model");
    match v.get(key) {
        Some(x) if !x.is_null() && !ok(x) => Err(format!(
            "{key} = {x} is not supported by pipewright's {family}"
        )),
        _ => Ok(()),
    }
}

/// The task head a causal model's `architectures` names: none (`*ForCausalLM`, or none
/// given) or a classifier (`*ForSequenceClassification`).
pub(crate) fn causal_head(v: &Value, family: &str) -> Result<Option<TaskHead>, String> {
    match architecture(v) {
        Some(a) if a.ends_with("ForSequenceClassification") => Ok(Some(TaskHead::Classify {
            classes: num_labels(v)?,
        })),
        Some(a) if a.ends_with("ForCausalLM") || a.ends_with("LMHeadModel") || a.ends_with("Model") => Ok(None),
        None => Ok(None),
        Some(other) => Err(format!(
            "architectures [\"{other}\"] is not supported for {family} (supported: a causal LM or sequence classification)"
        )),
    }
}

/// transformers' label fields for a classifier of `classes`: the class names the model was
/// trained with, else transformers' `LABEL_i`.
pub(crate) fn label_fields(v: &mut Value, classes: usize, names: &[String]) {
    let name = |i: usize| match names.len() == classes {
        true => names[i].clone(),
        false => format!("LABEL_{i}"),
    };
    v["num_labels"] = json!(classes);
    v["id2label"] = (0..classes)
        .map(|i| (i.to_string(), json!(name(i))))
        .collect();
    v["label2id"] = (0..classes).map(|i| (name(i), json!(i))).collect();
}

/// The first of `architectures`, which names the head.
pub(crate) fn architecture(v: &Value) -> Option<&str> {
    v.get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
}

/// Classes of a classification head: `num_labels`, or the size of `id2label`, else 2 (as
/// transformers defaults).
pub(crate) fn num_labels(v: &Value) -> Result<usize, String> {
    Ok(match usize_field(v, "num_labels")? {
        Some(n) => n,
        None => v
            .get("id2label")
            .and_then(Value::as_object)
            .map_or(2, |m| m.len()),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_unsupported_value_is_refused_naming_the_family() {
        let v = serde_json::json!({"model_type": "bert", "hidden_act": "relu"});
        let e = super::refuse_unless(&v, "hidden_act", |x| x == "gelu").unwrap_err();
        assert_eq!(
            e,
            "hidden_act = \"relu\" is not supported by pipewright's bert"
        );
        assert!(super::refuse_unless(&v, "qkv_bias", |x| x == true).is_ok());
    }
}
