//! The model equals nanoGPT's in PyTorch: logits, loss and per-parameter gradient norms of committed
//! weights on a committed batch, against values that scripts/torch_parity.py computed with PyTorch. Both
//! implementations are checked: candle's graph (GPUs, generation) and the CPU engine (training on CPU).

use std::path::PathBuf;

use candle_core::{Device, Tensor};
use nanodist::config::{Activation, ModelConfig};
use nanodist::model::Gpt;
use nanodist::train::checkpoint;

const CASES: [(&str, bool, Activation); 2] = [
    ("bias_gelu", true, Activation::Gelu),
    ("nobias_gelu_tanh", false, Activation::GeluTanh),
];
const T: usize = 8;
const B: usize = 2;

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

fn model(bias: bool, activation: Activation) -> Gpt {
    let cfg = ModelConfig {
        n_layers: 2,
        n_heads: 2,
        n_embd: 16,
        dropout: 0.0,
        vocab_size: 67,
        bias,
        activation,
    };
    Gpt::new(&cfg, T, 11, &Device::Cpu).unwrap()
}

fn close(a: f64, b: f64, what: &str) {
    assert!(
        (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
        "{what}: nanodist {a}, PyTorch {b}"
    );
}

#[test]
fn logits_loss_and_gradients_match_pytorch() {
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(golden("parity_expected.json")).unwrap())
            .unwrap();
    for (case, bias, act) in CASES {
        // The CPU engine computes from the flat weights; candle's graph from its tensors.
        let m = model(bias, act);
        let graph = model(bias, act).graph().unwrap();
        let meta: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(golden(&format!("parity_{case}.json"))).unwrap(),
        )
        .unwrap();
        let flat = checkpoint::read_hf_weights(&golden(&format!("parity_{case}.safetensors")), &m)
            .map(|(flat, _)| flat)
            .unwrap();
        graph.load((&flat).into()).unwrap();
        let ids = |k: &str| -> Vec<u32> { serde_json::from_value(meta[k].clone()).unwrap() };
        let x = Tensor::from_vec(ids("x"), (B, T), &Device::Cpu).unwrap();
        let y = Tensor::from_vec(ids("y"), (B, T), &Device::Cpu).unwrap();
        let want = &expected[case];
        graph_matches(&graph, (&x, &y), want, case);
        let batch = nanodist::data::Batch {
            b: B,
            t: T,
            x: ids("x"),
            y: ids("y"),
        };
        cpu_engine_matches(&m, &flat, &batch, want, case);
    }
}

/// candle's graph of the case's model: its logits, loss and each parameter's gradient norm against
/// PyTorch's (`want`).
fn graph_matches(graph: &Gpt, (x, y): (&Tensor, &Tensor), want: &serde_json::Value, case: &str) {
    let logits = graph
        .forward(x, None)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let want_logits: Vec<f64> = serde_json::from_value(want["logits"].clone()).unwrap();
    assert_eq!(logits.len(), want_logits.len());
    for (i, (a, b)) in logits.iter().zip(&want_logits).enumerate() {
        close(*a as f64, *b, &format!("{case} logit {i}"));
    }
    let loss = graph.loss(x, y, None).unwrap();
    close(
        loss.to_scalar::<f32>().unwrap() as f64,
        want["loss"].as_f64().unwrap(),
        &format!("{case} loss"),
    );
    let grads = loss.backward().unwrap();
    let norms = want["grad_norms"].as_object().unwrap();
    assert_eq!(norms.len(), graph.params.params.len());
    for p in &graph.params.params {
        let g = grads.get(graph.params.get(&p.name).unwrap()).unwrap();
        let n = g
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
            .sqrt() as f64;
        close(
            n,
            norms[&p.name].as_f64().unwrap(),
            &format!("{case} |grad {}|", p.name),
        );
    }
}

/// The CPU engine from the flat weights: its loss and each parameter's gradient norm against
/// PyTorch's (`want`).
fn cpu_engine_matches(
    m: &Gpt,
    flat: &[f32],
    batch: &nanodist::data::Batch,
    want: &serde_json::Value,
    case: &str,
) {
    let norms = want["grad_norms"].as_object().unwrap();
    let mut g = vec![0.0f32; m.params.numel];
    let loss = m
        .loss_and_grads(
            &mut Default::default(),
            flat.into(),
            batch,
            None,
            1.0,
            (&mut g).into(),
        )
        .unwrap();
    close(
        loss as f64,
        want["loss"].as_f64().unwrap(),
        &format!("{case} CPU engine loss"),
    );
    for p in &m.params.params {
        let g = &g[p.offset..p.offset + p.len];
        let n = g.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
        close(
            n,
            norms[&p.name].as_f64().unwrap(),
            &format!("{case} CPU engine |grad {}|", p.name),
        );
    }
}

/// Writes the inputs for scripts/torch_parity.py: nanodist's initial weights, perturbed so that biases
/// and gains are not trivial, in HF layout, and a batch.
#[test]
#[ignore = "regenerates the golden inputs; run with --ignored export, then scripts/torch_parity.py"]
fn export() {
    use rand::{Rng, SeedableRng};
    for (case, bias, act) in CASES {
        let m = model(bias, act);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let flat: Vec<f32> = m
            .initial_weights()
            .iter()
            .map(|v| v + rng.random_range(-0.2..0.2))
            .collect();
        checkpoint::save_weights(&golden(&format!("parity_{case}.safetensors")), &m, &flat, 0)
            .unwrap();
        let x: Vec<u32> = (0..B * T).map(|_| rng.random_range(0..67)).collect();
        let y: Vec<u32> = (0..B * T).map(|_| rng.random_range(0..67)).collect();
        let meta = serde_json::json!({
            "model": { "n_layers": 2, "n_heads": 2, "n_embd": 16, "vocab_size": 67, "context_length": T,
                       "bias": bias, "activation": if act == Activation::Gelu { "gelu" } else { "gelu_tanh" } },
            "b": B, "t": T, "x": x, "y": y,
        });
        std::fs::write(
            golden(&format!("parity_{case}.json")),
            serde_json::to_string_pretty(&meta).unwrap(),
        )
        .unwrap();
    }
}
