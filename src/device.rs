//! The compute device of a rank: `train.device = "cpu" | "cuda" | "auto"`. One GPU per rank, chosen by
//! the rank's place on its node (LOCAL_RANK, SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK); local workers
//! of one process take the GPUs round robin.

use anyhow::Result;
use candle_core::Device;

use crate::config::Device as DeviceCfg;

/// This process's rank on its node, from the launcher (torchrun, Slurm, Open MPI), if any.
pub fn local_rank_from(var: impl Fn(&str) -> Option<String>) -> Option<usize> {
    [
        "LOCAL_RANK",
        "SLURM_LOCALID",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MPI_LOCALRANKID",
    ]
    .iter()
    .find_map(|n| var(n)?.trim().parse().ok())
}

/// The GPU of a rank: the launcher's local rank for one process per GPU, else the worker index
/// (local workers share the GPUs round robin).
pub fn gpu_ordinal(local_rank: Option<usize>, worker: usize, gpus: usize) -> Result<usize> {
    match local_rank {
        Some(l) if l >= gpus => Err(crate::bad_input!(
            "train.device = \"cuda\": this process has local rank {l} but the node shows {gpus} GPU(s); \
             start one task per GPU (e.g. srun --gpus-per-task=1, or mpirun -np <GPUs per node> per node)"
        )),
        Some(l) => Ok(l),
        None => Ok(worker % gpus.max(1)),
    }
}

/// The GPUs visible to a run that asks for `cfg`: none for "cpu" and for "auto" without CUDA; for "cuda"
/// without CUDA (no `cuda` feature, driver or GPU) an input error that says why.
pub fn check(cfg: DeviceCfg) -> Result<Option<usize>> {
    match (cfg, gpus()) {
        (DeviceCfg::Cpu, _) | (DeviceCfg::Auto, Err(_)) => Ok(None),
        (DeviceCfg::Cuda, Err(why)) => Err(crate::bad_input!(
            "train.device = \"cuda\": {why}; use device = \"cpu\" (or \"auto\")"
        )),
        (DeviceCfg::Cuda | DeviceCfg::Auto, Ok(n)) => Ok(Some(n)),
    }
}

/// The device of local worker `worker`, as the config asks (see `check`).
pub fn select(cfg: DeviceCfg, worker: usize) -> Result<Device> {
    match check(cfg)? {
        None => Ok(Device::Cpu),
        Some(n) => {
            let local = local_rank_from(|k| std::env::var(k).ok());
            cuda_device(gpu_ordinal(local, worker, n)?)
        }
    }
}

/// The number of visible GPUs, or why there are none.
#[cfg(feature = "cuda")]
pub fn gpus() -> Result<usize, String> {
    use cudarc::driver::{sys::cudaError_enum::CUDA_ERROR_NO_DEVICE, DriverError};
    match cudarc::driver::CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(n as usize),
        Ok(_) | Err(DriverError(CUDA_ERROR_NO_DEVICE)) => {
            Err("the CUDA driver finds no GPU on this machine".into())
        }
        Err(e) => Err(format!(
            "the CUDA driver is not usable ({e}); this build needs a CUDA 13 driver (R580 or newer)"
        )),
    }
}

#[cfg(not(feature = "cuda"))]
pub fn gpus() -> Result<usize, String> {
    Err(
        "this nanodist was built without CUDA support (cargo build --release --features cuda)"
            .into(),
    )
}

#[cfg(feature = "cuda")]
fn cuda_device(ordinal: usize) -> Result<Device> {
    open_cuda(ordinal)
        .map(Device::Cuda)
        .map_err(|e| crate::bad_input!("train.device = \"cuda\": opening GPU {ordinal}: {e:#}"))
}

/// Candle's device on GPU `ordinal`, as every rank and test opens it:
/// - on a stream of its own (`new_with_stream`), not candle's default per-thread stream. Work that any
///   thread queues on it is ordered, and cudarc's events order each buffer's uses on other streams
///   (NCCL's) after the work that wrote it; on the per-thread stream neither holds.
/// - with the device's memory pool keeping what is freed (release threshold: all of it), as PyTorch's
///   caching allocator does. At the default threshold (0) the pool hands freed memory back to the driver
///   at every synchronization, so each step maps its activations afresh.
#[cfg(feature = "cuda")]
pub fn open_cuda(ordinal: usize) -> Result<candle_core::CudaDevice> {
    use anyhow::Context;
    use cudarc::driver::{result, sys};
    let dev = candle_core::CudaDevice::new_with_stream(ordinal)?;
    let cu_device = dev.cuda_stream().context().cu_device();
    let keep = u64::MAX;
    // SAFETY: the pool is the device's default one, which lives as long as the driver; the attribute is
    // a u64 (cuMemPoolSetAttribute's documented type for the release threshold), read during the call.
    unsafe {
        let pool = result::device::get_default_mem_pool(cu_device)?;
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &keep as *const u64 as *mut std::ffi::c_void,
        )
    }
    .context("keeping freed GPU memory in the device's memory pool")?;
    Ok(dev)
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(_ordinal: usize) -> Result<Device> {
    Err(crate::bad_input!(
        "train.device = \"cuda\": this nanodist was built without CUDA support"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_rank_comes_from_the_launcher_in_torchrun_slurm_open_mpi_order() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(local_rank_from(env(&[])), None);
        assert_eq!(local_rank_from(env(&[("SLURM_LOCALID", "3")])), Some(3));
        assert_eq!(
            local_rank_from(env(&[
                ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
                ("LOCAL_RANK", "2")
            ])),
            Some(2)
        );
        assert_eq!(local_rank_from(env(&[("LOCAL_RANK", "x")])), None);
    }

    #[test]
    fn one_gpu_per_local_rank_and_round_robin_for_local_workers() {
        assert_eq!(gpu_ordinal(Some(1), 0, 4).unwrap(), 1);
        assert_eq!(gpu_ordinal(None, 5, 4).unwrap(), 1);
        let err = gpu_ordinal(Some(4), 0, 4).unwrap_err();
        assert_eq!(crate::error::exit_code(&err), 2);
        assert!(err.to_string().contains("local rank 4"), "{err}");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_is_an_input_error_and_auto_is_the_cpu() {
        let err = select(DeviceCfg::Cuda, 0).unwrap_err();
        assert_eq!(crate::error::exit_code(&err), 2);
        assert!(err.to_string().contains("without CUDA support"), "{err}");
        assert!(select(DeviceCfg::Auto, 0).unwrap().is_cpu());
        assert!(select(DeviceCfg::Cpu, 0).unwrap().is_cpu());
    }
}
