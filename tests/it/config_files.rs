//! The committed configs: seed files load unchanged with the reference values, every example validates,
//! and the committed JSON Schema is the one the code generates.

use std::path::{Path, PathBuf};

use nanodist::config::{self, Backend, OptimConfig, Topology};
use nanodist::plan::LaunchEnv;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn load(path: &Path, workers: usize, set: &[&str]) -> nanodist::plan::Loaded {
    let launch = LaunchEnv {
        workers_flag: Some(workers),
        ..LaunchEnv::default()
    };
    let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
    nanodist::plan::load(path, &set, &launch).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn schema_file_is_fresh() {
    let committed = std::fs::read_to_string(root().join("schemas/config.schema.json")).unwrap();
    let generated = serde_json::to_string_pretty(&config::schema()).unwrap() + "\n";
    assert!(
        committed == generated,
        "schemas/config.schema.json is stale: run `cargo run -- schema --output schemas/config.schema.json`"
    );
}

#[test]
fn cluster_schema_file_is_fresh_and_every_builtin_profile_points_at_it() {
    let committed = std::fs::read_to_string(root().join("schemas/cluster.schema.json")).unwrap();
    let generated =
        serde_json::to_string_pretty(&nanodist::predict::profile::schema()).unwrap() + "\n";
    assert!(
        committed == generated,
        "schemas/cluster.schema.json is stale: run `cargo run -- schema --cluster --output schemas/cluster.schema.json`"
    );
    let mut names = Vec::new();
    for entry in std::fs::read_dir(root().join("config/clusters")).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.starts_with("#:schema ../../schemas/cluster.schema.json\n"),
            "{} must start with the #:schema line",
            path.display()
        );
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        // The compiled-in copy is the file.
        let builtin = nanodist::predict::profile::BUILTIN
            .iter()
            .find(|(n, _)| *n == name)
            .unwrap_or_else(|| panic!("{name} is not a built-in profile"));
        assert_eq!(builtin.1, text);
        names.push(name);
    }
    names.sort();
    assert_eq!(
        names,
        [
            "a100-ib100",
            "a40-25gbe",
            "h100-ib400",
            "local",
            "t4-ib",
            "wan-1g"
        ]
    );
}

#[test]
fn every_example_config_validates_and_points_at_the_schema() {
    let mut n = 0;
    for entry in std::fs::read_dir(root().join("config")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let text = std::fs::read_to_string(&path).unwrap();
            assert!(
                text.starts_with("#:schema ../schemas/config.schema.json\n"),
                "{} must start with the #:schema line",
                path.display()
            );
            // Launch-independent validation: one worker.
            load(&path, 1, &[]);
            n += 1;
        }
    }
    assert!(n >= 2);
}

#[test]
fn allreduce_seed_loads_with_reference_values() {
    let l = load(&root().join("config/gpt2-small.toml"), 16, &[]);
    let c = &l.config;
    assert_eq!(c.train.backend, Backend::PytorchDdp);
    assert_eq!(c.train.local_batch_size, Some(30));
    assert_eq!(c.train.global_batch_size, 480);
    assert_eq!(l.plan.accum_steps, 1);
    assert_eq!(l.plan.tokens_per_step, 480 * 1024);
    let OptimConfig::AdamW(o) = &c.train.optim else {
        panic!("adamw expected")
    };
    assert_eq!(o.betas, [0.9, 0.95]);
    assert_eq!(
        (c.model.n_layers, c.model.n_embd, c.model.vocab_size),
        (12, 768, 50304)
    );
    assert!(l.notes.iter().any(|n| n.contains("compile")));
    // 4 workers: 480 / (30 x 4) = 4 accumulation steps.
    assert_eq!(
        load(&root().join("config/gpt2-small.toml"), 4, &[])
            .plan
            .accum_steps,
        4
    );
}

#[test]
fn decentralized_seed_loads_with_reference_values() {
    let path = root().join("config/decent-gpt2-small.toml");
    let l = load(&path, 16, &["train.ranks_per_node=8"]);
    let c = &l.config;
    assert_eq!(c.train.backend, Backend::DecentDp);
    assert_eq!(c.train.topology, Some(Topology::AlternatingExpRing));
    let OptimConfig::AccumAdamW(o) = &c.train.optim else {
        panic!("accumadamw expected")
    };
    assert_eq!((o.betas, o.accum_steps, o.eps), ([0.9, 0.98], 8, 1e-8));
    assert_eq!((l.plan.local_batch_size, l.plan.accum_steps), (30, 1));
    for topo in ["complete", "ring", "exp", "one-peer-exp"] {
        load(&path, 4, &[&format!("train.topology={topo}")]);
    }
    // Decent-DP overlaps every gossip with the next step's compute; the seed, which has no overlap key,
    // runs that way unchanged, and `train.overlap = false` is synchronous gossip.
    let overlap = |l: &nanodist::plan::Loaded| match &l.plan.sync {
        nanodist::plan::SyncPlan::Gossip { overlap, .. } => *overlap,
        other => panic!("gossip expected, got {other:?}"),
    };
    assert!(overlap(&l), "{:?}", l.plan.sync);
    assert!(l
        .plan
        .sync
        .describe()
        .contains("overlapped with the next step"));
    let sync = load(
        &path,
        16,
        &["train.ranks_per_node=8", "train.overlap=false"],
    );
    assert!(!overlap(&sync) && sync.plan.sync.describe().contains("synchronous"));
}

/// Optional extra check: the committed copies are the shared fixtures plus the schema line.
#[test]
fn committed_seeds_equal_the_shared_fixtures() {
    let shared = root().join("../shared/fixtures/seed-configs");
    if !shared.is_dir() {
        eprintln!("skipped: {} not present", shared.display());
        return;
    }
    for name in ["gpt2-small.toml", "decent-gpt2-small.toml"] {
        let fixture = std::fs::read_to_string(shared.join(name)).unwrap();
        let ours = std::fs::read_to_string(root().join("config").join(name)).unwrap();
        assert_eq!(
            ours.strip_prefix("#:schema ../schemas/config.schema.json\n"),
            Some(fixture.as_str())
        );
        load(&shared.join(name), 16, &["train.ranks_per_node=8"]);
    }
}

#[test]
fn resolved_config_round_trips() {
    let l = load(&root().join("config/decent-gpt2-small.toml"), 1, &[]);
    let text = l.config.to_toml();
    let (again, _) = config::parse(&text, &[]).unwrap_or_else(|e| panic!("{e:?}\n{text}"));
    assert_eq!(again, l.config);
}
