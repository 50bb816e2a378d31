//! `nanodist netlab`: several hosts on one machine, joined by links of a chosen speed, for runs whose
//! collectives cross a real network stack. Each host is a network namespace of its own with one
//! interface (`eth0`, on the private subnet `SUBNET`.0/24, which exists only inside the lab), plugged into
//! one bridge that lives in a namespace of its own too (the lab's switch); `tc tbf` shapes each host's link
//! in both directions (its `eth0` out, the switch's port towards it in). Nothing is created outside the
//! lab's namespaces, no route leads out of them, and `down` removes them whole.
//!
//! `run` starts an MPI job across the hosts: `mpirun` in host 0's namespace, its daemons on the others
//! started by `nanodist netlab agent` (Open MPI's rsh agent, which enters the host's namespace), MPI's
//! TCP transport and out-of-band channel bound to the lab's subnet. It reads each link's kernel byte
//! counters before and after, so a run's logged bytes can be checked against what crossed the wire.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::bad_input;

/// The lab's private subnet (its /24): host i is SUBNET.(i + 1).
pub const SUBNET: &str = "10.233.0";

/// A link rate, in kbit/s as `tc` takes it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Rate {
    pub kbit: u64,
}

impl Rate {
    /// "20mbit", "500mbit", "1gbit", "800kbit" (tc's units, bits per second).
    pub fn parse(s: &str) -> Result<Self> {
        let t = s.trim().to_ascii_lowercase();
        let (num, unit) = t.split_at(t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len()));
        let scale = match unit {
            "kbit" => 1.0,
            "mbit" => 1e3,
            "gbit" => 1e6,
            _ => {
                return Err(bad_input!(
                    "rate {s:?}: expected a number and kbit, mbit or gbit (e.g. 20mbit)"
                ))
            }
        };
        match num.parse::<f64>() {
            Ok(x) if x > 0.0 && (x * scale) >= 8.0 => Ok(Rate {
                kbit: (x * scale).round() as u64,
            }),
            _ => Err(bad_input!(
                "rate {s:?}: expected a positive rate of at least 8kbit (e.g. 20mbit)"
            )),
        }
    }

    /// Bytes per second.
    pub fn bytes_per_s(self) -> f64 {
        self.kbit as f64 * 1000.0 / 8.0
    }
}

impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kbit {
            k if k >= 1_000_000 && k % 1000 == 0 => write!(f, "{} Gbit/s", k as f64 / 1e6),
            k if k >= 1000 => write!(f, "{} Mbit/s", k as f64 / 1e3),
            k => write!(f, "{k} kbit/s"),
        }
    }
}

/// One lab, by name: its namespaces are `nd-NAME-sw` (the switch) and `nd-NAME-h0`, `nd-NAME-h1`, ...
#[derive(Debug, Clone)]
pub struct Lab {
    pub name: String,
}

/// A host as `status` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Host {
    pub index: usize,
    pub namespace: String,
    pub ip: String,
    /// The shaped rate of its link (out of it, and into it), if any.
    pub rate_out: Option<Rate>,
    pub rate_in: Option<Rate>,
    /// Whether the switch's port towards it is up (`cut` takes it down).
    pub link_up: bool,
    /// The kernel's counters of its `eth0`.
    pub tx_bytes: u64,
    pub rx_bytes: u64,
}

impl Lab {
    /// A lab named `name` (letters, digits and '-', at most 8: namespace and interface names are short).
    pub fn new(name: &str) -> Result<Self> {
        let ok = !name.is_empty()
            && name.len() <= 8
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
        if !ok {
            return Err(bad_input!(
                "netlab --name {name:?}: expected 1 to 8 letters, digits or '-'"
            ));
        }
        Ok(Lab { name: name.into() })
    }

    fn switch(&self) -> String {
        format!("nd-{}-sw", self.name)
    }

    pub fn namespace(&self, host: usize) -> String {
        format!("nd-{}-h{host}", self.name)
    }

    pub fn ip(host: usize) -> String {
        format!("{SUBNET}.{}", host + 1)
    }

    /// The lab's namespaces that exist now.
    fn namespaces(&self) -> Result<Vec<String>> {
        let out = run_out(Command::new("ip").args(["netns", "list"]))?;
        let prefix = format!("nd-{}-", self.name);
        Ok(out
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|n| n.starts_with(&prefix))
            .map(String::from)
            .collect())
    }

    /// The indices of the lab's hosts, in order (none: the lab is down).
    pub fn hosts(&self) -> Result<Vec<usize>> {
        let prefix = format!("nd-{}-h", self.name);
        let mut hosts: Vec<usize> = self
            .namespaces()?
            .iter()
            .filter_map(|n| n.strip_prefix(&prefix)?.parse().ok())
            .collect();
        hosts.sort_unstable();
        Ok(hosts)
    }

    /// Creates the lab (after removing what is left of one of the same name): `hosts` hosts, each link
    /// shaped to `rate` both ways. Returns whether latency is emulated (`delay` needs the kernel's
    /// netem, which not every kernel has).
    pub fn up(&self, hosts: usize, rate: Rate, delay_ms: Option<f64>) -> Result<bool> {
        check_tools(false)?;
        if !(2..=250).contains(&hosts) {
            return Err(bad_input!(
                "netlab up --hosts {hosts}: expected 2 to 250 hosts"
            ));
        }
        self.down()?;
        let sw = self.switch();
        ip(&["netns", "add", &sw])?;
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &sw, "link", "set", "br0", "up"])?;
        for h in 0..hosts {
            let ns = self.namespace(h);
            let port = format!("h{h}");
            ip(&["netns", "add", &ns])?;
            // The pair is made inside the two namespaces at once: it never exists outside them.
            ip(&[
                "link", "add", "eth0", "netns", &ns, "type", "veth", "peer", "name", &port,
                "netns", &sw,
            ])?;
            ip(&["-n", &sw, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &sw, "link", "set", &port, "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", Lab::ip(h)),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            self.shape(h, rate)?;
        }
        match delay_ms {
            Some(ms) => self.delay(hosts, ms),
            None => Ok(false),
        }
    }

    /// netem's delay on every host's outgoing link, when the kernel has netem (then true).
    fn delay(&self, hosts: usize, ms: f64) -> Result<bool> {
        for h in 0..hosts {
            let ns = self.namespace(h);
            let delay = format!("{ms}ms");
            let netem = Command::new("tc")
                .args([
                    "-n", &ns, "qdisc", "add", "dev", "eth0", "parent", "1:1", "handle", "10:",
                ])
                .args(["netem", "delay", &delay])
                .output()
                .context("running tc")?;
            if !netem.status.success() {
                tracing::warn!(
                    "netlab: latency is not emulated: this kernel has no netem ({})",
                    String::from_utf8_lossy(&netem.stderr).trim()
                );
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Shapes host `h`'s link to `rate` in both directions (tbf: a bucket of 1 ms of traffic, at least
    /// 4 KB, and at most 200 ms queued). A bucket refills while a rank computes and lets the next bytes
    /// through at line rate: at 10 ms of traffic a 50 Mbit/s link let PowerSGD's 140 kB a step cross in
    /// 13 ms instead of 22. At 1 ms one TCP stream still keeps 96% of the rate (47.8 of 50 Mbit/s).
    pub fn shape(&self, h: usize, rate: Rate) -> Result<()> {
        let burst = ((rate.bytes_per_s() * 0.001) as u64).max(4096);
        let tbf = |ns: &str, dev: &str| {
            tc(&[
                "-n",
                ns,
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "handle",
                "1:",
                "tbf",
                "rate",
                &format!("{}kbit", rate.kbit),
                "burst",
                &burst.to_string(),
                "latency",
                "200ms",
            ])
        };
        self.require(h)?;
        tbf(&self.namespace(h), "eth0")?;
        tbf(&self.switch(), &format!("h{h}"))
    }

    /// Takes host `h`'s link down (`up = false`, the switch's port) or back up.
    pub fn link(&self, h: usize, up: bool) -> Result<()> {
        self.require(h)?;
        let state = if up { "up" } else { "down" };
        ip(&["-n", &self.switch(), "link", "set", &format!("h{h}"), state])
    }

    /// How many of a job's ranks (nanodist processes) run in the lab's hosts.
    pub fn ranks(&self) -> Result<usize> {
        let mut n = 0;
        for h in self.hosts()? {
            let pids = run_out(Command::new("ip").args(["netns", "pids", &self.namespace(h)]))?;
            n += pids
                .split_whitespace()
                .filter(|p| {
                    std::fs::read_to_string(format!("/proc/{p}/comm"))
                        .is_ok_and(|c| c.trim() == "nanodist")
                })
                .count();
        }
        Ok(n)
    }

    /// Waits (at most `limit`) until no TCP connection of an earlier job is left in the lab's hosts: the
    /// sockets of a job killed beyond a cut link linger (FIN-WAIT, with data queued) until the link is
    /// back and they drain, and hold the ports (Open MPI's from 1024) the next job binds.
    pub fn drain(&self, limit: Duration) -> Result<()> {
        let start = std::time::Instant::now();
        loop {
            let mut lingering = 0;
            for h in self.hosts()? {
                let ns = self.namespace(h);
                let out = run_out(Command::new("ip").args(["netns", "exec", &ns, "ss", "-Htan"]))?;
                lingering += out
                    .lines()
                    .filter(|l| !l.starts_with("LISTEN") && !l.starts_with("TIME-WAIT"))
                    .count();
            }
            if lingering == 0 || start.elapsed() > limit {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// SIGKILLs every process in host `h`'s namespace; how many.
    pub fn kill(&self, h: usize) -> Result<usize> {
        self.require(h)?;
        kill_all(&self.namespace(h))
    }

    fn require(&self, h: usize) -> Result<()> {
        let hosts = self.hosts()?;
        if !hosts.contains(&h) {
            return Err(bad_input!(
                "netlab {}: no host {h} (the lab has {}; `netlab up` makes one)",
                self.name,
                match hosts.len() {
                    0 => "none".to_string(),
                    n => format!("hosts 0..{}", n - 1),
                }
            ));
        }
        Ok(())
    }

    /// Removes the lab's namespaces (its links go with them), first killing what runs in them; how many
    /// there were. Removing a lab that is not there does nothing.
    pub fn down(&self) -> Result<usize> {
        check_tools(false)?;
        let namespaces = self.namespaces()?;
        for h in self.hosts()? {
            let _ = std::fs::remove_dir_all(self.tmpdir(h)?);
        }
        for ns in &namespaces {
            kill_all(ns)?;
            ip(&["netns", "del", ns])?;
        }
        Ok(namespaces.len())
    }

    /// Each host's address, rates, link state and kernel counters.
    pub fn status(&self) -> Result<Vec<Host>> {
        self.hosts()?
            .into_iter()
            .map(|h| {
                let (ns, sw, port) = (self.namespace(h), self.switch(), format!("h{h}"));
                let (tx_bytes, rx_bytes) = counters(&ns, "eth0")?;
                Ok(Host {
                    index: h,
                    ip: Lab::ip(h),
                    rate_out: tbf_rate(&ns, "eth0")?,
                    rate_in: tbf_rate(&sw, &port)?,
                    link_up: link_up(&sw, &port)?,
                    namespace: ns,
                    tx_bytes,
                    rx_bytes,
                })
            })
            .collect()
    }

    /// `mpirun` across the lab: `ranks_per_host` ranks on each host, running `exe` with `args`.
    pub fn mpirun(&self, ranks_per_host: usize, exe: &Path, args: &[String]) -> Result<Command> {
        check_tools(true)?;
        let hosts = self.hosts()?;
        if hosts.len() < 2 {
            return Err(bad_input!(
                "netlab {}: the lab is down; start it with `nanodist netlab up --hosts N --rate R`",
                self.name
            ));
        }
        let list: Vec<String> = hosts
            .iter()
            .map(|&h| format!("{}:{ranks_per_host}", Lab::ip(h)))
            .collect();
        let me = std::env::current_exe().context("locating the nanodist binary")?;
        let agent = format!("{} netlab agent --name={}", me.display(), self.name);
        let subnet = format!("{SUBNET}.0/24");
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.namespace(hosts[0]), "mpirun"])
            .args([
                "--oversubscribe",
                "-np",
                &(hosts.len() * ranks_per_host).to_string(),
            ])
            .args(["--host", &list.join(",")])
            .args(["--mca", "plm_rsh_agent", &agent])
            .args(["--mca", "btl", "tcp,self"])
            .args(["--mca", "btl_tcp_if_include", &subnet])
            .args(["--mca", "oob_tcp_if_include", &subnet])
            // Each rank believes its host is its own, but the lab's hosts share this machine's cores: a
            // rank that busy-polls in a collective would take the core its peer computes on (steps
            // then cost scheduler ticks, 4 ms each).
            .args(["--mca", "mpi_yield_when_idle", "1"])
            // Each host's daemon would bind its first rank to "its" first core: every host's to the same
            // core of this machine.
            .args(["--bind-to", "none"])
            .arg(exe)
            .args(args)
            .env("TMPDIR", self.tmpdir(hosts[0])?);
        if is_root() {
            // Open MPI refuses root unless told twice; the lab needs root anyway.
            c.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
                .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        }
        Ok(c)
    }

    /// Open MPI's rsh agent for the lab: `HOST COMMAND...` runs COMMAND in the namespace of the host
    /// whose address is HOST, through `sh -c` as ssh would.
    pub fn agent(&self, host: &str, command: &[String]) -> Result<Command> {
        let h = (0..250)
            .find(|&h| Lab::ip(h) == host)
            .with_context(|| format!("netlab agent: {host} is no host of lab {}", self.name))?;
        let mut c = Command::new("ip");
        c.args([
            "netns",
            "exec",
            &self.namespace(h),
            "sh",
            "-c",
            &command.join(" "),
        ])
        .env("TMPDIR", self.tmpdir(h)?);
        Ok(c)
    }

    /// Host `h`'s own temporary directory. Open MPI keeps a job's session directory in it, named by the
    /// host name, which the lab's hosts share: with one /tmp, two daemons of a job raced to create the
    /// same directory ("File exists") or to write hwloc's topology file in it (a segfault).
    fn tmpdir(&self, h: usize) -> Result<PathBuf> {
        let d = Path::new("/tmp").join(format!("nanodist-netlab-{}-h{h}", self.name));
        std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
        Ok(d)
    }
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|u| u.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

/// The lab needs root and iproute2's `ip` and `tc` (and `mpirun` to run jobs): bad input naming what is
/// missing.
pub fn check_tools(mpirun: bool) -> Result<()> {
    if !is_root() {
        return Err(bad_input!(
            "netlab makes network namespaces, which needs root: run it as root (e.g. sudo nanodist netlab ...)"
        ));
    }
    let mut tools = vec![("ip", "iproute2"), ("tc", "iproute2")];
    if mpirun {
        tools.push(("mpirun", "openmpi-bin"));
    }
    for (tool, package) in tools {
        if !on_path(tool) {
            return Err(bad_input!(
                "netlab needs `{tool}`, which is not on PATH: install the {package} package"
            ));
        }
    }
    Ok(())
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

fn run_out(c: &mut Command) -> Result<String> {
    let what = format!("{c:?}");
    let out = c.output().with_context(|| format!("running {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn ip(args: &[&str]) -> Result<()> {
    run_out(Command::new("ip").args(args)).map(|_| ())
}

fn tc(args: &[&str]) -> Result<()> {
    run_out(Command::new("tc").args(args)).map(|_| ())
}

/// SIGKILLs every process in namespace `ns`; how many.
fn kill_all(ns: &str) -> Result<usize> {
    let pids = run_out(Command::new("ip").args(["netns", "pids", ns]))?;
    let pids: Vec<&str> = pids.split_whitespace().collect();
    if !pids.is_empty() {
        // Gone already is fine: the namespace is what must go.
        let _ = Command::new("kill")
            .arg("-KILL")
            .args(&pids)
            .stderr(Stdio::null())
            .status();
    }
    Ok(pids.len())
}

/// (tx, rx) bytes of `dev` in namespace `ns` (the kernel's counters, `ip -s link`).
pub fn counters(ns: &str, dev: &str) -> Result<(u64, u64)> {
    let out = run_out(Command::new("ip").args(["-n", ns, "-s", "-j", "link", "show", dev]))?;
    let v: serde_json::Value = serde_json::from_str(&out).context("ip -j link's output")?;
    let stats = &v[0]["stats64"];
    let get = |dir: &str| {
        stats[dir]["bytes"]
            .as_u64()
            .context("ip -s -j link: no byte counter")
    };
    Ok((get("tx")?, get("rx")?))
}

fn tbf_rate(ns: &str, dev: &str) -> Result<Option<Rate>> {
    let out = run_out(Command::new("tc").args(["-n", ns, "-j", "qdisc", "show", "dev", dev]))?;
    let v: serde_json::Value = serde_json::from_str(&out).context("tc -j qdisc's output")?;
    Ok(v.as_array().into_iter().flatten().find_map(|q| {
        (q["kind"] == "tbf")
            .then(|| q["options"]["rate"].as_u64())?
            .map(|bytes_per_s| Rate {
                kbit: bytes_per_s * 8 / 1000,
            })
    }))
}

fn link_up(ns: &str, dev: &str) -> Result<bool> {
    let out = run_out(Command::new("ip").args(["-n", ns, "-j", "link", "show", dev]))?;
    let v: serde_json::Value = serde_json::from_str(&out).context("ip -j link's output")?;
    Ok(v[0]["flags"]
        .as_array()
        .is_some_and(|f| f.iter().any(|x| x == "UP")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse_in_tc_units_or_say_what_is_expected() {
        assert_eq!(Rate::parse("20mbit").unwrap().kbit, 20_000);
        assert_eq!(Rate::parse("1.5Gbit").unwrap().kbit, 1_500_000);
        assert_eq!(Rate::parse("800kbit").unwrap().kbit, 800);
        assert_eq!(Rate::parse("20mbit").unwrap().to_string(), "20 Mbit/s");
        for bad in ["20", "20mb", "-1mbit", "0gbit", "fast"] {
            let e = Rate::parse(bad).unwrap_err();
            assert_eq!(crate::error::exit_code(&e), 2, "{bad}");
        }
        assert!(Lab::new("a-lab").is_ok() && Lab::new("much-too-long").is_err());
        assert_eq!(Lab::ip(0), format!("{SUBNET}.1"));
    }

    #[test]
    fn only_train_and_calibrate_run_across_the_hosts() {
        let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        for ok in [&["train", "c.toml"][..], &["calibrate", "--engine", "mpi"]] {
            assert!(job_command(&args(ok)).is_ok(), "{ok:?}");
        }
        for bad in [&["frobnicate"][..], &["predict", "run"], &[], &["--help"]] {
            let e = job_command(&args(bad)).unwrap_err();
            assert_eq!(crate::error::exit_code(&e), 2, "{bad:?}");
            assert!(e.to_string().contains("train, calibrate"), "{e}");
        }
    }
}

/// `nanodist netlab ...`.
#[derive(Debug, clap::Subcommand)]
pub enum NetlabCommand {
    /// Create the lab: HOSTS network namespaces on a private subnet, one bridge, each link shaped to RATE
    /// both ways (replaces a lab of the same name).
    Up {
        #[arg(long, default_value_t = 2)]
        hosts: usize,
        /// Each link's rate, as tc writes it: 20mbit, 500mbit, 1gbit.
        #[arg(long, default_value = "1gbit")]
        rate: String,
        /// One-way latency to add to each host's outgoing link (needs the kernel's netem; without it
        /// the lab says that latency is not emulated).
        #[arg(long, value_name = "MS")]
        delay_ms: Option<f64>,
        #[arg(long, default_value = "lab")]
        name: String,
    },
    /// Remove the lab (its namespaces and links; what runs in them is killed).
    Down {
        #[arg(long, default_value = "lab")]
        name: String,
    },
    /// Each host: address, link rates, link state, and its interface's kernel byte counters.
    Status {
        #[arg(long, default_value = "lab")]
        name: String,
        /// One JSON object per host.
        #[arg(long)]
        json: bool,
    },
    /// Shape HOST's link to RATE both ways (one slow host: a straggler's link).
    Shape {
        host: usize,
        rate: String,
        #[arg(long, default_value = "lab")]
        name: String,
    },
    /// Take HOST's link down (a cut cable).
    Cut {
        host: usize,
        #[arg(long, default_value = "lab")]
        name: String,
    },
    /// Bring HOST's link back up, or every host's.
    Heal {
        host: Option<usize>,
        #[arg(long, default_value = "lab")]
        name: String,
    },
    /// SIGKILL every process on HOST (a host that dies).
    Kill {
        host: usize,
        #[arg(long, default_value = "lab")]
        name: String,
    },
    /// Run `nanodist ARGS...` as an MPI job across the hosts (mpirun in host 0's namespace), then print
    /// each host's bytes on the wire during the run.
    Run {
        #[arg(long, default_value_t = 1)]
        ranks_per_host: usize,
        #[arg(long, default_value = "lab")]
        name: String,
        /// The nanodist command to run, e.g. `train CONFIG --set train.engine=mpi`.
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Internal: Open MPI's rsh agent (`HOST COMMAND...` in that host's namespace).
    #[command(hide = true)]
    Agent {
        #[arg(long, default_value = "lab")]
        name: String,
        host: String,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<String>,
    },
}

/// Runs a `netlab` subcommand; the exit code of the job for `run`.
pub fn command(c: NetlabCommand) -> Result<i32> {
    match c {
        NetlabCommand::Up {
            hosts,
            rate,
            delay_ms,
            name,
        } => {
            let (lab, rate) = (Lab::new(&name)?, Rate::parse(&rate)?);
            let delayed = lab.up(hosts, rate, delay_ms)?;
            println!(
                "lab {name}: {hosts} hosts on {SUBNET}.0/24, each link {rate} both ways; latency {}",
                match (delay_ms, delayed) {
                    (Some(ms), true) => format!("{ms} ms one way (netem)"),
                    (Some(_), false) => "not emulated (no netem in this kernel)".into(),
                    (None, _) => "not emulated (--delay-ms adds it where netem exists)".into(),
                }
            );
        }
        NetlabCommand::Down { name } => {
            let n = Lab::new(&name)?.down()?;
            println!("lab {name}: {n} namespace(s) removed");
        }
        NetlabCommand::Status { name, json } => print_status(&Lab::new(&name)?, json)?,
        NetlabCommand::Shape { host, rate, name } => {
            let rate = Rate::parse(&rate)?;
            Lab::new(&name)?.shape(host, rate)?;
            println!("lab {name}: host {host}'s link is {rate} both ways");
        }
        NetlabCommand::Cut { host, name } => Lab::new(&name)?.link(host, false)?,
        NetlabCommand::Heal { host, name } => {
            let lab = Lab::new(&name)?;
            for h in host.map_or_else(|| lab.hosts(), |h| Ok(vec![h]))? {
                lab.link(h, true)?;
            }
        }
        NetlabCommand::Kill { host, name } => {
            let n = Lab::new(&name)?.kill(host)?;
            println!("lab {name}: {n} process(es) on host {host} killed");
        }
        NetlabCommand::Run {
            ranks_per_host,
            name,
            args,
        } => return run_job(&Lab::new(&name)?, ranks_per_host, &args),
        NetlabCommand::Agent {
            name,
            host,
            command,
        } => {
            use std::os::unix::process::CommandExt;
            let err = Lab::new(&name)?.agent(&host, &command)?.exec();
            return Err(err).context("netlab agent: entering the host's namespace");
        }
    }
    Ok(0)
}

fn print_status(lab: &Lab, json: bool) -> Result<()> {
    let hosts = lab.status()?;
    if json {
        println!("{}", serde_json::to_string_pretty(&hosts)?);
        return Ok(());
    }
    if hosts.is_empty() {
        println!("lab {}: down", lab.name);
        return Ok(());
    }
    println!("host  address       out          in           link  tx           rx");
    let rate = |r: Option<Rate>| r.map_or("unshaped".into(), |r| r.to_string());
    for h in hosts {
        println!(
            "{:<5} {:<13} {:<12} {:<12} {:<5} {:<12} {}",
            h.index,
            h.ip,
            rate(h.rate_out),
            rate(h.rate_in),
            if h.link_up { "up" } else { "cut" },
            crate::units::bytes(h.tx_bytes as f64),
            crate::units::bytes(h.rx_bytes as f64)
        );
    }
    Ok(())
}

/// `netlab run`: the job under mpirun across the lab, then each host's bytes on the wire during it.
fn run_job(lab: &Lab, ranks_per_host: usize, args: &[String]) -> Result<i32> {
    job_command(args)?;
    let exe = std::env::current_exe().context("locating the nanodist binary")?;
    let mut c = lab.mpirun(ranks_per_host, &exe, args)?;
    lab.drain(Duration::from_secs(30))?;
    let before = lab.status()?;
    let mut child = c.spawn().context("running mpirun in the lab")?;
    let code = wait_job(lab, &mut child)?;
    // What is left of the job (a daemon or a rank beyond a cut link) goes with it, as a batch system
    // cleans up a job's processes: it would hold on to the next job's ports and connections.
    for h in lab.hosts()? {
        kill_all(&lab.namespace(h))?;
    }
    let after = lab.status()?;
    for h in after.iter().filter(|h| code != 0 && !h.link_up) {
        eprintln!(
            "netlab {}: the job failed while host {} ({})'s link was cut: its ranks were unreachable",
            lab.name, h.index, h.ip
        );
    }
    println!(
        "netlab {}: bytes on the wire during the run (kernel counters of each host's eth0)",
        lab.name
    );
    for (a, b) in before.iter().zip(&after) {
        println!(
            "host {} ({}): sent {} ({} B), received {} ({} B)",
            a.index,
            a.ip,
            crate::units::bytes((b.tx_bytes - a.tx_bytes) as f64),
            b.tx_bytes - a.tx_bytes,
            crate::units::bytes((b.rx_bytes - a.rx_bytes) as f64),
            b.rx_bytes - a.rx_bytes
        );
    }
    Ok(code)
}

/// The commands `netlab run` runs across the hosts: MPI jobs of nanodist.
const JOBS: [&str; 2] = ["train", "calibrate"];

/// Refuses (bad input) a job that is not one of `JOBS`, before any host starts it.
fn job_command(args: &[String]) -> Result<()> {
    match args.first() {
        Some(cmd) if JOBS.contains(&cmd.as_str()) => Ok(()),
        other => Err(bad_input!(
            "netlab run: `{}` is not a job to run across the hosts; expected one of {} (e.g. \
             `nanodist netlab run -- train config/quickstart-char.toml --set train.engine=\"mpi\"`)",
            other.map_or("", String::as_str),
            JOBS.join(", ")
        )),
    }
}

/// How long mpirun may outlive the last of the job's ranks before `netlab run` ends it.
const MPIRUN_GRACE: Duration = Duration::from_secs(10);

/// mpirun's exit code. When every rank has exited but mpirun has not within `MPIRUN_GRACE` (a cut link
/// leaves it waiting for a daemon it cannot reach, as on a real cluster), it and the lab's daemons are
/// killed and the job counts as failed (1).
fn wait_job(lab: &Lab, child: &mut std::process::Child) -> Result<i32> {
    let (mut seen, mut gone_since) = (false, None::<std::time::Instant>);
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status.code().unwrap_or(1));
        }
        std::thread::sleep(Duration::from_millis(200));
        let ranks = lab.ranks()?;
        seen |= ranks > 0;
        match (seen && ranks == 0, gone_since) {
            (false, _) => gone_since = None,
            (true, None) => gone_since = Some(std::time::Instant::now()),
            (true, Some(t)) if t.elapsed() > MPIRUN_GRACE => {
                eprintln!(
                    "netlab {}: every rank has exited but mpirun has not after {MPIRUN_GRACE:?} (a daemon it \
                     cannot reach?): ending it",
                    lab.name
                );
                let _ = child.kill();
                let _ = child.wait();
                return Ok(1);
            }
            (true, Some(_)) => {}
        }
    }
}
