//! Bad configs: each mistake is reported with its key path and line, all at once, never a panic.

use std::path::Path;

use nanodist::config::ConfigError;
use nanodist::plan::LaunchEnv;
use proptest::prelude::*;

fn launch(workers: usize) -> LaunchEnv {
    LaunchEnv {
        workers_flag: Some(workers),
        ..LaunchEnv::default()
    }
}

fn errors(src: &str, set: &[&str], workers: usize) -> ConfigError {
    let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
    match nanodist::plan::load_str(Path::new("bad.toml"), src, &set, &launch(workers)) {
        Ok(_) => panic!("config was accepted:\n{src}\n--set {set:?}"),
        Err(e) => e,
    }
}

/// (what is wrong, document, --set overrides, workers, key path, location, words the message must contain)
type Case = (
    &'static str,
    &'static str,
    &'static [&'static str],
    usize,
    &'static str,
    &'static str,
    &'static [&'static str],
);

const CASES: &[Case] = &[
    (
        "diloco fragments that do not divide sync_every",
        "[train]\nbackend = 'diloco'\n[train.diloco]\nsync_every = 10\nfragments = 3\n",
        &[],
        1,
        "train.diloco.fragments",
        "bad.toml:5:13",
        &["must divide sync_every = 10"],
    ),
    (
        "diloco fragment delay as long as a period",
        "[train]\nbackend = 'diloco'\n[train.diloco]\nsync_every = 10\nfragments = 2\nfragment_delay = 5\n",
        &[],
        1,
        "train.diloco.fragment_delay",
        "bad.toml:6:18",
        &["smaller than sync_every / fragments = 5"],
    ),
    (
        "diloco compression with fragments",
        "[train]\nbackend = 'diloco'\n[train.diloco]\nsync_every = 10\nfragments = 2\n[train.compression]\nname = 'topk'\n",
        &[],
        1,
        "train.compression",
        "bad.toml:6:1",
        &["fragments = 1"],
    ),
    (
        "diloco settings under another backend",
        "[train.diloco]\nsync_every = 10\n",
        &[],
        1,
        "train.diloco",
        "bad.toml:1:1",
        &["belongs to backend = \"diloco\"", "\"pytorchddp\""],
    ),
    (
        "demo with adamw",
        "[train]\nbackend = 'demo'\n[train.optim]\nname = 'adamw'\n",
        &[],
        1,
        "train.optim.name",
        "bad.toml:4:8",
        &["train.optim.name = \"sgd\"", "\"adamw\""],
    ),
    (
        "demo with sgd momentum",
        "[train]\nbackend = 'demo'\n[train.optim]\nname = 'sgd'\nmomentum = 0.9\n",
        &[],
        1,
        "train.optim.momentum",
        "bad.toml:5:12",
        &["train.demo.decay"],
    ),
    (
        "sgd nesterov without momentum",
        "[train.optim]\nname = 'sgd'\nnesterov = true\n",
        &[],
        1,
        "train.optim.nesterov",
        "bad.toml:3:12",
        &["momentum > 0"],
    ),
    (
        "muon on a gpu",
        "[train]\ndevice = 'cuda'\n[train.optim]\nname = 'muon'\n",
        &[],
        1,
        "train.optim.name",
        "bad.toml:4:8",
        &["CPU only", "train.device = \"cpu\""],
    ),
    (
        "muon momentum of one",
        "[train.optim]\nname = 'muon'\nmomentum = 1.0\n",
        &[],
        1,
        "train.optim.momentum",
        "bad.toml:3:12",
        &["1"],
    ),
    (
        "sparseloco bits outside 2, 4, 8, 32",
        "[train]\nbackend = 'diloco'\n[train.compression]\nname = 'sparseloco'\nbits = 3\n",
        &[],
        1,
        "train.compression.bits",
        "bad.toml:5:8",
        &["found 3", "2, 4, 8, 32"],
    ),
    (
        "sparseloco under data parallel",
        "[train.compression]\nname = 'sparseloco'\n",
        &[],
        1,
        "train.compression.name",
        "bad.toml:2:8",
        &["backend = \"diloco\"", "\"topk\""],
    ),
    (
        "eager diloco with fragments",
        "[train]\nbackend = 'diloco'\n[train.diloco]\nsync_every = 4\nfragments = 2\neager = true\n",
        &[],
        1,
        "train.diloco.eager",
        "bad.toml:6:9",
        &["fragments = 1"],
    ),
    (
        "worker blend row with a weight per source missing",
        "[worker_data]\nname = 'blend'\nweights = [[1.0, 2.0]]\n",
        &[],
        1,
        "worker_data.weights",
        "bad.toml:3:11",
        &["row 0 has 2 weights", "1 source"],
    ),
    (
        "hierarchical diloco groups that do not divide the world",
        "[train]\nbackend = 'diloco'\nworkers = 4\n[train.diloco]\ngroup_size = 3\n",
        &[],
        1,
        "train.diloco.group_size",
        "bad.toml:5:14",
        &["must divide the world size"],
    ),
    (
        "radius correction without adamw",
        "[train.optim]\nname = 'accumadamw'\n[train.compression]\nname = 'radius'\ncorrection = true\n",
        &[],
        1,
        "train.compression.correction",
        "bad.toml:5:14",
        &["train.optim.name = \"adamw\"", "accumadamw"],
    ),
    (
        "powersgd single all-reduce without warm start",
        "[train.compression]\nname = 'powersgd'\nsingle_allreduce = true\nwarm_start = false\n",
        &[],
        1,
        "train.compression.single_allreduce",
        "bad.toml:3:20",
        &["warm_start = true"],
    ),
    (
        "alternating-exp-ring on one node, with a hint that fits",
        "[train]\nbackend = 'decentdp'\ntopology = 'alternating-exp-ring'\n",
        &[],
        4,
        "train.topology",
        "bad.toml:3:12",
        &["1 node(s)", "--set train.ranks_per_node=2"],
    ),
    (
        "alternating-exp-ring on an odd world",
        "[train]\nbackend = 'decentdp'\ntopology = 'alternating-exp-ring'\nglobal_batch_size = 6\n",
        &[],
        3,
        "train.topology",
        "bad.toml:3:12",
        &["odd world size has no such layout"],
    ),
    (
        "typo in top-level key",
        "log_dri = 'x'\n",
        &[],
        1,
        "log_dri",
        "bad.toml:1:1",
        &["did you mean `log_dir`"],
    ),
    (
        "typo in section name",
        "[trian]\nseed = 1\n",
        &[],
        1,
        "trian",
        "bad.toml:1:2",
        &["did you mean `train`"],
    ),
    (
        "typo in train key",
        "[train]\nn_step = 10\n",
        &[],
        1,
        "train.n_step",
        "bad.toml:2:1",
        &["did you mean `n_steps`"],
    ),
    (
        "key in the wrong section",
        "[train]\nlr = 0.1\n",
        &[],
        1,
        "train.lr",
        "bad.toml:2:1",
        &["train.lr_schedule.lr"],
    ),
    (
        "typo in optimizer key",
        "[train.optim]\nname = 'adamw'\nweight_decy = 0.1\n",
        &[],
        1,
        "train.optim.weight_decy",
        "bad.toml:3:1",
        &["did you mean `weight_decay`"],
    ),
    (
        "variant field under another variant",
        "[train.optim]\nname = 'adamw'\naccum_steps = 8\n",
        &[],
        1,
        "train.optim.accum_steps",
        "bad.toml:3:1",
        &["unknown key", "betas"],
    ),
    (
        "unknown optimizer",
        "[train.optim]\nname = 'adam'\n",
        &[],
        1,
        "train.optim.name",
        "bad.toml:2:8",
        &["\"adamw\"", "\"accumadamw\""],
    ),
    (
        "optimizer without name",
        "[train.optim]\nbetas = [0.9, 0.95]\n",
        &[],
        1,
        "train.optim",
        "bad.toml:1:1",
        &["missing key `name`"],
    ),
    (
        "unknown schedule",
        "[train.lr_schedule]\nname = 'step'\n",
        &[],
        1,
        "train.lr_schedule.name",
        "bad.toml:2:8",
        &["\"cosine\"", "\"wsd\""],
    ),
    (
        "unknown backend",
        "[train]\nbackend = 'ddp'\n",
        &[],
        1,
        "train.backend",
        "bad.toml:2:11",
        &["\"pytorchddp\"", "\"decentdp\""],
    ),
    (
        "unknown topology with suggestion",
        "[train]\nbackend = 'decentdp'\ntopology = 'rign'\n",
        &[],
        1,
        "train.topology",
        "bad.toml:3:12",
        &["did you mean \"ring\""],
    ),
    (
        "topology under allreduce",
        "[train]\nbackend = 'pytorchddp'\ntopology = 'ring'\n",
        &[],
        1,
        "train.topology",
        "bad.toml:3:12",
        &["belongs to backend = \"decentdp\""],
    ),
    (
        "bucket size under gossip",
        "[train]\nbackend = 'decentdp'\nbucket_size_mb = 25\n",
        &[],
        1,
        "train.bucket_size_mb",
        "bad.toml:3:18",
        &["belongs to backend = \"pytorchddp\""],
    ),
    (
        "compression under sparta",
        "[train]\nbackend = 'sparta'\n[train.compression]\nname = 'topk'\n",
        &[],
        1,
        "train.compression",
        "bad.toml:3:1",
        &["belongs to backend", "\"decentdp\""],
    ),
    (
        "unknown compressor",
        "[train.compression]\nname = 'qsgdd'\n",
        &[],
        1,
        "train.compression.name",
        "bad.toml:2:8",
        &["\"topk\"", "\"radius\"", "\"powersgd\"", "did you mean \"qsgd\"?"],
    ),
    (
        "gossip compressor reducing gradients",
        "[train.compression]\nname = 'qsgd'\n",
        &[],
        1,
        "train.compression.name",
        "bad.toml:2:8",
        &["compresses gossip messages", "\"topk\", \"radius\" and \"powersgd\""],
    ),
    (
        "consensus step without gossip",
        "[train.compression]\nname = 'topk'\nconsensus_step = 0.5\n",
        &[],
        1,
        "train.compression.consensus_step",
        "bad.toml:3:18",
        &["CHOCO", "\"decentdp\""],
    ),
    (
        "error feedback in compressed gossip",
        "[train]\nbackend = 'decentdp'\n[train.compression]\nname = 'topk'\nerror_feedback = true\n",
        &[],
        2,
        "train.compression.error_feedback",
        "bad.toml:5:18",
        &["does not apply to compressed gossip", "public copies"],
    ),
    (
        "gradient reducer in gossip",
        "[train]\nbackend = 'decentdp'\n[train.compression]\nname = 'powersgd'\n",
        &[],
        2,
        "train.compression.name",
        "bad.toml:4:8",
        &["reduces gradients", "\"randomk\", \"qsgd\" or \"sign\""],
    ),
    (
        "consensus step out of range",
        "[train]\nbackend = 'decentdp'\n[train.compression]\nname = 'sign'\nconsensus_step = 1.5\n",
        &[],
        2,
        "train.compression.consensus_step",
        "bad.toml:5:18",
        &["1.5"],
    ),
    (
        "misspelt auto consensus step",
        "[train]\nbackend = 'decentdp'\n[train.compression]\nname = 'randomk'\nconsensus_step = 'autoo'\n",
        &[],
        2,
        "train.compression.consensus_step",
        "bad.toml:5:18",
        &["did you mean \"auto\"?"],
    ),
    (
        "zero qsgd levels",
        "[train]\nbackend = 'decentdp'\n[train.compression]\nname = 'qsgd'\nlevels = 0\n",
        &[],
        2,
        "train.compression.levels",
        "bad.toml:5:10",
        &[">= 1"],
    ),
    (
        "powersgd key under topk",
        "[train.compression]\nname = 'topk'\nrank = 4\n",
        &[],
        1,
        "train.compression.rank",
        "bad.toml:3:1",
        &["unknown key", "density"],
    ),
    (
        "density out of range",
        "[train.compression]\nname = 'topk'\ndensity = 1.5\n",
        &[],
        1,
        "train.compression.density",
        "bad.toml:3:11",
        &["1.5", "<= 1"],
    ),
    (
        "zero density",
        "[train.compression]\nname = 'radius'\ndensity = 0.0\n",
        &[],
        1,
        "train.compression.density",
        "bad.toml:3:11",
        &["> 0"],
    ),
    (
        "string for integer",
        "[train]\nn_steps = 'ten'\n",
        &[],
        1,
        "train.n_steps",
        "bad.toml:2:11",
        &["string \"ten\"", "an integer"],
    ),
    (
        "float for integer",
        "[model]\nn_layers = 2.5\n",
        &[],
        1,
        "model.n_layers",
        "bad.toml:2:12",
        &["float 2.5", "an integer"],
    ),
    (
        "negative integer",
        "[train]\nseed = -1\n",
        &[],
        1,
        "train.seed",
        "bad.toml:2:8",
        &["-1", ">= 0"],
    ),
    (
        "zero layers",
        "[model]\nn_layers = 0\n",
        &[],
        1,
        "model.n_layers",
        "bad.toml:2:12",
        &[">= 1"],
    ),
    (
        "string for boolean",
        "[model]\nbias = 'yes'\n",
        &[],
        1,
        "model.bias",
        "bad.toml:2:8",
        &["a boolean"],
    ),
    (
        "beta out of range",
        "[train.optim]\nname = 'adamw'\nbetas = [0.9, 1.5]\n",
        &[],
        1,
        "train.optim.betas[1]",
        "bad.toml:3:15",
        &["1.5", "< 1"],
    ),
    (
        "too many betas",
        "[train.optim]\nname = 'adamw'\nbetas = [0.9, 0.95, 0.99]\n",
        &[],
        1,
        "train.optim.betas",
        "bad.toml:3:9",
        &["exactly 2"],
    ),
    (
        "betas not an array",
        "[train.optim]\nname = 'adamw'\nbetas = 0.9\n",
        &[],
        1,
        "train.optim.betas",
        "bad.toml:3:9",
        &["an array"],
    ),
    (
        "negative learning rate",
        "[train.lr_schedule]\nname = 'cosine'\nlr = -0.1\n",
        &[],
        1,
        "train.lr_schedule.lr",
        "bad.toml:3:6",
        &["> 0"],
    ),
    (
        "dropout above one",
        "[model]\ndropout = 1.2\n",
        &[],
        1,
        "model.dropout",
        "bad.toml:2:11",
        &["<= 1"],
    ),
    (
        "section given as a value",
        "train = 3\n",
        &[],
        1,
        "train",
        "bad.toml:1:9",
        &["a table"],
    ),
    (
        "heads do not divide width",
        "[model]\nn_embd = 100\nn_heads = 3\n",
        &[],
        1,
        "model.n_heads",
        "bad.toml:3:11",
        &["not divisible"],
    ),
    (
        "warmup not below steps",
        "[train]\nn_steps = 100\n[train.lr_schedule]\nname = 'cosine'\nwarmup_steps = 100\n",
        &[],
        1,
        "train.lr_schedule.warmup_steps",
        "bad.toml:5:16",
        &["smaller than train.n_steps = 100"],
    ),
    (
        "warmup not below decay_steps",
        "[train]\nn_steps = 100\n[train.lr_schedule]\nname = 'linear'\nwarmup_steps = 50\ndecay_steps = 40\n",
        &[],
        1,
        "train.lr_schedule.warmup_steps",
        "bad.toml:5:16",
        &["warmup_steps = 50 must be smaller than train.lr_schedule.decay_steps = 40"],
    ),
    (
        "warmup as a fraction that reaches the end",
        "[train]\nn_steps = 100\n[train.lr_schedule]\nwarmup_fraction = 1.0\n",
        &[],
        1,
        "train.lr_schedule.warmup_fraction",
        "bad.toml:4:19",
        &["warmup_fraction = 1 (100 steps) must be smaller than train.n_steps = 100"],
    ),
    (
        "warmup given twice",
        "[train]\nn_steps = 100\n[train.lr_schedule]\nwarmup_steps = 5\nwarmup_fraction = 0.1\n",
        &[],
        1,
        "train.lr_schedule.warmup_fraction",
        "bad.toml:5:19",
        &["warmup_steps or as warmup_fraction, not both"],
    ),
    (
        "a wsd key under cosine",
        "[train]\nn_steps = 100\n[train.lr_schedule]\nwarmup_steps = 5\ndecay_fraction = 0.2\n",
        &[],
        1,
        "train.lr_schedule.decay_fraction",
        "bad.toml:5:18",
        &["`decay_fraction` belongs to name = \"wsd\", but the schedule is \"cosine\""],
    ),
    (
        "decay_steps for a constant schedule",
        "[train]\nn_steps = 100\n[train.lr_schedule]\nname = 'constant'\nwarmup_steps = 5\ndecay_steps = 50\n",
        &[],
        1,
        "train.lr_schedule.decay_steps",
        "bad.toml:6:15",
        &["belongs to name = \"cosine\" or \"linear\" or \"wsd\""],
    ),
    (
        "powersgd start given twice",
        "[train.compression]\nname = 'powersgd'\nstart_iter = 10\nstart_fraction = 0.1\n",
        &[],
        1,
        "train.compression.start_fraction",
        "bad.toml:4:18",
        &["start_iter or as start_fraction, not both"],
    ),
    (
        "steps and samples both given",
        "[train]\nn_steps = 100\ntrain_samples = 800\n",
        &[],
        1,
        "train.train_samples",
        "bad.toml:3:17",
        &["give train.n_steps or train.train_samples, not both"],
    ),
    (
        "ramp-up start at the full batch",
        "[train]\nglobal_batch_size = 16\nrampup_batch_size = [16, 4, 100]\n",
        &[],
        1,
        "train.rampup_batch_size",
        "bad.toml:3:21",
        &["starts at 16 sequences", "not below global_batch_size = 16", "--rampup-batch-size"],
    ),
    (
        "ramp-up increment that misses the full batch",
        "[train]\nglobal_batch_size = 16\nrampup_batch_size = [4, 5, 100]\n",
        &[],
        1,
        "train.rampup_batch_size",
        "bad.toml:3:21",
        &["16 - 4 = 12 is not a multiple of the increment 5"],
    ),
    (
        "ramp-up batch that is not whole micro-steps",
        "[train]\nglobal_batch_size = 16\nlocal_batch_size = 2\nrampup_batch_size = [4, 4, 100]\n",
        &[],
        4,
        "train.rampup_batch_size",
        "bad.toml:4:21",
        &["must be multiples of local_batch_size (2) x world size (4) = 8"],
    ),
    (
        "ramp-up the workers cannot share",
        "[train]\nglobal_batch_size = 16\nrampup_batch_size = [6, 2, 100]\n",
        &[],
        4,
        "train.rampup_batch_size",
        "bad.toml:3:21",
        &["start 6 and increment 2", "world size 4", "train.local_batch_size"],
    ),
    (
        "warm-up in steps and in samples",
        "[train.lr_schedule]\nwarmup_steps = 10\nlr_warmup_samples = 800\n",
        &[],
        1,
        "train.lr_schedule.lr_warmup_samples",
        "bad.toml:3:21",
        &["give train.lr_schedule.warmup_steps or train.lr_schedule.lr_warmup_samples, not both"],
    ),
    (
        "wsd decay inside the warm-up",
        "[train]\nn_steps = 100\n[train.lr_schedule]\nname = 'wsd'\nwarmup_steps = 50\ndecay_fraction = 0.6\n",
        &[],
        1,
        "train.lr_schedule.decay_fraction",
        "bad.toml:6:18",
        &["would start at step 40, inside the warm-up of 50 steps"],
    ),
    (
        "eta_min above lr",
        "[train.lr_schedule]\nname = 'cosine'\nlr = 1e-4\neta_min = 1e-3\n",
        &[],
        1,
        "train.lr_schedule.eta_min",
        "bad.toml:4:11",
        &["above the peak"],
    ),
    (
        "global batch not divisible by local x world",
        "[train]\nglobal_batch_size = 480\nlocal_batch_size = 7\n",
        &[],
        4,
        "train.local_batch_size",
        "bad.toml:3:20",
        &["480", "(7) x world size (4) = 28"],
    ),
    (
        "global batch not divisible by world",
        "[train]\nglobal_batch_size = 10\n",
        &[],
        4,
        "train.global_batch_size",
        "bad.toml:2:21",
        &["not divisible by the world size 4"],
    ),
    (
        "ring with odd world",
        "[train]\nglobal_batch_size = 12\nbackend = 'decentdp'\ntopology = 'ring'\n",
        &[],
        3,
        "train.topology",
        "bad.toml:4:12",
        &["even world size, found 3"],
    ),
    (
        "exp with non power of two",
        "[train]\nglobal_batch_size = 12\nbackend = 'decentdp'\ntopology = 'exp'\n",
        &[],
        6,
        "train.topology",
        "bad.toml:4:12",
        &["power-of-two world size, found 6"],
    ),
    (
        "alternating-exp-ring on one node",
        "[train]\nglobal_batch_size = 8\nbackend = 'decentdp'\ntopology = 'alternating-exp-ring'\n",
        &[],
        4,
        "train.topology",
        "bad.toml:4:12",
        &["ranks_per_node"],
    ),
    (
        "bad override value",
        "[train.optim]\nname = 'adamw'\n",
        &["train.optim.betas=[0.9, 2.0]"],
        1,
        "train.optim.betas[1]",
        "--set train.optim.betas=[0.9, 2.0]",
        &["< 1"],
    ),
    (
        "override with unknown key",
        "",
        &["train.optimm.lr=1"],
        1,
        "train.optimm",
        "--set train.optimm.lr=1",
        &["did you mean `optim`"],
    ),
    (
        "override with wrong type",
        "",
        &["train.n_steps=many"],
        1,
        "train.n_steps",
        "--set train.n_steps=many",
        &["string \"many\""],
    ),
    (
        "unknown activation",
        "[model]\nactivation = 'relu'\n",
        &[],
        1,
        "model.activation",
        "bad.toml:2:14",
        &["\"gelu\"", "\"gelu_tanh\""],
    ),
    (
        "unknown engine",
        "[train]\nengine = 'gloo'\n",
        &[],
        1,
        "train.engine",
        "bad.toml:2:10",
        &["\"local\"", "\"mpi\"", "\"nccl\""],
    ),
    (
        "data source without path",
        "train_data = [{ weight = 1.0 }]\n",
        &[],
        1,
        "train_data[0]",
        "bad.toml:1:15",
        &["missing required key `path`"],
    ),
    (
        "zero blend weight",
        "train_data = [{ path = 'a.bin', weight = 0 }]\n",
        &[],
        1,
        "train_data[0].weight",
        "bad.toml:1:42",
        &["> 0"],
    ),
    (
        "a run name that leaves log_dir",
        "[log]\nrun_name = '../other'\n",
        &[],
        1,
        "log.run_name",
        "bad.toml:2:12",
        &["`..`", "under log_dir"],
    ),
    (
        "an empty run name",
        "[log]\nrun_name = ''\n",
        &[],
        1,
        "log.run_name",
        "bad.toml:2:12",
        &["is empty"],
    ),
    (
        "an absolute run name",
        "[log]\nrun_name = '/tmp/run'\n",
        &[],
        1,
        "log.run_name",
        "bad.toml:2:12",
        &["absolute path"],
    ),
    (
        "workers flag with the mpi engine",
        "[train]\nengine = 'mpi'\n",
        &[],
        2,
        "train.engine",
        "bad.toml",
        &["--workers applies to the local engine only"],
    ),
];

#[test]
fn every_bad_config_names_its_key_path_and_line() {
    assert!(CASES.len() >= 30);
    let mut seen = std::collections::HashSet::new();
    for (what, src, set, workers, path, at, words) in CASES {
        assert!(seen.insert(*what), "duplicate case {what}");
        let err = errors(src, set, *workers);
        let text = err.to_string();
        let line = err
            .problems
            .iter()
            .map(|p| p.render("bad.toml"))
            .find(|l| l.contains(&format!(": {path}: ")))
            .unwrap_or_else(|| panic!("{what}: no problem at {path}:\n{text}"));
        assert!(
            line.starts_with(at),
            "{what}: expected location {at}, got:\n{line}"
        );
        for w in *words {
            assert!(line.contains(w), "{what}: expected {w:?} in:\n{line}");
        }
    }
}

#[test]
fn all_shape_errors_are_reported_together() {
    let src = "[train]\nn_stepz = 1\nseed = 'x'\n[model]\nbias = 3\n";
    let err = errors(src, &["log.eval_interval=0"], 1);
    let paths: Vec<&str> = err.problems.iter().map(|p| p.path.as_str()).collect();
    for p in [
        "train.n_stepz",
        "train.seed",
        "model.bias",
        "log.eval_interval",
    ] {
        assert!(paths.contains(&p), "{p} missing from {paths:?}");
    }
}

#[test]
fn syntax_errors_have_a_position() {
    let err = errors("[train]\nseed = = 3\n", &[], 1);
    let text = err.to_string();
    assert!(text.contains("bad.toml:2:"), "{text}");
    assert!(text.contains("TOML syntax error"), "{text}");
}

#[test]
fn a_duplicated_key_is_named_with_its_line() {
    let err = errors("[train]\nn_steps = 3\nseed = 1\nn_steps = 4\n", &[], 1);
    let text = err.to_string();
    assert!(
        text.contains("bad.toml:4:1: TOML syntax error: duplicate key `n_steps`"),
        "{text}"
    );
}

/// The hint of every alternating-exp-ring layout error fixes it: the suggested --set loads.
#[test]
fn the_alternating_exp_ring_hint_fixes_the_layout() {
    let src = "[train]\nbackend = 'decentdp'\ntopology = 'alternating-exp-ring'\nglobal_batch_size = 48\n";
    for workers in [2, 4, 6, 8, 12, 16, 24] {
        let text = errors(src, &[], workers).to_string();
        let hint = text
            .split("--set ")
            .nth(1)
            .and_then(|t| t.split_whitespace().next())
            .unwrap_or_else(|| panic!("no --set hint for {workers} workers: {text}"));
        let set = vec![hint.to_string()];
        nanodist::plan::load_str(Path::new("ok.toml"), src, &set, &launch(workers))
            .unwrap_or_else(|e| panic!("{workers} workers with --set {hint}: {e}"));
    }
}

/// Counts given as fractions of the run resolve into steps: PowerSGD's start_fraction is start_iter in the
/// plan, a warmup_fraction schedule is the warmup_steps one.
#[test]
fn fractions_of_the_run_resolve_into_steps() {
    let load =
        |src: &str| nanodist::plan::load_str(Path::new("ok.toml"), src, &[], &launch(2)).unwrap();
    let by_fraction = load(
        "[train]\nn_steps = 400\n[train.lr_schedule]\nwarmup_steps = 5\n[train.compression]\nname = 'powersgd'\nstart_fraction = 0.1\n",
    );
    let by_step =
        load("[train]\nn_steps = 400\n[train.lr_schedule]\nwarmup_steps = 5\n[train.compression]\nname = 'powersgd'\nstart_iter = 40\n");
    assert_eq!(by_fraction.plan.sync, by_step.plan.sync);
    assert_eq!(by_fraction.config.train.dense_until(), Some(40));
    let s = |src: &str| load(src).config.train.lr_schedule;
    let (f, w) = (
        s("[train]\nn_steps = 400\n[train.lr_schedule]\nname = 'linear'\nwarmup_fraction = 0.05\n"),
        s("[train]\nn_steps = 400\n[train.lr_schedule]\nname = 'linear'\nwarmup_steps = 20\n"),
    );
    for step in [0, 7, 19, 20, 21, 200, 399, 400] {
        assert_eq!(
            nanodist::optim::lr_at(&f, step, 400),
            nanodist::optim::lr_at(&w, step, 400)
        );
    }
    // BigScience's sample counts, rounded up to whole global batches of 8: 3199 samples are 400 steps,
    // 81 warm-up samples 11 steps, 2000 decay samples 250 steps; the config keeps the steps only.
    let by_samples = load(
        "[train]\nglobal_batch_size = 8\ntrain_samples = 3199\n[train.lr_schedule]\nname = 'linear'\n\
         lr_warmup_samples = 81\nlr_decay_samples = 2000\n",
    );
    let t = &by_samples.config.train;
    assert_eq!(t.n_steps, 400);
    assert_eq!(t.train_samples, None);
    assert_eq!(
        (t.lr_schedule.warmup_steps, t.lr_schedule.decay_steps),
        (Some(11), Some(250))
    );
    assert_eq!(by_samples.plan.n_steps, 400);
    assert!(by_samples
        .notes
        .iter()
        .any(|n| n == "train.train_samples = 3199: train.n_steps = 400 (steps of global_batch_size 8, rounded up)"),
        "{:?}", by_samples.notes);
    assert!(!by_samples.config.to_toml().contains("samples"));
    // With a ramp-up (batches 2, 2, 4, 6, then 8 from step 4: 14 samples before it), the counts become
    // the steps whose real batches reach them.
    let ramped = load(
        "[train]\nglobal_batch_size = 8\nrampup_batch_size = [2, 2, 12]\ntrain_samples = 3199\n\
         [train.lr_schedule]\nname = 'linear'\nlr_warmup_samples = 5\nlr_decay_samples = 15\n",
    );
    let t = &ramped.config.train;
    // 3199 - 14 = 3185 samples after step 4: 399 more steps of 8 (rounded up).
    assert_eq!(t.n_steps, 4 + 399);
    assert_eq!(
        (t.lr_schedule.warmup_steps, t.lr_schedule.decay_steps),
        (Some(3), Some(5))
    );
    assert_eq!(ramped.plan.batches.samples_before(4), 14);
    assert!(
        ramped.notes.iter().any(|n| n.contains("ramping batches")),
        "{:?}",
        ramped.notes
    );
}

#[test]
fn malformed_overrides_are_errors() {
    for set in ["train.seed", "=3", "a..b=1", "train.seed.x=1"] {
        let err = errors("[train]\nseed = 1\n", &[set], 1);
        assert!(err.to_string().contains("--set"), "{set}: {err}");
    }
}

#[test]
fn one_worker_gossip_is_a_note_not_an_error() {
    // Every topology, the node-layout one included: one rank has nothing to mix with.
    for topo in ["complete", "ring", "exp", "alternating-exp-ring"] {
        let src = format!("[train]\nbackend = 'decentdp'\ntopology = '{topo}'\n");
        let loaded = nanodist::plan::load_str(Path::new("ok.toml"), &src, &[], &launch(1)).unwrap();
        assert!(loaded
            .notes
            .iter()
            .any(|n| n.contains("degenerates to local training")));
        // And the backend builds for that plan: what `check` accepts, `train` runs.
        nanodist::sync::build(
            &loaded.plan.sync,
            Box::new(nanodist::comm::Solo),
            Vec::new(),
        )
        .unwrap_or_else(|e| panic!("{topo}: {e}"));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    /// Any TOML document (or garbage) loads or fails with a ConfigError; it never panics.
    #[test]
    fn random_toml_never_panics(doc in random_document()) {
        let _ = nanodist::plan::load_str(Path::new("fuzz.toml"), &doc, &[], &launch(2));
    }

    #[test]
    fn random_bytes_never_panic(doc in "\\PC{0,200}") {
        let _ = nanodist::plan::load_str(Path::new("fuzz.toml"), &doc, &[], &launch(1));
    }
}

/// Documents built from the config's real keys with random values of random types.
fn random_document() -> impl Strategy<Value = String> {
    let keys = prop::sample::select(vec![
        "log_dir",
        "in_memory",
        "checkpoint",
        "log.eval_interval",
        "log.eval_steps",
        "train.backend",
        "train.topology",
        "train.seed",
        "train.global_batch_size",
        "train.local_batch_size",
        "train.n_steps",
        "train.optim.name",
        "train.optim.betas",
        "train.optim.accum_steps",
        "train.lr_schedule.name",
        "train.lr_schedule.lr",
        "train.lr_schedule.warmup_steps",
        "train.compression.name",
        "train.compression.density",
        "train.compression.rank",
        "model.n_layers",
        "model.n_heads",
        "model.n_embd",
        "model.vocab_size",
        "model.dropout",
        "train_data",
        "nonsense.key",
    ]);
    let values = prop::sample::select(vec![
        "0",
        "1",
        "-5",
        "3.5",
        "1e300",
        "nan",
        "inf",
        "true",
        "'ring'",
        "'adamw'",
        "'accumadamw'",
        "'cosine'",
        "'topk'",
        "'powersgd'",
        "'decentdp'",
        "[0.9, 0.95]",
        "[]",
        "[[1]]",
        "{}",
        "{ path = 'x' }",
        "[{ path = 'a', weight = -1 }]",
        "9223372036854775807",
        "'exp'",
    ]);
    prop::collection::vec((keys, values), 0..12).prop_map(|kvs| {
        kvs.iter()
            .map(|(k, v)| format!("{k} = {v}\n"))
            .collect::<String>()
    })
}
