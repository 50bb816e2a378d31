//! Validation in two phases (ripgrep's habit): first the document's shape against the JSON Schema that
//! the wire types generate (unknown keys, types, ranges, variants), then cross-field rules on the typed
//! config. Every problem is collected; nothing stops at the first one.

use serde_json::{Map, Value as J};

use super::error::Problem;
use super::lr::ScheduleName;
use super::tree::{find, Node, Value};
use super::Config;

/// Checks a document tree against a JSON Schema (the subset schemars emits).
pub fn check_schema(schema: &J, doc: &Node) -> Vec<Problem> {
    let mut walker = Walker {
        root: schema,
        problems: Vec::new(),
        key_index: Vec::new(),
    };
    walker.index_keys(schema, "", 0);
    walker.check(schema, doc, "");
    walker.problems
}

struct Walker<'a> {
    root: &'a J,
    problems: Vec<Problem>,
    /// Every key path the schema allows, to suggest where a misplaced key belongs.
    key_index: Vec<String>,
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// How to make `global` a whole number of `local` x `world` micro-batches: the local batch sizes that
/// fit this world (the largest divisor of global / world), or the world sizes that fit this local batch.
fn batch_fix(global: usize, local: usize, world: usize) -> String {
    let mut fixes = Vec::new();
    if global.is_multiple_of(world) {
        let share = global / world;
        let b = (1..=local.min(share))
            .rev()
            .find(|b| share.is_multiple_of(*b))
            .unwrap_or(1);
        fixes.push(format!(
            "set train.local_batch_size = {b} (--set train.local_batch_size={b})"
        ));
    }
    if local > 0 && global.is_multiple_of(local) {
        let most = global / local;
        let worlds: Vec<String> = (1..=most)
            .filter(|w| most.is_multiple_of(*w))
            .map(|w| w.to_string())
            .collect();
        fixes.push(format!("run {} workers", worlds.join(", ")));
    }
    match fixes.is_empty() {
        true => "change train.global_batch_size".into(),
        false => fixes.join(", or "),
    }
}

fn consts_of(branches: &[J]) -> Option<Vec<&str>> {
    branches
        .iter()
        .map(|b| b.get("const").and_then(J::as_str))
        .collect()
}

/// The closest candidate by edit distance, when it is close enough to be a plausible typo.
pub fn suggest<'c>(word: &str, candidates: impl IntoIterator<Item = &'c str>) -> Option<&'c str> {
    candidates
        .into_iter()
        .map(|c| (strsim::jaro_winkler(word, c), c))
        .filter(|(score, _)| *score >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, c)| c)
}

impl<'a> Walker<'a> {
    fn resolve(&self, mut schema: &'a J) -> &'a J {
        for _ in 0..16 {
            let Some(r) = schema.get("$ref").and_then(J::as_str) else {
                break;
            };
            let name = r.trim_start_matches("#/$defs/");
            match self.root.get("$defs").and_then(|d| d.get(name)) {
                Some(s) => schema = s,
                None => break,
            }
        }
        schema
    }

    fn index_keys(&mut self, schema: &'a J, path: &str, depth: usize) {
        if depth > 8 {
            return;
        }
        let schema = self.resolve(schema);
        if let Some(props) = schema.get("properties").and_then(J::as_object) {
            for (k, sub) in props {
                let p = join(path, k);
                self.key_index.push(p.clone());
                self.index_keys(sub, &p, depth + 1);
            }
        }
        for kw in ["oneOf", "anyOf"] {
            for b in schema.get(kw).and_then(J::as_array).into_iter().flatten() {
                self.index_keys(b, path, depth + 1);
            }
        }
    }

    /// A key path in another section whose last segment is (nearly) `key`: a key put in the wrong table.
    fn elsewhere(&self, key: &str) -> Option<String> {
        let exact = self
            .key_index
            .iter()
            .find(|k| k.rsplit('.').next() == Some(key));
        exact.cloned().or_else(|| {
            let leaves = self.key_index.iter().filter_map(|k| k.rsplit('.').next());
            let leaf = suggest(key, leaves)?;
            self.key_index
                .iter()
                .find(|k| k.rsplit('.').next() == Some(leaf))
                .cloned()
        })
    }

    fn problem(&mut self, path: &str, node: &Node, message: String) {
        self.problems.push(Problem {
            path: path.to_string(),
            origin: Some(node.origin.clone()),
            message,
        });
    }

    fn check(&mut self, schema: &'a J, node: &Node, path: &str) {
        let schema = self.resolve(schema);
        for kw in ["oneOf", "anyOf"] {
            if let Some(branches) = schema.get(kw).and_then(J::as_array) {
                self.check_union(branches, node, path);
                return;
            }
        }
        if !self.check_type(schema, node, path) {
            return;
        }
        match &node.value {
            Value::Table(entries) => self.check_table(schema, entries, node, path),
            Value::Array(items) => self.check_array(schema, items, node, path),
            Value::Int(_) | Value::Float(_) => self.check_range(schema, node, path),
            _ => {}
        }
        if let Some(c) = schema.get("const") {
            if node.value.to_json() != *c {
                self.problem(
                    path,
                    node,
                    format!("found {}, allowed: {c}", node.value.describe()),
                );
            }
        }
        if let Some(options) = schema.get("enum").and_then(J::as_array) {
            let found = node.value.to_json();
            if !options.contains(&found) {
                let names: Vec<&str> = options.iter().filter_map(J::as_str).collect();
                if names.len() == options.len() {
                    self.enum_problem(path, node, &names);
                } else {
                    let list: Vec<String> = options.iter().map(J::to_string).collect();
                    let message = format!("found {found}, allowed: {}", list.join(", "));
                    self.problem(path, node, message);
                }
            }
        }
    }

    fn enum_problem(&mut self, path: &str, node: &Node, allowed: &[&str]) {
        let list: Vec<String> = allowed.iter().map(|s| format!("{s:?}")).collect();
        let hint = match &node.value {
            Value::Str(s) => suggest(s, allowed.iter().copied())
                .map(|b| format!(" (did you mean {b:?}?)"))
                .unwrap_or_default(),
            _ => String::new(),
        };
        self.problem(
            path,
            node,
            format!(
                "found {}, allowed: {}{hint}",
                node.value.describe(),
                list.join(", ")
            ),
        );
    }

    fn check_union(&mut self, branches: &'a [J], node: &Node, path: &str) {
        // TOML has no null: an optional value that is present must match the non-null branch.
        let live: Vec<&'a J> = branches
            .iter()
            .map(|b| self.resolve(b))
            .filter(|b| b.get("type").and_then(J::as_str) != Some("null"))
            .collect();
        if let [only] = live.as_slice() {
            return self.check(only, node, path);
        }
        let owned: Vec<J> = live.iter().map(|b| (*b).clone()).collect();
        // A closed set of strings, each documented.
        if let Some(names) = consts_of(&owned) {
            if !matches!(&node.value, Value::Str(s) if names.contains(&s.as_str())) {
                self.enum_problem(path, node, &names);
            }
            return;
        }
        // A tagged union: the `name` key picks the variant, whose keys alone are then allowed.
        let tags: Option<Vec<&str>> = live
            .iter()
            .map(|b| b.pointer("/properties/name/const").and_then(J::as_str))
            .collect();
        if let Some(tags) = tags {
            let Value::Table(entries) = &node.value else {
                return self.problem(
                    path,
                    node,
                    format!("found {}, expected a table", node.value.describe()),
                );
            };
            let Some(tag) = entries.iter().find(|e| e.key == "name") else {
                let list: Vec<String> = tags.iter().map(|t| format!("{t:?}")).collect();
                return self.problem(
                    path,
                    node,
                    format!("missing key `name`: one of {}", list.join(", ")),
                );
            };
            let chosen = match &tag.node.value {
                Value::Str(s) => tags.iter().position(|t| t == s),
                _ => None,
            };
            match chosen {
                Some(i) => self.check(live[i], node, path),
                None => self.enum_problem(&join(path, "name"), &tag.node, &tags),
            }
            return;
        }
        // General case: the first branch that matches wins; otherwise report the closest branch, among
        // equals one of the node's type (a misspelt word is reported against the words, not numbers).
        let mut live = live;
        live.sort_by_key(|b| {
            let saved = std::mem::take(&mut self.problems);
            let same_type = self.check_type(b, node, path);
            self.problems = saved;
            !same_type
        });
        let mut best: Option<Vec<Problem>> = None;
        for b in &live {
            let saved = std::mem::take(&mut self.problems);
            self.check(b, node, path);
            let found = std::mem::replace(&mut self.problems, saved);
            if found.is_empty() {
                return;
            }
            if best.as_ref().is_none_or(|x| found.len() < x.len()) {
                best = Some(found);
            }
        }
        self.problems.extend(best.unwrap_or_default());
    }

    fn check_type(&mut self, schema: &J, node: &Node, path: &str) -> bool {
        let types: Vec<&str> = match schema.get("type") {
            Some(J::String(t)) => vec![t.as_str()],
            Some(J::Array(ts)) => ts.iter().filter_map(J::as_str).collect(),
            _ => return true,
        };
        let ok = types.iter().any(|t| {
            matches!(
                (*t, &node.value),
                ("object", Value::Table(_))
                    | ("array", Value::Array(_))
                    | ("string", Value::Str(_))
                    | ("integer", Value::Int(_))
                    | ("number", Value::Int(_) | Value::Float(_))
                    | ("boolean", Value::Bool(_))
            )
        });
        if !ok {
            let names: Vec<&str> = types
                .iter()
                .filter(|t| **t != "null")
                .map(|t| match *t {
                    "object" => "a table",
                    "array" => "an array",
                    "string" => "a string",
                    "integer" => "an integer",
                    "number" => "a number",
                    "boolean" => "a boolean (true or false)",
                    other => other,
                })
                .collect();
            self.problem(
                path,
                node,
                format!(
                    "found {}, expected {}",
                    node.value.describe(),
                    names.join(" or ")
                ),
            );
        }
        ok
    }

    fn check_table(
        &mut self,
        schema: &'a J,
        entries: &[super::tree::Entry],
        node: &Node,
        path: &str,
    ) {
        let props: Option<&'a Map<String, J>> = schema.get("properties").and_then(J::as_object);
        let closed = schema.get("additionalProperties") == Some(&J::Bool(false));
        for e in entries {
            let p = join(path, &e.key);
            match props.and_then(|p| p.get(&e.key)) {
                Some(sub) => self.check(sub, &e.node, &p),
                None if closed => {
                    let allowed: Vec<&str> = props
                        .into_iter()
                        .flat_map(|p| p.keys().map(String::as_str))
                        .collect();
                    let mut msg = format!("unknown key `{}`", e.key);
                    if let Some(s) = suggest(&e.key, allowed.iter().copied()) {
                        msg.push_str(&format!(" (did you mean `{s}`?)"));
                    } else if let Some(elsewhere) = self.elsewhere(&e.key) {
                        msg.push_str(&format!(" (did you mean `{elsewhere}`?)"));
                    }
                    msg.push_str(&format!("; allowed here: {}", allowed.join(", ")));
                    self.problems.push(Problem {
                        path: p,
                        origin: Some(e.key_origin.clone()),
                        message: msg,
                    });
                }
                None => {}
            }
        }
        for req in schema
            .get("required")
            .and_then(J::as_array)
            .into_iter()
            .flatten()
            .filter_map(J::as_str)
        {
            if !entries.iter().any(|e| e.key == req) {
                self.problem(path, node, format!("missing required key `{req}`"));
            }
        }
    }

    fn check_array(&mut self, schema: &'a J, items: &[Node], node: &Node, path: &str) {
        let n = items.len() as u64;
        let min = schema.get("minItems").and_then(J::as_u64);
        let max = schema.get("maxItems").and_then(J::as_u64);
        let wrong = min.is_some_and(|m| n < m) || max.is_some_and(|m| n > m);
        if wrong {
            let expected = match (min, max) {
                (Some(a), Some(b)) if a == b => format!("exactly {a}"),
                (Some(a), Some(b)) => format!("{a} to {b}"),
                (Some(a), None) => format!("at least {a}"),
                (None, Some(b)) => format!("at most {b}"),
                (None, None) => "another number of".into(),
            };
            self.problem(
                path,
                node,
                format!("found an array of {n} item(s), expected {expected} item(s)"),
            );
        }
        if let Some(item_schema) = schema.get("items") {
            for (i, item) in items.iter().enumerate() {
                self.check(item_schema, item, &format!("{path}[{i}]"));
            }
        }
    }

    fn check_range(&mut self, schema: &J, node: &Node, path: &str) {
        let x = match node.value {
            Value::Int(i) => i as f64,
            Value::Float(f) => f,
            _ => return,
        };
        if x.is_nan() {
            return self.problem(path, node, "found nan, expected a number".into());
        }
        let bound = |k: &str| schema.get(k).and_then(J::as_f64);
        let mut limits = Vec::new();
        let mut bad = false;
        if let Some(m) = bound("minimum") {
            limits.push(format!(">= {m}"));
            bad |= x < m;
        }
        if let Some(m) = bound("exclusiveMinimum") {
            limits.push(format!("> {m}"));
            bad |= x <= m;
        }
        if let Some(m) = bound("maximum") {
            limits.push(format!("<= {m}"));
            bad |= x > m;
        }
        if let Some(m) = bound("exclusiveMaximum") {
            limits.push(format!("< {m}"));
            bad |= x >= m;
        }
        if bad {
            self.problem(
                path,
                node,
                format!(
                    "found {}, allowed: a value {}",
                    node.value.describe(),
                    limits.join(" and ")
                ),
            );
        }
    }
}

/// A problem at `path`, pointing at the key where it was written, else at its nearest written table,
/// else at nothing (a default nobody wrote).
pub fn problem_at(doc: &Node, path: &str, message: String) -> Problem {
    let mut p = path;
    let origin = loop {
        if let Some(n) = find(doc, p) {
            break Some(n.origin.clone());
        }
        match p.rfind('.') {
            Some(i) => p = &p[..i],
            None => break None,
        }
    };
    Problem {
        path: path.to_string(),
        origin,
        message,
    }
}

/// A problem about several keys: at the `--set` that wrote one of them, if any (the change just made),
/// else where the first was written.
pub fn problem_at_keys(doc: &Node, keys: &[&str], message: String) -> Problem {
    let set = keys.iter().rev().find_map(|k| {
        find(doc, k)
            .filter(|n| matches!(n.origin, super::tree::Origin::Set(_)))
            .map(|n| n.origin.clone())
    });
    let mut p = problem_at(doc, keys[0], message);
    if let Some(o) = set {
        p.origin = Some(o);
    }
    p
}

/// Cross-field rules of the model, schedule and batch on a config whose shape is already valid (the
/// backends' rules are resolved with their plan, in `resolve`). `world` is the world size.
pub fn check_semantics(cfg: &Config, doc: &Node, world: usize) -> Vec<Problem> {
    let mut out = Vec::new();
    // Problems placed by a rule itself (see problem_at_keys), added after the others.
    let mut placed = Vec::new();
    let mut add = |path: &str, message: String| out.push(problem_at(doc, path, message));

    let m = &cfg.model;
    if !m.n_embd.is_multiple_of(m.n_heads) {
        add(
            "model.n_heads",
            format!(
                "n_embd = {} is not divisible by n_heads = {}; pick n_heads among the divisors of n_embd",
                m.n_embd, m.n_heads
            ),
        );
    }
    let t = &cfg.train;
    schedule_rules(doc, t, &mut add, &mut placed);
    placed.extend(t.membership.problems(doc, world, t.n_steps));
    optim_rules(t, &mut add);
    worker_data_rules(cfg, &mut add);
    if let Some(why) = cfg.log.run_name.as_deref().and_then(run_name_problem) {
        add("log.run_name", why);
    }

    // Batch arithmetic: every batch (global, and the ramp-up's) = local x world x accumulation.
    let local = t.local_batch(world);
    let per_step = local.saturating_mul(world);
    let ramp = t.rampup_batch_size;
    if t.local_batch_size.is_none() && local == 0 {
        let (key, what) = match ramp {
            None => (
                "train.global_batch_size",
                format!("global_batch_size = {}", t.global_batch_size),
            ),
            Some([start, inc, _]) => (
                "train.rampup_batch_size",
                format!(
                    "the ramp-up's start {start} and increment {inc} have no common divisor that"
                ),
            ),
        };
        add(
            key,
            format!(
                "{what} is not divisible by the world size {world}; make it so, or set train.local_batch_size"
            ),
        );
    } else if local == 0 || per_step == 0 || !t.global_batch_size.is_multiple_of(per_step) {
        add(
            "train.local_batch_size",
            format!(
                "global_batch_size = {} is not divisible by local_batch_size ({local}) x world size ({world}) = {per_step}; \
                 gradient accumulation steps must be a whole number: {}",
                t.global_batch_size,
                batch_fix(t.global_batch_size, local, world)
            ),
        );
    } else if let Some([start, inc, _]) =
        ramp.filter(|[s, i, _]| *s % per_step as u64 != 0 || *i % per_step as u64 != 0)
    {
        add(
            "train.rampup_batch_size",
            format!(
                "the ramp-up's start {start} and increment {inc} must be multiples of local_batch_size ({local}) x \
                 world size ({world}) = {per_step}: each step's batch is whole micro-steps of every worker"
            ),
        );
    }

    out.extend(placed);
    out
}

/// The problem of a warm-up of `w` steps that does not end before the decay's `end`: placed at the
/// warm-up's key, naming the fix of either side (a --set of either key is the change just made).
fn warmup_too_long(doc: &Node, t: &super::TrainConfig, w: u64, end: u64) -> Problem {
    let (c, n) = (&t.lr_schedule, t.n_steps);
    let (what, fix) = match c.decay_steps.filter(|_| c.name != ScheduleName::Constant) {
        Some(d) => (
            format!("train.lr_schedule.decay_steps = {d}"),
            format!("try --set train.lr_schedule.decay_steps={}", w + 1),
        ),
        None => (
            format!("train.n_steps = {n}"),
            format!("try --set train.n_steps={}", w + 1),
        ),
    };
    let by_fraction = c.warmup_steps.is_none() && c.warmup_fraction.is_some();
    let (warmup_key, warmup, shorter) = match by_fraction {
        true => (
            "train.lr_schedule.warmup_fraction",
            format!(
                "warmup_fraction = {} ({w} steps)",
                c.warmup_fraction.unwrap_or(0.0)
            ),
            "warmup_fraction=0.1".to_string(),
        ),
        false => (
            "train.lr_schedule.warmup_steps",
            format!("warmup_steps = {w}"),
            format!("warmup_steps={}", end.saturating_sub(1) / 10),
        ),
    };
    let mut p = problem_at_keys(
        doc,
        &[warmup_key, "train.lr_schedule.decay_steps", "train.n_steps"],
        format!("{warmup} must be smaller than {what}; {fix} or --set train.lr_schedule.{shorter}"),
    );
    p.path = warmup_key.into();
    p
}

/// Non-IID data: a blend row per worker names a weight for every source, and some data; membership
/// keeps every worker on the whole blend.
fn worker_data_rules(cfg: &Config, add: &mut impl FnMut(&str, String)) {
    let sources = cfg.train_data.len().max(1);
    if let super::WorkerData::Blend { weights } = &cfg.worker_data {
        let bad = weights.iter().enumerate().find_map(|(r, row)| {
            let why = if row.len() != sources {
                format!(
                    "has {} weights, train_data has {sources} source(s)",
                    row.len()
                )
            } else if row.iter().any(|w| !(w.is_finite() && *w >= 0.0)) {
                "has a weight that is negative or not finite".to_string()
            } else if row.iter().all(|&w| w == 0.0) {
                "gives every source weight 0".to_string()
            } else {
                return None;
            };
            Some(format!(
                "row {r} {why}; give each row one weight >= 0 per source, not all 0"
            ))
        });
        match (weights.is_empty(), bad) {
            (true, _) => add(
                "worker_data.weights",
                "give at least one row of weights".into(),
            ),
            (_, Some(why)) => add("worker_data.weights", why),
            _ => {}
        }
    }
    if cfg.worker_data != super::WorkerData::Shared && !cfg.train.membership.is_empty() {
        add(
            "worker_data.name",
            format!(
                "worker_data = {:?} with [train.membership] is not supported: a worker that is away \
                 leaves its data unread; use \"shared\"",
                cfg.worker_data.name()
            ),
        );
    }
}

/// Why `name` cannot name a run directory under `log_dir`, if it cannot: the run directory (and its lock,
/// checkpoints and W&B run) must stay inside `log_dir`.
fn run_name_problem(name: &str) -> Option<String> {
    use std::path::Component;
    let path = std::path::Path::new(name);
    let why = if name.trim().is_empty() {
        "is empty: the run would write into log_dir itself"
    } else if path.is_absolute() {
        "is an absolute path, which would replace log_dir"
    } else if path
        .components()
        .any(|c| !matches!(c, Component::Normal(_)))
    {
        "has a `..` or `.` part, where the run's directory must be a plain path under log_dir"
    } else {
        return None;
    };
    Some(format!(
        "run_name = {name:?} {why}; give a name (or names joined by `/`) under log_dir, e.g. \"my-run\""
    ))
}

/// The learning-rate schedule's rules: one way to give the warm-up, keys that belong to other schedules,
/// and a warm-up that ends before the decay does.
fn schedule_rules(
    doc: &Node,
    t: &super::TrainConfig,
    add: &mut dyn FnMut(&str, String),
    placed: &mut Vec<Problem>,
) {
    let c = &t.lr_schedule;
    let name = c.name;
    if c.warmup_steps.is_some() && c.warmup_fraction.is_some() {
        add(
            "train.lr_schedule.warmup_fraction",
            "give the warm-up as warmup_steps or as warmup_fraction, not both".into(),
        );
    }
    let owned: [(&str, bool, &[ScheduleName]); 3] = [
        (
            "decay_steps",
            c.decay_steps.is_some(),
            &[
                ScheduleName::Cosine,
                ScheduleName::Linear,
                ScheduleName::Wsd,
            ],
        ),
        (
            "decay_fraction",
            c.decay_fraction.is_some(),
            &[ScheduleName::Wsd],
        ),
        ("decay_style", c.decay_style.is_some(), &[ScheduleName::Wsd]),
    ];
    for (key, _, names) in owned.iter().filter(|(_, given, _)| *given) {
        if !names.contains(&name) {
            let names: Vec<String> = names.iter().map(|n| format!("{:?}", n.name())).collect();
            add(
                &format!("train.lr_schedule.{key}"),
                format!(
                    "`{key}` belongs to name = {}, but the schedule is {:?}",
                    names.join(" or "),
                    name.name()
                ),
            );
        }
    }
    let (w, n) = (c.warmup(t.n_steps), t.n_steps);
    let end = match name {
        ScheduleName::Constant => n,
        _ => c.decay_end(n),
    };
    if w >= end {
        placed.push(warmup_too_long(doc, t, w, end));
    } else if name == ScheduleName::Wsd && c.wsd_decay_start(n) < w {
        add(
            "train.lr_schedule.decay_fraction",
            format!(
                "wsd: the final decay would start at step {}, inside the warm-up of {w} steps; lower \
                 decay_fraction or the warm-up",
                c.wsd_decay_start(n)
            ),
        );
    }
    if c.eta_min > c.lr {
        add(
            "train.lr_schedule.eta_min",
            format!("eta_min = {} is above the peak lr = {}", c.eta_min, c.lr),
        );
    }
}

/// The optimizer's own rules.
fn optim_rules(t: &super::TrainConfig, add: &mut impl FnMut(&str, String)) {
    if let super::OptimConfig::Sgd(o) = &t.optim {
        if o.nesterov && o.momentum == 0.0 {
            add(
                "train.optim.nesterov",
                "nesterov = true needs momentum > 0 (as torch.optim.SGD requires)".into(),
            );
        }
    }
    if matches!(t.optim, super::OptimConfig::Muon(_)) && t.device == super::Device::Cuda {
        add(
            "train.optim.name",
            "Muon runs on the CPU only (its GPU path is not built): set train.device = \"cpu\", or \
             train.optim.name = \"adamw\" on GPUs"
                .into(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::batch_fix;

    /// A batch that does not divide gets the local batch sizes and world sizes that would.
    #[test]
    fn a_batch_that_does_not_divide_gets_the_sizes_that_would() {
        assert_eq!(
            batch_fix(480, 30, 32),
            "set train.local_batch_size = 15 (--set train.local_batch_size=15), or run 1, 2, 4, 8, 16 workers"
        );
        assert_eq!(
            batch_fix(12, 5, 4),
            "set train.local_batch_size = 3 (--set train.local_batch_size=3)"
        );
        assert_eq!(batch_fix(7, 2, 3), "change train.global_batch_size");
    }
}
