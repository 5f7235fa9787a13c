"""Pipeline schedules: bubble fractions, in-flight counts, and the step-time closed form against an event-driven
simulation of the GPipe, 1F1B and Megatron interleaved schedules."""

from __future__ import annotations

import random

import pytest

from costmodel.pipeline import (
    bubble_fraction,
    drain_slack,
    in_flight_microbatches,
    in_flight_per_chunk,
    pipeline_step_time,
    pipeline_times,
)


def simulate(f, b, schedule, m, v=1, send=0.0):
    """Makespan of the schedule when each op starts as soon as its rank is free and its input is ready; `send`
    seconds after the op that produced it for an input from another chunk (a non-blocking send: neither rank waits
    for it otherwise, as Megatron-Core's overlapped interleaved sends).

    Per-rank op order: GPipe all forwards then all backwards; 1F1B warm-up min(p-r-1, m) forwards then alternate;
    interleaved as Megatron-LM's schedules.py (warm-up 2(p-r-1) + (v-1)p, k-th forward on chunk (k//p) % v).
    """
    n = len(f)
    p = n // v
    orders = []
    for r in range(p):
        if schedule == "gpipe":
            orders.append([("F", k, 0) for k in range(m)] + [("B", k, 0) for k in range(m)])
            continue
        total = m * v

        def fu(k):
            return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

        def bu(k):
            return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

        w = min(p - r - 1, m) if v == 1 else min((p - r - 1) * 2 + (v - 1) * p, total)
        ops = [fu(k) for k in range(w)]
        for i in range(total - w):
            ops += [fu(w + i), bu(i)]
        ops += [bu(k) for k in range(total - w, total)]
        orders.append(ops)
    done: dict = {}
    free, pos = [0.0] * p, [0] * p

    def ready(r, op):
        kind, mb, c = op
        j = c * p + r
        if kind == "F":
            t = 0.0 if j == 0 else done.get(("F", mb, (j - 1) // p, (j - 1) % p))
            return t if t is None or j == 0 else t + send
        if j == n - 1:
            return done.get(("F", mb, c, r))
        t = done.get(("B", mb, (j + 1) // p, (j + 1) % p))
        return None if t is None else t + send

    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                op = orders[r][pos[r]]
                t = ready(r, op)
                if t is None:
                    break
                j = op[2] * p + r
                free[r] = max(free[r], t) + (f[j] if op[0] == "F" else b[j])
                done[(op[0], op[1], op[2], r)] = free[r]
                pos[r] += 1
                remaining -= 1
                progressed = True
        assert progressed, "schedule deadlocked"
    return max(free)


def test_bubble_fractions():
    assert bubble_fraction("1f1b", 8, 64) == pytest.approx(7 / 64)
    assert bubble_fraction("gpipe", 4, 4) == pytest.approx(3 / 4)
    assert bubble_fraction("interleaved", 8, 64, 3) == pytest.approx(7 / 192)
    assert bubble_fraction("1f1b", 1, 5) == 0.0
    with pytest.raises(ValueError, match="interleaved"):
        bubble_fraction("1f1b", 4, 8, 2)


@pytest.mark.parametrize("schedule,p,m,v", [("1f1b", 4, 8, 1), ("gpipe", 4, 8, 1), ("1f1b", 8, 3, 1),
                                            ("interleaved", 4, 8, 2), ("interleaved", 8, 64, 3),
                                            ("interleaved", 3, 3, 4)])
def test_equal_stages_match_closed_form_and_simulation(schedule, p, m, v):
    f, b = 1.0 / v, 2.0 / v
    stages = p * v
    t = pipeline_step_time([f] * stages, [b] * stages, schedule, m, v)
    busy = m * 3.0
    assert t == pytest.approx(busy * (1 + bubble_fraction(schedule, p, m, v)))
    assert t == pytest.approx(simulate([f] * stages, [b] * stages, schedule, m, v))
    parts = pipeline_times([f] * stages, [b] * stages, schedule, m, v)
    assert parts.busy_s == pytest.approx(busy) and parts.p2p_s == 0.0
    assert parts.bubble_s == pytest.approx(busy * bubble_fraction(schedule, p, m, v))


def test_uneven_stages_documented_bounds():
    """GPipe's formula is exact; 1F1B's (slowest stage sets the steady state) is an upper bound within 20%;
    the interleaved analogue stays within 25% on stages whose costs differ up to 4x."""
    rng = random.Random(7)
    worst = {"gpipe": 0.0, "1f1b": 0.0, "interleaved": 0.0}
    for _ in range(150):
        schedule = rng.choice(sorted(worst))
        p = rng.randint(2, 5)
        v = rng.randint(2, 3) if schedule == "interleaved" else 1
        m = p * rng.randint(1, 3) if schedule == "interleaved" else rng.randint(1, 10)
        f = [rng.uniform(0.5, 2.0) for _ in range(p * v)]
        b = [x * rng.uniform(1.5, 2.5) for x in f]
        sim = simulate(f, b, schedule, m, v)
        err = (pipeline_step_time(f, b, schedule, m, v) - sim) / sim
        if schedule == "1f1b":
            assert err >= -1e-12
        worst[schedule] = max(worst[schedule], abs(err))
    assert worst["gpipe"] < 1e-9
    assert worst["1f1b"] < 0.20
    assert worst["interleaved"] < 0.25


def test_uneven_1f1b_formula_by_hand():
    f, b = [1.0, 2.0, 1.0], [2.0, 4.0, 2.0]
    # sum(f+b) + (m-1) max(f+b) = 12 + 3 * 6
    assert pipeline_step_time(f, b, "1f1b", 4) == pytest.approx(30.0)
    # The event simulation overlaps the slow middle stage's fill better: 28, so the formula is 7% conservative.
    assert simulate(f, b, "1f1b", 4) == pytest.approx(28.0)


def test_p2p_adds_to_receiving_forward_and_sending_backward():
    f, b = [1.0, 1.0], [2.0, 2.0]
    base = pipeline_step_time(f, b, "1f1b", 4)
    parts = pipeline_times(f, b, "1f1b", 4, 1, 0.1)
    # Each stage gains 0.1 per micro-batch: 2 stages in the fill/drain sum plus (m-1) in the steady state.
    assert parts.total_s == pytest.approx(base + 0.1 * 2 + 3 * 0.1)
    assert parts.p2p_s == pytest.approx(0.5)
    with pytest.raises(ValueError, match="one value per stage boundary"):
        pipeline_step_time(f, b, "1f1b", 4, 1, [0.1, 0.2])


def test_in_flight_counts():
    assert [in_flight_microbatches("1f1b", 4, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight_microbatches("1f1b", 4, r, 2) for r in range(4)] == [2, 2, 2, 1]
    assert in_flight_microbatches("gpipe", 4, 3, 8) == 8
    p, v, m = 8, 3, 64
    counts = in_flight_per_chunk("interleaved", p, 0, m, v)
    assert counts == (2 * p - 1, p, p)
    # Korthikanti et al. 2022 Sec. 4.2.3: interleaving multiplies the first stage's activations by 1 + (p-1)/(p*v)
    # relative to 1F1B's p micro-batches of L/p layers.
    assert sum(counts) / v == pytest.approx(p * (1 + (p - 1) / (p * v)))
    # Few micro-batches: capped by m*v.
    assert sum(in_flight_per_chunk("interleaved", 4, 0, 4, 2)) == 8
    with pytest.raises(ValueError, match="outside"):
        in_flight_per_chunk("1f1b", 4, 4, 8)


def test_drain_slack():
    assert drain_slack([2.0, 3.0, 4.0], 3) == (0.0, 2.0, 5.0)
    assert drain_slack([2.0, 3.0, 4.0], 3, 0.5) == (0.0, 2.5, 6.0)


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (8, 4, 16)])
def test_overlapped_interleaved_sends_wait_only_in_the_fill_and_drain(p, v, m):
    """Megatron-Core's overlapped sends (`p2p_overlap`): the step is the step without sends plus 2 sum(p2p), what
    an event simulation of the schedule gives when a send delays only the chunk that reads it; blocking sends cost
    every micro-batch's."""
    f, b, s = [1.0] * (p * v), [2.0] * (p * v), 0.1
    plain = pipeline_times(f, b, "interleaved", m, v)
    overlapped = pipeline_times(f, b, "interleaved", m, v, s, p2p_overlap=True)
    blocking = pipeline_times(f, b, "interleaved", m, v, s)
    assert overlapped.total_s == pytest.approx(plain.total_s + 2 * s * (p * v - 1))
    assert overlapped.p2p_s == pytest.approx(2 * s * (p * v - 1)) and overlapped.p2p_s < blocking.p2p_s
    assert simulate(f, b, "interleaved", m, v) == pytest.approx(plain.total_s)
    assert simulate(f, b, "interleaved", m, v, send=s) == pytest.approx(overlapped.total_s)
    # 1F1B has no overlapped sends: the flag changes nothing there
    assert pipeline_times(f[:p], b[:p], "1f1b", m, 1, s, p2p_overlap=True).total_s == pytest.approx(
        pipeline_times(f[:p], b[:p], "1f1b", m, 1, s).total_s)
