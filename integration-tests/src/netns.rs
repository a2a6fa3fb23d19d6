//! Network namespaces for partition drills: each process of a cluster in a namespace of
//! its own with one address, all joined by veth pairs to a bridge in a namespace of the
//! lab's, so that a test can cut one process off the network (its port taken off the
//! bridge: its sockets stay open, its packets go nowhere) and heal it. The test's own
//! namespace reaches every address through a veth of its own.
//!
//! Making namespaces needs `CAP_SYS_ADMIN` and `CAP_NET_ADMIN` (root) and `ip` from
//! iproute2; [`Lab::new`] says why when it cannot.

use std::ffi::OsStr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

/// Labs made by this process so far (names and subnets apart).
static LABS: AtomicU32 = AtomicU32::new(0);

/// A process's place in a [`Lab`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// The namespace.
    pub ns: String,
    /// Its address.
    pub ip: String,
    /// Its port on the bridge (in the lab's namespace).
    port: String,
}

/// Namespaces joined by a bridge; every namespace is deleted when dropped.
pub struct Lab {
    prefix: String,
    switch: String,
    subnet: String,
    root_link: String,
    hosts: Vec<Host>,
}

/// Runs `ip ARGS`; the error names the command and what it printed.
fn ip<I, S>(args: I) -> Result<(), String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let args: Vec<String> = args
        .into_iter()
        .map(|a| a.as_ref().to_string_lossy().into_owned())
        .collect();
    let out = Command::new("ip")
        .args(&args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run `ip` ({e}); iproute2 is needed"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Lab {
    /// A new lab, or `None` after a note saying why namespaces cannot be made here.
    pub fn new() -> Option<Lab> {
        match Lab::make() {
            Ok(lab) => Some(lab),
            Err(why) => {
                eprintln!("note: skipped: cannot make network namespaces here: {why}");
                None
            }
        }
    }

    fn make() -> Result<Lab, String> {
        let n = LABS.fetch_add(1, Ordering::Relaxed);
        let id = (std::process::id() % 10_000) * 10 + n % 10;
        let prefix = format!("bt{id}");
        // One /24 per lab, 10.213.x.0, apart from other labs of this and other runs.
        let subnet = format!("10.213.{}", (id % 250) + 1);
        let switch = format!("{prefix}sw");
        let root_link = format!("{prefix}r");
        let lab = Lab {
            prefix,
            switch: switch.clone(),
            subnet: subnet.clone(),
            root_link: root_link.clone(),
            hosts: Vec::new(),
        };
        ip(["netns", "add", &switch])?;
        ip(["-n", &switch, "link", "set", "lo", "up"])?;
        ip(["-n", &switch, "link", "add", "br0", "type", "bridge"])?;
        ip(["-n", &switch, "link", "set", "br0", "up"])?;
        ip([
            "link", "add", &root_link, "type", "veth", "peer", "name", "root", "netns", &switch,
        ])?;
        ip(["addr", "add", &format!("{subnet}.1/24"), "dev", &root_link])?;
        ip(["link", "set", &root_link, "up"])?;
        ip(["-n", &switch, "link", "set", "root", "master", "br0"])?;
        ip(["-n", &switch, "link", "set", "root", "up"])?;
        Ok(lab)
    }

    /// A new namespace on the bridge, for one process (`role` names it in messages).
    pub fn host(&mut self, role: &str) -> Host {
        let k = self.hosts.len() + 2;
        let ns = format!("{}h{k}", self.prefix);
        let port = format!("p{k}");
        let ip_addr = format!("{}.{k}", self.subnet);
        let made = (|| -> Result<(), String> {
            ip(["netns", "add", &ns])?;
            ip(["-n", &ns, "link", "set", "lo", "up"])?;
            ip([
                "-n",
                &self.switch,
                "link",
                "add",
                &port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                &ns,
            ])?;
            ip(["-n", &self.switch, "link", "set", &port, "master", "br0"])?;
            ip(["-n", &self.switch, "link", "set", &port, "up"])?;
            ip([
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{ip_addr}/24"),
                "dev",
                "eth0",
            ])?;
            ip(["-n", &ns, "link", "set", "eth0", "up"])
        })();
        if let Err(e) = made {
            panic!("making the namespace of {role}: {e}");
        }
        let host = Host {
            ns,
            ip: ip_addr,
            port,
        };
        self.hosts.push(host.clone());
        host
    }

    /// Cuts `host` off: its port leaves the bridge. Its sockets stay open; what it sends
    /// and what is sent to it is lost until [`Lab::heal`].
    pub fn cut(&self, host: &Host) {
        ip(["-n", &self.switch, "link", "set", &host.port, "nomaster"])
            .unwrap_or_else(|e| panic!("cutting {}: {e}", host.ns));
    }

    /// Puts `host` back on the bridge.
    pub fn heal(&self, host: &Host) {
        ip([
            "-n",
            &self.switch,
            "link",
            "set",
            &host.port,
            "master",
            "br0",
        ])
        .unwrap_or_else(|e| panic!("healing {}: {e}", host.ns));
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for h in &self.hosts {
            let _ = ip(["netns", "del", &h.ns]);
        }
        let _ = ip(["link", "del", &self.root_link]);
        let _ = ip(["netns", "del", &self.switch]);
    }
}

/// `program` run inside `host`'s namespace (or here, without one).
pub fn command(host: Option<&Host>, program: impl AsRef<OsStr>) -> Command {
    match host {
        Some(h) => {
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", &h.ns]).arg(program);
            cmd
        }
        None => Command::new(program),
    }
}

/// The address a process listens on and is reached at: its host's, or loopback.
pub fn address(host: Option<&Host>) -> &str {
    host.map_or("127.0.0.1", |h| h.ip.as_str())
}
