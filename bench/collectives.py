"""Predicted vs measured all-reduce bus bandwidth for every row of costmodel/hardware/data/measured_collectives.csv.

    python bench/collectives.py

Each row is priced on the shorthand cluster `NODESxGPUSxDEVICE` of its system with `costmodel.hardware.collectives`; rows
measured with NVLink SHARP disabled are priced with the ring only. The link calibrations used (efficiency,
per-step latency, in-switch reduction) are printed first; costmodel/hardware/data/links.csv says which rows set them, so
rows that set a parameter match by construction and the others are checks.
"""

from __future__ import annotations

import csv
from importlib import resources

from costmodel.hardware.catalog import list_links
from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collectives import Algorithm, Collective, CommGroup, bus_bandwidth, collective_cost


def main() -> None:
    print(f"{'link':8s} {'efficiency':>10s} {'latency':>10s} {'in-switch eff':>13s} {'in-switch lat':>13s}")
    for link in list_links():
        print(f"{link.name:8s} {link.efficiency:10.4f} {link.latency * 1e6:8.2f}us "
              f"{link.in_network_reduction_efficiency:13.4f} {link.in_network_reduction_latency * 1e6:11.2f}us")
    text = resources.files("costmodel.hardware").joinpath("data", "measured_collectives.csv").read_text(encoding="utf-8")
    print(f"\n{'system':44s} {'n':>3s} {'nodes':>5s} {'size':>6s} {'measured':>12s} {'predicted':>10s} "
          f"{'model algo':>10s} {'error':>7s}")
    errors = []
    for row in csv.DictReader(text.splitlines()):
        n, nodes, nbytes = int(row["ranks"]), int(row["nodes"]), int(row["message_bytes"])
        cluster = Cluster.parse(f"{nodes}x{n // nodes}x{row['device']}")
        algorithms = {Algorithm.RING} if "NVLS off" in row["source"] or "NVLS_ENABLE=0" in row["source"] else None
        cost = collective_cost(Collective.ALL_REDUCE, nbytes, CommGroup(n), cluster, algorithms=algorithms)
        pred = bus_bandwidth(Collective.ALL_REDUCE, nbytes, n, cost.time_s) / 1e9
        meas = float(row["busbw_gbps"])
        err = pred / meas - 1
        errors.append((nbytes, abs(err)))
        algo = row["algorithm"] or "?"
        print(f"{row['system'][:44]:44s} {n:3d} {nodes:5d} {row['message_label']:>6s} {meas:8.2f} {algo:>3s} "
              f"{pred:10.2f} {cost.algorithm.value:>10s} {err:+7.1%}")
    large = [e for nbytes, e in errors if nbytes >= 2**30]
    print(f"\n{len(errors)} rows; messages >= 1 GiB: max |error| {max(large):.1%}, "
          f"mean {sum(large) / len(large):.1%}; all rows: max {max(e for _, e in errors):.1%}")


if __name__ == "__main__":
    main()
