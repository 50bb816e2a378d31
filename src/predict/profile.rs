//! Cluster profiles: the devices and links of a cluster, as a TOML file checked against its JSON Schema
//! (`schemas/cluster.schema.json`) with the config's error quality. Built-in profiles live in
//! `config/clusters/NAME.toml` and are compiled in; a file of that name under the current directory's
//! `config/clusters/` (e.g. one `nanodist calibrate` wrote) takes precedence.

use std::path::{Path, PathBuf};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::codec::CodecName;
use crate::config::{ConfigError, Problem};

/// A cluster to predict a run's wall-clock time on. The number of nodes is not part of it: it follows
/// from the run's world size and `--ranks-per-node`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(title = "nanodist cluster profile")]
pub struct ClusterProfile {
    /// What the cluster is, in a few words (printed with every prediction).
    pub description: String,
    /// Devices (GPUs; CPU ranks for `local`) per node. Ranks fill nodes in rank order.
    #[schemars(extend("minimum" = 1))]
    pub devices_per_node: usize,
    pub device: DeviceSpec,
    /// The link between two devices of a node (NVLink, PCIe, shared memory).
    pub intra: Link,
    /// The link between nodes (InfiniBand, Ethernet, WAN).
    pub inter: Link,
    /// Whether a node's ranks share its network interfaces (one NIC per node): ranks that send off-node
    /// at the same time split `inter.bandwidth_gbps`. False where each device has its own NIC (HGX/DGX).
    pub nic_shared: bool,
    /// Whether gradient all-reduce buckets run during the backward pass, as PyTorch DDP does on GPUs.
    /// nanodist's own engines reduce after the backward pass (`local` says false).
    pub overlap_backward: bool,
    /// Whether collectives run beside the forward and backward pass at no cost to them (overlapped
    /// gossip, streaming DiLoCo's fragments): GPUs, whose NCCL kernels run on their own streams. False
    /// where the core that computes also moves the bytes (one CPU core a rank, as `calibrate` measures):
    /// on this machine's netlab, overlapped gossip steps took as long as synchronous ones.
    #[serde(default = "yes")]
    pub overlap_compute: bool,
    /// Where `overlap_compute` is false: a collective progresses at 1 / this of its idle speed while the
    /// rank computes beside it (`nanodist calibrate`: a ring exchange with each neighbour, sized to take
    /// about as long as a training step's compute, idle and then beside training steps as overlapped
    /// steps run it). `predict RUN_DIR --measured` prices a run's overlapped collectives at this slower
    /// pace while its forward and backward pass ran beside them (`overlap_compute_ms`), at their idle pace
    /// after. Absent: not measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub comm_beside_compute: Option<f64>,
    /// Nodes whose link to the others is not `[inter]` (a slow site, a straggler's link): a collective
    /// across nodes runs at its slowest member's link.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub node_links: Vec<NodeLink>,
    /// An all-reduce over every node, one rank on each, as it was measured (`nanodist calibrate` across
    /// nodes writes it). Such an all-reduce is interpolated from it: MPI picks its algorithm by size
    /// (recursive doubling, rings, ...), which a ring over the slowest member's link does not price.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub all_reduce: Option<MeasuredAllReduce>,
}

/// `[all_reduce]`: an all-reduce over `nodes` nodes, one rank on each, as measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MeasuredAllReduce {
    /// The nodes it spanned: an all-reduce over this many nodes, one rank on each, takes its times.
    #[schemars(extend("minimum" = 2))]
    pub nodes: usize,
    /// `[bytes, microseconds]` of the all-reduce of `bytes`, by ascending size (past the largest, at the
    /// rate of the last two).
    #[schemars(extend("minItems" = 2))]
    pub measured: Vec<[f64; 2]>,
}

impl MeasuredAllReduce {
    /// Seconds of the all-reduce of `bytes` over `nodes` nodes, one rank on each; None for other
    /// counts, or where fewer than two points were given.
    pub fn seconds(&self, nodes: usize, bytes: f64) -> Option<f64> {
        (nodes == self.nodes && self.measured.len() >= 2)
            .then(|| interpolate(&self.measured, bytes) * 1e-6)
    }
}

fn yes() -> bool {
    true
}

/// `[[node_links]]`: one node's own link to the others.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NodeLink {
    /// The node (ranks fill nodes in rank order: node k holds ranks k x ranks-per-node and up).
    pub node: usize,
    /// Its link, in place of `[inter]`.
    pub link: Link,
}

impl ClusterProfile {
    /// The profile with every link's per-message latency taken off (`Link::latency_free`).
    pub fn latency_free(&self) -> ClusterProfile {
        let mut p = self.clone();
        p.intra = p.intra.latency_free();
        p.inter = p.inter.latency_free();
        for n in &mut p.node_links {
            n.link = n.link.latency_free();
        }
        if let Some(a) = &mut p.all_reduce {
            a.measured = without_floor(&a.measured);
        }
        p
    }

    /// Node `k`'s link to the other nodes.
    pub fn inter_of(&self, k: usize) -> &Link {
        self.node_links
            .iter()
            .find(|n| n.node == k)
            .map_or(&self.inter, |n| &n.link)
    }
}

/// One device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    /// The device's name.
    pub name: String,
    /// Peak dense throughput for the training dtype, TFLOPS (bf16 tensor cores on GPUs, without
    /// sparsity).
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub peak_tflops: f64,
    /// Sustained fraction of the peak that a GPT training step reaches (model FLOPs utilisation).
    #[schemars(extend("exclusiveMinimum" = 0, "maximum" = 1))]
    pub mfu: f64,
    /// Memory bandwidth, GB/s: the optimizer's update and compression (top-k, PowerSGD, DeMo, quantization)
    /// are memory-bound.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub memory_gbps: f64,
    /// When a node runs more ranks than devices, the fraction of the devices' throughput the ranks keep
    /// (time slicing, caches, waiting for a co-located rank); measured by `nanodist calibrate` on CPUs.
    /// Absent: the devices are not shared (one rank per GPU), and a run directory's ranks are placed at
    /// most `devices_per_node` to a node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0, "maximum" = 1))]
    pub sharing_efficiency: Option<f64>,
    /// `[device.codec_gbps]`: each compressor's measured throughput on one device, GB/s of f32 gradient
    /// through encode and decode (`nanodist calibrate` measures them on this machine). A codec without a
    /// rate is priced as memory-bound: 4 passes over the gradient at `memory_gbps`.
    #[serde(default, skip_serializing_if = "CodecRates::is_empty")]
    pub codec_gbps: CodecRates,
}

/// Measured codec throughputs, GB/s of f32 gradient (see `predict::codec::measure` for the settings).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CodecRates {
    /// Top-k 1% with error feedback (the reducer and CHOCO's top-k).
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub topk: Option<f64>,
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub randomk: Option<f64>,
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub qsgd: Option<f64>,
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub sign: Option<f64>,
    /// Radius's stable steps.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub radius: Option<f64>,
    /// PowerSGD rank 4.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub powersgd: Option<f64>,
    /// DiLoCo's quantized all-reduces.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub bf16: Option<f64>,
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub fp8: Option<f64>,
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub uint8: Option<f64>,
    /// DeMo's momentum, DCT, top-k and sign.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub demo: Option<f64>,
    /// SparseLoCo's chunk-wise top-k, quantization and decoding.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub sparseloco: Option<f64>,
}

impl CodecRates {
    pub fn is_empty(&self) -> bool {
        *self == CodecRates::default()
    }

    /// The rate of `codec`, GB/s (None: not measured).
    pub fn get(&self, codec: CodecName) -> Option<f64> {
        match codec {
            CodecName::TopK => self.topk,
            CodecName::RandomK => self.randomk,
            CodecName::Qsgd => self.qsgd,
            CodecName::Sign => self.sign,
            CodecName::Radius => self.radius,
            CodecName::PowerSgd => self.powersgd,
            CodecName::Bf16 => self.bf16,
            CodecName::Fp8 => self.fp8,
            CodecName::Uint8 => self.uint8,
            CodecName::Demo => self.demo,
            CodecName::SparseLoco => self.sparseloco,
        }
    }
}

/// Memory passes over the gradient that a codec without a measured rate is priced at (accumulate the
/// residual, select or project, write the residual, scatter the result), each reading and writing f32.
pub const CODEC_PASSES: f64 = 4.0;

impl DeviceSpec {
    /// `codec`'s throughput on this device, GB/s of f32 gradient, and whether it was measured (else the
    /// memory-bound estimate: `CODEC_PASSES` reads and writes of the gradient at `memory_gbps`).
    pub fn codec_rate(&self, codec: CodecName) -> (f64, bool) {
        match self.codec_gbps.get(codec) {
            Some(r) => (r, true),
            None => (self.memory_gbps / (2.0 * CODEC_PASSES), false),
        }
    }
}

/// A link in the alpha-beta model: a message of S bytes takes latency + S / (bandwidth x efficiency);
/// or, where `measured` gives them, the times a real link took by message size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Link {
    /// Bandwidth per direction, Gbit/s.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub bandwidth_gbps: f64,
    /// Latency per message (alpha), microseconds.
    #[schemars(extend("minimum" = 0))]
    pub latency_us: f64,
    /// Fraction of the bandwidth a collective achieves (protocol and NCCL/MPI overheads).
    #[schemars(extend("exclusiveMinimum" = 0, "maximum" = 1))]
    pub efficiency: f64,
    /// Measured `[bytes, microseconds]` of one message sent both ways at once, by ascending size
    /// (`nanodist calibrate` across nodes writes them). When given, a message's time is interpolated
    /// from them (past the largest, at the rate of the last two): real links are not one line (MPI's
    /// eager and rendezvous protocols, TCP's windows, a shaper's token bucket). Latency, bandwidth and
    /// efficiency then only describe the link.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub measured: Vec<[f64; 2]>,
    /// Measured `[bytes, microseconds]` of two ranks swapping `bytes` each way, alone on their links,
    /// by ascending size (`nanodist calibrate` across nodes writes them). A swap between two nodes (a
    /// gossip pair) is interpolated from them: a pair's one stream each way runs closer to the line
    /// than the all-reduce's messages in `measured`, which share each link with the other ranks'.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pairs: Vec<[f64; 2]>,
}

impl Link {
    /// Alpha, seconds.
    pub fn alpha(&self) -> f64 {
        self.latency_us * 1e-6
    }

    /// Achieved bandwidth, bytes per second.
    pub fn bytes_per_s(&self) -> f64 {
        self.bandwidth_gbps * 1e9 / 8.0 * self.efficiency
    }

    /// Seconds of one message of `bytes` while `share` senders split the link (as one message
    /// `share` times larger).
    pub fn message_seconds(&self, bytes: f64, share: usize) -> f64 {
        let bytes = bytes * share.max(1) as f64;
        match self.measured.as_slice() {
            [] => self.alpha() + bytes / self.bytes_per_s(),
            [[_, us]] => us * 1e-6,
            points => interpolate(points, bytes) * 1e-6,
        }
    }

    /// Seconds of two ranks swapping `bytes` each way while `share` senders split the link: from
    /// `pairs` where measured, else two messages of half the bytes (the all-reduce of two ranks).
    pub fn swap_seconds(&self, bytes: f64, share: usize) -> f64 {
        match self.pairs.as_slice() {
            [] => 2.0 * self.message_seconds(bytes / 2.0, share),
            [[_, us]] => us * 1e-6,
            points => interpolate(points, bytes * share.max(1) as f64) * 1e-6,
        }
    }

    /// The link `k` times slower (ranks that share cores also share their copies).
    pub fn slowed(&self, k: f64) -> Link {
        let slow = |c: &[[f64; 2]]| c.iter().map(|&[b, us]| [b, us * k]).collect();
        Link {
            bandwidth_gbps: self.bandwidth_gbps / k,
            latency_us: self.latency_us * k,
            efficiency: self.efficiency,
            measured: slow(&self.measured),
            pairs: slow(&self.pairs),
        }
    }

    /// The link without its per-message latency (the smallest message's time, where measured).
    pub fn latency_free(&self) -> Link {
        Link {
            latency_us: 0.0,
            measured: without_floor(&self.measured),
            pairs: without_floor(&self.pairs),
            ..self.clone()
        }
    }
}

/// A measured curve less its smallest message's time (its per-message latency).
fn without_floor(c: &[[f64; 2]]) -> Vec<[f64; 2]> {
    let floor = c.first().map_or(0.0, |p| p[1]);
    c.iter()
        .map(|&[b, us]| [b, (us - floor).max(0.0)])
        .collect()
}

/// Microseconds at `bytes` on the piecewise-linear curve through `points` (at least two, ascending):
/// the first point's below it, the last segment's slope past it (never falling).
fn interpolate(points: &[[f64; 2]], bytes: f64) -> f64 {
    if bytes <= points[0][0] {
        return points[0][1];
    }
    let i = points
        .windows(2)
        .position(|w| bytes <= w[1][0])
        .unwrap_or(points.len() - 2);
    let ([b0, t0], [b1, t1]) = (points[i], points[i + 1]);
    let slope = ((t1 - t0) / (b1 - b0).max(1.0)).max(0.0);
    t0 + slope * (bytes - b0)
}

/// The built-in profiles, by name.
pub const BUILTIN: &[(&str, &str)] = &[
    (
        "a40-25gbe",
        include_str!("../../config/clusters/a40-25gbe.toml"),
    ),
    (
        "a100-ib100",
        include_str!("../../config/clusters/a100-ib100.toml"),
    ),
    (
        "h100-ib400",
        include_str!("../../config/clusters/h100-ib400.toml"),
    ),
    ("t4-ib", include_str!("../../config/clusters/t4-ib.toml")),
    ("wan-1g", include_str!("../../config/clusters/wan-1g.toml")),
    ("local", include_str!("../../config/clusters/local.toml")),
];

/// The JSON Schema of a cluster profile.
pub fn schema() -> serde_json::Value {
    schemars::schema_for!(ClusterProfile).to_value()
}

/// A profile and where it came from.
#[derive(Debug, Clone)]
pub struct Cluster {
    /// The name it was asked for by (a built-in's name or the file's stem).
    pub name: String,
    pub source: String,
    pub profile: ClusterProfile,
}

/// Loads `NAME` (a file path, else `config/clusters/NAME.toml` under the current directory, else a
/// built-in) and checks it.
pub fn load(name: &str) -> anyhow::Result<Cluster> {
    let as_path = Path::new(name);
    let local = PathBuf::from("config/clusters").join(format!("{name}.toml"));
    let file = if as_path.extension().is_some_and(|e| e == "toml") || name.contains('/') {
        Some(as_path.to_path_buf())
    } else {
        local.is_file().then_some(local)
    };
    let (source, text) = match file {
        Some(path) => {
            let text = std::fs::read_to_string(&path).map_err(|e| {
                crate::bad_input!("--cluster {name}: cannot read {}: {e}", path.display())
            })?;
            (path.display().to_string(), text)
        }
        None => match BUILTIN.iter().find(|(n, _)| *n == name) {
            Some((n, text)) => (format!("built-in {n}"), text.to_string()),
            None => {
                let names: Vec<&str> = BUILTIN.iter().map(|(n, _)| *n).collect();
                return Err(crate::bad_input!(
                    "--cluster {name}: no such profile; built-in: {}, or a path to a TOML file (schema: \
                     schemas/cluster.schema.json)",
                    names.join(", ")
                ));
            }
        },
    };
    let profile = parse(&source, &text)?;
    let stem = as_path
        .file_stem()
        .map_or(name.to_string(), |s| s.to_string_lossy().to_string());
    Ok(Cluster {
        name: stem,
        source,
        profile,
    })
}

/// Every measured curve of a profile, by its key path.
fn curves(p: &ClusterProfile) -> Vec<(String, &[[f64; 2]])> {
    let mut links = vec![
        ("intra".to_string(), &p.intra),
        ("inter".to_string(), &p.inter),
    ];
    for (i, n) in p.node_links.iter().enumerate() {
        links.push((format!("node_links[{i}].link"), &n.link));
    }
    let mut out: Vec<(String, &[[f64; 2]])> = links
        .into_iter()
        .flat_map(|(name, l)| {
            [
                (format!("{name}.measured"), l.measured.as_slice()),
                (format!("{name}.pairs"), l.pairs.as_slice()),
            ]
        })
        .collect();
    if let Some(a) = &p.all_reduce {
        out.push(("all_reduce.measured".to_string(), a.measured.as_slice()));
    }
    out
}

/// Parses and checks a profile's text (`source` names it in messages).
pub fn parse(source: &str, text: &str) -> Result<ClusterProfile, ConfigError> {
    let fail = |problems: Vec<Problem>| ConfigError {
        file: source.to_string(),
        problems,
    };
    let (p, doc) = crate::config::parse_as::<ClusterProfile>(text, &[], &schema()).map_err(fail)?;
    let mut problems: Vec<Problem> = curves(&p)
        .into_iter()
        .filter(|(_, c)| {
            c.windows(2).any(|w| w[1][0] <= w[0][0]) || c.iter().any(|&[b, us]| b < 0.0 || us < 0.0)
        })
        .map(|(at, _)| {
            crate::config::validate::problem_at(
                &doc,
                &at,
                "measured points are [bytes, microseconds] pairs, neither negative, by strictly ascending \
                 bytes; sort them by size and drop repeated sizes"
                    .into(),
            )
        })
        .collect();
    for (i, n) in p.node_links.iter().enumerate() {
        if p.node_links[..i].iter().any(|m| m.node == n.node) {
            problems.push(crate::config::validate::problem_at(
                &doc,
                &format!("node_links[{i}].node"),
                format!(
                    "node {} has a link already; give each node one [[node_links]] entry",
                    n.node
                ),
            ));
        }
    }
    match problems.is_empty() {
        true => Ok(p),
        false => Err(fail(problems)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_profile_loads() {
        for (name, text) in BUILTIN {
            let p = parse(name, text).unwrap_or_else(|e| panic!("{e}"));
            assert!(p.devices_per_node >= 1, "{name}");
        }
    }

    #[test]
    fn bad_profiles_name_the_key_line_and_what_is_allowed() {
        let text = BUILTIN[0].1.replace("mfu = ", "mfu = 1.5 # was ");
        let err = parse("x.toml", &text).unwrap_err().to_string();
        assert!(
            err.contains("x.toml:") && err.contains("device.mfu"),
            "{err}"
        );
        let text = BUILTIN[0].1.replace("nic_shared", "nic_sharde");
        let err = parse("x.toml", &text).unwrap_err().to_string();
        assert!(err.contains("nic_shared"), "{err}");
        let text = BUILTIN[0]
            .1
            .replace("[inter]", "[inter]\nmeasured = [[10, 5.0], [10, 6.0]]");
        let err = parse("x.toml", &text).unwrap_err().to_string();
        assert!(
            err.contains("inter.measured") && err.contains("ascending"),
            "{err}"
        );
        let curve = |m: &str| {
            format!(
                "{}\n[all_reduce]\nnodes = 4\nmeasured = {m}\n",
                BUILTIN[0].1
            )
        };
        let err = parse("x.toml", &curve("[[10, 5.0], [8, 6.0]]")).unwrap_err();
        let err = err.to_string();
        assert!(
            err.contains("all_reduce.measured") && err.contains("ascending"),
            "{err}"
        );
        let err = parse("x.toml", &curve("[[10, 5.0]]"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("all_reduce.measured"), "{err}");
        let p = parse("x.toml", &curve("[[10, 5.0], [20, 6.0]]")).unwrap();
        let a = p.all_reduce.as_ref().unwrap();
        assert_eq!(a.seconds(4, 15.0), Some(5.5e-6));
        assert_eq!(a.seconds(3, 15.0), None);
        // Latency-free: the smallest all-reduce's time comes off.
        let free = p.latency_free().all_reduce.unwrap();
        assert!((free.seconds(4, 30.0).unwrap() - 2e-6).abs() < 1e-15);
    }

    fn link(measured: Vec<[f64; 2]>) -> Link {
        Link {
            bandwidth_gbps: 8.0,
            latency_us: 10.0,
            efficiency: 0.5,
            measured,
            pairs: vec![],
        }
    }

    /// Without measurements a message costs alpha + S / (B x efficiency), a shared link as one message
    /// `share` times larger; with them, the curve through them: their own times at their sizes, linear
    /// between, the last segment's rate past the last, the first time below the first.
    #[test]
    fn a_message_costs_the_line_or_the_measured_curve() {
        let close = |a: f64, b: f64| assert!((a - b).abs() <= 1e-12 * b.abs().max(1.0), "{a} {b}");
        let l = link(vec![]);
        close(l.message_seconds(1e6, 1), 10e-6 + 1e6 / 0.5e9);
        close(l.message_seconds(1e6, 3), 10e-6 + 3e6 / 0.5e9);
        let points = vec![[100.0, 50.0], [1000.0, 60.0], [10_000.0, 960.0]];
        let m = link(points.clone());
        for [b, us] in &points {
            close(m.message_seconds(*b, 1), us * 1e-6);
        }
        close(m.message_seconds(10.0, 1), 50e-6);
        close(m.message_seconds(550.0, 1), 55e-6);
        close(m.message_seconds(20_000.0, 1), 1960e-6);
        close(m.message_seconds(5_000.0, 2), 960e-6);
        // Latency-free: the smallest message's time comes off every point; slowed: every time k x.
        close(m.latency_free().message_seconds(1000.0, 1), 10e-6);
        close(m.slowed(2.0).message_seconds(550.0, 1), 110e-6);
        close(l.latency_free().message_seconds(1e6, 1), 1e6 / 0.5e9);
    }
}
