//! Connecting a multi-process engine (MPI, NCCL) for this process's rank.

use anyhow::Result;

use crate::bad_input;
use crate::comm::Communicator;
use crate::config::{Device as DeviceCfg, Engine};
use crate::plan::Plan;

/// This process's communicator for a multi-process engine; `None` for the local engine (its workers
/// are threads, connected by `comm::local::group`).
pub fn connect(
    plan: &Plan,
    device: DeviceCfg,
    timeout: std::time::Duration,
) -> Result<Option<Box<dyn Communicator>>> {
    Ok(match plan.engine {
        Engine::Local | Engine::Auto => None,
        Engine::Mpi => Some(connect_mpi(plan, timeout)?),
        Engine::Nccl => Some(connect_nccl(device, plan, timeout)?),
    })
}

/// The job's start time, rank 0's on every rank (it names the run directory).
pub fn agreed_start(comm: &mut Option<Box<dyn Communicator>>) -> Result<std::time::SystemTime> {
    let now = std::time::SystemTime::now();
    let Some(comm) = comm.as_mut() else {
        return Ok(now);
    };
    let secs = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut packed = crate::comm::pack_u64(secs);
    comm.broadcast(&mut packed, 0)?;
    Ok(std::time::UNIX_EPOCH + std::time::Duration::from_secs(crate::comm::unpack_u64(packed)))
}

/// This process's rank of an `mpirun`/`srun` job.
#[cfg(feature = "mpi")]
fn connect_mpi(plan: &Plan, timeout: std::time::Duration) -> Result<Box<dyn Communicator>> {
    let comm = crate::comm::mpi::MpiComm::init(timeout)?;
    if comm.world_size() != plan.world_size {
        anyhow::bail!(
            "MPI reports {} ranks but the launcher's environment said {}",
            comm.world_size(),
            plan.world_size
        );
    }
    Ok(Box::new(comm))
}

#[cfg(not(feature = "mpi"))]
fn connect_mpi(_: &Plan, _: std::time::Duration) -> Result<Box<dyn Communicator>> {
    Err(bad_input!(
        "train.engine = \"mpi\": this nanodist was built without MPI; rebuild with `cargo build --release --features mpi` \
         (needs libopenmpi-dev and libclang-dev)"
    ))
}

/// The NCCL engine: this process's GPU (its local rank) and NCCL's id from rank 0, over MPI under an MPI
/// launcher in a build with `mpi`, else over TCP from MASTER_ADDR / MASTER_PORT.
#[cfg(feature = "cuda")]
fn connect_nccl(
    device: DeviceCfg,
    plan: &Plan,
    timeout: std::time::Duration,
) -> Result<Box<dyn Communicator>> {
    use crate::comm::bootstrap;
    let env = |k: &str| std::env::var(k).ok();
    if device == DeviceCfg::Cpu {
        return Err(bad_input!(
            "train.engine = \"nccl\" runs on GPUs: set train.device = \"cuda\" (or use engine \"mpi\" on CPUs)"
        ));
    }
    let gpus = crate::device::gpus().map_err(|why| bad_input!("train.engine = \"nccl\": {why}"))?;
    let ordinal = crate::device::gpu_ordinal(crate::device::local_rank_from(env), 0, gpus)?;
    let n = plan.world_size;
    let mpi_rank = crate::plan::LaunchEnv::process_rank();
    let rank = mpi_rank
        .or_else(|| env("RANK")?.trim().parse().ok())
        .unwrap_or(0);
    let comm = crate::comm::nccl::NcclComm::init(rank, n, ordinal, timeout, |id| {
        if n == 1 {
            return Ok(());
        }
        #[cfg(feature = "mpi")]
        if mpi_rank.is_some() {
            let mut mpi = crate::comm::mpi::MpiComm::init(timeout)?;
            return bootstrap::broadcast_bytes(&mut mpi, id);
        }
        bootstrap::tcp_share(&bootstrap::master_from_env(env)?, rank, n, id, timeout)
    })?;
    Ok(Box::new(comm))
}

#[cfg(not(feature = "cuda"))]
fn connect_nccl(_: DeviceCfg, _: &Plan, _: std::time::Duration) -> Result<Box<dyn Communicator>> {
    Err(bad_input!(
        "train.engine = \"nccl\": this nanodist was built without CUDA support; rebuild with \
         `cargo build --release --features cuda` on a machine with the CUDA toolkit and NCCL"
    ))
}
