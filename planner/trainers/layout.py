"""Where the transformer blocks are in a layer chain, and pipeline cuts counted in blocks, as trainers count them.

Trainers place layers by count: Megatron-LM (`--decoder-first-pipeline-num-layers`, `--pipeline-model-parallel-layout
"Et|tt|tL"`), torchtitan (`module_fqns_per_model_part`) and DeepSpeed (`PipelineModule` partitions) all split the
repeated decoder layer and put the embedding on the first and the head on the last stage. A plan cuts the layer
chain by segment. `BlockLayout` converts between the two: the blocks are the chain's most frequent layer class, one
contiguous run, widened to the other items of the module list holding them (a trainer counts DeepSeek-V3's dense
first layers and Llama 4's NoPE layers as decoder layers too); the segments before it (embedding) and after it
(final norm, head) belong to the first and last stage. A cut inside those leading or trailing segments has no
trainer equivalent.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from costmodel.strategy import Recompute, StageSpec
from ir.layer_chain import LayerChain
from planner.errors import UserError


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The chain as trainers see it: `lead` segments, `num_blocks` repeated blocks, then the trailing segments."""

    num_segments: int
    lead: int
    """Segments before the first block (the embedding)."""
    num_blocks: int

    def __post_init__(self) -> None:
        if not (self.lead >= 0 and self.num_blocks >= 1 and self.lead + self.num_blocks <= self.num_segments):
            raise ValueError(f"bad block layout: {self.lead} + {self.num_blocks} blocks in {self.num_segments} "
                             f"segments")

    @classmethod
    def of(cls, chain: LayerChain) -> BlockLayout:
        """The layout of a traced chain: the run of its most frequent layer class, widened to the other items of
        the module list those layers are in (DeepSeek-V3's dense first layers before its MoE layers, Llama 4's
        NoPE layers among its rotary ones: a trainer counts them all as decoder layers)."""
        counts = Counter(s.class_id for s in chain.segments)
        main, count = max(counts.items(), key=lambda kv: (kv[1], -kv[0]))
        idx = [s.index for s in chain.segments if s.class_id == main]
        run = _list_run([s.name for s in chain.segments], idx)
        if count < 2 or (run is None and idx[-1] - idx[0] + 1 != count):
            raise UserError(f"{chain.graph.model_name} has no run of repeated layers (transformer blocks) that a "
                            f"trainer's pipeline split could count; only block models can be exported")
        start, stop = run or (idx[0], idx[-1] + 1)
        return cls(num_segments=len(chain.segments), lead=start, num_blocks=stop - start)

    @property
    def trail_start(self) -> int:
        return self.lead + self.num_blocks

    def first_blocks_recomputed(self, stages: Sequence[StageSpec]) -> int | None:
        """N when every stage fully recomputes exactly its first min(N, blocks) blocks and some stage fewer than
        all of them (Megatron-LM's block method; `stages_of` with `recompute_layers`), else None."""
        if all(st.recomputed is None for st in stages):
            return None
        counts, whole = set(), []
        for st in stages:
            blocks = list(range(max(st.start, self.lead), min(st.stop, self.trail_start)))
            chosen = [i for i in (range(st.start, st.stop) if st.recomputed is None else st.recomputed)
                      if i in blocks] if st.recompute is Recompute.FULL else []
            if chosen != blocks[:len(chosen)] or (st.recompute is not Recompute.FULL and st.recomputed is not None):
                return None
            if len(chosen) < len(blocks):
                counts.add(len(chosen))
            else:
                whole.append(len(blocks))
        if len(counts) != 1 or any(n > min(counts) for n in whole):
            return None
        return counts.pop()

    def blocks_per_stage(self, stages: Sequence[StageSpec], trainer: str) -> tuple[int, ...]:
        """Blocks of each (virtual) stage; UserError when a cut falls inside the leading/trailing segments."""
        out = []
        for i, st in enumerate(stages):
            for cut in (st.start, st.stop):
                if 0 < cut < self.lead or self.trail_start < cut < self.num_segments:
                    raise UserError(f"stage {i} is cut at segment {cut}, inside the embedding or head segments; "
                                    f"{trainer} cuts only between transformer blocks")
            out.append(max(0, min(st.stop, self.trail_start) - max(st.start, self.lead)))
        return tuple(out)

    def stages_of(self, blocks: Sequence[int], recompute: Recompute = Recompute.NONE,
                  recompute_layers: int | None = None) -> tuple[StageSpec, ...]:
        """Stages holding `blocks[i]` blocks each; the embedding joins the first, the head the last stage. With
        `recompute_layers` N, each stage recomputes only its first N blocks."""
        if sum(blocks) != self.num_blocks or any(b < 0 for b in blocks):
            raise UserError(f"the pipeline split {list(blocks)} does not add up to the model's {self.num_blocks} "
                            f"layers")
        bounds = [self.lead]
        for b in blocks:
            bounds.append(bounds[-1] + b)
        bounds[0], bounds[-1] = 0, self.num_segments
        stages = []
        for i in range(len(blocks)):
            if bounds[i + 1] <= bounds[i]:
                raise UserError(f"pipeline stage {i} of {list(blocks)} would hold nothing")
            first = max(bounds[i], self.lead)
            picked = (None if recompute_layers is None
                      else tuple(range(first, min(first + recompute_layers, bounds[i + 1], self.trail_start))))
            stages.append(StageSpec(start=bounds[i], stop=bounds[i + 1], recompute=recompute, recomputed=picked))
        return tuple(stages)


_LIST_ITEM = re.compile(r"^(.+)\.(\d+)$")
"""A segment that is one item of a module list: "model.layers.7" is item 7 of "model.layers"."""


def _list_run(names: Sequence[str], main: Sequence[int]) -> tuple[int, int] | None:
    """[start, stop) of the segments that are consecutive items of the module list holding every segment of
    `main` (the most frequent class), or None when those are not items of one list."""
    matches = [_LIST_ITEM.match(n) for n in names]
    lists = [m.group(1) if m else None for m in matches]
    positions = [int(m.group(2)) if m else -1 for m in matches]
    prefix = lists[main[0]]
    if prefix is None or any(lists[i] != prefix for i in main):
        return None
    start, stop = main[0], main[-1] + 1
    while start > 0 and lists[start - 1] == prefix:
        start -= 1
    while stop < len(names) and lists[stop] == prefix:
        stop += 1
    if any(lists[i] != prefix for i in range(start, stop)):
        return None
    consecutive = positions[start:stop] == list(range(positions[start], positions[start] + stop - start))
    return (start, stop) if consecutive else None


# ---- Megatron-LM's --pipeline-model-parallel-layout ("E|(t|)*3,tL") ---------------------------------------------

def format_megatron_layout(blocks: Sequence[int]) -> str:
    """`blocks` per virtual stage as a Megatron-LM layout string: E embedding, t a decoder layer, L the loss."""
    parts = ["t" * b for b in blocks]
    parts[0] = "E" + parts[0]
    parts[-1] = parts[-1] + "L"
    return "|".join(parts)


_REPEAT = re.compile(r"\(([^()]*)\)\*(\d+)")
_TOKEN_REPEAT = re.compile(r"([A-Za-z])\*(\d+)")


def parse_megatron_layout(text: str) -> tuple[int, ...]:
    """Decoder layers per virtual stage of a layout string (grammar of Megatron-Core's
    `PipelineParallelLayerLayout.parse_str_to_list`: "|" splits stages, "(...)*N" and "x*N" repeat, commas are
    cosmetic). Only E, t and L are priced; MTP layers (m) are refused."""
    s = text.replace(",", "").replace(" ", "")
    while (m := _REPEAT.search(s)) is not None:
        s = s[:m.start()] + m.group(1) * int(m.group(2)) + s[m.end():]
    s = _TOKEN_REPEAT.sub(lambda m: m.group(1) * int(m.group(2)), s)
    stages = s.split("|")
    bad = set(s) - set("EtL|")
    if bad:
        raise UserError(f"pipeline layout {text!r}: layer kinds {''.join(sorted(bad))} are not priced "
                        f"(only E, t and L)")
    if not stages[0].startswith("E") or not stages[-1].endswith("L"):
        raise UserError(f"pipeline layout {text!r}: the embedding (E) must open the first stage and the loss (L) "
                        f"close the last")
    return tuple(st.count("t") for st in stages)
