//! Fault injection for tests of failure handling: `NANODIST_FAULT=RANK:STEP:KIND` makes rank RANK fail
//! at step STEP. KIND is `panic` (the worker dies), `hang` (it stops answering), `exit` (the whole process
//! exits with code 137, as if killed), `error` (the step returns an error, as a failed write would), all
//! at the start of the step, or `nan` (the rank's loss and gradient of that step become NaN, as a
//! diverged step's). Off unless the variable is set.

use anyhow::{bail, Result};

use crate::bad_input;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kind {
    Panic,
    Hang,
    Exit,
    Error,
    Nan,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fault {
    pub rank: usize,
    pub step: u64,
    pub kind: Kind,
}

impl Fault {
    /// The fault set by NANODIST_FAULT, if any.
    pub fn from_env() -> Result<Option<Self>> {
        match std::env::var("NANODIST_FAULT") {
            Ok(v) if !v.is_empty() => Self::parse(&v).map(Some),
            _ => Ok(None),
        }
    }

    pub fn parse(spec: &str) -> Result<Self> {
        let bad = || {
            bad_input!(
                "NANODIST_FAULT={spec:?}: expected RANK:STEP:KIND with KIND panic, hang, exit, error or nan (e.g. 1:5:panic)"
            )
        };
        let parts: Vec<&str> = spec.split(':').collect();
        let [rank, step, kind] = parts[..] else {
            return Err(bad());
        };
        Ok(Self {
            rank: rank.parse().map_err(|_| bad())?,
            step: step.parse().map_err(|_| bad())?,
            kind: match kind {
                "panic" => Kind::Panic,
                "hang" => Kind::Hang,
                "exit" => Kind::Exit,
                "error" => Kind::Error,
                "nan" => Kind::Nan,
                _ => return Err(bad()),
            },
        })
    }

    /// Strikes when `rank` reaches `step`; true when the step's loss and gradient are to be poisoned.
    pub fn check(&self, rank: usize, step: u64) -> Result<bool> {
        if rank != self.rank || step != self.step {
            return Ok(false);
        }
        eprintln!(
            "NANODIST_FAULT: injecting {:?} on rank {rank} at step {step}",
            self.kind
        );
        match self.kind {
            Kind::Panic => panic!("injected fault on rank {rank} at step {step}"),
            Kind::Hang => loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            },
            Kind::Exit => std::process::exit(137),
            Kind::Error => bail!("injected error on rank {rank} at step {step}"),
            Kind::Nan => Ok(true),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_or_say_what_is_expected() {
        assert_eq!(
            Fault::parse("2:5:hang").unwrap(),
            Fault {
                rank: 2,
                step: 5,
                kind: Kind::Hang
            }
        );
        for bad in ["", "1:2", "a:1:panic", "1:2:explode", "1:2:panic:3"] {
            let e = Fault::parse(bad).unwrap_err().to_string();
            assert!(e.contains("RANK:STEP:KIND"), "{bad}: {e}");
        }
    }
}
