//! Cluster profiles: the devices and links of a cluster, as a TOML file checked against its JSON Schema
//! (`schemas/cluster.schema.json`) with the config's error quality. Built-in profiles live in
//! `config/clusters/NAME.toml` and are compiled in; a file of that name under the current directory's
//! `config/clusters/` (e.g. one `nanodist calibrate` wrote) takes precedence.

use std::path::{Path, PathBuf};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

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
    #[serde(default = "one")]
    #[schemars(extend("exclusiveMinimum" = 0, "maximum" = 1))]
    pub sharing_efficiency: f64,
}

fn one() -> f64 {
    1.0
}

/// A link in the alpha-beta model: a message of S bytes takes latency + S / (bandwidth x efficiency).
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

/// Parses and checks a profile's text (`source` names it in messages).
pub fn parse(source: &str, text: &str) -> Result<ClusterProfile, ConfigError> {
    let fail = |problems: Vec<Problem>| ConfigError {
        file: source.to_string(),
        problems,
    };
    crate::config::parse_as::<ClusterProfile>(text, &[], &schema())
        .map(|(p, _)| p)
        .map_err(fail)
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
    }
}
