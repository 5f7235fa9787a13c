"""A strategy in one line, the one way every report, error and table writes it, at four levels of detail:

    DEGREES    dp=2 tp=4 pp=2 cp=2 ep=2                       (cp and ep only when > 1)
    MESH       dp=2 tp=4 pp=2 (pp inside dp)                  (+ which of dp and pp is the inner axis)
    CANDIDATE  dp=2 tp=4 pp=2 (pp inside dp) mbs=1 m=8 interleaved:2 zero=1 sp
    FULL       dp=2 tp=4 pp=2 mbs=1 m=8 interleaved:2 zero=1 sp recompute=none,selective
"""

from __future__ import annotations

import enum

from costmodel.strategy import MeshAxis, Strategy


class Detail(enum.StrEnum):
    DEGREES = "degrees"
    MESH = "mesh"
    CANDIDATE = "candidate"
    FULL = "full"


def strategy_label(s: Strategy, detail: Detail = Detail.FULL) -> str:
    """`s` in one line at `detail` (module docstring)."""
    text = f"dp={s.dp} tp={s.tp} pp={s.pp}" + (f" cp={s.cp}" if s.cp > 1 else "") + (f" ep={s.ep}" if s.ep > 1 else "")
    if detail is Detail.DEGREES:
        return text
    if detail is not Detail.FULL:
        order = s.mesh_order
        inner = "pp inside dp" if order.index(MeshAxis.PP) < order.index(MeshAxis.DP) else "dp inside pp"
        text += f" ({inner})"
        if detail is Detail.MESH:
            return text
    schedule = s.schedule.label(s.virtual_stages)
    text += f" mbs={s.microbatch_size} m={s.num_microbatches} {schedule} zero={s.zero_stage}"
    text += " sp" if s.sequence_parallel else ""
    text += f" offload={s.runtime.offload.value}" if s.runtime.offload.value != "none" else ""
    if detail is Detail.FULL:
        modes = sorted({st.recompute.value + ("(part)" if st.recomputed is not None else "") for st in s.stages}) \
            or [s.recompute.value]
        text += f" recompute={','.join(modes)}"
    return text
