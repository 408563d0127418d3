//! Striking one fault and settling after it: choosing its targets, injecting it (signals,
//! the proxy, network namespaces, coordinator and etcd faults), waiting for the job to
//! react, and what is learned meanwhile (the straggler's verdict, `status` while a rank hangs,
//! shared-memory segments left behind).

use super::*;

/// Bound on finding a node's relay server, and on another pod serving it after it died.
const RELAY_BOUND: Duration = Duration::from_secs(5);

impl Run<'_> {
    /// The shared-memory objects of generations older than its current one that each
    /// running worker past generation `gen` still holds; how many workers were read; how many
    /// objects of their current generations they hold (evidence that the reading sees them).
    pub(super) fn stale_shared_memory(&mut self, gen: i64) -> (Vec<String>, usize, usize) {
        let mut stale = Vec::new();
        let mut read = 0;
        let mut current_held = 0;
        for w in self.cluster.worker_names() {
            if self.killed.contains(&w) || self.stopped.contains(&w) || self.cluster.worker_exit(&w).is_some() {
                continue;
            }
            let Some(current) = self.generation_of(&w).filter(|c| *c > gen) else { continue };
            let Some(pid) = self.cluster.worker_pid(&w) else { continue };
            match crate::segments::held_by(pid) {
                Ok(held) => {
                    read += 1;
                    current_held += held.iter().filter(|h| h.generation as i64 >= current).count();
                    stale.extend(
                        held.iter()
                            .filter(|h| (h.generation as i64) < current)
                            .map(|h| format!("{w} (in generation {current}) holds {}", h.name)),
                    );
                }
                // Exited meanwhile: nothing held.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound || self.cluster.worker_exit(&w).is_some() => {}
                Err(e) => stale.push(format!("{w}: cannot read /proc/{pid}: {e}")),
            }
        }
        (stale, read, current_held)
    }

    /// After disruptive fault `index` of generation `gen` settled: every running worker that
    /// moved past `gen` let go of the older generations' shared-memory segments and sockets.
    /// Polled for up to 2 s (a worker drops the old mesh as it leaves the generation, at no
    /// moment the harness sees); recorded as a check.
    pub(super) async fn check_shared_memory_released(&mut self, index: usize, kind: FaultKind, gen: i64) {
        let deadline = Instant::now() + Duration::from_secs(2);
        let started = Instant::now();
        let (stale, read, current) = loop {
            let (stale, read, current) = self.stale_shared_memory(gen);
            if stale.is_empty() || Instant::now() >= deadline {
                break (stale, read, current);
            }
            self.pass_time(Instant::now() + Duration::from_millis(100)).await;
        };
        self.fault_checks.push(Check {
            what: format!(
                "fault {index} ({}): no running worker kept a shared-memory segment or socket of a generation it left",
                kind.name()
            ),
            ok: stale.is_empty() && read > 0,
            detail: if stale.is_empty() {
                format!(
                    "{read} workers past generation {gen} read in /proc, holding {current} segments and sockets of their current generations only ({})",
                    match started.elapsed().as_millis() {
                        0..=9 => "at the first look".to_string(),
                        t => format!("after {t} ms"),
                    }
                )
            } else {
                stale.join("; ")
            },
        });
    }

    /// Strikes fault `index`: arms it (its steps after the previous one), aims it (targets,
    /// peers), injects it by its kind, records it, and settles after it by its kind.
    pub(super) async fn fault(&mut self, index: usize, f: &FaultSpec) -> Result<(), RunError> {
        self.arm(index, f).await?;
        let strike = self.aim(index, f).await?;
        let injected = self.inject(f, &strike).await?;
        self.record(index, f, &strike, injected.note);
        self.settle(index, f, &strike, injected.duty).await
    }

    /// Waits for the fault's moment: its number of steps after the previous fault settled
    /// (drawn up to `after_steps_max`), then every member's generation event.
    async fn arm(&mut self, index: usize, f: &FaultSpec) -> Result<(), RunError> {
        let steps = match f.after_steps_max {
            Some(max) => self.rng.random_range(f.after_steps..=max),
            None => f.after_steps,
        } as i64;
        let target_step = self.view.max_step + steps;
        if steps > 0 {
            self.pump(&format!("step {target_step} before fault {index}"), f.settle.0, |e, _| {
                e.get::<ev::Step>().is_some_and(|s| s.step as i64 >= target_step)
            })
            .await?;
        }
        if !self.view.complete(self.view.current()) {
            self.pump("every member's generation event", Duration::from_secs(10), |_, v| v.complete(v.current()))
                .await?;
        }
        Ok(())
    }

    /// Chooses the targets of the fault in the current generation and, for a link fault,
    /// its peers (both grown to whole hosts when several workers share one); for a
    /// mid-allreduce strike, waits for the first target to announce an allreduce.
    async fn aim(&mut self, index: usize, f: &FaultSpec) -> Result<Strike, RunError> {
        let g = self.view.current();
        let mut targets = if f.relay_server { self.relay_server_of(index, g).await? } else { self.ranks_of(f, g)? };
        let target_names: Vec<String> = targets.iter().map(|(_, w)| w.clone()).collect();
        let members: Vec<String> = self.view.members.get(&g).map(|m| m.values().cloned().collect()).unwrap_or_default();
        let mut peers: Vec<String> = if !f.kind.link() {
            Vec::new()
        } else if f.peers.is_empty() {
            members.iter().filter(|w| !target_names.contains(w)).cloned().collect()
        } else {
            let m = self.view.members.get(&g).cloned().unwrap_or_default();
            f.peers.iter().filter_map(|r| m.get(&(*r as i64)).cloned()).filter(|w| !target_names.contains(w)).collect()
        };
        // Several workers per host: a host fault cuts every member on the target's host, and a
        // route fault cuts whole hosts from each other, so both sides grow to their hosts.
        if self.sc.ranks_per_host > 1
            && matches!(f.kind, FaultKind::Isolate | FaultKind::Blackhole | FaultKind::Partition)
        {
            let (grown, grown_peers) = self.grow_to_hosts(f, g, &target_names, &peers);
            targets = grown;
            if f.kind.link() {
                peers = grown_peers;
            }
        }
        let names: Vec<String> = targets.iter().map(|(_, w)| w.clone()).collect();
        if f.kind.link() && peers.is_empty() {
            return Err(RunError::Scenario(format!(
                "fault {index} ({}): no peers (on another host than the targets)",
                f.kind.name()
            )));
        }
        // Strike mid-allreduce: wait for the first target to announce one.
        let mut mid = false;
        if let (true, Some(t0)) = (f.mid_allreduce, names.first()) {
            let t0 = t0.clone();
            self.pump(&format!("an allreduce of {t0}"), Duration::from_secs(20), |e, _| {
                e.worker == t0 && e.get::<ev::Allreduce>().is_some_and(|a| a.gen as i64 == g)
            })
            .await?;
            mid = true;
        }
        Ok(Strike {
            generation: g,
            world: self.view.worlds.get(&g).copied().unwrap_or(0),
            targets,
            names,
            peers,
            members,
            mid,
            at_ms: now_ms(),
            struck: Instant::now(),
            duration: f.duration.map(|d| d.0).unwrap_or(Duration::ZERO),
        })
    }

    /// A member of generation `g` that serves its node's heartbeat relay, drawn at random
    /// (`relay_server`). A relay is served from the first beat of a node's first pod on, so
    /// one is there at once; the harness looks for up to [`RELAY_BOUND`].
    async fn relay_server_of(&mut self, index: usize, g: i64) -> Result<Vec<(i64, String)>, RunError> {
        let deadline = Instant::now() + RELAY_BOUND;
        loop {
            let members = self.view.members.get(&g).cloned().unwrap_or_default();
            let servers = self.cluster.heartbeat_relay_servers();
            let mut serving: Vec<(i64, String)> = members.into_iter().filter(|(_, w)| servers.contains(w)).collect();
            if let Some(pick) = (!serving.is_empty()).then(|| self.rng.random_range(0..serving.len())) {
                return Ok(vec![serving.swap_remove(pick)]);
            }
            if Instant::now() >= deadline {
                return Err(RunError::Scenario(format!(
                    "fault {index}: no member of generation {g} serves a node's heartbeat relay (within {RELAY_BOUND:?}; servers: {servers:?})"
                )));
            }
            self.pass_time(Instant::now() + Duration::from_millis(50)).await;
        }
    }

    /// After a kill or term of a node's relay server (`relay_server`): exactly one other
    /// running pod of the same node serves the node's heartbeat relay (it took the lock the
    /// dead one's process let go; pods that did not share the node's directory would each
    /// serve one), within [`RELAY_BOUND`] of the job's recovery; recorded as a check. A
    /// stopped server keeps the lock: its pod-mates bypass it and nothing is handed on.
    async fn check_relay_handed_on(&mut self, index: usize, f: &FaultSpec, s: &Strike) {
        if !f.relay_server || !matches!(f.kind, FaultKind::Kill | FaultKind::Term) {
            return;
        }
        let Some(target) = s.names.first().cloned() else { return };
        let Some(node) = self.cluster.worker_node(&target).map(str::to_string) else { return };
        let started = Instant::now();
        let deadline = started + RELAY_BOUND;
        let servers = loop {
            let servers: Vec<String> = self
                .cluster
                .heartbeat_relay_servers()
                .into_iter()
                .filter(|w| self.cluster.worker_node(w) == Some(node.as_str()))
                .collect();
            if !servers.is_empty() || Instant::now() >= deadline {
                break servers;
            }
            self.pass_time(Instant::now() + Duration::from_millis(50)).await;
        };
        let ok = servers.len() == 1 && servers[0] != target;
        self.fault_checks.push(Check {
            what: format!(
                "fault {index} ({}): one other pod of {node} serves the node's heartbeat relay after {target}",
                f.kind.name()
            ),
            ok,
            detail: match servers.as_slice() {
                [] => format!("no pod of {node} holds the relay's lock {RELAY_BOUND:?} after the job recovered"),
                [w] if ok => {
                    format!("{w} holds the relay's lock ({} ms after the job recovered)", started.elapsed().as_millis())
                }
                many => format!("the relay's lock is held by {many:?}, not by one other pod"),
            },
        });
    }

    /// The members of generation `g` on the hosts of `targets` (the first target first: the
    /// mid-allreduce strike waits on it), and those on the hosts of `peers` that hold no
    /// target (`random_peer_hosts` of them, if set).
    fn grow_to_hosts(
        &mut self,
        f: &FaultSpec,
        g: i64,
        targets: &[String],
        peers: &[String],
    ) -> (Vec<(i64, String)>, Vec<String>) {
        let host = |w: &String| self.cluster.worker_host(w).map(str::to_string);
        let target_hosts: BTreeSet<String> = targets.iter().filter_map(host).collect();
        let mut peer_hosts: Vec<String> = Vec::new();
        for h in peers.iter().filter_map(host) {
            if !target_hosts.contains(&h) && !peer_hosts.contains(&h) {
                peer_hosts.push(h);
            }
        }
        if f.random_peer_hosts > 0 {
            peer_hosts.shuffle(&mut self.rng);
            peer_hosts.truncate(f.random_peer_hosts as usize);
        }
        let on_hosts = |hosts: &[&String]| -> Vec<(i64, String)> {
            self.view
                .members
                .get(&g)
                .map(|m| {
                    m.iter()
                        .filter(|(_, w)| self.cluster.worker_host(w).is_some_and(|h| hosts.iter().any(|x| *x == h)))
                        .map(|(r, w)| (*r, w.clone()))
                        .collect()
                })
                .unwrap_or_default()
        };
        let mut grown = on_hosts(&target_hosts.iter().collect::<Vec<_>>());
        grown.sort_by_key(|(r, w)| (!targets.contains(w), *r));
        let grown_peers = on_hosts(&peer_hosts.iter().collect::<Vec<_>>()).into_iter().map(|(_, w)| w).collect();
        (grown, grown_peers)
    }

    /// Injects the fault by its kind.
    async fn inject(&mut self, f: &FaultSpec, s: &Strike) -> Result<Injected, RunError> {
        let mut injected = Injected::default();
        match f.kind {
            FaultKind::Kill => self.kill(&s.names),
            FaultKind::Stop => self.stop(&s.names, s.duration),
            FaultKind::Term => self.term(&s.names),
            FaultKind::Straggler => injected.duty = self.start_straggler(f, s),
            FaultKind::Slow => self.slow(f, s).await,
            FaultKind::JoinStorm => injected.note = self.join_storm(f).await?,
            FaultKind::CoordinatorLeaderKill => injected.note = self.kill_leader(s.duration).await,
            FaultKind::CoordinatorsDown => self.coordinators_down(s.duration).await,
            FaultKind::EtcdRestart => self.restart_etcd(s.duration),
            FaultKind::Isolate => self.isolate(f, s)?,
            FaultKind::Blackhole | FaultKind::Partition if self.cluster.netlab().is_some() => self.drop_routes(f, s)?,
            FaultKind::Blackhole
            | FaultKind::Partition
            | FaultKind::Latency
            | FaultKind::Bandwidth
            | FaultKind::Reset => injected.note = self.proxy_fault(f, s),
        }
        Ok(injected)
    }

    /// `kill`: SIGKILL to every target.
    fn kill(&mut self, targets: &[String]) {
        for w in targets {
            self.signal(w, libc::SIGKILL);
            self.killed.insert(w.clone());
        }
    }

    /// `stop`: SIGSTOP to every target, SIGCONT after `duration`.
    fn stop(&mut self, targets: &[String], duration: Duration) {
        for w in targets {
            self.signal(w, libc::SIGSTOP);
            self.stopped.insert(w.clone());
            self.timers.push((Instant::now() + duration, Action::Signal(w.clone(), libc::SIGCONT)));
        }
    }

    /// `term`: SIGTERM to every target (a graceful leave).
    fn term(&mut self, targets: &[String]) {
        for w in targets {
            self.signal(w, libc::SIGTERM);
            self.leaving.insert(w.clone());
        }
    }

    /// `straggler`: the first target's duty cycle of stops and runs, on its own thread (it
    /// stays exact while the harness polls `status`).
    fn start_straggler(&self, f: &FaultSpec, s: &Strike) -> Option<DutyCycle> {
        let pid = s.names.first().and_then(|w| self.cluster.worker_pid(w))?;
        Some(DutyCycle::start(pid, s.duration, f.stop_for.unwrap_or_default().0, f.run_for.unwrap_or_default().0))
    }

    /// `slow`: every target stopped and continued in turn until the fault's end.
    async fn slow(&mut self, f: &FaultSpec, s: &Strike) {
        let until = Instant::now() + s.duration;
        let (stop_for, run_for) =
            (f.stop_for.map(|d| d.0).unwrap_or_default(), f.run_for.map(|d| d.0).unwrap_or_default());
        for w in &s.names {
            self.fire(Action::SlowStop { worker: w.clone(), until, stop_for, run_for }).await;
        }
    }

    /// `join_storm`: `count` new workers at once; the note names them.
    async fn join_storm(&mut self, f: &FaultSpec) -> Result<String, RunError> {
        let names = self.spawn(f.count).await?;
        Ok(format!("joined: {}", names.join(",")))
    }

    /// `coordinator_leader_kill`: the leading replica killed, restarted after `duration`; the
    /// note names it.
    async fn kill_leader(&mut self, duration: Duration) -> String {
        let leader = self.cluster.leader_index(Duration::from_secs(3)).await;
        let i = leader.unwrap_or(0);
        self.cluster.kill_coordinator(i).await;
        self.timers.push((Instant::now() + duration, Action::RestartCoordinators(vec![i])));
        format!("leader coord{i}{}", if leader.is_none() { " (unknown; killed coord0)" } else { "" })
    }

    /// `coordinators_down`: every replica killed, all restarted after `duration`.
    async fn coordinators_down(&mut self, duration: Duration) {
        let all: Vec<usize> = (0..self.cluster.coordinator_count()).collect();
        for &i in &all {
            self.cluster.kill_coordinator(i).await;
        }
        self.timers.push((Instant::now() + duration, Action::RestartCoordinators(all)));
    }

    /// `etcd_restart`: etcd killed, restarted after `duration`.
    fn restart_etcd(&mut self, duration: Duration) {
        if let Some(e) = self.cluster.etcd() {
            e.kill();
        }
        self.timers.push((Instant::now() + duration, Action::RestartEtcd));
    }

    /// `isolate`: the targets' hosts cut off the network (namespaces), plugged back after the
    /// fault's duration (else its settle time).
    fn isolate(&mut self, f: &FaultSpec, s: &Strike) -> Result<(), RunError> {
        let lab =
            self.cluster.netlab().ok_or_else(|| RunError::Scenario("isolate needs network = \"netns\"".into()))?;
        let hosts = self.hosts_of(&s.names);
        for h in &hosts {
            lab.isolate(h, true).map_err(|e| RunError::Scenario(e.to_string()))?;
        }
        let plug_at = Instant::now() + if s.duration.is_zero() { f.settle.0 } else { s.duration };
        self.timers.push((plug_at, Action::Plug(hosts)));
        Ok(())
    }

    /// `blackhole` or `partition` on network namespaces: the routes between the targets' and
    /// the peers' hosts dropped (one way for a partition), healed after the fault's duration
    /// (else three no-progress deadlines).
    fn drop_routes(&mut self, f: &FaultSpec, s: &Strike) -> Result<(), RunError> {
        let pairs = self.host_pairs(directed_pairs(&s.names, &s.peers, f.kind == FaultKind::Partition));
        if let Some(lab) = self.cluster.netlab() {
            for (a, b) in &pairs {
                lab.drop_route(a, b, true).map_err(|e| RunError::Scenario(e.to_string()))?;
            }
        }
        let heal_at = Instant::now() + if s.duration.is_zero() { self.sc.no_progress.0 * 3 } else { s.duration };
        self.timers.push((heal_at, Action::Heal(pairs)));
        Ok(())
    }

    /// A link fault through the proxy (`blackhole`, `partition`, `latency`, `bandwidth`: a
    /// rule on the target-peer pairs, cleared after the fault's duration, else three
    /// no-progress deadlines; `reset`: their connections reset, counted in the note).
    fn proxy_fault(&mut self, f: &FaultSpec, s: &Strike) -> String {
        let proxy = self.cluster.enable_proxy();
        if f.kind == FaultKind::Reset {
            let n: usize = s
                .names
                .iter()
                .flat_map(|t| s.peers.iter().map(move |p| (t, p)))
                .map(|(t, p)| proxy.reset_pair(t, p))
                .sum();
            return format!("{n} connections reset");
        }
        let rule = match f.kind {
            FaultKind::Latency => {
                LinkRule { latency: f.latency.map(|d| d.0).unwrap_or_default(), ..Default::default() }
            }
            FaultKind::Bandwidth => {
                LinkRule { bandwidth: f.bandwidth.as_deref().and_then(|b| parse_bytes(b).ok()), ..Default::default() }
            }
            _ => LinkRule { blackhole: true, ..Default::default() },
        };
        let pairs = directed_pairs(&s.names, &s.peers, f.kind == FaultKind::Partition);
        for (a, b) in &pairs {
            proxy.set_rule(a, b, rule);
        }
        let heal_at = Instant::now() + if s.duration.is_zero() { self.sc.no_progress.0 * 3 } else { s.duration };
        self.timers.push((heal_at, Action::Heal(pairs)));
        String::new()
    }

    /// Says what was struck and keeps the fault's record (measured later from the events).
    fn record(&mut self, index: usize, f: &FaultSpec, s: &Strike, note: String) {
        let ranks_text: Vec<String> = s.targets.iter().map(|(r, w)| format!("{w}(rank {r})")).collect();
        self.say(format!(
            "fault {index}: {} {} peers [{}] in generation {} (world {}) at step {}{} {note}",
            f.kind.name(),
            ranks_text.join(","),
            s.peers.join(","),
            s.generation,
            s.world,
            self.view.max_step,
            if s.mid { ", mid-allreduce" } else { "" }
        ));
        self.records.push(FaultRecord {
            index,
            kind: f.kind,
            targets: ranks_text,
            peers: s.peers.clone(),
            generation: s.generation,
            world: s.world,
            step: self.view.max_step,
            at_ms: s.at_ms,
            duration_ms: s.duration.as_millis() as u64,
            mid_allreduce: s.mid,
            survivors: if kill_like(f.kind) {
                s.members.iter().filter(|w| !s.names.contains(w)).cloned().collect()
            } else {
                s.members.clone()
            },
            note,
            ..Default::default()
        });
    }

    /// Waits, by the fault's kind, for the job to get past it.
    async fn settle(
        &mut self,
        index: usize,
        f: &FaultSpec,
        s: &Strike,
        duty: Option<DutyCycle>,
    ) -> Result<(), RunError> {
        match f.kind {
            FaultKind::Kill
            | FaultKind::Stop
            | FaultKind::Reset
            | FaultKind::Blackhole
            | FaultKind::Partition
            | FaultKind::Term => self.settle_disruptive(index, f, s).await,
            FaultKind::Isolate => self.settle_isolate(index, f, s).await,
            FaultKind::JoinStorm => self.settle_join_storm(f, s).await,
            FaultKind::Straggler => self.settle_straggler(index, f, s, duty).await,
            FaultKind::Slow
            | FaultKind::Latency
            | FaultKind::Bandwidth
            | FaultKind::CoordinatorLeaderKill
            | FaultKind::CoordinatorsDown
            | FaultKind::EtcdRestart => self.settle_quiet(index, f, s).await,
        }
    }

    /// After a fault that breaks a generation (kill, stop, term, a cut or reset link): a cut
    /// link healed once a member reports it; a stopped rank's `status` taken; the first
    /// verified step of a later generation; a continued rank seen to react; killed ranks
    /// replaced if asked; the old generation's shared memory released.
    async fn settle_disruptive(&mut self, index: usize, f: &FaultSpec, s: &Strike) -> Result<(), RunError> {
        let sc = self.sc;
        let gen = s.generation;
        if matches!(f.kind, FaultKind::Blackhole | FaultKind::Partition) {
            self.heal_once_seen(gen).await?;
        }
        if sc.expect == Expect::Fail && f.kind == FaultKind::Kill {
            return Ok(());
        }
        if f.kind == FaultKind::Stop {
            self.status_while_hung(s.struck).await;
        }
        let cont_at = self
            .timers
            .iter()
            .filter(|(_, a)| matches!(a, Action::Signal(_, sig) if *sig == libc::SIGCONT))
            .map(|(t, _)| *t)
            .max();
        self.pump(&format!("the first verified step after fault {index}"), f.settle.0, |e, _| {
            e.get::<ev::Step>().is_some_and(|st| st.gen as i64 > gen)
        })
        .await?;
        if let Some(t) = cont_at {
            // The hung rank comes back: let its continuation happen, then see it react.
            self.pass_time(t).await;
            let _ = self
                .pump("the continued rank to react", Duration::from_secs(10) + sc.no_progress.0, |e, _| {
                    s.names.contains(&e.worker) && e.kind() != ev::EventKind::Allreduce
                })
                .await;
        }
        if f.kind == FaultKind::Kill && f.respawn {
            let names = self.spawn(s.names.len() as u32).await?;
            let last = names.last().cloned().unwrap_or_default();
            self.pump(&format!("replacement {last} to join"), f.settle.0, |e, _| {
                e.worker == last && e.get::<ev::Step>().is_some()
            })
            .await?;
        }
        self.check_shared_memory_released(index, f.kind, gen).await;
        self.check_relay_handed_on(index, f, s).await;
        Ok(())
    }

    /// A cut link (blackhole, partition) is healed as soon as a member of generation `gen`
    /// reports an error (the fault was seen), at the latest at its duration (its timer).
    async fn heal_once_seen(&mut self, gen: i64) -> Result<(), RunError> {
        let bound = self.sc.no_progress.0 * 3 + Duration::from_secs(5);
        let seen = self
            .pump("an error after the link fault", bound, |e, _| {
                e.get::<ev::Error>().is_some_and(|x| x.gen as i64 == gen)
            })
            .await;
        if let Some(pos) = self.timers.iter().position(|(_, a)| matches!(a, Action::Heal(_))) {
            let (_, a) = self.timers.remove(pos);
            self.fire(a).await;
        }
        seen.map(|_| ())
    }

    /// After `isolate`: the survivors re-form without the cut-off hosts; then they are
    /// plugged back (at the latest at their duration) and must find their way back in.
    async fn settle_isolate(&mut self, index: usize, f: &FaultSpec, s: &Strike) -> Result<(), RunError> {
        let gen = s.generation;
        let recovered = self
            .pump(&format!("the first verified step after fault {index}"), f.settle.0, |e, _| {
                e.get::<ev::Step>().is_some_and(|st| st.gen as i64 > gen)
            })
            .await;
        if let Some(pos) = self.timers.iter().position(|(_, a)| matches!(a, Action::Plug(_))) {
            let (_, a) = self.timers.remove(pos);
            self.fire(a).await;
        }
        recovered?;
        for w in &s.names {
            self.pump(&format!("{w} to rejoin after it was plugged back"), f.settle.0, |e, _| {
                e.worker == *w && e.get::<ev::Step>().is_some_and(|st| st.gen as i64 > gen)
            })
            .await?;
        }
        self.check_shared_memory_released(index, f.kind, gen).await;
        Ok(())
    }

    /// After `join_storm`: a generation with the joiners (up to `max_workers`) steps.
    async fn settle_join_storm(&mut self, f: &FaultSpec, s: &Strike) -> Result<(), RunError> {
        let want = (s.world + f.count as i64).min(self.sc.max_workers as i64);
        self.pump(&format!("a generation of {want} after the join storm"), f.settle.0, |e, _| {
            e.get::<ev::Step>().is_some_and(|st| st.world as i64 == want)
        })
        .await?;
        Ok(())
    }

    /// After `straggler`: what the coordinator did about it (kept in the record), then three
    /// more steps; its window is a quiet one.
    async fn settle_straggler(
        &mut self,
        index: usize,
        f: &FaultSpec,
        s: &Strike,
        duty: Option<DutyCycle>,
    ) -> Result<(), RunError> {
        let target = s.names.first().cloned().unwrap_or_default();
        let mut seen = self.follow_straggler(&target, s.generation, s.struck + s.duration, f.settle.0).await;
        seen.cycles = duty.map_or(0, DutyCycle::finish);
        if let Some(r) = self.records.last_mut() {
            r.straggler = Some(seen);
        }
        self.three_more_steps(index, f).await?;
        self.quiet.push((s.at_ms, now_ms(), index));
        Ok(())
    }

    /// After a fault that breaks nothing (slow, latency, bandwidth) or only the control plane
    /// (coordinators, etcd): its duration passes, its timers fire, three more steps; the
    /// data-plane ones and a leader kill are quiet windows (no collective may fail).
    async fn settle_quiet(&mut self, index: usize, f: &FaultSpec, s: &Strike) -> Result<(), RunError> {
        self.pass_time(Instant::now() + s.duration).await;
        self.fire_due().await;
        self.three_more_steps(index, f).await?;
        if matches!(
            f.kind,
            FaultKind::Latency | FaultKind::Bandwidth | FaultKind::CoordinatorLeaderKill | FaultKind::Slow
        ) {
            self.quiet.push((s.at_ms, now_ms(), index));
        }
        Ok(())
    }

    /// Waits for the job's highest step to move 3 past where it is.
    async fn three_more_steps(&mut self, index: usize, f: &FaultSpec) -> Result<(), RunError> {
        let target = self.view.max_step + 3;
        self.pump(&format!("3 steps after fault {index}"), f.settle.0, |e, _| {
            e.get::<ev::Step>().is_some_and(|s| s.step as i64 >= target)
        })
        .await?;
        Ok(())
    }

    /// Follows a straggler fault on `target` (struck in generation `gen`, its duty
    /// cycle ending at `until`): polls `status` until the coordinator names it (or the cycle
    /// ends), noting anybody else it names; under `exclude`, waits for its leave at a commit
    /// point and, after the cycle, for its return after the cool-down. Failures to see any
    /// of this are left to the checks (the run goes on).
    pub(super) async fn follow_straggler(
        &mut self,
        target: &str,
        gen: i64,
        until: Instant,
        settle: Duration,
    ) -> StragglerSeen {
        let sc = self.sc;
        let policy = sc.straggler_policy.clone().unwrap_or_else(|| "report".into());
        let mut seen = StragglerSeen { policy: policy.clone(), target: target.to_string(), ..Default::default() };
        let who = target.to_string();
        let is_leave = move |e: &WorkerEvent| e.worker == who && e.get::<ev::StragglerLeave>().is_some();
        while Instant::now() < until && seen.named.is_none() && seen.excluded_at_ms.is_none() {
            let leave = is_leave.clone();
            if let Ok(e) = self.pump("", Duration::from_millis(100), move |e, _| leave(e)).await {
                seen.excluded_at_ms = Some(e.t_ms());
                break;
            }
            let Some(status) = self.cluster.status_json(Duration::from_millis(500)).await else { continue };
            let members = status.get("members").and_then(|m| m.as_array()).cloned().unwrap_or_default();
            for m in &members {
                let Some(v) = m.get("straggler").filter(|v| !v.is_null()) else { continue };
                let worker = m.get("worker_id").and_then(|w| w.as_str()).unwrap_or("?").to_string();
                if worker == target && seen.named.is_none() {
                    let text = |k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or("").to_string();
                    seen.kind = text("kind");
                    seen.reason = text("reason");
                    seen.action = text("action");
                    seen.named_at_ms = Some(now_ms());
                    self.say(format!("status names {worker} a straggler: {} ({})", seen.reason, seen.action));
                    seen.named = Some(worker);
                } else if worker != target && !seen.others_named.contains(&worker) {
                    seen.others_named.push(worker);
                }
            }
        }
        if policy == "exclude" && seen.excluded_at_ms.is_none() {
            let bound = until.saturating_duration_since(Instant::now()) + settle;
            let leave = is_leave.clone();
            if let Ok(e) = self.pump(&format!("{target} to leave as a straggler"), bound, move |e, _| leave(e)).await {
                seen.excluded_at_ms = Some(e.t_ms());
            }
        }
        if let (None, Some(left)) = (&seen.named, seen.excluded_at_ms) {
            // It left before a poll of `status` caught the verdict (named and excluded within
            // one heartbeat): the leave carries the coordinator's verdict, named no later.
            let event = self
                .cluster
                .events
                .iter()
                .rev()
                .filter(|e| e.worker == target)
                .find_map(|e| e.get::<ev::StragglerLeave>());
            let reason = event.map(|e| e.reason.to_string()).unwrap_or_default();
            seen.kind = reason.strip_prefix("straggler (").and_then(|r| r.split(' ').next()).unwrap_or("").to_string();
            seen.reason = reason;
            seen.action = "excluded (from its straggler_leave event)".into();
            seen.named_at_ms = Some(left);
            seen.named = Some(target.to_string());
        }
        self.pass_time(until).await;
        if seen.excluded_at_ms.is_some() {
            let cooldown = sc.straggler_cooldown.map_or(Duration::from_secs(60), |d| d.0);
            let who = target.to_string();
            if let Ok(e) = self
                .pump(&format!("{target} to return after its cool-down"), cooldown + settle, |e, _| {
                    e.worker == who && e.get::<ev::Step>().is_some_and(|st| st.gen as i64 > gen)
                })
                .await
            {
                seen.rejoined_at_ms = Some(e.t_ms());
            }
        }
        seen
    }

    /// Takes the coordinator's `status` while a rank is stopped: three heartbeat intervals
    /// after the SIGSTOP (its heartbeat age must stand out by then), and before the
    /// no-progress deadline (before anybody times out and the rank is evicted); only with
    /// fixed deadlines (learned ones catch the rank sooner). Kept in the
    /// fault's record; checked in [`Run::checks`].
    pub(super) async fn status_while_hung(&mut self, struck: Instant) {
        let sc = self.sc;
        let after = sc.heartbeat_interval.0 * 3;
        if !sc.fixed_deadlines {
            if let Some(r) = self.records.last_mut() {
                r.note = "no status taken: learned deadlines catch the hung rank before its heartbeat age stands out (fixed_deadlines = true takes one)".into();
            }
            return;
        }
        if after + Duration::from_millis(300) >= sc.no_progress.0 {
            if let Some(r) = self.records.last_mut() {
                r.note = format!(
                    "no status taken: 3 heartbeat intervals ({after:?}) do not fit before the no-progress deadline"
                );
            }
            return;
        }
        self.pass_time(struck + after).await;
        let at_ms = self.records.last().map_or(0, |r| r.at_ms);
        let status = self.cluster.status_json(Duration::from_millis(500)).await;
        let seen = status.and_then(|s| StatusSeen::from_json(now_ms() as i64 - at_ms as i64, &s));
        if let Some(r) = self.records.last_mut() {
            r.status = seen;
        }
    }
}

/// A fault as aimed: where and when it strikes.
struct Strike {
    /// The generation struck.
    generation: i64,
    /// Its number of members.
    world: i64,
    /// The targets' ranks and names.
    targets: Vec<(i64, String)>,
    /// The targets' names.
    names: Vec<String>,
    /// The other ends of a link fault.
    peers: Vec<String>,
    /// Every member of the generation.
    members: Vec<String>,
    /// Struck while the first target's allreduce was announced.
    mid: bool,
    /// When (ms since the Unix epoch).
    at_ms: u64,
    /// When (the harness's clock).
    struck: Instant,
    /// The fault's duration (zero: none given).
    duration: Duration,
}

/// What injecting a fault left to settle and to record.
#[derive(Default)]
struct Injected {
    /// The record's note (who joined, which leader, how many connections reset).
    note: String,
    /// A straggler's duty cycle, finished when the fault settles.
    duty: Option<DutyCycle>,
}
