"""Megatron-LM's fused kernels as traced ops (`models.megatron_kernels`): exact on CPU, each traced as one op priced as
one pass over its tensors; the attention core around the softmax is still what selective recomputation recomputes."""

from __future__ import annotations

import pytest
import torch

import ir
from costmodel.hardware.catalog import get_device
from costmodel.operators import node_time
from ir.graph import OpKind, dtype_bytes
from models.megatron_kernels import dropout_add, reference, scale_causal_softmax
from models.registry import build_model


def test_values_and_gradients_equal_the_masked_softmax_it_fuses():
    torch.manual_seed(0)
    scores = torch.randn(2, 3, 7, 7, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    out = scale_causal_softmax(scores, 0.37)
    expected = torch.softmax((scores * 0.37).masked_fill(torch.ones(7, 7).triu(1).bool(), float("-inf")), dim=-1)
    assert torch.allclose(out, expected) and torch.allclose(out, reference(scores, 0.37))
    assert torch.all(out.triu(1) == 0)
    (ours,) = torch.autograd.grad(out, scores, grad)
    (autograd,) = torch.autograd.grad(expected, scores, grad)
    assert torch.allclose(ours, autograd)
    with pytest.raises(ValueError, match="square"):
        scale_causal_softmax(torch.randn(2, 3, 4, 5), 1.0)


def _layer_nodes(attn_impl: str, *sets: str):
    built = build_model("gpt", (f"attn_impl={attn_impl}", "layers=2", "hidden=256", "heads=4", "vocab=512",
                                "dropout=0.1", *sets), batch=2, seq=128, device="meta")
    chain = ir.build_layer_chain(ir.trace(built.module, built.example_inputs, model_name=attn_impl))
    seg = chain.segments[len(chain.segments) // 2]
    return chain.graph.nodes[seg.start:seg.stop]


def test_gpt_causal_attention_traces_one_softmax_pass_inside_the_attention_core():
    fused, math = _layer_nodes("fused_softmax"), _layer_nodes("math")
    softmax = [n for n in fused if n.op_kind is OpKind.SOFTMAX]
    assert len(softmax) == 1 and softmax[0].attr("attention_core") and softmax[0].attr("dim") == -1
    assert not any("masked_fill" in n.target for n in fused)
    # It keeps its probabilities for backward, as the kernel does (Korthikanti et al.'s 2as^2b), and it reads the
    # scores once and writes the probabilities once.
    sm = softmax[0]
    probs = sm.output_specs[0]
    assert probs.shape == (2, 4, 128, 128)
    assert sm.saved_bytes == sm.bytes_written == sm.bytes_read == probs.numel * dtype_bytes(probs.dtype)

    def core_time(nodes):
        a100 = get_device("a100-80gb")
        return sum(sum(node_time(n, a100)) for n in nodes
                   if n.attr("attention_core") and n.op_kind is not OpKind.MATMUL)

    # scale, mask, cast, softmax, cast (math) against one kernel, dropout in both
    assert core_time(fused) < 0.6 * core_time(math)


def test_dropout_add_is_residual_plus_dropout_with_a_one_byte_mask():
    torch.manual_seed(0)
    x = torch.randn(4, 8, 16, dtype=torch.float64, requires_grad=True)
    res = torch.randn(4, 8, 16, dtype=torch.float64, requires_grad=True)
    out, keep = dropout_add(x, res, 0.25)
    assert keep.dtype == torch.bool and 0.6 < keep.double().mean() < 0.9
    assert torch.allclose(out, res + x * keep / 0.75)
    grad = torch.randn_like(out)
    gx, gres = torch.autograd.grad(out, (x, res), grad)
    assert torch.allclose(gx, grad * keep / 0.75) and torch.allclose(gres, grad)
    out0, keep0 = dropout_add(x, res, 0.0)
    assert keep0.all() and torch.allclose(out0, x + res)


def test_gpt_residual_branches_trace_as_one_fused_op_each_when_asked():
    fused = _layer_nodes("fused_softmax", "fused_dropout_add=true")
    eager = _layer_nodes("fused_softmax")
    kernels = [n for n in fused if n.target.endswith("_dropout_add")]
    assert len(kernels) == 2
    for n in kernels:  # reads branch and residual, writes the sum and a 1-byte mask, keeps the mask
        out = n.output_specs[0]
        assert n.bytes_read == 2 * out.nbytes and n.bytes_written == out.nbytes + out.numel == n.saved_bytes + out.nbytes
    a100 = get_device("a100-80gb")
    residual = {id(n) for n in eager if n.target in ("operator.add", "torch.nn.Dropout")}
    assert sum(sum(node_time(n, a100)) for n in kernels) < 0.6 * sum(
        sum(node_time(n, a100)) for n in eager if id(n) in residual)
