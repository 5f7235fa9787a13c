r"""Fit the alpha-beta parameters of a local process group's collectives from measured times.

`stratagem profile --collectives` times each collective kind at several message sizes and group sizes on the local
backend (gloo for CPU processes, NCCL for GPUs). Each measurement is explained by the single-tier (one node) ring
forms that `costmodel.hardware.collectives` prices a node-local group with (group of n ranks, S = the full logical buffer
per device, as there):

    kind            steps        bytes per device on the wire
    all_reduce      2 (n - 1)    2 (n - 1) / n * S
    all_gather      n - 1        (n - 1) / n * S
    reduce_scatter  n - 1        (n - 1) / n * S
    all_to_all      n - 1        (n - 1) / n * S
    broadcast       n - 1        S                     (ring / chain broadcast)
    send_recv       1            S

so that  t = steps * alpha + volume / B  with alpha the per-step latency (seconds) and B the achieved bandwidth per
device (bytes/s). `fit_alpha_beta` solves for (alpha, 1/B) by least squares on the *relative* error (each sample
weighted by 1 / t_measured, since the sizes span several orders of magnitude and a plain fit would ignore the
small messages), with both coefficients kept non-negative (a coefficient that would go negative is fixed at 0
and the other refitted: the two-variable non-negative least squares solution). The fit reports its root mean
square and largest relative residual.

`fit_link` fits one (alpha, B) over every kind the step-time model uses, and `calibrated_cluster` writes it into
the node tier of a cluster whose devices were measured as the tier's default latency and bandwidth, and each
kind's own fit as that kind's `per_collective` override: the kinds differ (gloo, 2 ranks: 96 us per all-reduce
step, 170 us per reduce-scatter step, and reduce-scatter ~3x slower per byte at 4 MB), so the joint fit alone
under-prices reduce-scatter up to 5x. Every collective the cost model prices on that node then uses its own
kind's measured latency and bandwidth, and the joint fit for kinds that were not measured.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collectives import Collective
from costmodel.hardware.network import CollectiveLink, NetworkTier

COLLECTIVE_PROFILE_KEYS = frozenset({"samples", "fits"})
_SAMPLE_KEYS = frozenset({"device", "backend", "kind", "group_size", "nbytes", "seconds", "repeats"})
_FIT_KEYS = frozenset({"device", "backend", "kind", "alpha_s", "bandwidth_bytes_per_s", "rms_rel_residual",
                       "max_rel_residual", "samples"})
LINK_FIT_KIND = "link"
"""`CollectiveFit.kind` of the joint fit over all kinds (`fit_link`), the one a network tier is calibrated with."""


def ring_terms(kind: Collective | str, group_size: int, nbytes: float) -> tuple[int, float]:
    """(algorithm steps, bytes per device on the wire) of one single-tier ring collective (module docstring)."""
    kind = Collective(kind)
    n = group_size
    if not isinstance(n, int) or n < 2:
        raise ValueError(f"a collective needs a group of at least 2 ranks, got {n!r}")
    if kind is Collective.ALL_REDUCE:
        return 2 * (n - 1), 2 * (n - 1) / n * nbytes
    if kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        return n - 1, (n - 1) / n * nbytes
    if kind is Collective.BROADCAST:
        return n - 1, float(nbytes)
    return 1, float(nbytes)  # SEND_RECV


@dataclass(frozen=True, slots=True)
class CollectiveSample:
    """One measured collective: the median of `repeats` timed calls."""

    kind: Collective
    group_size: int
    nbytes: float
    """Full logical buffer per device, as `costmodel.hardware.collectives.collective_time` takes it."""
    seconds: float
    device: str = "cpu"
    backend: str = "gloo"
    repeats: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Collective(self.kind))
        if not isinstance(self.group_size, int) or self.group_size < 2:
            raise ValueError(f"collective sample group_size must be an integer >= 2, got {self.group_size!r}")
        if not (self.nbytes > 0 and math.isfinite(self.nbytes)):
            raise ValueError(f"collective sample nbytes must be a positive number, got {self.nbytes!r}")
        if not (self.seconds > 0 and math.isfinite(self.seconds)):
            raise ValueError(f"collective sample seconds must be a positive number, got {self.seconds!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "backend": self.backend, "kind": self.kind.value,
                "group_size": self.group_size, "nbytes": self.nbytes, "seconds": self.seconds,
                "repeats": self.repeats}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CollectiveSample:
        _check_keys(d, _SAMPLE_KEYS, "collectives.samples")
        return cls(kind=Collective(d["kind"]), group_size=int(d["group_size"]), nbytes=float(d["nbytes"]),
                   seconds=float(d["seconds"]), device=str(d["device"]), backend=str(d["backend"]),
                   repeats=int(d.get("repeats", 1)))


@dataclass(frozen=True, slots=True)
class CollectiveFit:
    """t = steps * alpha + volume / bandwidth for one collective kind (or `LINK_FIT_KIND` for all at once)."""

    kind: str
    alpha_s: float
    """Seconds per algorithm step (latency)."""
    bandwidth_bytes_per_s: float
    """Achieved bytes/s per device (math.inf when the measurements show no size dependence)."""
    rms_rel_residual: float
    """Root mean square of (predicted - measured) / measured over the fitted samples."""
    max_rel_residual: float
    samples: int
    device: str = "cpu"
    backend: str = "gloo"

    def time(self, kind: Collective | str, group_size: int, nbytes: float) -> float:
        """Seconds the fitted model gives for one collective."""
        steps, volume = ring_terms(kind, group_size, nbytes)
        return steps * self.alpha_s + volume / self.bandwidth_bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        bw = self.bandwidth_bytes_per_s
        return {"device": self.device, "backend": self.backend, "kind": self.kind, "alpha_s": self.alpha_s,
                "bandwidth_bytes_per_s": bw if math.isfinite(bw) else None,
                "rms_rel_residual": self.rms_rel_residual, "max_rel_residual": self.max_rel_residual,
                "samples": self.samples}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CollectiveFit:
        _check_keys(d, _FIT_KEYS, "collectives.fits")
        kind = str(d["kind"])
        if kind != LINK_FIT_KIND:
            kind = Collective(kind).value
        bw = d["bandwidth_bytes_per_s"]
        return cls(kind=kind, alpha_s=float(d["alpha_s"]), bandwidth_bytes_per_s=math.inf if bw is None else float(bw),
                   rms_rel_residual=float(d["rms_rel_residual"]), max_rel_residual=float(d["max_rel_residual"]),
                   samples=int(d["samples"]), device=str(d["device"]), backend=str(d["backend"]))


def _check_keys(d: Mapping[str, Any], valid: frozenset[str], where: str) -> None:
    if not isinstance(d, Mapping):
        raise ValueError(f"{where}: expected an object, got {type(d).__name__}")
    unknown = sorted(set(d) - valid)
    if unknown:
        raise ValueError(f"unknown key(s) in {where}: {', '.join(unknown)}; valid: {', '.join(sorted(valid))}")


def _weighted_lstsq(rows: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """Minimize sum ((a x + b y - t) / t)^2 over a, b >= 0 for rows (x, y, t): the 2x2 normal equations, then the
    two one-variable fits if a coefficient comes out negative (non-negative least squares in two variables)."""
    sxx = sxy = syy = sxt = syt = 0.0
    for x, y, t in rows:
        w = 1.0 / (t * t)
        sxx += w * x * x
        sxy += w * x * y
        syy += w * y * y
        sxt += w * x * t
        syt += w * y * t
    det = sxx * syy - sxy * sxy
    if det > 1e-12 * max(sxx * syy, 1e-300):
        a = (sxt * syy - syt * sxy) / det
        b = (syt * sxx - sxt * sxy) / det
        if a >= 0 and b >= 0:
            return a, b
    candidates = [(sxt / sxx if sxx > 0 else 0.0, 0.0), (0.0, syt / syy if syy > 0 else 0.0)]
    candidates = [(max(a, 0.0), max(b, 0.0)) for a, b in candidates]
    return min(candidates, key=lambda ab: _rel_sse(rows, *ab))


def _rel_sse(rows: Sequence[tuple[float, float, float]], a: float, b: float) -> float:
    return sum(((a * x + b * y - t) / t) ** 2 for x, y, t in rows)


def fit_alpha_beta(samples: Iterable[CollectiveSample], *, kind: str | None = None) -> CollectiveFit:
    """Fit t = steps * alpha + volume / B to `samples` (all of one kind, or several for a joint link fit).

    `kind` labels the result: the samples' single kind by default, `LINK_FIT_KIND` when they mix kinds.
    Raises ValueError with fewer than two distinct (steps, volume) points, which cannot separate alpha from B.
    """
    samples = list(samples)
    rows = []
    for s in samples:
        steps, volume = ring_terms(s.kind, s.group_size, s.nbytes)
        rows.append((float(steps), volume, s.seconds))
    if len({(x, y) for x, y, _ in rows}) < 2:
        raise ValueError(f"need measurements at two or more sizes to fit alpha and beta, got {len(rows)} sample(s)")
    kinds = sorted({s.kind.value for s in samples})
    label = kind or (kinds[0] if len(kinds) == 1 else LINK_FIT_KIND)
    alpha, beta = _weighted_lstsq(rows)
    residuals = [(alpha * x + beta * y - t) / t for x, y, t in rows]
    devices = sorted({s.device for s in samples})
    backends = sorted({s.backend for s in samples})
    return CollectiveFit(kind=label, alpha_s=alpha, bandwidth_bytes_per_s=1.0 / beta if beta > 0 else math.inf,
                         rms_rel_residual=math.sqrt(sum(r * r for r in residuals) / len(residuals)),
                         max_rel_residual=max(abs(r) for r in residuals), samples=len(rows),
                         device=",".join(devices), backend=",".join(backends))


LINK_KINDS: tuple[Collective, ...] = (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER,
                                      Collective.SEND_RECV)
"""Kinds the step-time model prices (data-parallel all-reduce, ZeRO all-gather / reduce-scatter, tensor-parallel
all-reduce / all-gather / reduce-scatter, pipeline send/recv): the joint link fit uses these."""


def fit_link(samples: Iterable[CollectiveSample], kinds: Sequence[Collective] = LINK_KINDS) -> CollectiveFit:
    """One (alpha, B) over the samples of `kinds` -- what one network tier can express."""
    chosen = [s for s in samples if s.kind in kinds]
    return fit_alpha_beta(chosen, kind=LINK_FIT_KIND)


@dataclass(frozen=True)
class CollectiveProfile:
    """The collectives section of a profile: raw samples and their fits, per (device, backend)."""

    samples: tuple[CollectiveSample, ...] = ()
    fits: tuple[CollectiveFit, ...] = ()

    @classmethod
    def from_samples(cls, samples: Iterable[CollectiveSample]) -> CollectiveProfile:
        """Fit every kind with enough points, plus the joint link fit, per (device, backend)."""
        samples = tuple(sorted(samples, key=lambda s: (s.device, s.backend, s.kind.value, s.group_size, s.nbytes)))
        fits = []
        for dev, backend in sorted({(s.device, s.backend) for s in samples}):
            mine = [s for s in samples if (s.device, s.backend) == (dev, backend)]
            for kind in sorted({s.kind for s in mine}, key=lambda k: k.value):
                of_kind = [s for s in mine if s.kind is kind]
                if len({(s.group_size, s.nbytes) for s in of_kind}) >= 2:
                    fits.append(fit_alpha_beta(of_kind))
            if len({(s.kind, s.group_size, s.nbytes) for s in mine if s.kind in LINK_KINDS}) >= 2:
                fits.append(fit_link(mine))
        return cls(samples=samples, fits=tuple(fits))

    def fit(self, device: str, kind: str = LINK_FIT_KIND) -> CollectiveFit | None:
        """The fit of `kind` measured on `device` (any backend; the first in sorted order)."""
        for f in self.fits:
            if f.kind == kind and device in f.device.split(","):
                return f
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"samples": [s.to_dict() for s in self.samples], "fits": [f.to_dict() for f in self.fits]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CollectiveProfile:
        _check_keys(d, COLLECTIVE_PROFILE_KEYS, "profile collectives")
        return cls(samples=tuple(CollectiveSample.from_dict(s) for s in d.get("samples", [])),
                   fits=tuple(CollectiveFit.from_dict(f) for f in d.get("fits", [])))


def calibrated_cluster(cluster: Cluster, collectives: CollectiveProfile | None) -> Cluster:
    """`cluster` with the node tier of every device group whose device has a link fit set to the fitted latency
    and bandwidth (efficiency 1: the fit already is the achieved bandwidth), and with a `per_collective` override
    for each kind the device has its own fit of (finite bandwidth, at least one sample); overrides the tier
    already had for other kinds are kept. Outer tiers are left alone: a local process group measures only the
    link inside one node. Returns `cluster` itself when nothing applies."""
    if collectives is None:
        return cluster
    groups = list(cluster.groups)
    tiers = list(cluster.tiers)
    changed = False
    shared_tier_devices = {g.device.name for g in groups if g.node_tier is None}
    for i, g in enumerate(groups):
        fit = collectives.fit(g.device.name)
        if fit is None or not math.isfinite(fit.bandwidth_bytes_per_s):
            continue
        links = _kind_links(collectives, g.device.name)
        if g.node_tier is not None:
            groups[i] = dataclasses.replace(g, node_tier=_calibrated_tier(g.node_tier, fit, links))
        elif shared_tier_devices == {g.device.name}:
            tiers[0] = _calibrated_tier(tiers[0], fit, links)
        else:  # tiers[0] also serves another device type: give this group its own calibrated node tier
            groups[i] = dataclasses.replace(g, node_tier=_calibrated_tier(tiers[0], fit, links))
        changed = True
    if not changed:
        return cluster
    return dataclasses.replace(cluster, groups=tuple(groups), tiers=tuple(tiers))


def _kind_links(collectives: CollectiveProfile, device: str) -> tuple[CollectiveLink, ...]:
    """One `CollectiveLink` per kind with a usable fit on `device` (a fit without size dependence has infinite
    bandwidth and says nothing a link can hold)."""
    out = []
    for kind in Collective:
        fit = collectives.fit(device, kind.value)
        if fit is not None and fit.samples > 0 and math.isfinite(fit.bandwidth_bytes_per_s):
            out.append(CollectiveLink(kind.value, latency=fit.alpha_s, bandwidth=fit.bandwidth_bytes_per_s))
    return tuple(out)


def _calibrated_tier(tier: NetworkTier, fit: CollectiveFit, links: tuple[CollectiveLink, ...]) -> NetworkTier:
    """`tier` with the joint `fit` as its defaults and `links` replacing its overrides of the same kinds."""
    measured = {x.kind for x in links}
    kept = tuple(x for x in tier.per_collective if x.kind not in measured)
    source = (f"measured: `stratagem profile --collectives` {fit.backend} link fit ({fit.samples} samples, rms "
              f"relative residual {fit.rms_rel_residual:.3f})")
    if links:
        source += f"; per-kind fits of {', '.join(x.kind for x in links)}"
    return dataclasses.replace(tier, latency=fit.alpha_s, bandwidth=fit.bandwidth_bytes_per_s, efficiency=1.0,
                               per_collective=kept + links, source=source)
