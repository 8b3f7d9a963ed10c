//! The queue, the waves and the cutover window as pure rules.

use super::*;
use crate::api::{CutoverSpec, CutoverWindow};

fn at(secs: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + secs).unwrap()
}

fn member(ns: &str, name: &str, host: &str, since: i64) -> Member {
    Member {
        namespace: ns.into(),
        name: name.into(),
        host: host.into(),
        wave: None,
        phase: Phase::Validated,
        disks: 1,
        holds_slot: false,
        queued: true,
        queued_since: at(since),
        waits_for_wave: false,
        own_cap: None,
    }
}

fn limits(per_host: u32, cluster: Option<u32>) -> ReadCaps {
    ReadCaps { per_host, hosts: BTreeMap::new(), cluster }
}

/// A tiny deterministic generator (no PRNG crate).
struct Draw(u64);
impl Draw {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % n
    }
}

#[test]
fn over_a_whole_run_no_host_and_not_the_cluster_ever_has_more_reads_than_its_cap_and_everyone_finishes() {
    for seed in 0..20 {
        let mut draw = Draw(seed);
        let mut lim = limits(2, Some(7));
        lim.hosts.insert("esx-00".into(), 3);
        let mut members: Vec<Member> = (0..60)
            .map(|i| {
                let mut m = member(
                    &format!("team-{}", i % 3),
                    &format!("vm-{i:02}"),
                    &format!("esx-{:02}", i % 5),
                    i,
                );
                m.disks = 1 + (draw.below(3) as u32);
                m
            })
            .collect();
        let mut rounds = 0;
        while members.iter().any(|m| m.phase != Phase::Completed) {
            rounds += 1;
            assert!(rounds < 10_000, "seed {seed}: the run does not finish");
            let q = queue(&members, &lim);
            for &i in &q.admitted {
                members[i].holds_slot = true;
                members[i].queued = false;
                members[i].phase = Phase::Preparing;
            }
            // Reads in use never exceed a cap (a migration with more disks than
            // its host's cap reads alone).
            let mut per_host: HashMap<&str, u32> = HashMap::new();
            let mut total = 0;
            for m in members.iter().filter(|m| m.holds_slot) {
                let w = m.disks.min(lim.host(&m.host));
                *per_host.entry(&m.host).or_default() += w;
                total += w;
            }
            for (host, used) in per_host {
                assert!(used <= lim.host(host), "seed {seed}: {host} reads {used}");
            }
            assert!(total <= 7, "seed {seed}: cluster reads {total}");
            // A random holder finishes its copy.
            let holders: Vec<usize> = (0..members.len()).filter(|&i| members[i].holds_slot).collect();
            if let Some(&done) = holders.get(draw.below(holders.len().max(1) as u64) as usize) {
                members[done].holds_slot = false;
                members[done].phase = Phase::Completed;
            }
        }
    }
}

#[test]
fn a_namespace_with_fewer_reads_running_goes_before_a_busier_one_even_when_it_came_later() {
    let mut busy = member("big", "big-0", "esx-01", 0);
    busy.holds_slot = true;
    busy.queued = false;
    busy.phase = Phase::Preparing;
    let members = vec![
        busy,
        member("big", "big-1", "esx-01", 1),
        member("big", "big-2", "esx-01", 2),
        member("small", "small-1", "esx-01", 50),
    ];
    let q = queue(&members, &limits(2, None));
    assert_eq!(q.admitted, vec![3], "small-1 takes the free slot");
    let first = &q.waiting[&1];
    assert_eq!((first.reason, first.position), (Reason::WaitingForHostSlot, Some(1)));
    assert_eq!(first.message, "1st in line for esx-01 (2 of 2 reads in use)");
    assert_eq!(q.waiting[&2].position, Some(2));
}

#[test]
fn within_a_namespace_the_earliest_validated_goes_first_and_positions_count_per_host() {
    let members = vec![
        member("a", "late", "esx-01", 30),
        member("a", "early", "esx-01", 10),
        member("a", "middle", "esx-01", 20),
        member("a", "other-host", "esx-02", 40),
    ];
    let q = queue(&members, &limits(1, None));
    assert_eq!(q.admitted, vec![1, 3]);
    assert_eq!(q.waiting[&2].position, Some(1));
    assert_eq!(q.waiting[&0].position, Some(2));
    assert_eq!(q.waiting[&0].message, "2nd in line for esx-01 (1 of 1 reads in use)");
}

#[test]
fn a_small_migration_does_not_overtake_a_bigger_one_waiting_on_the_same_host() {
    let mut running = member("a", "running", "esx-01", 0);
    running.holds_slot = true;
    running.queued = false;
    let mut big = member("a", "big", "esx-01", 1);
    big.disks = 2;
    let small = member("a", "small", "esx-01", 2);
    let q = queue(&[running, big, small], &limits(2, None));
    assert!(q.admitted.is_empty(), "the one free read waits for big, first in line");
    assert_eq!(q.waiting[&2].position, Some(2));
}

#[test]
fn the_cluster_cap_holds_when_hosts_have_room_and_names_itself() {
    let members: Vec<Member> =
        (0..4).map(|i| member("a", &format!("vm-{i}"), &format!("esx-{i}"), i)).collect();
    let q = queue(&members, &limits(2, Some(2)));
    assert_eq!(q.admitted, vec![0, 1]);
    let w = &q.waiting[&2];
    assert_eq!(w.reason, Reason::WaitingForClusterSlot);
    assert_eq!(w.message, "1st in line for the cluster-wide cap (2 of 2 reads in use)");
}

#[test]
fn a_host_override_raises_or_lowers_one_hosts_cap() {
    let mut lim = limits(1, None);
    lim.hosts.insert("esx-big".into(), 3);
    let members: Vec<Member> = (0..4).map(|i| member("a", &format!("vm-{i}"), "esx-big", i)).collect();
    assert_eq!(queue(&members, &lim).admitted, vec![0, 1, 2]);
}

fn waved(name: &str, plan: &str, number: i32, phase: Phase) -> Member {
    let mut m = member("a", name, "esx-01", 0);
    m.wave = Some((plan.into(), number));
    m.phase = phase;
    m
}

#[test]
fn a_wave_waits_until_every_earlier_wave_of_its_plan_completed_and_other_plans_do_not_matter() {
    let me = waved("app", "p", 2, Phase::Validated);
    let mut members = vec![
        waved("db", "p", 1, Phase::Importing),
        waved("cache", "p", 1, Phase::Completed),
        waved("other-plan", "q", 0, Phase::Preparing),
        waved("same-wave", "p", 2, Phase::Preparing),
        me.clone(),
    ];
    let w = wave_gate(&members, &me).expect("wave 1 is not done");
    assert_eq!(w.reason, Reason::WaitingForWave);
    assert_eq!(w.message, "plan \"p\" wave 2 waits for every migration of wave 1 to complete");
    members[1].phase = Phase::Importing;
    assert_eq!(wave_gate(&members, &me), Some(w), "the wait reads the same while the wave drains");
    members[1].phase = Phase::Completed;
    members[0].phase = Phase::Completed;
    assert_eq!(wave_gate(&members, &me), None);
    let mut other_ns = waved("db", "p", 1, Phase::Importing);
    other_ns.namespace = "b".into();
    members.push(other_ns);
    assert_eq!(wave_gate(&members, &me), None, "plans are per namespace");
}

#[test]
fn a_failure_in_an_earlier_wave_holds_the_later_waves_and_says_which() {
    let me = waved("app", "p", 3, Phase::Validated);
    let members = vec![
        waved("db", "p", 1, Phase::Failed),
        waved("web", "p", 2, Phase::ManualInterventionRequired),
        waved("queue", "p", 2, Phase::Retryable),
        me.clone(),
    ];
    let w = wave_gate(&members, &me).unwrap();
    assert_eq!(w.reason, Reason::WaveHeld);
    assert!(w.message.contains("db (Failed), web (ManualInterventionRequired)"), "{}", w.message);
    assert!(!w.message.contains("queue"), "a retry is not a failure: {}", w.message);
}

fn window_spec(start: &str, end: &str, zone: &str) -> VirtualMachineMigrationSpec {
    let mut spec: VirtualMachineMigrationSpec = serde_json::from_value(serde_json::json!({
        "source": {"host": "esx-01", "hostKey": "SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s",
                   "credentialsSecretRef": {"name": "c"}, "vm": {"name": "v"}},
        "destination": {"namespace": "a", "storageClassName": "s"}
    }))
    .unwrap();
    spec.cutover = CutoverSpec {
        mode: CutoverMode::Window,
        window: Some(CutoverWindow { start: start.into(), end: end.into(), time_zone: zone.into() }),
        approved: false,
    };
    spec
}

fn instant(text: &str) -> Timestamp {
    text.parse().unwrap()
}

#[test]
fn a_window_in_a_time_zone_opens_and_closes_at_local_wall_clock_times() {
    // Saturday night in Berlin: 22:00 CET is 21:00 UTC.
    let spec = window_spec("2026-12-12T22:00", "2026-12-13T04:00", "Europe/Berlin");
    let status = VirtualMachineMigrationStatus::default();
    let before = cutover_gate(&spec, &status, instant("2026-12-12T20:59:59Z"), false).unwrap().unwrap();
    assert_eq!(before.reason, Reason::WaitingForWindow);
    assert_eq!(before.until, Some(instant("2026-12-12T21:00:00Z")));
    assert!(before.message.contains("opens in 1s"), "{}", before.message);
    assert_eq!(cutover_gate(&spec, &status, instant("2026-12-12T21:00:00Z"), false).unwrap(), None);
    assert_eq!(cutover_gate(&spec, &status, instant("2026-12-13T02:59:59Z"), false).unwrap(), None);
    let after = cutover_gate(&spec, &status, instant("2026-12-13T03:00:00Z"), false).unwrap().unwrap();
    assert_eq!(after.reason, Reason::CutoverWindowClosed);
}

#[test]
fn a_window_across_a_daylight_saving_change_uses_the_offset_of_each_end() {
    // Europe/Berlin leaves summer time on 2026-10-25 at 03:00 CEST.
    let spec = window_spec("2026-10-24T22:00", "2026-10-25T06:00", "Europe/Berlin");
    let (start, end) = window_bounds(spec.cutover.window.as_ref().unwrap()).unwrap();
    assert_eq!(start, instant("2026-10-24T20:00:00Z"));
    assert_eq!(end, instant("2026-10-25T05:00:00Z"));
}

#[test]
fn a_bad_window_is_a_clear_error_naming_the_field() {
    let status = VirtualMachineMigrationStatus::default();
    for (start, end, zone, expect) in [
        ("2026-12-12T22:00", "2026-12-12T21:00", "UTC", "end \"2026-12-12T21:00\" is not after start"),
        (
            "2026-12-12T22:00",
            "2026-12-13T04:00",
            "Mars/Olympus",
            "timeZone \"Mars/Olympus\" is not a known IANA time zone",
        ),
        (
            "2026-13-12T22:00",
            "2026-12-13T04:00",
            "UTC",
            "start \"2026-13-12T22:00\" is not a local date and time",
        ),
    ] {
        let err = cutover_gate(&window_spec(start, end, zone), &status, at(0), false).unwrap_err();
        assert_eq!(err.reason, Reason::InvalidCutoverWindow);
        assert!(err.message.starts_with("spec.cutover.window: "), "{}", err.message);
        assert!(err.message.contains(expect), "{}", err.message);
    }
}

#[test]
fn approval_mode_waits_until_git_or_the_annotation_approves_and_a_started_cutover_never_waits_again() {
    let mut spec = window_spec("2026-12-12T22:00", "2026-12-13T04:00", "UTC");
    spec.cutover = CutoverSpec { mode: CutoverMode::Approval, window: None, approved: false };
    let mut status = VirtualMachineMigrationStatus::default();
    let w = cutover_gate(&spec, &status, at(0), false).unwrap().unwrap();
    assert_eq!(w.reason, Reason::WaitingForApproval);
    assert!(w.message.contains("migration.platform.example/approve-cutover"), "{}", w.message);
    assert_eq!(cutover_gate(&spec, &status, at(0), true).unwrap(), None, "annotation");
    spec.cutover.approved = true;
    assert_eq!(cutover_gate(&spec, &status, at(0), false).unwrap(), None, "spec through Git");
    spec.cutover.approved = false;
    status.timestamps.shutdown_requested = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at(0)));
    assert_eq!(cutover_gate(&spec, &status, at(0), false).unwrap(), None, "the power-off already began");
}

#[test]
fn ordinals_read_as_english() {
    let shown: Vec<String> = [1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111].iter().map(|&n| ordinal(n)).collect();
    assert_eq!(shown, ["1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st", "111th"]);
}

#[test]
fn a_providers_cap_lowers_its_hosts_cap_for_its_migrations_and_never_raises_it() {
    // Host cap 3; the provider's migrations say 1: one of theirs at a time,
    // while a migration without the field still gets the host's room.
    let limits = limits(3, None);
    let mut a = member("apps", "a", "esx-07", 0);
    a.own_cap = Some(1);
    let mut b = member("apps", "b", "esx-07", 1);
    b.own_cap = Some(1);
    let c = member("apps", "c", "esx-07", 2);
    let q = queue(&[a.clone(), b.clone(), c.clone()], &limits);
    assert_eq!(q.admitted, vec![0], "b waits behind a's one read; c waits its turn behind b");
    let wait = &q.waiting[&1];
    assert_eq!(wait.reason, Reason::WaitingForHostSlot);
    assert!(wait.message.contains("1 of 1 reads"), "{}", wait.message);
    // a reading: c (no cap of its own) fits beside it under the host's 3.
    a.holds_slot = true;
    a.queued = false;
    let q = queue(&[a.clone(), c.clone()], &limits);
    assert_eq!(q.admitted, vec![1]);
    // A cap above the host's changes nothing: the administrator's is the ceiling.
    let mut big = member("apps", "big", "esx-08", 0);
    big.own_cap = Some(10);
    big.disks = 5;
    let q = queue(&[big], &limits);
    assert_eq!(q.admitted, vec![0]);
    let mut reading = member("apps", "r", "esx-08", 0);
    reading.own_cap = Some(10);
    reading.disks = 5;
    reading.holds_slot = true;
    reading.queued = false;
    let q = queue(&[reading, member("apps", "n", "esx-08", 1)], &limits);
    assert!(q.admitted.is_empty(), "a reader of 5 disks holds the host's 3 reads, not 5 or 10");
}

/// The wave gate of one migration (indexes the fleet for one question).
fn wave_gate(members: &[Member], me: &Member) -> Option<Wait> {
    WaveIndex::new(members).gate(me)
}
