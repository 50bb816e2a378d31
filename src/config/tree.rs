//! A TOML document as a tree that remembers where every value came from (file line:column or a
//! `--set` override), so that every error can point at its source.

use std::fmt;

use toml::de::{DeTable, DeValue};
use toml::Spanned;

/// Where a value was written.
#[derive(Debug, Clone, PartialEq)]
pub enum Origin {
    /// 1-based line and column in the config file.
    File { line: usize, col: usize },
    /// A command-line override, as given (`--set train.seed=3`).
    Set(String),
    /// The document as a whole (it cannot be read, or a problem names its own source).
    Document,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File { line, col } => write!(f, "{line}:{col}"),
            Origin::Set(arg) => write!(f, "--set {arg}"),
            Origin::Document => Ok(()),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Node {
    pub value: Value,
    pub origin: Origin,
}

#[derive(Debug, Clone)]
pub struct Entry {
    pub key: String,
    /// Where the key itself was written (for unknown-key errors).
    pub key_origin: Origin,
    pub node: Node,
}

#[derive(Debug, Clone)]
pub enum Value {
    Table(Vec<Entry>),
    Array(Vec<Node>),
    Str(String),
    Int(i64),
    Float(f64),
    Bool(bool),
    Datetime(String),
}

impl Value {
    /// How a value is named in messages: its TOML type and, for scalars, the value itself.
    pub fn describe(&self) -> String {
        match self {
            Value::Table(_) => "a table".into(),
            Value::Array(a) => format!("an array of {} item(s)", a.len()),
            Value::Str(s) => format!("string {s:?}"),
            Value::Int(i) => format!("integer {i}"),
            Value::Float(x) => format!("float {x}"),
            Value::Bool(b) => format!("boolean {b}"),
            Value::Datetime(d) => format!("datetime {d}"),
        }
    }

    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::Value as J;
        match self {
            Value::Table(entries) => J::Object(
                entries
                    .iter()
                    .map(|e| (e.key.clone(), e.node.value.to_json()))
                    .collect(),
            ),
            Value::Array(items) => J::Array(items.iter().map(|n| n.value.to_json()).collect()),
            Value::Str(s) | Value::Datetime(s) => J::String(s.clone()),
            Value::Int(i) => J::from(*i),
            Value::Float(x) => serde_json::Number::from_f64(*x).map_or(J::Null, J::Number),
            Value::Bool(b) => J::Bool(*b),
        }
    }
}

/// A TOML syntax error with its position.
#[derive(Debug, Clone)]
pub struct SyntaxError {
    pub line: usize,
    pub col: usize,
    pub message: String,
}

/// Converts byte offsets to 1-based line:column.
struct LineIndex<'a> {
    src: &'a str,
}

impl LineIndex<'_> {
    fn line_col(&self, offset: usize) -> (usize, usize) {
        let mut offset = offset.min(self.src.len());
        while !self.src.is_char_boundary(offset) {
            offset -= 1;
        }
        let before = &self.src[..offset];
        let line = before.matches('\n').count() + 1;
        let col = before.rfind('\n').map_or(before.chars().count(), |nl| {
            before[nl + 1..].chars().count()
        }) + 1;
        (line, col)
    }

    fn origin(&self, offset: usize) -> Origin {
        let (line, col) = self.line_col(offset);
        Origin::File { line, col }
    }
}

/// Parses a TOML document into a tree of values with their positions.
pub fn parse_document(src: &str) -> Result<Node, SyntaxError> {
    let index = LineIndex { src };
    match DeTable::parse(src) {
        Ok(table) => {
            let origin = index.origin(table.span().start);
            Ok(Node {
                value: convert_table(table.get_ref(), &index),
                origin,
            })
        }
        Err(e) => {
            let (line, col) = index.line_col(e.span().map_or(0, |s| s.start));
            let mut message = e.message().trim().to_string();
            // The parser's message can be generic ("duplicate key"); the text it points at says which.
            let text = e.span().and_then(|s| src.get(s)).unwrap_or("").trim();
            if !text.is_empty() && !text.contains('\n') && text.len() <= 80 {
                message.push_str(&format!(" `{text}`"));
            }
            Err(SyntaxError { line, col, message })
        }
    }
}

fn convert_table(table: &DeTable<'_>, index: &LineIndex<'_>) -> Value {
    Value::Table(
        table
            .iter()
            .map(|(k, v)| Entry {
                key: k.get_ref().to_string(),
                key_origin: index.origin(k.span().start),
                node: convert(v, &|off| index.origin(off)),
            })
            .collect(),
    )
}

fn convert(v: &Spanned<DeValue<'_>>, origin_at: &dyn Fn(usize) -> Origin) -> Node {
    let origin = origin_at(v.span().start);
    let value = match v.get_ref() {
        DeValue::String(s) => Value::Str(s.to_string()),
        DeValue::Integer(i) => match i64::from_str_radix(&i.as_str().replace('_', ""), i.radix()) {
            Ok(n) => Value::Int(n),
            // Out of i64 range: keep it as a float so that range checks report it.
            Err(_) => Value::Float(f64::INFINITY),
        },
        DeValue::Float(x) => Value::Float(parse_float(x.as_str())),
        DeValue::Boolean(b) => Value::Bool(*b),
        DeValue::Datetime(d) => Value::Datetime(d.to_string()),
        DeValue::Array(items) => {
            Value::Array(items.iter().map(|n| convert(n, origin_at)).collect())
        }
        DeValue::Table(t) => Value::Table(
            t.iter()
                .map(|(k, v)| Entry {
                    key: k.get_ref().to_string(),
                    key_origin: origin_at(k.span().start),
                    node: convert(v, origin_at),
                })
                .collect(),
        ),
    };
    Node { value, origin }
}

fn parse_float(s: &str) -> f64 {
    let s = s.replace('_', "");
    match s.as_str() {
        "inf" | "+inf" => f64::INFINITY,
        "-inf" => f64::NEG_INFINITY,
        "nan" | "+nan" | "-nan" => f64::NAN,
        other => other.parse().unwrap_or(f64::NAN),
    }
}

/// Applies one `--set KEY=VALUE` override. VALUE is read as a TOML value (`3e-4`, `true`, `[0.9, 0.95]`,
/// `"text"`); anything that is not valid TOML is taken as a plain string (`--set train.backend=decentdp`).
pub fn apply_override(root: &mut Node, arg: &str) -> Result<(), String> {
    let (key, raw) = arg.split_once('=').ok_or_else(|| {
        format!("--set {arg}: expected KEY=VALUE, e.g. --set train.lr_schedule.lr=3e-4")
    })?;
    let key = key.trim();
    let segments: Vec<&str> = key.split('.').map(str::trim).collect();
    if key.is_empty() || segments.iter().any(|s| s.is_empty()) {
        return Err(format!(
            "--set {arg}: the key {key:?} is not a dotted key path like train.lr_schedule.lr"
        ));
    }
    let origin = Origin::Set(arg.to_string());
    let raw = raw.trim();
    let value = match DeValue::parse(raw) {
        Ok(v) => convert(&v, &|_| origin.clone()),
        Err(_) => Node {
            value: Value::Str(raw.to_string()),
            origin: origin.clone(),
        },
    };
    let mut cur = root;
    for (i, seg) in segments.iter().enumerate() {
        let what = cur.value.describe();
        let Value::Table(entries) = &mut cur.value else {
            return Err(format!(
                "--set {arg}: {} is {what}, not a table, so it has no key {seg:?}",
                segments[..i].join("."),
            ));
        };
        let last = i + 1 == segments.len();
        let pos = match entries.iter().position(|e| e.key == *seg) {
            Some(p) => p,
            None => {
                entries.push(Entry {
                    key: seg.to_string(),
                    key_origin: origin.clone(),
                    node: Node {
                        value: Value::Table(Vec::new()),
                        origin: origin.clone(),
                    },
                });
                entries.len() - 1
            }
        };
        if last {
            entries[pos].node = value;
            entries[pos].key_origin = origin;
            return Ok(());
        }
        cur = &mut entries[pos].node;
    }
    Ok(())
}

/// Looks up the node at a key path such as `train.optim.betas[1]`.
pub fn find<'a>(root: &'a Node, path: &str) -> Option<&'a Node> {
    let mut cur = root;
    for seg in path.split('.') {
        let (name, indices) = match seg.find('[') {
            Some(p) => (&seg[..p], &seg[p..]),
            None => (seg, ""),
        };
        if !name.is_empty() {
            let Value::Table(entries) = &cur.value else {
                return None;
            };
            cur = &entries.iter().find(|e| e.key == name)?.node;
        }
        for idx in indices.split(['[', ']']).filter(|s| !s.is_empty()) {
            let Value::Array(items) = &cur.value else {
                return None;
            };
            cur = items.get(idx.parse::<usize>().ok()?)?;
        }
    }
    Some(cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_are_one_based_lines_and_columns() {
        let doc = parse_document("a = 1\n[t]\n  b = [1, 2]\n").unwrap();
        assert_eq!(
            find(&doc, "a").unwrap().origin,
            Origin::File { line: 1, col: 5 }
        );
        assert_eq!(
            find(&doc, "t.b[1]").unwrap().origin,
            Origin::File { line: 3, col: 11 }
        );
    }

    #[test]
    fn overrides_create_and_replace_keys() {
        let mut doc = parse_document("[train]\nseed = 1\n").unwrap();
        apply_override(&mut doc, "train.seed=7").unwrap();
        apply_override(&mut doc, "train.optim.betas=[0.9, 0.99]").unwrap();
        apply_override(&mut doc, "train.backend=decentdp").unwrap();
        assert!(matches!(
            find(&doc, "train.seed").unwrap().value,
            Value::Int(7)
        ));
        assert!(
            matches!(find(&doc, "train.optim.betas[1]").unwrap().value, Value::Float(x) if x == 0.99)
        );
        assert!(
            matches!(&find(&doc, "train.backend").unwrap().value, Value::Str(s) if s == "decentdp")
        );
        assert!(apply_override(&mut doc, "train.seed.x=1").is_err());
        assert!(apply_override(&mut doc, "noequals").is_err());
        assert!(apply_override(&mut doc, "a..b=1").is_err());
    }
}
