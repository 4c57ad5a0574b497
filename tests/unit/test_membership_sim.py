"""Whole clusters of SWIM nodes in virtual time: convergence, failure detection, loss, refutation, leave, partitions."""

import math

import pytest

from shared.membership import MembershipSettings, Simulation, Status
from shared.membership.timing import suspicion_bounds

# Anything stuck fails fast, with a stack dump, instead of at the suite-wide limit.
pytestmark = pytest.mark.timeout(120)

CONFIG = MembershipSettings(cluster_name="drivetrain")
PERIOD = CONFIG.probe_interval
N = 64


def start_cluster(n=N, seed=0, loss=0.0, spread_seeds=True):
    """n members all starting at t=0; each joins through one member started before it."""
    sim = Simulation(CONFIG, seed=seed, loss=loss)
    sim.add("m0", role="edge")
    for i in range(1, n):
        seed_member = f"m{sim.rng.randrange(i)}" if spread_seeds else "m0"
        sim.add(f"m{i}", role=("edge", "worker", "router")[i % 3], seeds=[seed_member])
    return sim


def converged_cluster(n=N, seed=0, loss=0.0):
    sim = start_cluster(n, seed, loss)
    assert sim.run_until_true(sim.converged, timeout=10.0, step=PERIOD) is not None
    sim.changes.clear()
    return sim


def dead_notices(sim, members=None):
    return [c for c in sim.changes if c.new in (Status.DEAD,) and (members is None or c.member in members)]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_join_converges_in_log_n_periods(seed):
    sim = start_cluster(seed=seed)
    took = sim.run_until_true(sim.converged, timeout=30.0, step=PERIOD / 4)
    assert took is not None
    assert took / PERIOD <= 2 * math.log2(N)
    assert all(len(node.members()) == N for node in sim.live())


def test_crashed_member_is_declared_dead_by_everyone_within_bounds():
    sim = converged_cluster(seed=4)
    sim.crash("m7")
    shortest, _ = suspicion_bounds(CONFIG.suspicion_mult, CONFIG.suspicion_max_timeout_mult, N, PERIOD)
    took = sim.run_until_true(lambda: sim.all_see("m7", [Status.DEAD]), timeout=30.0, step=PERIOD / 4)
    assert took is not None and took <= shortest + 10 * PERIOD
    first_suspect = min(c.at for c in sim.changes if c.member == "m7" and c.new is Status.SUSPECT)
    first_dead = min(c.at for c in dead_notices(sim, ["m7"]))
    assert first_dead - first_suspect >= shortest - 1e-9  # nobody skipped the suspicion
    assert {c.member for c in dead_notices(sim)} == {"m7"}
    # Helpers answered the failed indirect probes with nacks, so the probers kept trusting themselves.
    assert max(node.awareness.score for node in sim.live()) == 0


def test_no_false_positives_over_300_periods_with_5_percent_loss():
    sim = converged_cluster(seed=5, loss=0.05)
    sim.run_for(300 * PERIOD)
    suspicions = [c for c in sim.changes if c.new is Status.SUSPECT]
    assert suspicions, "with 5% loss some probes must fail, or this test proves nothing"
    assert dead_notices(sim) == []
    assert sum(node.table.refutations for node in sim.live()) > 0
    assert all(sim.status(a.id, b.id) in (Status.ALIVE, Status.SUSPECT) for a in sim.live() for b in sim.live())


def test_falsely_suspected_member_refutes_and_stays_alive():
    sim = converged_cluster(seed=6)
    accuser = sim.nodes["m1"]
    assert accuser.table.suspect("m9", sim.now)  # as if m1's probe of m9 had failed
    took = sim.run_until_true(lambda: sim.all_see("m9", [Status.ALIVE]) and sim.status("m1", "m9") is Status.ALIVE,
                              timeout=5.0, step=PERIOD / 4)
    assert took is not None and took < 2.0
    assert sim.nodes["m9"].table.me.incarnation == 1 and sim.nodes["m9"].table.refutations == 1
    assert all(node.member("m9").incarnation == 1 for node in sim.live())
    sim.run_for(30 * PERIOD)
    assert dead_notices(sim) == []


def test_graceful_leave_is_seen_by_all_without_suspicion():
    sim = converged_cluster(seed=7)
    sim.leave("m5")
    took = sim.run_until_true(lambda: sim.all_see("m5", [Status.LEFT]), timeout=3.0, step=PERIOD / 4)
    assert took is not None and took <= 2 * PERIOD
    sim.run_for(20 * PERIOD)
    assert sim.all_see("m5", [Status.LEFT])
    assert [c for c in sim.changes if c.member == "m5" and c.new is not Status.LEFT] == []


def test_load_updates_reach_everyone_with_a_new_incarnation():
    sim = converged_cluster(n=32, seed=8)
    node = sim.nodes["m4"]
    sim._after(node, node.set_meta(sim.now, load={"running": 7, "free_kv_blocks": 120}))
    took = sim.run_until_true(lambda: all(n.member("m4").load.get("running") == 7 for n in sim.live()),
                              timeout=5.0, step=PERIOD / 4)
    assert took is not None and took <= 3 * PERIOD
    assert {n.member("m4").incarnation for n in sim.live()} == {1}
    # A burst of changes is coalesced: at most one publication per meta_min_interval.
    for running in range(8, 20):
        sim._after(node, node.set_meta(sim.now, load={"running": running}))
    assert node.table.me.incarnation == 1
    sim.run_for(CONFIG.meta_min_interval + 5 * PERIOD)
    assert node.table.me.incarnation == 2
    assert all(n.member("m4").load == {"running": 19} for n in sim.live())


@pytest.mark.parametrize("forgotten", [False, True], ids=["still-held-dead", "forgotten"])
def test_a_restarted_seed_is_found_again_at_a_new_incarnation(forgotten):
    """The only seed crashes and comes back as a new process that knows nobody, while the others
    hold its old self dead at a higher incarnation, or have forgotten it altogether."""
    sim = start_cluster(n=12, seed=11, spread_seeds=False)
    assert sim.run_until_true(sim.converged, timeout=10.0, step=PERIOD) is not None
    seed = sim.nodes["m0"]
    for running in range(5):  # each publication is a new incarnation of the old self
        sim._after(seed, seed.set_meta(sim.now, load={"running": running}))
        sim.run_for(CONFIG.meta_min_interval + PERIOD)
    old_incarnation = seed.table.me.incarnation
    assert old_incarnation >= 4 and all(n.member("m0").incarnation == old_incarnation for n in sim.live())

    sim.crash("m0")
    assert sim.run_until_true(lambda: sim.all_see("m0", [Status.DEAD]), timeout=10.0, step=PERIOD) is not None
    if forgotten:
        sim.run_for(CONFIG.dead_retention + 2.0)
        assert all(n.member("m0") is None for n in sim.live() if n.id != "m0")
    sim.restart("m0")
    took = sim.run_until_true(sim.converged, timeout=10.0, step=PERIOD / 4)
    assert took is not None and took <= 3 * CONFIG.resync_interval
    if not forgotten:  # its new self overruled the old one's death
        assert all(n.member("m0").incarnation > old_incarnation for n in sim.live())


def test_partition_longer_than_suspicion_heals_after_the_cut_is_removed():
    sim = converged_cluster(n=40, seed=9)
    left, right = [f"m{i}" for i in range(20)], [f"m{i}" for i in range(20, 40)]
    sim.partition(left, right)
    sim.run_for(6.0)
    assert sim.status("m0", "m30") is Status.DEAD and sim.status("m30", "m0") is Status.DEAD
    sim.faults.heal()
    took = sim.run_until_true(sim.converged, timeout=CONFIG.dead_retention, step=PERIOD)
    assert took is not None and took <= 5.0


def test_a_degraded_member_raises_its_own_health_score():
    sim = converged_cluster(n=32, seed=10)
    sick = sim.nodes["m4"]
    sim.faults.degrade(sick.address, loss=0.5)
    sick_scores, healthy_scores = [], []
    for _ in range(60):
        sim.run_for(PERIOD)
        sick_scores.append(sick.awareness.score)
        healthy_scores += [n.awareness.score for n in sim.live() if n is not sick]
    assert sum(sick_scores) / len(sick_scores) >= 3
    # Healthy members only pay a point per false accusation they refute, and recover.
    assert sum(healthy_scores) / len(healthy_scores) <= 0.5
    assert {c.member for c in dead_notices(sim)} <= {"m4"}  # nobody healthy pays for the sick one


def test_simulation_is_deterministic_for_a_seed():
    def trace(seed):
        sim = start_cluster(n=16, seed=seed, loss=0.1)
        sim.run_for(40 * PERIOD)
        return [(c.at, c.observer, c.member, c.new) for c in sim.changes]

    assert trace(11) == trace(11)
    assert trace(11) != trace(12)


def test_a_leaving_member_has_nothing_due_once_its_goodbye_is_out():
    sim = converged_cluster(n=4, seed=12)
    node = sim.nodes["m1"]
    sim.leave("m1", grace=5.0)
    sim.run_for(2.0)  # past every sync deadline it had: none may stay due, or its loop would spin
    assert node.next_deadline() > sim.now
