//! Striking one fault and settling after it: choosing its targets, injecting it (signals,
//! the proxy, network namespaces, coordinator and etcd faults), waiting for the job to
//! react, and what is learned meanwhile (the straggler's verdict, `status` while a rank hangs,
//! shared-memory segments left behind).

use super::*;

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
        self.segment_checks.push(Check {
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

    pub(super) async fn fault(&mut self, index: usize, f: &FaultSpec) -> Result<(), RunError> {
        let sc = self.sc;
        let settle = f.settle.0;
        // Arm: the number of steps after the previous fault settled.
        let steps = match f.after_steps_max {
            Some(max) => self.rng.random_range(f.after_steps..=max),
            None => f.after_steps,
        } as i64;
        let target_step = self.view.max_step + steps;
        if steps > 0 {
            self.pump(&format!("step {target_step} before fault {index}"), settle, |e, _| {
                e.kind == EventKind::Step && e.int("step").unwrap_or(0) >= target_step
            })
            .await?;
        }
        let mut g = self.view.current();
        if !self.view.complete(g) {
            self.pump("every member's generation event", Duration::from_secs(10), |_, v| v.complete(v.current()))
                .await?;
            g = self.view.current();
        }
        let mut targets = self.ranks_of(f, g)?;
        let mut target_names: Vec<String> = targets.iter().map(|(_, w)| w.clone()).collect();
        let members: Vec<String> = self.view.members.get(&g).map(|m| m.values().cloned().collect()).unwrap_or_default();
        let peers: Vec<String> = if f.kind.link() {
            if f.peers.is_empty() {
                members.iter().filter(|w| !target_names.contains(w)).cloned().collect()
            } else {
                let m = self.view.members.get(&g).cloned().unwrap_or_default();
                f.peers
                    .iter()
                    .filter_map(|r| m.get(&(*r as i64)).cloned())
                    .filter(|w| !target_names.contains(w))
                    .collect()
            }
        } else {
            Vec::new()
        };
        // Several workers per host: a host fault cuts every member on the target's host, and a
        // route fault cuts whole hosts from each other, so both sides grow to their hosts.
        let mut peers = peers;
        if sc.ranks_per_host > 1 && matches!(f.kind, FaultKind::Isolate | FaultKind::Blackhole | FaultKind::Partition) {
            let host = |w: &String| self.cluster.worker_host(w).map(str::to_string);
            let target_hosts: BTreeSet<String> = target_names.iter().filter_map(host).collect();
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
            // The chosen target first (the mid-allreduce strike waits on it).
            grown.sort_by_key(|(r, w)| (!target_names.contains(w), *r));
            let grown_peers: Vec<String> =
                on_hosts(&peer_hosts.iter().collect::<Vec<_>>()).into_iter().map(|(_, w)| w).collect();
            targets = grown;
            target_names = targets.iter().map(|(_, w)| w.clone()).collect();
            if f.kind.link() {
                peers = grown_peers;
            }
        }
        if f.kind.link() && peers.is_empty() {
            return Err(RunError::Scenario(format!(
                "fault {index} ({}): no peers (on another host than the targets)",
                f.kind.name()
            )));
        }
        // Strike mid-allreduce: wait for the first target to announce one.
        let mut mid = false;
        if f.mid_allreduce && !targets.is_empty() {
            let t0 = target_names[0].clone();
            let gen = g;
            self.pump(&format!("an allreduce of {t0}"), Duration::from_secs(20), |e, _| {
                e.kind == EventKind::Allreduce && e.worker == t0 && e.int("gen") == Some(gen)
            })
            .await?;
            mid = true;
        }
        let at_ms = now_ms();
        let struck = Instant::now();
        let world = self.view.worlds.get(&g).copied().unwrap_or(0);
        let dur = f.duration.map(|d| d.0).unwrap_or(Duration::ZERO);
        let ranks_text: Vec<String> = targets.iter().map(|(r, w)| format!("{w}(rank {r})")).collect();
        let mut note = String::new();
        let mut duty: Option<DutyCycle> = None;
        match f.kind {
            FaultKind::Kill => {
                for w in &target_names {
                    self.signal(w, libc::SIGKILL);
                    self.killed.insert(w.clone());
                }
            }
            FaultKind::Stop => {
                for w in &target_names {
                    self.signal(w, libc::SIGSTOP);
                    self.stopped.insert(w.clone());
                    self.timers.push((Instant::now() + dur, Action::Signal(w.clone(), libc::SIGCONT)));
                }
            }
            FaultKind::Term => {
                for w in &target_names {
                    self.signal(w, libc::SIGTERM);
                    self.leaving.insert(w.clone());
                }
            }
            FaultKind::Straggler => {
                // Its own thread keeps the duty cycle exact while the harness polls `status`.
                let pid = target_names.first().and_then(|w| self.cluster.worker_pid(w));
                duty = pid.map(|pid| {
                    DutyCycle::start(pid, dur, f.stop_for.unwrap_or_default().0, f.run_for.unwrap_or_default().0)
                });
            }
            FaultKind::Slow => {
                let until = Instant::now() + dur;
                let (stop_for, run_for) =
                    (f.stop_for.map(|d| d.0).unwrap_or_default(), f.run_for.map(|d| d.0).unwrap_or_default());
                for w in &target_names {
                    self.fire(Action::SlowStop { worker: w.clone(), until, stop_for, run_for }).await;
                }
            }
            FaultKind::JoinStorm => {
                let names = self.spawn(f.count).await?;
                note = format!("joined: {}", names.join(","));
            }
            FaultKind::CoordinatorLeaderKill => {
                let leader = self.cluster.leader_index(Duration::from_secs(3)).await;
                let i = leader.unwrap_or(0);
                note = format!("leader coord{i}{}", if leader.is_none() { " (unknown; killed coord0)" } else { "" });
                self.cluster.kill_coordinator(i).await;
                self.timers.push((Instant::now() + dur, Action::RestartCoordinators(vec![i])));
            }
            FaultKind::CoordinatorsDown => {
                let all: Vec<usize> = (0..self.cluster.coordinator_count()).collect();
                for &i in &all {
                    self.cluster.kill_coordinator(i).await;
                }
                self.timers.push((Instant::now() + dur, Action::RestartCoordinators(all)));
            }
            FaultKind::EtcdRestart => {
                if let Some(e) = self.cluster.etcd() {
                    e.kill();
                }
                self.timers.push((Instant::now() + dur, Action::RestartEtcd));
            }
            FaultKind::Isolate => {
                let lab = self
                    .cluster
                    .netlab()
                    .ok_or_else(|| RunError::Scenario("isolate needs network = \"netns\"".into()))?;
                let hosts = self.hosts_of(&target_names);
                for h in &hosts {
                    lab.isolate(h, true).map_err(|e| RunError::Scenario(e.to_string()))?;
                }
                let plug_at = Instant::now() + if dur.is_zero() { settle } else { dur };
                self.timers.push((plug_at, Action::Plug(hosts)));
            }
            FaultKind::Blackhole | FaultKind::Partition if self.cluster.netlab().is_some() => {
                let pairs = self.host_pairs(directed_pairs(&target_names, &peers, f.kind == FaultKind::Partition));
                if let Some(lab) = self.cluster.netlab() {
                    for (a, b) in &pairs {
                        lab.drop_route(a, b, true).map_err(|e| RunError::Scenario(e.to_string()))?;
                    }
                }
                let heal_at = Instant::now() + if dur.is_zero() { sc.no_progress.0 * 3 } else { dur };
                self.timers.push((heal_at, Action::Heal(pairs)));
            }
            FaultKind::Blackhole
            | FaultKind::Partition
            | FaultKind::Latency
            | FaultKind::Bandwidth
            | FaultKind::Reset => {
                let proxy = self.cluster.enable_proxy();
                let rule = match f.kind {
                    FaultKind::Latency => {
                        LinkRule { latency: f.latency.map(|d| d.0).unwrap_or_default(), ..Default::default() }
                    }
                    FaultKind::Bandwidth => LinkRule {
                        bandwidth: f.bandwidth.as_deref().and_then(|b| parse_bytes(b).ok()),
                        ..Default::default()
                    },
                    _ => LinkRule { blackhole: true, ..Default::default() },
                };
                let pairs = directed_pairs(&target_names, &peers, f.kind == FaultKind::Partition);
                if f.kind == FaultKind::Reset {
                    let n: usize = target_names
                        .iter()
                        .flat_map(|t| peers.iter().map(move |p| (t, p)))
                        .map(|(t, p)| proxy.reset_pair(t, p))
                        .sum();
                    note = format!("{n} connections reset");
                } else {
                    for (a, b) in &pairs {
                        proxy.set_rule(a, b, rule);
                    }
                    let heal_at = Instant::now() + if dur.is_zero() { sc.no_progress.0 * 3 } else { dur };
                    self.timers.push((heal_at, Action::Heal(pairs)));
                }
            }
        }
        self.say(format!(
            "fault {index}: {} {} peers [{}] in generation {g} (world {world}) at step {}{} {note}",
            f.kind.name(),
            ranks_text.join(","),
            peers.join(","),
            self.view.max_step,
            if mid { ", mid-allreduce" } else { "" }
        ));
        self.records.push(FaultRecord {
            index,
            kind: f.kind,
            targets: ranks_text,
            peers: peers.clone(),
            generation: g,
            world,
            step: self.view.max_step,
            at_ms,
            duration_ms: dur.as_millis() as u64,
            mid_allreduce: mid,
            survivors: if kill_like(f.kind) {
                members.iter().filter(|w| !target_names.contains(w)).cloned().collect()
            } else {
                members.clone()
            },
            note,
            ..Default::default()
        });

        // Settle.
        let gen = g;
        match f.kind {
            FaultKind::Kill
            | FaultKind::Stop
            | FaultKind::Reset
            | FaultKind::Blackhole
            | FaultKind::Partition
            | FaultKind::Term => {
                if matches!(f.kind, FaultKind::Blackhole | FaultKind::Partition) {
                    // Heal as soon as a member reports it (the fault was seen); at the
                    // latest at its duration (the timer set above).
                    let seen = self
                        .pump("an error after the link fault", sc.no_progress.0 * 3 + Duration::from_secs(5), |e, _| {
                            e.kind == EventKind::Error && e.int("gen") == Some(gen)
                        })
                        .await;
                    if let Some(pos) = self.timers.iter().position(|(_, a)| matches!(a, Action::Heal(_))) {
                        let (_, a) = self.timers.remove(pos);
                        self.fire(a).await;
                    }
                    seen?;
                }
                if sc.expect == Expect::Fail && f.kind == FaultKind::Kill {
                    return Ok(());
                }
                if f.kind == FaultKind::Stop {
                    self.status_while_hung(struck).await;
                }
                let cont_at = self
                    .timers
                    .iter()
                    .filter(|(_, a)| matches!(a, Action::Signal(_, s) if *s == libc::SIGCONT))
                    .map(|(t, _)| *t)
                    .max();
                self.pump(&format!("the first verified step after fault {index}"), settle, |e, _| {
                    e.kind == EventKind::Step && e.int("gen").unwrap_or(0) > gen
                })
                .await?;
                if let Some(t) = cont_at {
                    // The hung rank comes back: let its continuation happen, then see it react.
                    self.pass_time(t).await;
                    let back: Vec<String> = target_names.clone();
                    let _ = self
                        .pump("the continued rank to react", Duration::from_secs(10) + sc.no_progress.0, |e, _| {
                            back.contains(&e.worker) && e.kind != EventKind::Allreduce
                        })
                        .await;
                }
                if f.kind == FaultKind::Kill && f.respawn {
                    let names = self.spawn(target_names.len() as u32).await?;
                    let last = names.last().cloned().unwrap_or_default();
                    self.pump(&format!("replacement {last} to join"), settle, |e, _| {
                        e.kind == EventKind::Step && e.worker == last
                    })
                    .await?;
                }
                self.check_shared_memory_released(index, f.kind, gen).await;
            }
            FaultKind::Isolate => {
                // The survivors re-form without the cut-off hosts; then they are plugged back
                // (at the latest at their duration) and must find their way back in.
                let recovered = self
                    .pump(&format!("the first verified step after fault {index}"), settle, |e, _| {
                        e.kind == EventKind::Step && e.int("gen").unwrap_or(0) > gen
                    })
                    .await;
                if let Some(pos) = self.timers.iter().position(|(_, a)| matches!(a, Action::Plug(_))) {
                    let (_, a) = self.timers.remove(pos);
                    self.fire(a).await;
                }
                recovered?;
                for w in &target_names {
                    let who = w.clone();
                    self.pump(&format!("{w} to rejoin after it was plugged back"), settle, |e, _| {
                        e.kind == EventKind::Step && e.worker == who && e.int("gen").unwrap_or(0) > gen
                    })
                    .await?;
                }
                self.check_shared_memory_released(index, f.kind, gen).await;
            }
            FaultKind::JoinStorm => {
                let want = (world + f.count as i64).min(sc.max_workers as i64);
                self.pump(&format!("a generation of {want} after the join storm"), settle, |e, _| {
                    e.kind == EventKind::Step && e.int("world") == Some(want)
                })
                .await?;
            }
            FaultKind::Straggler => {
                let target = target_names.first().cloned().unwrap_or_default();
                let mut seen = self.follow_straggler(&target, gen, struck + dur, settle).await;
                seen.cycles = duty.map_or(0, DutyCycle::finish);
                if let Some(r) = self.records.last_mut() {
                    r.straggler = Some(seen);
                }
                let target = self.view.max_step + 3;
                self.pump(&format!("3 steps after fault {index}"), settle, |e, _| {
                    e.kind == EventKind::Step && e.int("step").unwrap_or(0) >= target
                })
                .await?;
                self.quiet.push((at_ms, now_ms(), index));
            }
            FaultKind::Slow
            | FaultKind::Latency
            | FaultKind::Bandwidth
            | FaultKind::CoordinatorLeaderKill
            | FaultKind::CoordinatorsDown
            | FaultKind::EtcdRestart => {
                let end = Instant::now() + dur;
                self.pass_time(end).await;
                self.fire_due().await;
                let target = self.view.max_step + 3;
                self.pump(&format!("3 steps after fault {index}"), settle, |e, _| {
                    e.kind == EventKind::Step && e.int("step").unwrap_or(0) >= target
                })
                .await?;
                if matches!(
                    f.kind,
                    FaultKind::Latency | FaultKind::Bandwidth | FaultKind::CoordinatorLeaderKill | FaultKind::Slow
                ) {
                    self.quiet.push((at_ms, now_ms(), index));
                }
            }
        }
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
        let is_leave = move |e: &WorkerEvent| e.kind == EventKind::StragglerLeave && e.worker == who;
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
            let event =
                self.cluster.events.iter().rev().find(|e| e.kind == EventKind::StragglerLeave && e.worker == target);
            let reason = event.and_then(|e| e.text("reason")).unwrap_or("").to_string();
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
                    e.kind == EventKind::Step && e.worker == who && e.int("gen").unwrap_or(0) > gen
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
