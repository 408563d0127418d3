//! A lab of network namespaces: every worker on a "host" of its own, with its own address,
//! wired to one bridge; faults cut hosts and links at the IP layer, for the data plane and
//! the control plane alike.
//!
//! ```text
//!   netns <lab>-hub: bridge br0 10.X.Y.1/24, the coordinator(s)
//!        │ veth h-w0        │ veth h-w1        ...
//!   netns <lab>-w0: eth0 10.X.Y.2     netns <lab>-w1: eth0 10.X.Y.3     ...
//! ```
//!
//! Nothing is created in the namespace the harness runs in: the bridge lives in the hub
//! namespace, and each veth pair is created there with its other end moved straight into the
//! worker's namespace. Processes start inside a namespace through `ip netns exec`, which
//! execs in place, so the harness's PID is the process's and signals reach it.
//!
//! Faults:
//! - [`NetLab::isolate`]: the host's cable is pulled (its bridge port goes down): every
//!   packet to or from it vanishes, heartbeats included, with no RST and no error on the
//!   host's sockets;
//! - [`NetLab::drop_route`]: packets from one host to another vanish (a `blackhole` route in
//!   the sender's namespace); both directions make a symmetric partition. On an established
//!   TCP connection a packet that has no route is a soft error: the socket keeps retrying
//!   and the application sees silence, as on a real partition.
//!
//! Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2; [`NetLab::probe`] says whether
//! this machine has them. Namespaces are named after the harness's PID, so a lab left behind
//! by a killed harness is removed by the next one ([`NetLab::sweep_stale`]).

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

/// Errors of the lab.
#[derive(Debug, thiserror::Error)]
pub enum NetLabError {
    /// An `ip` command failed.
    #[error("`ip {args}` failed: {detail}")]
    Ip {
        /// The arguments.
        args: String,
        /// Its stderr or the spawn error.
        detail: String,
    },
    /// The host is not in the lab, or the lab is full.
    #[error("{0}")]
    Lab(String),
}

/// Prefix of every namespace a lab creates (then the harness PID and a counter).
const PREFIX: &str = "cohort-chaos-";

/// Most hosts per lab (a /24, less the bridge's and the network's addresses).
const MAX_HOSTS: usize = 250;

/// Runs `ip ARGS`; fails with its stderr.
fn ip(args: &[&str]) -> Result<(), NetLabError> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| NetLabError::Ip { args: args.join(" "), detail: e.to_string() })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(NetLabError::Ip { args: args.join(" "), detail: String::from_utf8_lossy(&out.stderr).trim().to_string() })
    }
}

/// One worker's host.
#[derive(Clone, Debug)]
struct Host {
    ns: String,
    port: String,
    addr: Ipv4Addr,
}

/// A hub namespace with a bridge and one namespace per host. Dropping it deletes them all.
#[derive(Debug)]
pub struct NetLab {
    name: String,
    hub: String,
    subnet: [u8; 3],
    hosts: BTreeMap<String, Host>,
}

impl NetLab {
    /// Whether namespaces can be made here: `Err` says why not (not root, no iproute2, the
    /// kernel refuses).
    pub fn probe() -> Result<(), String> {
        let name = format!("{PREFIX}{}-probe", std::process::id());
        ip(&["netns", "add", &name]).map_err(|e| e.to_string())?;
        let wired = ip(&["-n", &name, "link", "add", "p0", "type", "veth", "peer", "name", "p1"]);
        let _ = ip(&["netns", "del", &name]);
        wired.map_err(|e| e.to_string())
    }

    /// Removes namespaces left by harnesses that are no longer running.
    pub fn sweep_stale() {
        let Ok(entries) = std::fs::read_dir("/run/netns") else { return };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            let Some(pid) =
                name.strip_prefix(PREFIX).and_then(|rest| rest.split('-').next()).and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                tracing::info!(namespace = %name, "removing a namespace left by harness {pid}");
                let _ = ip(&["netns", "del", &name]);
            }
        }
    }

    /// Creates the hub namespace and its bridge on a random 10.X.Y.0/24 (private to the lab:
    /// no route to it exists outside its namespaces).
    ///
    /// The bridge gets a fixed MAC address ([`NetLab::bridge_mac`]). Left to itself, a Linux
    /// bridge takes the lowest MAC of its ports, so adding a host can change it: the hosts
    /// that resolved the hub's address before then keep sending to the old MAC, which the
    /// bridge passes up as another host's traffic and IP drops. Their connections to the
    /// coordinator go silent until the ARP entry goes stale (tens of seconds), and a worker
    /// that joined just before the next host was wired missed the first generation.
    pub fn create() -> Result<Self, NetLabError> {
        static LABS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = LABS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("{PREFIX}{}-{n}", std::process::id());
        let subnet = [10, 200 + rand::random::<u8>() % 50, rand::random::<u8>()];
        let lab = Self { hub: format!("{name}-hub"), name, subnet, hosts: BTreeMap::new() };
        ip(&["netns", "add", &lab.hub])?;
        let bridge = format!("{}/24", lab.hub_address());
        let mac = lab.bridge_mac();
        for args in [
            vec!["-n", &lab.hub, "link", "set", "lo", "up"],
            vec!["-n", &lab.hub, "link", "add", "br0", "address", &mac, "type", "bridge"],
            vec!["-n", &lab.hub, "addr", "add", &bridge, "dev", "br0"],
            vec!["-n", &lab.hub, "link", "set", "br0", "up"],
        ] {
            ip(&args)?;
        }
        Ok(lab)
    }

    /// The bridge's address, in the hub namespace (where the coordinators listen).
    pub fn hub_address(&self) -> Ipv4Addr {
        Ipv4Addr::new(self.subnet[0], self.subnet[1], self.subnet[2], 1)
    }

    /// The bridge's MAC address: locally administered, unicast, made of the lab's subnet.
    /// Set explicitly, it never follows the ports' (see [`NetLab::create`]).
    pub fn bridge_mac(&self) -> String {
        let [_, x, y] = self.subnet;
        format!("02:00:0a:{x:02x}:{y:02x}:01")
    }

    /// The hub namespace's name.
    pub fn hub(&self) -> &str {
        &self.hub
    }

    /// Adds host `name` (a namespace wired to the bridge); returns its address.
    pub fn add_host(&mut self, name: &str) -> Result<Ipv4Addr, NetLabError> {
        if let Some(h) = self.hosts.get(name) {
            return Ok(h.addr);
        }
        if self.hosts.len() >= MAX_HOSTS {
            return Err(NetLabError::Lab(format!("lab {} is full ({MAX_HOSTS} hosts)", self.name)));
        }
        let index = self.hosts.len();
        let addr = Ipv4Addr::new(self.subnet[0], self.subnet[1], self.subnet[2], 2 + index as u8);
        let host = Host { ns: format!("{}-h{index}", self.name), port: format!("h{index}"), addr };
        ip(&["netns", "add", &host.ns])?;
        // Registered before wiring, so that a failure part-way is cleaned up on drop.
        self.hosts.insert(name.to_string(), host.clone());
        let cidr = format!("{addr}/24");
        for args in [
            vec!["-n", &host.ns, "link", "set", "lo", "up"],
            vec!["-n", &self.hub, "link", "add", &host.port, "type", "veth", "peer", "name", "eth0", "netns", &host.ns],
            vec!["-n", &self.hub, "link", "set", &host.port, "master", "br0"],
            vec!["-n", &self.hub, "link", "set", &host.port, "up"],
            vec!["-n", &host.ns, "addr", "add", &cidr, "dev", "eth0"],
            vec!["-n", &host.ns, "link", "set", "eth0", "up"],
        ] {
            ip(&args)?;
        }
        Ok(addr)
    }

    /// Address of host `name`.
    pub fn address(&self, name: &str) -> Option<Ipv4Addr> {
        self.hosts.get(name).map(|h| h.addr)
    }

    /// A command that runs `program` inside host `name`'s namespace (`None`: the hub's).
    pub fn command(
        &self,
        host: Option<&str>,
        program: &std::path::Path,
    ) -> Result<tokio::process::Command, NetLabError> {
        let ns = match host {
            None => self.hub.clone(),
            Some(h) => self.host(h)?.ns.clone(),
        };
        let mut cmd = tokio::process::Command::new("ip");
        cmd.args(["netns", "exec", &ns]).arg(program);
        Ok(cmd)
    }

    fn host(&self, name: &str) -> Result<&Host, NetLabError> {
        self.hosts.get(name).ok_or_else(|| NetLabError::Lab(format!("no host {name} in lab {}", self.name)))
    }

    /// Pulls (`true`) or plugs back (`false`) host `name`'s cable: its bridge port goes
    /// down or up.
    pub fn isolate(&self, name: &str, cut: bool) -> Result<(), NetLabError> {
        let host = self.host(name)?;
        ip(&["-n", &self.hub, "link", "set", &host.port, if cut { "down" } else { "up" }])
    }

    /// Makes packets from host `from` to host `to` vanish (`true`) or flow again (`false`).
    pub fn drop_route(&self, from: &str, to: &str, drop: bool) -> Result<(), NetLabError> {
        let (src, dst) = (self.host(from)?, self.host(to)?);
        let target = format!("{}/32", dst.addr);
        ip(&["-n", &src.ns, "route", if drop { "add" } else { "del" }, "blackhole", &target])
    }
}

impl Drop for NetLab {
    fn drop(&mut self) {
        // Deleting a namespace deletes its end of every veth pair, and with it the other end.
        for host in self.hosts.values() {
            if let Err(e) = ip(&["netns", "del", &host.ns]) {
                tracing::warn!(error = %e, "removing a lab namespace");
            }
        }
        if let Err(e) = ip(&["netns", "del", &self.hub]) {
            tracing::warn!(error = %e, "removing the lab's hub namespace");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpListener, TcpStream};
    use std::time::{Duration, Instant};

    /// Runs `f` on a thread that has entered `ns`'s network namespace: sockets it creates
    /// belong to that namespace for good.
    fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{ns}");
        std::thread::spawn(move || {
            let file = std::fs::File::open(&path).expect("namespace file");
            let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
            f()
        })
        .join()
        .expect("namespace thread")
    }

    fn connect(lab: &NetLab, from: Option<&str>, to: SocketAddr) -> std::io::Result<TcpStream> {
        let ns = match from {
            Some(h) => lab.host(h).expect("host").ns.clone(),
            None => lab.hub.clone(),
        };
        in_ns(&ns, move || TcpStream::connect_timeout(&to, Duration::from_millis(500)))
    }

    #[test]
    fn hosts_reach_each_other_and_faults_are_silent() {
        if let Err(why) = NetLab::probe() {
            println!(
                "SKIPPED hosts_reach_each_other_and_faults_are_silent: network namespaces unavailable here: {why}"
            );
            return;
        }
        let mut lab = NetLab::create().expect("lab");
        let a = lab.add_host("a").expect("host a");
        let b = lab.add_host("b").expect("host b");
        assert_ne!(a, b);
        let b_ns = lab.host("b").unwrap().ns.clone();
        let listener = in_ns(&b_ns, move || TcpListener::bind((b, 0)).expect("listen on b"));
        let to_b = listener.local_addr().unwrap();
        // a and the hub reach b; the harness's own namespace does not (nothing routes there).
        let mut a_to_b = connect(&lab, Some("a"), to_b).expect("a reaches b");
        let (mut at_b, _) = listener.accept().unwrap();
        connect(&lab, None, to_b).expect("the hub reaches b");
        let _ = listener.accept().unwrap();

        // A route-level partition a -> b: the established connection sees silence, not an
        // error, and the bytes arrive once healed (TCP retransmits them).
        lab.drop_route("a", "b", true).expect("partition");
        a_to_b.write_all(b"during").expect("a write is buffered, not refused");
        at_b.set_read_timeout(Some(Duration::from_millis(400))).unwrap();
        let mut buf = [0u8; 6];
        let err = at_b.read_exact(&mut buf).expect_err("nothing crosses the partition");
        assert!(matches!(err.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut), "{err}");
        connect(&lab, None, to_b).expect("only a -> b is cut");
        let _ = listener.accept().unwrap();
        lab.drop_route("a", "b", false).expect("heal");
        at_b.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let t = Instant::now();
        at_b.read_exact(&mut buf).expect("retransmitted after the heal");
        assert_eq!(&buf, b"during");
        assert!(t.elapsed() < Duration::from_secs(10));

        // Isolation: b's cable pulled; nobody reaches it; plugged back, it is reachable.
        lab.isolate("b", true).expect("isolate");
        assert!(connect(&lab, None, to_b).is_err(), "b is off the network");
        lab.isolate("b", false).expect("plug back");
        connect(&lab, Some("a"), to_b).expect("b is back");

        let names = [lab.hub.clone(), lab.host("a").unwrap().ns.clone(), b_ns];
        drop(lab);
        for n in names {
            assert!(!std::path::Path::new(&format!("/run/netns/{n}")).exists(), "{n} removed");
        }
    }

    /// The MAC address `ip` reports for `dev` in namespace `ns`.
    fn mac_of(ns: &str, dev: &str) -> String {
        let out = Command::new("ip").args(["-n", ns, "-o", "link", "show", dev]).output().expect("ip link show");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let mac = text.split_whitespace().skip_while(|w| *w != "link/ether").nth(1);
        mac.unwrap_or_else(|| panic!("no MAC in {text:?}")).to_string()
    }

    /// Hosts wired after a connection was made leave it working: the bridge's MAC address
    /// stays the one set at creation (a bridge left to itself takes its lowest port's, and
    /// the hosts that resolved the old one would be cut off from the hub).
    #[test]
    fn adding_hosts_keeps_the_bridges_address_and_the_connections_to_the_hub() {
        if let Err(why) = NetLab::probe() {
            println!("SKIPPED adding_hosts_keeps_the_bridges_address_and_the_connections_to_the_hub: network namespaces unavailable here: {why}");
            return;
        }
        let mut lab = NetLab::create().expect("lab");
        let mac = mac_of(&lab.hub, "br0");
        assert_eq!(mac, lab.bridge_mac());
        lab.add_host("first").expect("host");
        let hub = lab.hub.clone();
        let listener = in_ns(&hub, {
            let addr = lab.hub_address();
            move || TcpListener::bind((addr, 0)).expect("listen on the hub")
        });
        let mut to_hub = connect(&lab, Some("first"), listener.local_addr().unwrap()).expect("first reaches the hub");
        let (mut at_hub, _) = listener.accept().unwrap();
        for i in 0..8 {
            lab.add_host(&format!("later{i}")).expect("host");
            assert_eq!(mac_of(&hub, "br0"), mac, "the bridge's address changed when host {i} was added");
        }
        // The first host's connection, resolved before the others came, still carries bytes
        // both ways.
        to_hub.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        at_hub.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 4];
        to_hub.write_all(b"ping").unwrap();
        at_hub.read_exact(&mut buf).expect("the hub hears the first host");
        at_hub.write_all(b"pong").unwrap();
        to_hub.read_exact(&mut buf).expect("the first host hears the hub");
        assert_eq!(&buf, b"pong");
    }
}
