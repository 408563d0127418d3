//! Which host each worker runs on, when a host holds several workers (`ranks_per_host`).
//!
//! Ranks are the coordinator's business (a generation numbers its members afresh), so
//! workers are placed by their name, once, when they start: a new worker goes to the first
//! host (in the order hosts were made) that runs fewer than `ranks_per_host` live workers,
//! else to a new host. A replacement started after a kill therefore lands on the host that
//! lost a worker, beside the survivor it shares memory with, and a join storm fills the
//! free slots before it opens new hosts. With one rank per host every worker has a host of
//! its own, named after it (as the harness has always run them).
//!
//! Hosts of one rank can also be grouped into nodes (`pods_per_node`): pods of one rank on a
//! Kubernetes node, each with a network namespace of its own, sharing the node's relay
//! directory. A new pod goes to the first node (in the order nodes were made) with fewer than
//! `pods_per_node` live pods, else to a new node (`node<N>`), so a replacement lands on the
//! node that lost a pod.

use std::collections::BTreeMap;

/// The worker -> host map of one cluster.
#[derive(Clone, Debug)]
pub struct Placement {
    per_host: usize,
    /// Host names in the order they were made.
    hosts: Vec<String>,
    /// Worker -> host, for every worker ever placed.
    of: BTreeMap<String, String>,
    /// Pods (hosts of one rank) per node; 1: no nodes.
    per_node: usize,
    /// Node names in the order they were made.
    nodes: Vec<String>,
    /// Worker -> node, for every worker placed while nodes were on.
    node_of: BTreeMap<String, String>,
}

impl Placement {
    /// An empty placement with `per_host` workers per host (0 is taken as 1).
    pub fn new(per_host: usize) -> Self {
        Self {
            per_host: per_host.max(1),
            hosts: Vec::new(),
            of: BTreeMap::new(),
            per_node: 1,
            nodes: Vec::new(),
            node_of: BTreeMap::new(),
        }
    }

    /// Groups the hosts of workers placed from now on into nodes of `per_node` (0 or 1: no
    /// nodes). Meant for one worker per host (pods of one rank).
    pub fn set_pods_per_node(&mut self, per_node: usize) {
        self.per_node = per_node.max(1);
    }

    /// The node worker `name` was placed on (`None` without nodes).
    pub fn node_of(&self, name: &str) -> Option<&str> {
        self.node_of.get(name).map(String::as_str)
    }

    /// Workers per host.
    pub fn per_host(&self) -> usize {
        self.per_host
    }

    /// Places worker `name` and returns its host: where it was placed before if it was; else
    /// the first host whose live workers (`live(worker)`) are fewer than the limit; else a new
    /// host (`host<N>`, or the worker's own name with one worker per host).
    pub fn place(&mut self, name: &str, live: impl Fn(&str) -> bool) -> String {
        if let Some(h) = self.of.get(name) {
            return h.clone();
        }
        let host = if self.per_host == 1 {
            name.to_string()
        } else {
            let free = self
                .hosts
                .iter()
                .find(|h| self.of.iter().filter(|(w, host)| host == h && live(w.as_str())).count() < self.per_host);
            match free {
                Some(h) => h.clone(),
                None => format!("host{}", self.hosts.len()),
            }
        };
        if !self.hosts.contains(&host) {
            self.hosts.push(host.clone());
        }
        self.of.insert(name.to_string(), host.clone());
        if self.per_node > 1 {
            let free = self.nodes.iter().find(|n| {
                self.node_of.iter().filter(|(w, node)| node == n && live(w.as_str())).count() < self.per_node
            });
            let node = match free {
                Some(n) => n.clone(),
                None => {
                    let n = format!("node{}", self.nodes.len());
                    self.nodes.push(n.clone());
                    n
                }
            };
            self.node_of.insert(name.to_string(), node);
        }
        host
    }

    /// The host worker `name` was placed on.
    pub fn host_of(&self, name: &str) -> Option<&str> {
        self.of.get(name).map(String::as_str)
    }

    /// Every worker ever placed, with its host.
    pub fn all(&self) -> &BTreeMap<String, String> {
        &self.of
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn workers_fill_hosts_in_order_and_replacements_take_the_freed_slot() {
        let mut p = Placement::new(2);
        let dead: BTreeSet<&str> = BTreeSet::new();
        let hosts: Vec<String> =
            ["w0", "w1", "w2", "w3", "w4"].iter().map(|w| p.place(w, |x| !dead.contains(x))).collect();
        assert_eq!(hosts, ["host0", "host0", "host1", "host1", "host2"]);
        // w2 dies: its replacement goes to host1, beside w3, not to host2 (which has room too,
        // but comes later) nor to a new host.
        let dead: BTreeSet<&str> = ["w2"].into();
        assert_eq!(p.place("w5", |x| !dead.contains(x)), "host1");
        // Placing a known worker again changes nothing.
        assert_eq!(p.place("w2", |_| true), "host1");
        // host2 still has a free slot; after it, a new host.
        assert_eq!(p.place("w6", |x| !dead.contains(x)), "host2");
        assert_eq!(p.place("w7", |x| !dead.contains(x)), "host3");
        assert_eq!(p.host_of("w5"), Some("host1"));
        assert_eq!(p.host_of("nobody"), None);
        assert_eq!(p.all().len(), 8);
    }

    #[test]
    fn pods_fill_nodes_in_order_and_a_replacement_takes_the_freed_place() {
        let mut p = Placement::new(1);
        p.set_pods_per_node(3);
        let dead: BTreeSet<&str> = BTreeSet::new();
        for w in ["w0", "w1", "w2", "w3", "w4", "w5"] {
            assert_eq!(p.place(w, |x| !dead.contains(x)), w, "a pod is a host of its own");
        }
        let nodes: Vec<&str> = ["w0", "w1", "w2", "w3", "w4", "w5"].iter().map(|w| p.node_of(w).unwrap()).collect();
        assert_eq!(nodes, ["node0", "node0", "node0", "node1", "node1", "node1"]);
        // w4 dies: its replacement goes to node1 (node0 is full), not to a new node.
        let dead: BTreeSet<&str> = ["w4"].into();
        p.place("w6", |x| !dead.contains(x));
        assert_eq!(p.node_of("w6"), Some("node1"));
        p.place("w7", |x| !dead.contains(x));
        assert_eq!(p.node_of("w7"), Some("node2"));
        assert_eq!(Placement::new(1).node_of("w0"), None, "no nodes by default");
    }

    #[test]
    fn one_worker_per_host_names_the_host_after_the_worker() {
        let mut p = Placement::new(1);
        assert_eq!(p.place("w0", |_| false), "w0");
        assert_eq!(p.place("w1", |_| false), "w1", "a dead worker's host is not reused");
        assert_eq!(Placement::new(0).per_host(), 1);
    }
}
