"""The model's state as fake tensors: parameters and buffers on the trace device, never allocated."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ir.graph import TensorSpec


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


@dataclass
class FakeModel:
    """The model's parameters and buffers as fake tensors on the trace device, optionally cast to `dtype`.

    Meta-device models are traced as fake *CPU* tensors so kernel selection (e.g. which attention kernel runs)
    is that of a real device; fake tensors never allocate either way.
    """

    model: nn.Module
    fake_mode: FakeTensorMode
    device: torch.device
    dtype: torch.dtype | None
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    """Canonical (first) parameter name -> fake leaf."""
    param_alias: dict[str, str] = field(default_factory=dict)
    """Every name a parameter is reachable by (tied weights have several) -> canonical name."""
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    param_name_by_id: dict[int, str] = field(default_factory=dict)
    """id(fake parameter) -> canonical name."""

    @classmethod
    def build(cls, model: nn.Module, dtype: torch.dtype | None) -> FakeModel:
        device = _model_device(model)
        fake = cls(model, FakeTensorMode(allow_non_fake_inputs=True), device, dtype)
        canonical_by_id: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=True):
            canonical_by_id[id(p)] = name
            fake.params[name] = fake._fake_like(p, requires_grad=p.requires_grad)
            fake.param_name_by_id[id(fake.params[name])] = name
        for name, p in model.named_parameters(remove_duplicate=False):
            fake.param_alias[name] = canonical_by_id[id(p)]
        by_id: dict[int, torch.Tensor] = {}
        for name, b in model.named_buffers(remove_duplicate=False):
            if id(b) not in by_id:
                by_id[id(b)] = fake._fake_like(b, requires_grad=False)
            fake.buffers[name] = by_id[id(b)]
        return fake

    def _fake_like(self, t: torch.Tensor, *, requires_grad: bool) -> torch.Tensor:
        dtype = self.dtype if (self.dtype is not None and t.is_floating_point()) else t.dtype
        with self.fake_mode:
            out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=dtype, device=self.device)
        return out.requires_grad_(requires_grad and (dtype.is_floating_point or dtype.is_complex))

    def fake_input(self, x: Any) -> Any:
        """A user input as a fake tensor on the trace device (TensorSpec, real, meta or fake tensors)."""
        if isinstance(x, TensorSpec):
            dt = torch_dtype(x.dtype)
            if self.dtype is not None and dt.is_floating_point:
                dt = self.dtype
            with self.fake_mode:
                return torch.empty(x.shape, dtype=dt, device=self.device)
        if isinstance(x, torch.Tensor):
            return self._fake_like(x, requires_grad=x.requires_grad)
        return x

    def module_state(self, qualname: str, module: nn.Module) -> dict[str, torch.Tensor]:
        """Fake parameters and buffers of a (leaf) module under their local names, for functional_call."""
        prefix = f"{qualname}." if qualname else ""
        state: dict[str, torch.Tensor] = {}
        for local, _ in module.named_parameters(remove_duplicate=False):
            state[local] = self.params[self.param_alias[prefix + local]]
        for local, _ in module.named_buffers(remove_duplicate=False):
            state[local] = self.buffers[prefix + local]
        return state

    def attribute(self, qualname: str) -> Any:
        """A get_attr target: fake parameter / buffer, or a constant attribute converted to fake."""
        if qualname in self.param_alias:
            return self.params[self.param_alias[qualname]]
        if qualname in self.buffers:
            return self.buffers[qualname]
        obj: Any = self.model
        for part in qualname.split("."):
            obj = getattr(obj, part)
        if isinstance(obj, torch.Tensor):
            return self._fake_like(obj, requires_grad=False)
        return obj


def _model_device(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return torch.device("cpu") if t.device.type == "meta" else t.device
    return torch.device("cpu")
