use super::*;
use cohort_store::HashStore;

const T: Duration = Duration::from_secs(5);

fn info(node_rank: usize, nproc_per_node: usize, nnodes: (usize, usize)) -> NodeInfo {
    NodeInfo {
        node_rank,
        nproc_per_node,
        max_restarts: 1,
        min_nodes: nnodes.0,
        max_nodes: nnodes.1,
        host: "host a".into(),
        pid: 42 + node_rank as u32,
    }
}

fn agent(store: &Arc<HashStore>, me: NodeInfo) -> Rendezvous {
    Rendezvous::new(
        store.clone(),
        "127.0.0.1",
        1,
        me,
        Duration::from_millis(200),
    )
}

fn member(joined: Wait<Joined>) -> Membership {
    match joined {
        Wait::Done(Joined::Member(m)) => m,
        other => panic!("not a member: {other:?}"),
    }
}

/// Every agent joins `round` on a thread of its own.
fn join_all(agents: &[&Rendezvous], round: u32) -> Vec<Result<Wait<Joined>, LaunchError>> {
    thread::scope(|s| {
        let handles: Vec<_> = agents
            .iter()
            .map(|a| s.spawn(move || a.join(round, T, &Events::install().unwrap())))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn node_info_survives_encoding_even_with_spaces_in_the_host() {
    let me = info(3, 2, (1, 4));
    assert_eq!(NodeInfo::decode(&me.encode()), Some(me));
    assert_eq!(NodeInfo::decode("nproc_per_node=x"), None);
}

#[test]
fn a_fixed_job_runs_every_node_and_counts_failed_rounds() {
    let events = Events::install().unwrap();
    let store = Arc::new(HashStore::new());
    // Node 1 joins first: group ranks follow node ranks, not arrival.
    let (b, a) = (
        agent(&store, info(1, 2, (2, 2))),
        agent(&store, info(0, 2, (2, 2))),
    );
    let ids = thread::scope(|s| {
        let h = s.spawn(|| b.run_id("ignored", T, &Events::install().unwrap()));
        (a.run_id("run-a", T, &events).unwrap(), h.join().unwrap())
    });
    assert_eq!(ids.0, Wait::Done("run-a".to_string()));
    assert_eq!(ids.1.unwrap(), Wait::Done("run-a".to_string()));

    let joined: Vec<_> = join_all(&[&b, &a], 0)
        .into_iter()
        .map(|j| member(j.unwrap()))
        .collect();
    assert_eq!(joined[0], joined[1]);
    let m = &joined[0];
    assert_eq!((m.nodes.clone(), m.restarts), (vec![0, 1], 0));
    assert_eq!((m.group_rank(0), m.group_rank(1)), (0, 1));
    assert_eq!(a.interruption(m).unwrap(), None);

    b.report_failure(0, "rank 3 failed").unwrap();
    a.report_failure(0, "rank 0 failed later").unwrap();
    assert_eq!(a.failure(0).unwrap().as_deref(), Some("rank 3 failed"));
    assert_eq!(
        a.interruption(m).unwrap(),
        Some(Interruption::Failed("rank 3 failed".into()))
    );
    assert_eq!(a.failure(1).unwrap(), None, "failures belong to a round");
    let mut liveness = Liveness::new(T);
    assert_eq!(
        a.finish(m, &mut liveness, &events).unwrap(),
        Wait::Done(RoundResult::Failed("rank 3 failed".into()))
    );

    // The next round records the failure restart, for every node alike.
    let next = join_all(&[&a, &b], 1);
    for j in next {
        assert_eq!(member(j.unwrap()).restarts, 1);
    }
    assert_eq!(a.current_round().unwrap(), 1);
    assert_eq!(a.closed().unwrap(), None);
    b.close(&JobEnd::Stopped("node 1 gave up".into())).unwrap();
    a.close(&JobEnd::Succeeded).unwrap();
    assert_eq!(
        a.closed().unwrap(),
        Some(JobEnd::Stopped("node 1 gave up".into()))
    );
}

#[test]
fn a_round_succeeds_when_every_node_finished() {
    let store = Arc::new(HashStore::new());
    let nodes: Vec<_> = (0..3).map(|n| agent(&store, info(n, 1, (3, 3)))).collect();
    let refs: Vec<&Rendezvous> = nodes.iter().collect();
    let m = member(join_all(&refs, 0).remove(0).unwrap());
    let results: Vec<_> = thread::scope(|s| {
        let handles: Vec<_> = nodes
            .iter()
            .map(|n| {
                let m = m.clone();
                s.spawn(move || {
                    let mut liveness = Liveness::new(T);
                    n.finish(&m, &mut liveness, &Events::install().unwrap())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect()
    });
    assert!(results
        .iter()
        .all(|r| *r == Wait::Done(RoundResult::AllSucceeded)));
}

#[test]
fn an_elastic_round_starts_with_min_nodes_and_regroups_for_a_late_one() {
    let events = Events::install().unwrap();
    let store = Arc::new(HashStore::new());
    let a = agent(&store, info(0, 1, (1, 2)));
    let b = agent(&store, info(1, 1, (1, 2)));

    // Alone, node 0 waits out the last call, then runs by itself.
    let started = Instant::now();
    let m0 = member(a.join(0, T, &events).unwrap());
    assert!(started.elapsed() >= Duration::from_millis(200));
    assert_eq!(m0.nodes, vec![0]);

    // Node 1 arrives while round 0 runs: it waits for round 1, which
    // cannot close (not even with MIN = 1) until round 0 ended.
    assert_eq!(b.current_round().unwrap(), 0);
    assert_eq!(b.join(0, T, &events).unwrap(), Wait::Done(Joined::Late));
    assert_eq!(
        a.interruption(&m0).unwrap(),
        Some(Interruption::Regroup),
        "a round with room regroups for a waiting node"
    );
    let (m1_b, m1_a) = thread::scope(|s| {
        let h = s.spawn(|| b.join(1, T, &Events::install().unwrap()));
        thread::sleep(Duration::from_millis(400));
        assert!(!h.is_finished(), "round 1 closed while round 0 ran");
        a.report_regroup(0).unwrap();
        let mine = a.join(1, T, &events).unwrap();
        (h.join().unwrap().unwrap(), mine)
    });
    let (m1_a, m1_b) = (member(m1_a), member(m1_b));
    assert_eq!(m1_a, m1_b);
    assert_eq!(m1_a.nodes, vec![0, 1]);
    assert_eq!(m1_a.restarts, 0, "regrouping is not a failure restart");
    assert_eq!(b.current_round().unwrap(), 1);
}

#[test]
fn a_full_round_does_not_regroup_and_a_closed_job_turns_away_newcomers() {
    let events = Events::install().unwrap();
    let store = Arc::new(HashStore::new());
    let a = agent(&store, info(0, 1, (1, 1)));
    let m = member(a.join(0, T, &events).unwrap());
    let late = agent(&store, info(0, 1, (1, 1)));
    // Same node rank, another agent: a replacement that must wait.
    let mut other = info(0, 1, (1, 1));
    other.pid = 7;
    let replacement = agent(&store, other);
    assert_eq!(
        replacement.join(0, T, &events).unwrap_err().to_string(),
        LaunchError::DuplicateNodeRank {
            node_rank: 0,
            holder: info(0, 1, (1, 1)).encode()
        }
        .to_string()
    );
    drop(late);
    assert_eq!(a.interruption(&m).unwrap(), None);
    a.close(&JobEnd::Succeeded).unwrap();
    let newcomer = agent(&store, info(0, 1, (1, 1)));
    assert_eq!(newcomer.current_round().unwrap(), 1);
    assert_eq!(
        newcomer.join(1, T, &events).unwrap(),
        Wait::Done(Joined::Closed(JobEnd::Succeeded))
    );
}

#[test]
fn mismatched_nodes_are_named() {
    let store = Arc::new(HashStore::new());
    let a = agent(&store, info(0, 2, (2, 2)));
    let b = agent(&store, info(1, 4, (2, 2)));
    let results = join_all(&[&a, &b], 0);
    let err = results[0].as_ref().unwrap_err().to_string();
    assert!(
        err.contains("node 1") && err.contains("nproc_per_node = 4"),
        "{err}"
    );
    assert!(results[1].is_err());

    let store = Arc::new(HashStore::new());
    let a = agent(&store, info(0, 1, (2, 2)));
    let b = agent(&store, info(1, 1, (1, 2)));
    let results = join_all(&[&a, &b], 0);
    let err = results[0].as_ref().unwrap_err().to_string();
    assert!(err.contains("nnodes = 1:2"), "{err}");
}

#[test]
fn too_few_nodes_is_a_timeout_naming_the_missing() {
    let events = Events::install().unwrap();
    let store = Arc::new(HashStore::new());
    let a = agent(&store, info(1, 1, (2, 3)));
    let err = a.join(0, Duration::from_millis(300), &events).unwrap_err();
    match err {
        LaunchError::JoinTimeout {
            arrived,
            needed,
            missing,
            ..
        } => assert_eq!((arrived, needed, missing), (1, 2, vec![0, 2])),
        other => panic!("{other}"),
    }
}

#[test]
fn a_silent_node_fails_the_round_it_was_awaited_in() {
    let events = Events::install().unwrap();
    let store = Arc::new(HashStore::new());
    let (a, b) = (
        agent(&store, info(0, 1, (2, 2))),
        agent(&store, info(1, 1, (2, 2))),
    );
    let m = member(join_all(&[&a, &b], 0).remove(0).unwrap());
    let mut liveness = Liveness::new(Duration::from_millis(200));
    liveness.watch(&m.others(0));
    // Node 1 never beats and never finishes.
    let result = a.finish(&m, &mut liveness, &events).unwrap();
    match result {
        Wait::Done(RoundResult::Failed(detail)) => {
            assert!(
                detail.starts_with("node 1 lost: no heartbeat for"),
                "{detail}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert!(b.failure(0).unwrap().unwrap().contains("node 1 lost"));
}
