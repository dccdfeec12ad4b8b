"""Linear layers run through oneDNN with their weights packed once, for decoding on CPU.

A decode step multiplies a few rows by every weight matrix of the model; ``nn.Linear`` hands that
to a GEMM that re-packs the weight matrix on every call. Packing each weight once per rollout into
oneDNN's blocked layout and calling oneDNN's linear directly is about 2x faster for those shapes
in float32 and 1.5x in bfloat16 (``bench/cpu_kernels.py``). The cost: a packed copy of the
linear weights for the duration of the rollout, and one pass over the weights to make it.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Callable, Iterator

import torch
from torch import nn


def packing_dtypes() -> tuple[torch.dtype, ...]:
    """Weight dtypes oneDNN packs on this machine (none when PyTorch was built without it)."""
    if not torch.backends.mkldnn.is_available():
        return ()
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def _packed_forward(packed: torch.Tensor, bias: torch.Tensor | None, inputs: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(inputs, packed, bias, "none", [], "")


def fused_linear(layers: list[nn.Linear], rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """One linear map computing all of ``layers`` on the same input (their outputs concatenated),
    on a weight packed once for ``rows`` rows where oneDNN packs its dtype. Call without gradients."""
    weight, bias = _concatenated([layer.weight.detach() for layer in layers]), fused_bias(layers)
    if weight.device.type == "cpu" and weight.dtype in packing_dtypes():
        return partial(_packed_forward, torch.ops.mkldnn._reorder_linear_weight(weight, max(1, rows)), bias)
    return partial(nn.functional.linear, weight=weight, bias=bias)


class WeightVersions:
    """A model's weights as they were when packed: each parameter tensor and its version counter, so another
    tensor (a swapped-in module) or an in-place write (an optimizer step) shows as a change."""

    def __init__(self, model: nn.Module):
        self.state = [(p, p._version) for p in model.parameters()]

    def current(self, model: nn.Module) -> bool:
        """Whether ``model``'s weights are still these."""
        now = list(model.parameters())
        return len(now) == len(self.state) and all(p is q and p._version == v for p, (q, v) in zip(now, self.state))


def fused_bias(layers: list[nn.Linear]) -> torch.Tensor | None:
    """The ``layers``' biases side by side (zeros for a layer without), None where none has one."""
    if all(layer.bias is None for layer in layers):
        return None
    return _concatenated([layer.weight.new_zeros(layer.out_features) if layer.bias is None else layer.bias.detach() for layer in layers])


def _concatenated(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)  # one layer: no copy before packing


@contextmanager
def packed_linears(model: nn.Module, rows: int) -> Iterator[int]:
    """Within the block (entered without gradients), every plain ``nn.Linear`` of ``model``
    with a CPU weight of a packable dtype runs on a copy of its weight packed for ``rows`` input
    rows (a hint: any number of rows works). Yields how many layers were packed; the layers are
    restored on exit, also after an error."""
    with PackedLinears(model, rows).applied() as count:
        yield count


class PackedLinears:
    """``model``'s plain CPU ``nn.Linear`` layers of a packable dtype, packed for ``rows`` rows at the first
    :meth:`applied` and kept while their weights stay the same (tensor version counters): the engine's
    model-forward runner packs once and runs each step on the packed copies."""

    def __init__(self, model: nn.Module, rows: int):
        self.model, self.rows = model, rows
        self._state: list[tuple[nn.Linear, torch.Tensor, int]] = []
        self._forwards: list[Callable[[torch.Tensor], torch.Tensor]] = []

    @contextmanager
    def applied(self) -> Iterator[int]:
        """Within the block (entered without gradients) the layers run on their packed weights (packed
        afresh where a weight changed); yields how many; restored on exit, also after an error."""
        if torch.is_grad_enabled():
            raise RuntimeError("packed_linears computes no gradients: enter it under torch.no_grad() or torch.inference_mode()")
        dtypes = packing_dtypes()
        state = [
            (module, module.weight, module.weight._version)
            for module in self.model.modules()
            if type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype in dtypes
        ]
        if len(state) != len(self._state) or any(a is not b or w is not v or i != j for (a, w, i), (b, v, j) in zip(state, self._state)):
            self._state, self._forwards = state, [fused_linear([module], self.rows) for module, _, _ in state]
        patched: list[nn.Linear] = []
        try:
            for (module, _, _), forward in zip(self._state, self._forwards):
                module.forward = forward  # type: ignore[method-assign]
                patched.append(module)
            yield len(patched)
        finally:
            for module in patched:  # pop: a concurrent rollout on the same model may have restored it already
                vars(module).pop("forward", None)
