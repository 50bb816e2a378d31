//! Helpers shared by the integration tests: a small synthetic token stream and a tiny model config.
#![allow(dead_code)]

use std::path::Path;

use nanodist::comm::{local, Communicator};

/// Writes train.bin / val.bin (u16 tokens below 48) with learnable structure: mostly t -> 3t + 1 mod 48.
pub fn make_data(dir: &Path) {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    for (name, n) in [("train.bin", 40_000), ("val.bin", 4_000)] {
        let mut t = 0u16;
        let bytes: Vec<u8> = (0..n)
            .flat_map(|_| {
                t = if rng.random::<f64>() < 0.8 {
                    (t * 3 + 1) % 48
                } else {
                    rng.random_range(0..48)
                };
                t.to_le_bytes()
            })
            .collect();
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

/// A 2-layer, 32-wide GPT over the data in `dir`, 20 steps, evaluated every 10; logs to dir/log/<run_name>.
pub fn tiny_config(dir: &Path, run_name: &str) -> String {
    format!(
        "log_dir = {:?}\ndata_dir = {:?}\n[log]\nrun_name = \"{run_name}\"\neval_interval = 10\neval_steps = 4\nlog_interval = 1\n\
         ckpt_interval = 0\n[train]\nseed = 3\nglobal_batch_size = 8\ncontext_length = 16\nn_steps = 20\n\
         [train.lr_schedule]\nname = \"cosine\"\nlr = 3e-3\nwarmup_steps = 4\neta_min = 3e-4\n\
         [model]\nn_layers = 2\nn_heads = 2\nn_embd = 32\nvocab_size = 64\nbias = true\n",
        dir.join("log").display().to_string(),
        dir.display().to_string()
    )
}

/// Runs `f` on every rank of a local group of `n` and returns the results in rank order.
pub fn on_ranks<T: Send>(n: usize, f: impl Fn(Box<dyn Communicator>) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = local::group(n, std::time::Duration::from_secs(30))
            .into_iter()
            .map(|c| s.spawn(move || f(Box::new(c))))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}
