//! How the ranks of the NCCL engine agree on NCCL's unique id before NCCL connects them: over MPI when
//! the job runs under mpirun or srun in a build with the `mpi` feature, else over TCP from MASTER_ADDR and
//! MASTER_PORT (the torchrun and sbatch conventions): rank 0 listens, every other rank connects.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::Communicator;

/// Rank 0's `bytes` on every rank, over an existing communicator (one f32 per byte: exact).
pub fn broadcast_bytes(comm: &mut dyn Communicator, bytes: &mut [u8]) -> Result<()> {
    let mut buf: Vec<f32> = bytes.iter().map(|&b| b as f32).collect();
    comm.broadcast(&mut buf, 0)?;
    bytes.iter_mut().zip(&buf).for_each(|(b, &v)| *b = v as u8);
    Ok(())
}

/// `host:port` of rank 0 from MASTER_ADDR and MASTER_PORT.
pub fn master_from_env(var: impl Fn(&str) -> Option<String>) -> Result<String> {
    match (var("MASTER_ADDR"), var("MASTER_PORT")) {
        (Some(a), Some(p)) if p.trim().parse::<u16>().is_ok() => Ok(format!("{}:{}", a.trim(), p.trim())),
        (a, p) => Err(crate::bad_input!(
            "train.engine = \"nccl\" without MPI needs MASTER_ADDR (rank 0's host) and MASTER_PORT (a free TCP port) \
             to exchange NCCL's id; got MASTER_ADDR={a:?} MASTER_PORT={p:?} (or launch with mpirun/srun in a build with \
             --features mpi)"
        )),
    }
}

/// Rank 0's `bytes` on every rank of `world` over TCP. Rank 0 listens on the port of `master` (all
/// interfaces) and answers each of the other ranks, which connect (retrying until `timeout`) and say
/// their rank first.
pub fn tcp_share(
    master: &str,
    rank: usize,
    world: usize,
    bytes: &mut [u8],
    timeout: Duration,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    if rank == 0 {
        let port = master.rsplit(':').next().unwrap_or_default();
        let listener = TcpListener::bind(format!("0.0.0.0:{port}")).with_context(|| {
            format!("rank 0 listening on port {port} (MASTER_PORT) for the NCCL id")
        })?;
        listener.set_nonblocking(true)?;
        let mut seen = vec![false; world];
        seen[0] = true;
        while seen.iter().any(|s| !s) {
            match listener.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false)?;
                    s.set_read_timeout(Some(timeout))?;
                    let mut r = [0u8; 4];
                    s.read_exact(&mut r)?;
                    let r = u32::from_le_bytes(r) as usize;
                    if r >= world {
                        bail!("a process that says it is rank {r} connected to a world of {world}");
                    }
                    seen[r] = true;
                    s.write_all(bytes)?;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        let missing: Vec<usize> = (0..world).filter(|&r| !seen[r]).collect();
                        bail!("rank 0: timed out after {timeout:?} waiting for rank(s) {missing:?} to fetch the NCCL id");
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(e.into()),
            }
        }
        return Ok(());
    }
    let mut stream = loop {
        match TcpStream::connect(master) {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => {
                bail!("rank {rank}: could not reach rank 0 at {master} for the NCCL id within {timeout:?}: {e}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    stream.set_read_timeout(Some(timeout))?;
    stream.write_all(&(rank as u32).to_le_bytes())?;
    stream
        .read_exact(bytes)
        .with_context(|| format!("rank {rank}: reading the NCCL id from {master}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(seed: u8) -> Vec<u8> {
        (0..128u32)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn every_rank_gets_rank_zeros_bytes_over_tcp() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let master = format!("127.0.0.1:{port}");
        let world = 4;
        let got: Vec<Vec<u8>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .rev() // the others start before rank 0 listens: they retry
                .map(|rank| {
                    let master = master.clone();
                    s.spawn(move || {
                        let mut b = if rank == 0 { id(7) } else { vec![0u8; 128] };
                        tcp_share(&master, rank, world, &mut b, Duration::from_secs(20)).unwrap();
                        b
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(got.iter().all(|b| *b == id(7)));
    }

    #[test]
    fn a_missing_rank_is_named_after_the_timeout() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut b = id(1);
        let err = tcp_share(
            &format!("127.0.0.1:{port}"),
            0,
            2,
            &mut b,
            Duration::from_millis(300),
        )
        .unwrap_err();
        assert!(err.to_string().contains("rank(s) [1]"), "{err}");
    }

    #[test]
    fn every_rank_gets_rank_zeros_bytes_over_a_communicator() {
        let comms = crate::comm::local::group(3, Duration::from_secs(10));
        let got: Vec<Vec<u8>> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|mut c| {
                    s.spawn(move || {
                        let mut b = if c.rank() == 0 { id(9) } else { vec![0u8; 128] };
                        broadcast_bytes(&mut c, &mut b).unwrap();
                        b
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(got.iter().all(|b| *b == id(9)));
    }

    #[test]
    fn master_address_needs_both_variables() {
        let env = |k: &str| match k {
            "MASTER_ADDR" => Some("node1".to_string()),
            "MASTER_PORT" => Some("29500".to_string()),
            _ => None,
        };
        assert_eq!(master_from_env(env).unwrap(), "node1:29500");
        let err = master_from_env(|k| (k == "MASTER_ADDR").then(|| "n".to_string())).unwrap_err();
        assert_eq!(crate::error::exit_code(&err), 2);
        assert!(err.to_string().contains("MASTER_PORT"));
    }
}
