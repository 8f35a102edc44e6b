"""Linear layers whose weights are packed once for oneDNN: CPU decoding without a per-call reorder.

On CPU a bf16 ``F.linear`` runs through oneDNN, which first reorders the weight into its blocked
layout, on every call: the whole weight is read, rewritten and read again. Decoding a small
model is exactly that cost (each forward streams every weight once for a handful of rows), so
packing once at load, with the op torch.compile's freezing pass uses
(``torch.ops.mkldnn._reorder_linear_weight``), and calling the packed kernel
(``torch.ops.mkldnn._linear_pointwise``) saves about a third of a bf16 forward. Measured on this
project's CPU (AVX-512 bf16, 1 thread, SmolLM2-135M, body + lm_head over a 128-token cache): a
1-token forward 61 -> 43 ms, an 8-token one 92 -> 58 ms; selfspec's vanilla loop 1.43x faster
(``benchmarks/speed.py`` runs both side by side).

In bf16 the packed kernel's results equal ``F.linear``'s bit for bit, and a row's result does
not depend on how many rows share the call (tested): the linear layers of a tree verification
compute each token exactly as a one-token forward does (attention still rounds differently with
the number of queries). In float32 neither holds (oneDNN and MKL round differently from each
other and by row count) and nothing was gained here, so float32 is only packed on request.

``PackedLinear`` *is* an ``nn.Linear`` (peft wraps it, the LoRA bank hooks it, ``state_dict`` and
the fingerprint see the same Parameter): only its forward changes. The packed copy costs the
weight's size again in memory. It is rebuilt when the weight is replaced or modified in place;
a forward that needs autograd, or an input of another dtype or device, takes plain ``F.linear``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

PACKABLE_DTYPES = (torch.bfloat16, torch.float32)


def packing_available(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU run oneDNN's packed linear in ``dtype``."""
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` (made by ``pack_linears``, never constructed directly) that keeps its weight
    in oneDNN's layout as well: ``_packed``, valid while ``_packed_key`` matches the weight."""

    _packed: torch.Tensor | None
    _packed_key: tuple[int, int, torch.dtype] | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (
            x.dtype != weight.dtype
            or x.device.type != "cpu"
            or weight.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        ):
            return F.linear(x, weight, self.bias)
        packed = self.packed_weight()
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")

    def packed_weight(self) -> torch.Tensor:
        """The weight in oneDNN's layout, packed again if the weight changed since."""
        weight = self.weight
        key = (weight.data_ptr(), weight._version, weight.dtype)
        if self._packed is None or self._packed_key != key:
            with torch.no_grad():
                # Packed for one row: the kernel then gives every row F.linear's exact result.
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
            self._packed_key = key
        return self._packed


def pack_linears(module: nn.Module) -> int:
    """Turn every plain ``nn.Linear`` under ``module`` whose weight is on CPU in a dtype oneDNN
    packs here into a ``PackedLinear``, packing it now. Returns how many were packed."""
    count = 0
    for sub in module.modules():
        if type(sub) is not nn.Linear:
            continue
        if sub.weight.device.type != "cpu" or not packing_available(sub.weight.dtype):
            continue
        sub.__class__ = PackedLinear
        sub._packed = sub._packed_key = None
        sub.packed_weight()
        count += 1
    return count


def unpack_linears(module: nn.Module) -> int:
    """Undo ``pack_linears``: plain ``nn.Linear`` again, packed copies freed. Returns how many."""
    count = 0
    for sub in module.modules():
        if type(sub) is PackedLinear:
            del sub._packed, sub._packed_key
            sub.__class__ = nn.Linear
            count += 1
    return count


def is_packed(module: nn.Module) -> bool:
    """Whether any linear layer under ``module`` is packed."""
    return any(type(sub) is PackedLinear for sub in module.modules())
