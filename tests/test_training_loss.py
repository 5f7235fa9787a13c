"""The training loss's memory, measured: the live bytes of every tensor the loss creates, on the CPU, against
`costmodel.training_loss` (`loss_saved_bytes` + `loss_transient_bytes`), for PyTorch's cross-entropy, for an in-place
cross-entropy written as Megatron-LM's `_VocabParallelCrossEntropy` computes it (on one rank), and for a fused one
written as flash-attn's kernel works (row blocks stand in for its thread blocks: nothing logits-sized but the
gradient it writes)."""

from __future__ import annotations

import os
import subprocess
import sys
import weakref
from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from costmodel.strategy import CrossEntropy
from costmodel.training_loss import loss_saved_bytes, loss_transient_bytes

TOKENS, VOCAB, HIDDEN = 2048, 4096, 16


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops create inside the mode and that are still referenced; `peak` since `reset`."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._storages: set[int] = set()

    def reset(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or key in self._storages:  # a view or an in-place result: no new memory
            return
        self._storages.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._storages.discard(key)
        self.live -= nbytes


class InPlaceCrossEntropy(torch.autograd.Function):
    """Softmax cross-entropy in place in its fp32 input, as Megatron-LM's vocab-parallel cross-entropy does it:
    the input becomes the softmax that backward keeps and turns into the gradient."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        logits.sub_(logits.max(dim=-1)[0].unsqueeze(-1))
        predicted = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        torch.exp(logits, out=logits)
        total = logits.sum(dim=-1)
        logits.div_(total.unsqueeze(-1))
        ctx.save_for_backward(logits, target)
        return torch.log(total) - predicted

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        softmax, target = ctx.saved_tensors
        softmax[torch.arange(softmax.size(0)), target] -= 1.0
        softmax.mul_(grad.unsqueeze(-1))
        return softmax, None


class FusedCrossEntropy(torch.autograd.Function):
    """Softmax cross-entropy as flash-attn's kernel computes it: a log-sum-exp per row, the 16-bit logits kept for
    backward, which writes their gradient in one pass."""

    ROWS = 4

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        lse = torch.cat([torch.logsumexp(block.float(), dim=-1) for block in logits.split(FusedCrossEntropy.ROWS)])
        ctx.save_for_backward(logits, lse, target)
        return lse - logits.gather(-1, target.unsqueeze(-1)).squeeze(-1).float()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        logits, lse, target = ctx.saved_tensors
        out = torch.empty_like(logits)
        for start in range(0, logits.size(0), FusedCrossEntropy.ROWS):
            rows = slice(start, start + FusedCrossEntropy.ROWS)
            block = torch.exp(logits[rows].float() - lse[rows].unsqueeze(-1))
            block[torch.arange(block.size(0)), target[rows]] -= 1.0
            out[rows] = block * grad[rows].unsqueeze(-1)
        return out, None


def _pytorch(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float(), target)


def _in_place(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return InPlaceCrossEntropy.apply(logits.float(), target).mean()


def _fused(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return FusedCrossEntropy.apply(logits, target).mean()


def _measured(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dtype: torch.dtype) -> tuple[int, int]:
    """(bytes saved by the loss after its forward, peak bytes of the loss over forward and backward), logits
    excluded: they are the model's output, created before the loss and freed by the trainer before backward."""
    torch.manual_seed(0)
    h = torch.randn(TOKENS, HIDDEN, dtype=dtype, requires_grad=True)
    w = torch.randn(VOCAB, HIDDEN, dtype=dtype, requires_grad=True)
    target = torch.randint(0, VOCAB, (TOKENS,))
    with LiveBytes() as mem:
        logits = h @ w.t()
        before = mem.live
        mem.reset()
        loss = loss_fn(logits, target)
        forward_peak = mem.peak - before
        del logits  # torchtitan's train step and this project's runtime keep no reference to the output
        saved = mem.live - before + logits_bytes(dtype)
        mem.reset()
        loss.backward()
        backward_peak = mem.peak - before + logits_bytes(dtype)
    return saved, max(forward_peak + logits_bytes(dtype), backward_peak)


def logits_bytes(dtype: torch.dtype) -> int:
    return TOKENS * VOCAB * dtype.itemsize


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("loss_fn", "kernel"), [(_pytorch, CrossEntropy.TORCH), (_in_place, CrossEntropy.INPLACE),
                                               (_fused, CrossEntropy.FUSED)])
def test_loss_memory_is_what_the_model_prices(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                                              kernel: CrossEntropy, dtype: torch.dtype) -> None:
    elements = TOKENS * VOCAB
    saved, peak = _measured(loss_fn, dtype)
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    # besides: the gradients of h and w, one row block, and row-sized tensors (maxima, sums, per-row losses)
    slack = (TOKENS + VOCAB) * HIDDEN * 4 + 0.02 * elements
    assert abs(saved - loss_saved_bytes(elements, name, kernel)) <= slack, saved / elements
    priced = loss_saved_bytes(elements, name, kernel) + loss_transient_bytes(elements, name, kernel)
    assert abs(peak - priced) <= slack, (peak / elements, priced / elements)


def test_the_kernels_differ_up_to_fourfold() -> None:
    # bf16 bytes per logit, kept + transient: PyTorch 4 + 8, in place 4 + 2, fused 2 + 2, loss-parallel 4 + 12
    peaks = {k: loss_saved_bytes(1, "bfloat16", k) + loss_transient_bytes(1, "bfloat16", k) for k in CrossEntropy}
    assert peaks == {CrossEntropy.TORCH: 12, CrossEntropy.INPLACE: 6, CrossEntropy.FUSED: 4,
                     CrossEntropy.LOSS_PARALLEL: 16}
    assert loss_transient_bytes(1, "float32", CrossEntropy.INPLACE) == 0


def test_estimate_prices_the_trainers_loss_on_the_last_stage() -> None:
    """A traced GPT whose 32K-token vocabulary makes the loss the largest transient, priced in bf16: the last
    stage's temporary memory is PyTorch's 8E, and in place or fused the larger of the loss's 2E and the bf16 logits
    with their gradient (4E, the segment's own largest transient); what the loss keeps is 4E for every micro-batch
    in flight (2E fused); the first stage, which has no loss, is unchanged; the fused loss is faster."""
    import ir
    from costmodel import Cluster, RuntimeOptions, Strategy
    from costmodel.estimate import estimate
    from models.registry import build_model

    batch, seq, vocab = 2, 256, 32000
    built = build_model("gpt-tiny", ("vocab=32000",), batch=batch, seq=seq, device="meta")
    chain = ir.build_layer_chain(ir.trace(built.module, built.example_inputs, model_name="gpt-tiny"))
    cluster = Cluster.parse("1x8xa100-80gb")

    def priced(kernel: CrossEntropy):  # noqa: ANN202
        strategy = Strategy(dp=1, pp=2, microbatch_size=batch, num_microbatches=4,
                            runtime=RuntimeOptions(cross_entropy=kernel))
        return estimate(chain, cluster, strategy)

    torch_loss, in_place, fused = (priced(k) for k in (CrossEntropy.TORCH, CrossEntropy.INPLACE, CrossEntropy.FUSED))
    elements = batch * seq * vocab
    assert torch_loss.stages[0].memory == in_place.stages[0].memory == fused.stages[0].memory
    last = [e.stages[-1] for e in (torch_loss, in_place, fused)]
    assert [s.memory.temporary for s in last] == [8 * elements, 4 * elements, 4 * elements]
    in_flight = last[0].in_flight_microbatches
    assert last[0].memory.activations == last[1].memory.activations
    assert last[0].memory.activations - last[2].memory.activations == in_flight * 2 * elements
    assert torch_loss.stages[-1].bwd_s == in_place.stages[-1].bwd_s > fused.stages[-1].bwd_s


def test_training_metric_passes_add_loss_forwards_after_the_backward() -> None:
    """Composer's two train metrics over an MPT's logits: two `torch` loss forwards per micro-batch on the stage
    that returns the logits, priced in its backward; recorded in plan JSON and settable with --fix."""
    import ir
    from costmodel import Cluster, RuntimeOptions, Strategy
    from costmodel.estimate import estimate
    from costmodel.hardware.catalog import get_device
    from costmodel.training_loss import metric_pass_time
    from models.registry import build_model
    from planner.search.space import SearchSpace

    batch, seq, vocab = 2, 256, 32000
    built = build_model("gpt-tiny", ("vocab=32000",), batch=batch, seq=seq, device="meta")
    chain = ir.build_layer_chain(ir.trace(built.module, built.example_inputs, model_name="gpt-tiny"))
    cluster = Cluster.parse("1x8xa100-80gb")

    def priced(passes: int):  # noqa: ANN202
        return estimate(chain, cluster, Strategy(dp=1, pp=2, microbatch_size=batch, num_microbatches=4,
                                                 runtime=RuntimeOptions(metric_passes=passes)))

    plain, composer = priced(0), priced(2)
    added = 2 * metric_pass_time(batch * seq * vocab, 2, get_device("a100-80gb"))
    assert added > 0
    assert composer.stages[-1].bwd_s - plain.stages[-1].bwd_s == pytest.approx(added)
    assert composer.stages[0].bwd_s == plain.stages[0].bwd_s
    assert RuntimeOptions.from_dict(RuntimeOptions(metric_passes=2).to_dict()).metric_passes == 2
    assert "metric_passes" not in RuntimeOptions().to_dict()
    assert SearchSpace.from_fixes(["metric_passes=2"]).runtime.metric_passes == 2
    with pytest.raises(ValueError, match="metric_passes=two: expected an integer from 0 to 8"):
        SearchSpace.from_fixes(["metric_passes=two"])
    with pytest.raises(ValueError, match="metric_passes must be an integer from 0 to 8"):
        RuntimeOptions(metric_passes=-1)


LOSS_PARALLEL_PEAK = """
import os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel

dtype = getattr(torch, sys.argv[1])
tokens, vocab = int(sys.argv[2]), int(sys.argv[3])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (1,))


def loss_of(logits, target):
    with loss_parallel():
        return torch.nn.functional.cross_entropy(
            DTensor.from_local(logits, mesh, [Shard(1)], run_check=False).float(),
            DTensor.from_local(target, mesh, [Replicate()], run_check=False))


leaf = torch.randn(tokens, vocab, dtype=dtype, requires_grad=True)
target = torch.randint(0, vocab, (tokens,))
warm = loss_of(leaf[:8, :64] * 1, target[:8] % 64)  # load the kernels before measuring
with loss_parallel():
    warm.backward()
logits = leaf * 1


def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident size starts again from what is resident now
resident = status_kib("VmRSS")
loss = loss_of(logits, target)
del logits
with loss_parallel():
    loss.backward()
peak = status_kib("VmHWM")
dist.destroy_process_group()
print((peak - resident) * 1024)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads and resets the peak resident size in /proc")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_loss_parallel_peak_is_what_the_model_prices(dtype: str, tmp_path) -> None:  # noqa: ANN001
    """PyTorch's loss under `loss_parallel()` (torchtitan with tp > 1), on a one-rank mesh: the peak resident memory
    of a process running it (VmHWM, reset before the loss: `ru_maxrss` would carry the forking parent's), above
    what it held with the logits made, is the logits and what the model prices.
    DTensor runs its decomposition on local tensors, which a dispatch mode cannot see, hence a process of its own
    and tensors far above the allocator's mmap threshold (each is mapped and unmapped on its own)."""
    tokens, vocab = 2048, 8192
    elements = tokens * vocab
    port = str(29400 + os.getpid() % 500)
    out = subprocess.run([sys.executable, "-c", LOSS_PARALLEL_PEAK, dtype, str(tokens), str(vocab), port],
                         capture_output=True, text=True, timeout=300, check=True, cwd=tmp_path)
    itemsize = {"bfloat16": 2, "float32": 4}[dtype]
    # the logits were resident before: the peak above them is the loss's
    measured = int(out.stdout.strip().splitlines()[-1]) + itemsize * elements
    priced = (loss_saved_bytes(elements, dtype, CrossEntropy.LOSS_PARALLEL)
              + loss_transient_bytes(elements, dtype, CrossEntropy.LOSS_PARALLEL))
    assert abs(measured - priced) <= 0.05 * priced, (measured / elements, priced / elements)
    assert priced - (loss_saved_bytes(elements, dtype, CrossEntropy.TORCH)
                     + loss_transient_bytes(elements, dtype, CrossEntropy.TORCH)) == 4 * elements


def test_loss_parallel_is_priced_at_tp_above_one_only() -> None:
    """torchtitan's loss (`cross_entropy=loss-parallel`) on a traced GPT with a 32K vocabulary: at tp 2 (the head
    vocabulary-parallel, E local logits) its peak holds 4E more than PyTorch's kernels and it takes longer (6
    kernels each way instead of 3); at tp 1 it is PyTorch's loss, priced the same."""
    import ir
    from costmodel import Cluster, RuntimeOptions, Strategy
    from models.registry import build_model
    from planner.api import estimate

    batch, seq, vocab = 2, 256, 32000
    built = build_model("gpt-tiny", ("vocab=32000",), batch=batch, seq=seq, device="meta")
    chain = ir.build_layer_chain(ir.trace(built.module, built.example_inputs, model_name="gpt-tiny"))
    cluster = Cluster.parse("1x8xa100-80gb")

    def priced(kernel: CrossEntropy, tp: int):  # noqa: ANN202
        strategy = Strategy(dp=1, tp=tp, pp=1, microbatch_size=batch, num_microbatches=1,
                            runtime=RuntimeOptions(cross_entropy=kernel, tp_sharded_weights=tp > 1))
        return estimate(chain, cluster, strategy).stages[-1]

    torch_tp2, parallel_tp2 = priced(CrossEntropy.TORCH, 2), priced(CrossEntropy.LOSS_PARALLEL, 2)
    local = batch * seq * vocab // 2
    assert parallel_tp2.memory.temporary - torch_tp2.memory.temporary == 4 * local
    assert parallel_tp2.memory.activations == torch_tp2.memory.activations
    assert parallel_tp2.bwd_s > torch_tp2.bwd_s and parallel_tp2.fwd_s > torch_tp2.fwd_s
    torch_tp1, parallel_tp1 = priced(CrossEntropy.TORCH, 1), priced(CrossEntropy.LOSS_PARALLEL, 1)
    assert parallel_tp1 == torch_tp1


def test_the_runtime_runs_torchtitans_loss_only_where_it_is_pytorchs() -> None:
    """`planner.parallelize` computes PyTorch's loss: a plan priced with torchtitan's runs at tp 1 (the same
    kernels) and is refused, in one line, at tp 2."""
    from costmodel import RuntimeOptions, Strategy
    from planner.runtime.parallelize import runtime_unsupported

    runtime = RuntimeOptions(cross_entropy=CrossEntropy.LOSS_PARALLEL)
    assert runtime_unsupported(Strategy(dp=2, tp=1, pp=1, microbatch_size=1, num_microbatches=1,
                                        runtime=runtime)) == ""
    refused = runtime_unsupported(Strategy(dp=1, tp=2, pp=1, microbatch_size=1, num_microbatches=1,
                                           runtime=runtime))
    assert "cross_entropy=loss-parallel" in refused and "\n" not in refused
