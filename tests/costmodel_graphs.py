"""Hand-built GPT graphs for the cost-model tests: every node's FLOPs, bytes and saved bytes are set by hand to
Korthikanti et al. 2022's accounting (Sec. 4.1: Megatron GPT layer, 16-bit activations, math attention, dropout
with 1-byte masks), so the tests can check the cost model against closed forms without the tracer."""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.hardware.device import DeviceSpec
from ir.graph import Graph, Node, OpKind, TensorSpec
from ir.layer_chain import LayerChain, Segment

DT = "bfloat16"

A100 = DeviceSpec(
    name="a100-80gb", display_name="A100 80GB", peak_flops={"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
    matmul_efficiency=0.8692, memory_bytes=80 * 10**9, memory_bandwidth=2.039e12, memory_efficiency=1.70 / 2.039,
    intra_node_bandwidth=300e9, inter_node_bandwidth=25e9)
"""A fixed A100-80GB spec (datasheet peaks, MAMF matmul level, STREAM triad 1.70 TB/s) so closed-form tests do not
move when the catalog is recalibrated."""


@dataclass(frozen=True)
class GptShape:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    seq: int = 32
    vocab: int = 128
    batch: int = 2


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[Node] = []

    def add(self, name: str, kind: OpKind, inputs: tuple[str, ...], in_shapes: tuple[tuple[int, ...], ...],
            out_shape: tuple[int, ...], *, params: tuple[tuple[int, ...], ...] = (), fwd: int = 0, bwd: int = 0,
            saved: int = 0, module: str = "", attrs: tuple = (), out_dtype: str = DT, view: bool = False,
            extra_written: int = 0) -> str:
        in_specs = tuple(TensorSpec(s, DT if i or kind is not OpKind.EMBEDDING else "int64")
                         for i, s in enumerate(in_shapes))
        out_spec = TensorSpec(out_shape, out_dtype)
        p_specs = tuple(TensorSpec(s, DT) for s in params)
        read = 0 if view else sum(s.nbytes for s in in_specs) + sum(s.nbytes for s in p_specs)
        written = 0 if view else out_spec.nbytes + extra_written
        self.nodes.append(Node(
            name=name, op_kind=kind, target=f"test.{kind.value}", module_path=module, inputs=inputs,
            input_specs=in_specs, output_specs=(out_spec,), param_names=tuple(f"{name}.p{i}" for i in
                                                                              range(len(params))),
            param_specs=p_specs, forward_flops=fwd, backward_flops=bwd, bytes_read=read, bytes_written=written,
            saved_bytes=saved, attrs=tuple(sorted(attrs))))
        return name


def gpt_chain(shape: GptShape = GptShape(), *, attention: str = "math", tied: bool = False) -> LayerChain:
    """Embedding, `layers` pre-LN GPT blocks, final norm + LM head + loss, as a LayerChain.

    attention="math": QK^T, softmax, dropout, AV as separate nodes marked attention_core (saved 5as^2b);
    attention="flash": one fused ATTENTION node saving q, k, v, out (FlashAttention semantics, no logsumexp here).
    tied=True: the LM head uses the embedding's weight (counted once, in the embedding segment).
    """
    s, b, h, a, v = shape.seq, shape.batch, shape.hidden, shape.heads, shape.vocab
    d = h // a
    x = (b, s, h)
    sbh = s * b * h
    g = _Builder()
    bounds: list[tuple[str, int, int, int, int]] = []  # (name, start, params, input bytes, boundary bytes)

    start = len(g.nodes)
    g.add("tokens", OpKind.PLACEHOLDER, (), (), (b, s), out_dtype="int64")
    g.add("wte", OpKind.EMBEDDING, ("tokens",), ((b, s),), x, params=((v, h),), module="wte")
    g.add("wpe", OpKind.ELEMENTWISE, ("wte",), (x,), x, params=((s, h),), module="wpe")
    prev = g.add("emb_drop", OpKind.ELEMENTWISE, ("wpe",), (x,), x, saved=sbh, module="drop", extra_written=sbh)
    bounds.append(("embed", start, v * h + s * h, b * s * 8, 2 * sbh))

    for i in range(shape.layers):
        p = f"blocks.{i}"
        start = len(g.nodes)
        ln1 = g.add(f"{p}.ln1", OpKind.NORM, (prev,), (x,), x, params=((h,), (h,)), saved=2 * sbh, fwd=5 * sbh,
                    module=f"{p}.ln1", attrs=(("dim", -1),))
        lin = {"fwd": 2 * b * s * h * h, "bwd": 4 * b * s * h * h}
        q = g.add(f"{p}.q", OpKind.LINEAR, (ln1,), (x,), x, params=((h, h), (h,)), saved=2 * sbh,
                  module=f"{p}.attn.q_proj", attrs=(("in_features", h), ("out_features", h)), **lin)
        k = g.add(f"{p}.k", OpKind.LINEAR, (ln1,), (x,), x, params=((h, h), (h,)), module=f"{p}.attn.k_proj",
                  attrs=(("in_features", h), ("out_features", h)), **lin)
        vv = g.add(f"{p}.v", OpKind.LINEAR, (ln1,), (x,), x, params=((h, h), (h,)), module=f"{p}.attn.v_proj",
                   attrs=(("in_features", h), ("out_features", h)), **lin)
        hs = (b, a, s, d)
        qh = g.add(f"{p}.qh", OpKind.VIEW, (q,), (x,), hs, view=True)
        kh = g.add(f"{p}.kh", OpKind.VIEW, (k,), (x,), hs, view=True)
        vh = g.add(f"{p}.vh", OpKind.VIEW, (vv,), (x,), hs, view=True)
        if attention == "math":
            sc = (b, a, s, s)
            core = (("attention_core", True),)
            qk = g.add(f"{p}.qk", OpKind.MATMUL, (qh, kh), (hs, hs), sc, fwd=2 * b * s * s * h,
                       bwd=4 * b * s * s * h, saved=4 * sbh, attrs=core)
            sm = g.add(f"{p}.softmax", OpKind.SOFTMAX, (qk,), (sc,), sc, saved=2 * a * s * s * b,
                       attrs=core + (("dim", -1),))
            dr = g.add(f"{p}.attn_drop", OpKind.ELEMENTWISE, (sm,), (sc,), sc, saved=a * s * s * b, attrs=core,
                       extra_written=a * s * s * b)
            ctx = g.add(f"{p}.av", OpKind.MATMUL, (dr, vh), (sc, hs), hs, fwd=2 * b * s * s * h,
                        bwd=4 * b * s * s * h, saved=2 * a * s * s * b + 2 * sbh, attrs=core)
        else:
            ctx = g.add(f"{p}.sdpa", OpKind.ATTENTION, (qh, kh, vh), (hs, hs, hs), hs, fwd=4 * b * s * s * h,
                        bwd=10 * b * s * s * h, saved=8 * sbh,
                        attrs=(("attention_core", True), ("head_dim", d), ("is_causal", True), ("num_heads", a)))
        if attention == "math":
            # Head count lives on the QK^T matmul for math attention.
            g.nodes[-4] = _with_attr(g.nodes[-4], ("num_heads", a))
        cm = g.add(f"{p}.merge", OpKind.VIEW, (ctx,), (hs,), x, view=True)
        o = g.add(f"{p}.o", OpKind.LINEAR, (cm,), (x,), x, params=((h, h), (h,)), saved=2 * sbh,
                  module=f"{p}.attn.o_proj", attrs=(("in_features", h), ("out_features", h)), **lin)
        d1 = g.add(f"{p}.drop1", OpKind.ELEMENTWISE, (o,), (x,), x, saved=sbh, extra_written=sbh)
        r1 = g.add(f"{p}.res1", OpKind.ELEMENTWISE, (prev, d1), (x, x), x)
        ln2 = g.add(f"{p}.ln2", OpKind.NORM, (r1,), (x,), x, params=((h,), (h,)), saved=2 * sbh, fwd=5 * sbh,
                    module=f"{p}.ln2", attrs=(("dim", -1),))
        x4 = (b, s, 4 * h)
        up = g.add(f"{p}.up", OpKind.LINEAR, (ln2,), (x,), x4, params=((4 * h, h), (4 * h,)), saved=2 * sbh,
                   fwd=8 * b * s * h * h, bwd=16 * b * s * h * h, module=f"{p}.mlp.up_proj",
                   attrs=(("in_features", h), ("out_features", 4 * h)))
        ge = g.add(f"{p}.gelu", OpKind.ELEMENTWISE, (up,), (x4,), x4, saved=8 * sbh)
        dn = g.add(f"{p}.down", OpKind.LINEAR, (ge,), (x4,), x, params=((h, 4 * h), (h,)), saved=8 * sbh,
                   fwd=8 * b * s * h * h, bwd=16 * b * s * h * h, module=f"{p}.mlp.down_proj",
                   attrs=(("in_features", 4 * h), ("out_features", h)))
        d2 = g.add(f"{p}.drop2", OpKind.ELEMENTWISE, (dn,), (x,), x, saved=sbh, extra_written=sbh)
        prev = g.add(f"{p}.res2", OpKind.ELEMENTWISE, (r1, d2), (x, x), x)
        bounds.append((p, start, 12 * h * h + 13 * h, 2 * sbh, 2 * sbh))

    start = len(g.nodes)
    lnf = g.add("ln_f", OpKind.NORM, (prev,), (x,), x, params=((h,), (h,)), saved=2 * sbh, module="ln_f")
    logits = g.add("head", OpKind.LINEAR, (lnf,), (x,), (b, s, v), params=((v, h),), saved=2 * sbh,
                   fwd=2 * b * s * h * v, bwd=4 * b * s * h * v, module="head")
    if tied:
        from dataclasses import replace
        g.nodes[-1] = replace(g.nodes[-1], param_names=("wte.p0",))
    loss = g.add("loss", OpKind.LOSS, (logits,), ((b, s, v),), (), saved=4 * s * b * v, out_dtype="float32")
    g.add("output", OpKind.OUTPUT, (loss,), ((),), ())
    head_params = 2 * h + (0 if tied else v * h)
    bounds.append(("head", start, head_params, 2 * sbh, 0))

    params = v * h + s * h + shape.layers * (12 * h * h + 13 * h) + head_params
    graph = Graph(model_name="gpt-test", nodes=tuple(g.nodes), batch_size=b, seq_len=s, dtype=DT,
                  param_count=params, param_bytes=2 * params)
    segments = []
    for i, (name, st, pc, inb, bb) in enumerate(bounds):
        stop = bounds[i + 1][1] if i + 1 < len(bounds) else len(g.nodes)
        seg_nodes = graph.nodes[st:stop]
        cls = 0 if name == "embed" else (2 if name == "head" else 1)
        segments.append(Segment(
            index=i, name=name, start=st, stop=stop, class_id=cls, structural_hash=f"h{cls}",
            forward_flops=sum(n.forward_flops for n in seg_nodes),
            backward_flops=sum(n.backward_flops for n in seg_nodes), param_count=pc, param_bytes=2 * pc,
            saved_bytes=sum(n.saved_bytes for n in seg_nodes), input_bytes=inb, boundary_bytes=bb))
    return LayerChain(graph=graph, segments=tuple(segments))


def _with_attr(node: Node, kv: tuple) -> Node:
    from dataclasses import replace
    return replace(node, attrs=tuple(sorted(node.attrs + (kv,))))
