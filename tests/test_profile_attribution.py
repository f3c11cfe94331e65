"""The profiles' wall-clock attribution (`benchmarks.common`): ops that overlap share the
interval, containers (a `while` thunk around its body) are not charged, and the charges add up
to the busy time. A summed duration double-counts concurrent ops: the bug this guards against
(it made the decode loop's matmuls look half as fast as they run)."""

from benchmarks.common import self_segments, wall_shares


def ev(name, ts, dur, tid=1):
    return {"name": name, "ts": ts, "dur": dur, "tid": tid}


def test_overlapping_ops_split_the_interval_they_share():
    # gate and up run at once on two threads for 10 units; down runs alone for 4
    shares = wall_shares([ev("gate", 0, 10, 1), ev("up", 0, 10, 2), ev("down", 10, 4, 1)])
    assert shares == {"gate": 5.0, "up": 5.0, "down": 4.0}
    # partial overlap: a [0, 6), b [4, 10): 4 alone, 2 shared, 4 alone
    shares = wall_shares([ev("a", 0, 6, 1), ev("b", 4, 6, 2)])
    assert shares == {"a": 5.0, "b": 5.0}
    assert sum(shares.values()) == 10  # the busy time, not 12


def test_idle_gaps_are_charged_to_nobody():
    shares = wall_shares([ev("a", 0, 2), ev("b", 5, 3)])
    assert shares == {"a": 2.0, "b": 3.0}


def test_nested_events_charge_each_instant_to_the_innermost_op():
    # a while thunk spans its body; the executor runs `add` inline inside `dot`'s completion
    loop = ev("while.1", 0, 100)
    body = [ev("dot", 10, 40), ev("add", 40, 10), ev("other_thread", 0, 30, tid=2)]
    pieces = self_segments([loop, *body])
    own = {}
    for p in pieces:
        own[p["name"]] = own.get(p["name"], 0) + p["dur"]
    assert own == {"while.1": 60, "dot": 30, "add": 10, "other_thread": 30}
    assert sum(own.values()) == 130  # 100 on thread 1 + 30 on thread 2: nothing counted twice
    shares = wall_shares(pieces)
    assert shares["other_thread"] == 15  # [0, 10) shared with the loop, [10, 30) with dot
    assert abs(sum(shares.values()) - 100) < 1e-9  # the busy wall time
    # back-to-back ops on one thread do not nest
    assert {p["name"]: p["dur"] for p in self_segments([ev("a", 0, 5), ev("b", 5, 5)])} == {"a": 5, "b": 5}


def test_steal_seconds_reads_the_eighth_counter_of_the_cpu_line():
    """/proc/stat: cpu user nice system idle iowait irq softirq steal ... (clock ticks)."""
    import os

    from benchmarks.common import steal_seconds

    hz = os.sysconf("SC_CLK_TCK")
    line = f"cpu  1789112 141036 320778 3039716 12673 0 2028 {3 * hz} 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"
    assert steal_seconds(line) == 3.0
    assert steal_seconds("cpu0 1 2 3 4 5 6 7 8 9") is None  # not the aggregate line
    assert steal_seconds("cpu 1 2 3") is None  # a kernel without the column
