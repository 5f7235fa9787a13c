"""Interleaved chunk layouts: which layers each of the p*v model chunks holds, also when they do not divide evenly.

Formulation
-----------
Units. When the chain's repeated layer class (the transformer block) forms one contiguous run of L segments, the
chain reads as U units: the segments before the run (the embedding) as one unit, each block as one, the segments
after it (final norm, head and loss) as one -- the embedding and the loss counted as layers, as Megatron-LM's
``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split`` and NeMo count them.

Chunks. The units are cut into p*v contiguous chunks, chunk j on pipeline rank j % p as its chunk c = j // p. Every
chunk holds q = floor(U / (p v)) or q + 1 units (q >= 1, so no chunk is empty); E = U - p v q of them hold q + 1.
The space is every choice of the E larger chunks: C(p v, E) layouts. It holds the even split when p v divides L
(E = 2: the embedding and the head on top of q blocks, as `costmodel.rank_layout.even_stages` cuts it), the splits
of Megatron-LM's ``--decoder-first/last-pipeline-num-layers`` that take a block off the first and the last chunk,
and Llama 3 405B's 126 blocks on p = 16, v = 8 (U = 128, E = 0: the embedding and the head each alone in a chunk,
"one layer fewer on the first and the last stage", Llama Team 2024, Sec. 3.3.2).

Per rank. The blocks are one class, so rank r's terms (`costmodel.estimate.rank_step_terms`, `memory.rank_memory`)
depend on its own chunks' sizes, not on where they sit in the chain: per chunk its forward, backward, data-parallel
and framework terms; its sends by boundary position (each carries a block's output, see below); the embedding
always in rank 0's first chunk, the head in rank p-1's last, weights shared only between those two. Which of the
rank's chunks are the larger ones matters in two ways only:

- the drain behind rank r + 1 (`pipeline.drain_slack`) runs through rank r's first chunk, so the size of that
  *lead* chunk changes time; rank p-1 is behind no drain, and its lead chunk is its last, the one with the head;
- activation memory is ``sum_c n_c act_c`` (the rest does not depend on the order), with the in-flight counts n_c
  non-increasing in c (`pipeline.in_flight_per_chunk`), so for a fixed lead chunk the other larger chunks placed
  last never need more memory (rearrangement inequality) and change no time term.

So every layout has a *canonical* one -- on each rank the larger chunks other than the lead placed last -- with the
same step time and no more memory on any rank. A rank's choice is then ``(e_r, lead_r)``: e_r in 0..v larger chunks
(sum_r e_r = E), and whether the lead chunk is one of them. `planner.search.interleaved_problem` solves it exactly
with the stage-partition DP: rank r is a stage of e_r + 1 of p + E tokens.

The sends. A chunk that holds the embedding alone sends the embedding's output; where that differs in size from a
block's output, such layouts are left out (rank 0's lead chunk then holds a block), so that every send depends on
its position only.

Placement. The same holds for the zero-bubble schedules (`costmodel.pipeline`): interleaved-zb loops its chunks as
above; zbv and dualpipev place chunk j on rank j for j < p and on rank 2p - 1 - j after (`pipeline.stage_rank`),
so rank 0 holds both the embedding (its first chunk) and the head (its second), and with v = 2 the lead flag
already says which of a rank's two chunks is the larger. Their in-flight counts are non-increasing in the chunk
too (equal for interleaved-zb), and they have no drain (weight gradients fill it), so the argument stands.

Chains that do not read as units (a repeated layer outside the run of blocks: DeepSeek-V3's dense first blocks
before its MoE blocks, Gemma 3's and GPT-OSS's sliding-window blocks between their global ones, a T5 decoder after
its encoder; or blocks that share weights) have one layout, fixed: the p v contiguous chunks whose largest
forward + backward FLOPs is least (`costmodel.rank_layout.balanced_chunks`, the split `even_stages` gives such a
chain), every chunk priced with its own segments. The search then chooses recomputation per rank but not the
chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from costmodel.pipeline import chunk_stages, stage_rank
from costmodel.rank_layout import balanced_cuts, block_run, segment_flops, stages_between
from costmodel.strategy import Recompute, Schedule, StageSpec
from ir.layer_chain import LayerChain


@dataclass(frozen=True, slots=True)
class RankChoice:
    """One way a pipeline rank holds its v chunks: `extra` larger chunks, `lead_large` whether its lead chunk is one
    of them, and per chunk the segments it prices (a block stands for every block: `first_block` repeated)."""

    extra: int
    lead_large: bool
    chunks: tuple[tuple[int, ...], ...]

    def __hash__(self) -> int:
        # A rank's choices differ in (extra, lead_large): hashing the chunks too would only cost time (choices are
        # looked up tens of thousands of times per search); equality still compares every field.
        return hash((self.extra, self.lead_large))


@dataclass(frozen=True, slots=True)
class InterleavedLayout:
    """The interleaved chunk layouts of a chain on p ranks with v chunks each (module docstring)."""

    pp: int
    virtual_stages: int
    num_segments: int
    pre: int = 0
    """Segments before the run of blocks (one unit when > 0)."""
    blocks: int = 0
    post: int = 0
    """Segments after the run of blocks (one unit when > 0)."""
    alone_pre_sends_like_a_block: bool = True
    fixed: tuple[StageSpec, ...] = ()
    """The chunks of a chain that does not read as units (then the only layout)."""
    schedule: Schedule = Schedule.INTERLEAVED
    """Whose placement of chunks on ranks (`pipeline.chunk_stages`)."""

    @classmethod
    def of(cls, chain: LayerChain, pp: int, virtual_stages: int, units: ChainUnits | None = None,
           schedule: Schedule = Schedule.INTERLEAVED) -> InterleavedLayout | None:
        """The layouts of `chain` (None when it cannot be cut into pp * v chunks); `units`: `ChainUnits.of(chain)`,
        when the caller has it."""
        units = units or ChainUnits.of(chain)
        n, chunks = units.num_segments, pp * virtual_stages
        if chunks > n:
            return None
        if units.blocks == 0:
            return cls(pp, virtual_stages, n, fixed=units.balanced_chunks(chunks), schedule=schedule)
        layout = cls(pp, virtual_stages, n, pre=units.pre, blocks=units.blocks, post=units.post,
                     alone_pre_sends_like_a_block=units.alone_pre_sends_like_a_block, schedule=schedule)
        if layout.small < 1 or (layout.rank_units(0, 0, False) is None and layout.extra == 0):
            return None
        return layout

    @property
    def num_units(self) -> int:
        return self.blocks + (self.pre > 0) + (self.post > 0)

    @property
    def small(self) -> int:
        """q: units of a smaller chunk."""
        return self.num_units // (self.pp * self.virtual_stages) if not self.fixed else 0

    @property
    def extra(self) -> int:
        """E: how many chunks hold q + 1 units (0 for fixed chunks)."""
        return self.num_units - self.small * self.pp * self.virtual_stages if not self.fixed else 0

    @property
    def lead_options(self) -> tuple[bool, ...]:
        """Whether a rank's lead chunk is one of its larger ones: both for units, no choice for fixed chunks."""
        return (False,) if self.fixed else (False, True)

    def lead_chunk(self, rank: int) -> int:
        """The chunk whose size matters beyond the multiset: the first (drain), the last on rank p-1 (head); the
        first on a V (two chunks: the flag covers both)."""
        return self.virtual_stages - 1 if rank == self.pp - 1 and not self.schedule.v_shape else 0

    @property
    def head_chunk(self) -> tuple[int, int]:
        """(rank, chunk) that holds the last virtual stage."""
        last = self.pp * self.virtual_stages - 1
        rank = stage_rank(self.schedule, self.pp, last)
        return rank, chunk_stages(self.schedule, self.pp, self.virtual_stages, rank).index(last)

    def rank_units(self, rank: int, extra: int, lead_large: bool) -> tuple[int, ...] | None:
        """Units per chunk of `rank` with `extra` larger chunks, the lead one among them or not (None: no such
        layout)."""
        v, q = self.virtual_stages, self.small
        if not 0 <= extra <= v or (lead_large and extra == 0) or (not lead_large and extra == v):
            return None
        lead = self.lead_chunk(rank)
        sizes = [q] * v
        sizes[lead] += lead_large
        others = [c for c in range(v) if c != lead]
        for c in others[len(others) - (extra - lead_large):]:   # the other larger chunks last
            sizes[c] += 1
        if rank == 0 and self.pre and sizes[0] == 1 and not self.alone_pre_sends_like_a_block:
            return None
        return tuple(sizes)

    def choices(self, rank: int) -> tuple[RankChoice, ...]:
        """Every way `rank` may hold its chunks, fewer larger chunks first, the lead one small first."""
        if self.fixed:
            mine = [self.fixed[j] for j in chunk_stages(self.schedule, self.pp, self.virtual_stages, rank)]
            return (RankChoice(0, False, tuple(tuple(range(c.start, c.stop)) for c in mine)),)
        out = []
        for extra in range(self.virtual_stages + 1):
            for lead_large in self.lead_options:
                sizes = self.rank_units(rank, extra, lead_large)
                if sizes is not None:
                    out.append(RankChoice(extra, lead_large, self.chunk_segments(rank, sizes)))
        return tuple(out)

    def chunk_segments(self, rank: int, sizes: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """The segments each chunk of `rank` prices: the embedding's, `units - 1` blocks and the head's."""
        first_block = self.pre
        out = []
        for c, units in enumerate(sizes):
            pre = tuple(range(self.pre)) if rank == 0 and c == 0 and self.pre else ()
            post = (tuple(range(first_block + self.blocks, self.num_segments))
                    if (rank, c) == self.head_chunk and self.post else ())
            out.append(pre + (first_block,) * (units - bool(pre) - bool(post)) + post)
        return tuple(out)

    def stages(self, picks: Sequence[tuple[int, bool]], recompute: Sequence[Recompute]) -> tuple[StageSpec, ...]:
        """The p*v chunks in chain order for each rank's (extra, lead_large), each with its rank's recomputation."""
        p, v, schedule = self.pp, self.virtual_stages, self.schedule
        rank_of = [stage_rank(schedule, p, j) for j in range(p * v)]
        if self.fixed:
            return tuple(StageSpec(c.start, c.stop, recompute[rank_of[j]]) for j, c in enumerate(self.fixed))
        per_rank = []
        for r, (extra, lead_large) in enumerate(picks):
            sizes = self.rank_units(r, extra, lead_large)
            if sizes is None:
                raise ValueError(f"rank {r} cannot hold {extra} larger chunks (lead larger: {lead_large})")
            per_rank.append(sizes)
        units = [per_rank[rank_of[j]][chunk_stages(schedule, p, v, rank_of[j]).index(j)] for j in range(p * v)]
        if sum(units) != self.num_units:
            raise ValueError(f"the chunks hold {sum(units)} units, the chain has {self.num_units}")
        out, start, done = [], 0, 0
        for j, u in enumerate(units):
            done += u
            stop = self._segment_of_unit(done)
            out.append(StageSpec(start, stop, recompute[rank_of[j]]))
            start = stop
        return tuple(out)

    def even_picks(self) -> tuple[tuple[int, bool], ...] | None:
        """Each rank's (extra, lead_large) for the even split of `costmodel.rank_layout.even_stages` (blocks spread
        evenly, the remainder on the last chunks, the embedding and the head joining the first and the last), or
        None when that split is not in the space. The search prefers it on ties: it is what an estimate without
        stages prices and Megatron-LM's default."""
        chunks = self.pp * self.virtual_stages
        if self.fixed or self.blocks < chunks:
            return None
        base, rest = divmod(self.blocks, chunks)
        units = [base + (j >= chunks - rest) for j in range(chunks)]
        units[0] += self.pre > 0
        units[-1] += self.post > 0
        picks = []
        for r in range(self.pp):
            sizes = tuple(units[j] for j in chunk_stages(self.schedule, self.pp, self.virtual_stages, r))
            found = [(e, lead) for e in range(self.virtual_stages + 1) for lead in self.lead_options
                     if self.rank_units(r, e, lead) == sizes]
            if not found:
                return None
            picks.append(found[0])
        return tuple(picks)

    def example_stages(self) -> tuple[StageSpec, ...]:
        """One layout of the space (the larger chunks on the last ranks' last chunks): what holds the embedding and
        the head, and so the tied weights, is the same in all of them."""
        if self.fixed:
            return self.fixed
        v = self.virtual_stages
        # Rank 0 keeps a block in its lead chunk when the embedding may not be sent alone.
        need = int(self.rank_units(0, 0, False) is None)
        extras, leads = [need] + [0] * (self.pp - 1), [bool(need)] + [False] * (self.pp - 1)
        left = self.extra - need
        for r in reversed(range(self.pp)):
            more = min(v - extras[r], left)
            extras[r] += more
            left -= more
            leads[r] = leads[r] or extras[r] == v
        return self.stages(list(zip(extras, leads, strict=True)), [Recompute.NONE] * self.pp)

    def _segment_of_unit(self, unit: int) -> int:
        """The segment where unit boundary `unit` falls (units before it: the embedding, blocks, the head)."""
        if unit >= self.num_units:
            return self.num_segments
        if self.pre:
            return 0 if unit == 0 else self.pre + unit - 1
        return unit


@dataclass(frozen=True, slots=True)
class ChainUnits:
    """How a chain reads as units (module docstring): `blocks` 0 when it does not."""

    num_segments: int
    pre: int = 0
    blocks: int = 0
    post: int = 0
    alone_pre_sends_like_a_block: bool = True
    flops: tuple[int, ...] = ()
    """Forward + backward FLOPs per segment when the chain does not read as units (what its chunks balance)."""
    _chunks: dict[int, tuple[StageSpec, ...]] = field(default_factory=dict, compare=False, repr=False)

    def balanced_chunks(self, num_chunks: int) -> tuple[StageSpec, ...]:
        """`costmodel.rank_layout.balanced_chunks` of the chain, once per chunk count (the search asks for them per
        candidate)."""
        if num_chunks not in self._chunks:
            self._chunks[num_chunks] = stages_between(balanced_cuts(self.flops, num_chunks))
        return self._chunks[num_chunks]

    @classmethod
    def of(cls, chain: LayerChain) -> ChainUnits:
        n = len(chain.segments)
        # The embedding and the head are one unit each only when they hold no repeated layer (`block_run`: a T5
        # decoder stack after its encoder does not read as one unit).
        blocks = block_run(chain)
        if blocks is None or _blocks_share_weights(chain, blocks):
            return cls(n, flops=segment_flops(chain))
        first, count = blocks.start, len(blocks)
        alone = first == 0 or chain.segments[first - 1].boundary_bytes == chain.segments[first].boundary_bytes
        return cls(n, pre=first, blocks=count, post=n - first - count, alone_pre_sends_like_a_block=alone)


def _blocks_share_weights(chain: LayerChain, blocks: range) -> bool:
    """Whether a weight of a block is used by any other segment (then a block's terms depend on where it sits)."""
    users: dict[str, set[int]] = {}
    for seg in chain.segments:
        for node in chain.nodes_of(seg):
            for name in node.param_names:
                users.setdefault(name, set()).add(seg.index)
    return any(len(u) > 1 and any(i in blocks for i in u) for u in users.values())
