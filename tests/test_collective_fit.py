"""The alpha-beta fit of measured collectives (costmodel.hardware.collective_fit): closed forms, recovery of known
parameters from synthetic timings, the profile JSON section, and the calibrated cluster the cost model prices with."""

from __future__ import annotations

import math
import random

import pytest

from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collective_fit import (
    LINK_FIT_KIND,
    CollectiveFit,
    CollectiveProfile,
    CollectiveSample,
    calibrated_cluster,
    fit_alpha_beta,
    fit_link,
    ring_terms,
)
from costmodel.hardware.collectives import Collective, CommGroup, collective_time
from costmodel.profile_db import OpProfile, OpTiming

ALPHA = 85e-6          # seconds per ring step
BANDWIDTH = 1.2e9      # bytes/s per device
SIZES = (4096, 65536, 1 << 20, 4 << 20, 16 << 20)


def synthetic(kind: Collective, sizes=SIZES, groups=(2, 3, 4), noise: float = 0.0, seed: int = 0,
              alpha: float = ALPHA, bandwidth: float = BANDWIDTH) -> list[CollectiveSample]:
    rng = random.Random(seed)
    out = []
    for n in groups:
        for s in sizes:
            steps, volume = ring_terms(kind, n, s)
            t = steps * alpha + volume / bandwidth
            out.append(CollectiveSample(kind, n, float(s), t * (1 + rng.uniform(-noise, noise))))
    return out


def test_ring_terms_are_the_textbook_volumes():
    S = 1000.0
    assert ring_terms(Collective.ALL_REDUCE, 4, S) == (6, 1500.0)          # 2(n-1) steps, 2(n-1)/n S
    assert ring_terms(Collective.ALL_GATHER, 4, S) == (3, 750.0)           # n-1, (n-1)/n S
    assert ring_terms(Collective.REDUCE_SCATTER, 2, S) == (1, 500.0)
    assert ring_terms(Collective.ALL_TO_ALL, 5, S) == (4, 800.0)
    assert ring_terms(Collective.BROADCAST, 3, S) == (2, 1000.0)
    assert ring_terms(Collective.SEND_RECV, 8, S) == (1, 1000.0)
    with pytest.raises(ValueError, match="at least 2"):
        ring_terms(Collective.ALL_REDUCE, 1, S)


@pytest.mark.parametrize("kind", list(Collective))
def test_fit_recovers_exact_parameters(kind):
    fit = fit_alpha_beta(synthetic(kind))
    assert fit.kind == kind.value
    assert fit.alpha_s == pytest.approx(ALPHA, rel=1e-9)
    assert fit.bandwidth_bytes_per_s == pytest.approx(BANDWIDTH, rel=1e-9)
    assert fit.rms_rel_residual < 1e-12 and fit.max_rel_residual < 1e-12
    assert fit.samples == 15


def test_fit_recovers_parameters_from_noisy_timings():
    # +-5% uniform noise on every sample: both parameters within 5%, residual about noise / sqrt(3)
    fit = fit_alpha_beta(synthetic(Collective.ALL_REDUCE, noise=0.05, seed=7))
    assert fit.alpha_s == pytest.approx(ALPHA, rel=0.05)
    assert fit.bandwidth_bytes_per_s == pytest.approx(BANDWIDTH, rel=0.05)
    assert 0.005 < fit.rms_rel_residual < 0.05
    assert fit.max_rel_residual <= 0.11


def test_relative_weighting_keeps_small_messages_honest():
    # An unweighted fit would let the 16 MiB points dominate; the relative one predicts 4 KiB within 1%.
    samples = synthetic(Collective.ALL_GATHER, noise=0.01, seed=3)
    fit = fit_alpha_beta(samples)
    small = [s for s in samples if s.nbytes == 4096]
    for s in small:
        assert fit.time(s.kind, s.group_size, s.nbytes) == pytest.approx(s.seconds, rel=0.03)


def test_negative_coefficients_are_clamped():
    # Pure bandwidth (alpha = 0) with noise that would push an unconstrained alpha below zero.
    samples = synthetic(Collective.ALL_REDUCE, alpha=0.0, groups=(2,))
    samples[0] = CollectiveSample(samples[0].kind, 2, samples[0].nbytes, samples[0].seconds * 0.8)
    fit = fit_alpha_beta(samples)
    assert fit.alpha_s >= 0 and fit.bandwidth_bytes_per_s > 0
    # Latency only (no size dependence): bandwidth is infinite, alpha is the step latency.
    flat = [CollectiveSample(Collective.SEND_RECV, 2, float(s), 1e-3) for s in SIZES]
    fit = fit_alpha_beta(flat)
    assert fit.alpha_s == pytest.approx(1e-3) and math.isinf(fit.bandwidth_bytes_per_s)


def test_fit_needs_two_distinct_points():
    one = synthetic(Collective.ALL_REDUCE, sizes=(4096,), groups=(2,))
    with pytest.raises(ValueError, match="two or more sizes"):
        fit_alpha_beta(one)


def test_link_fit_over_kinds_of_one_link():
    samples = [s for k in (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER,
                           Collective.SEND_RECV, Collective.ALL_TO_ALL) for s in synthetic(k)]
    fit = fit_link(samples)
    assert fit.kind == LINK_FIT_KIND and fit.samples == 60  # all-to-all is not one of the link kinds
    assert fit.alpha_s == pytest.approx(ALPHA, rel=1e-9)
    assert fit.bandwidth_bytes_per_s == pytest.approx(BANDWIDTH, rel=1e-9)


def test_collective_profile_fits_every_kind_and_the_link():
    prof = CollectiveProfile.from_samples(synthetic(Collective.ALL_REDUCE) + synthetic(Collective.BROADCAST))
    kinds = [f.kind for f in prof.fits]
    assert kinds == ["all_reduce", "broadcast", LINK_FIT_KIND]
    assert prof.fit("cpu").kind == LINK_FIT_KIND and prof.fit("a100-80gb") is None


def test_profile_json_round_trip_and_versions(tmp_path):
    coll = CollectiveProfile.from_samples(synthetic(Collective.ALL_REDUCE))
    prof = OpProfile(entries={("cpu", "sig"): OpTiming(1e-4, 2e-4, 3)}, meta={"torch": "x"}, collectives=coll)
    path = tmp_path / "p.json"
    prof.save(path)
    again = OpProfile.load(path)
    assert again == prof
    data = prof.to_dict()
    assert data["schema_version"] == 2
    assert OpProfile(entries=prof.entries).to_dict()["schema_version"] == 1  # no collectives: still version 1
    v1 = dict(data, schema_version=1)
    with pytest.raises(ValueError, match="collectives"):
        OpProfile.from_dict(v1)  # a version-1 file has no collectives section
    bad = dict(data, collectives={**data["collectives"], "extra": []})
    with pytest.raises(ValueError, match="extra"):
        OpProfile.from_dict(bad)
    assert CollectiveFit.from_dict(coll.fits[0].to_dict()) == coll.fits[0]


def test_calibrated_cluster_prices_collectives_with_the_fit():
    cluster = Cluster.parse("1x4xcpu")
    coll = CollectiveProfile.from_samples(synthetic(Collective.ALL_REDUCE) + synthetic(Collective.ALL_GATHER))
    calibrated = calibrated_cluster(cluster, coll)
    fit = coll.fit("cpu")
    for kind, n, nbytes in ((Collective.ALL_REDUCE, 4, 1 << 20), (Collective.ALL_GATHER, 2, 4 << 20),
                            (Collective.REDUCE_SCATTER, 4, 65536)):
        assert collective_time(kind, nbytes, CommGroup(n), calibrated) == pytest.approx(fit.time(kind, n, nbytes))
    assert calibrated.tiers[0].latency == fit.alpha_s and calibrated.tiers[0].efficiency == 1.0
    # Nothing measured for the device: the cluster is returned unchanged.
    assert calibrated_cluster(Cluster.parse("1x8xa100-80gb"), coll) == Cluster.parse("1x8xa100-80gb")
    assert calibrated_cluster(cluster, None) is cluster


def test_sample_validation_names_the_bad_value():
    with pytest.raises(ValueError, match="group_size"):
        CollectiveSample(Collective.ALL_REDUCE, 1, 1024.0, 1e-3)
    with pytest.raises(ValueError, match="seconds"):
        CollectiveSample(Collective.ALL_REDUCE, 2, 1024.0, -1.0)
    with pytest.raises(ValueError, match="not_a_kind|valid"):
        CollectiveSample("not_a_kind", 2, 1024.0, 1e-3)
