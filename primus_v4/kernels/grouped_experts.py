"""Grouped routed experts: clamped SwiGLU over rows already sorted by expert.

Legend: M = routed rows (tokens x top-k, sorted by expert), D = hidden, F = expert ffn,
E = local experts.

The torch reference loops over experts with one matmul pair each (exact, no padding). Fused
backends register under the same op name and must match it: `grouped_mm` (torch's own grouped
GEMM, `torch.nn.functional.grouped_mm`: CUDA / ROCm kernels and a CPU path, which on CPU equals
the loop bit for bit) here, primus-turbo's grouped GEMM in `turbo.py`. Callers resolve the op
once at construction (`registry.resolve(OP_NAME)`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from primus_v4.kernels.registry import register

OP_NAME = "grouped_experts"


def _swiglu(gate_up_MF2: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate_up_MF2.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


class _LowPrecisionSwiGLU(torch.autograd.Function):
    """Saves only the [M, 2F] input: autograd would also keep the clamped gate, its SiLU and the
    clamped up ([M, F] each), twice the input's bytes, for a few elementwise ops."""

    @staticmethod
    def forward(ctx, gate_up_MF2: torch.Tensor, limit: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(gate_up_MF2)
        ctx.limit = limit
        return _swiglu(gate_up_MF2, limit)

    @staticmethod
    def backward(ctx, g_MF: torch.Tensor):  # type: ignore[override]
        (gate_up_MF2,) = ctx.saved_tensors
        limit = ctx.limit
        gate, up = gate_up_MF2.float().chunk(2, dim=-1)
        gc, uc = gate.clamp(max=limit), up.clamp(-limit, limit)
        sig = torch.sigmoid(gc)
        g = g_MF.float()
        # clamp passes the gradient where the input lies inside the bounds (ends included).
        d_gate = g * uc * sig * (1 + gc * (1 - sig)) * (gate <= limit)
        d_up = g * gc * sig * ((up >= -limit) & (up <= limit))
        return torch.cat((d_gate, d_up), dim=-1).to(gate_up_MF2.dtype), None


def clamped_swiglu(gate_up_MF2: torch.Tensor, limit: float) -> torch.Tensor:
    """SiLU(min(gate, limit)) * clamp(up, -limit, limit); clamps bound bf16 activations.
    float32 and float64 take the plain autograd expression (bit for bit as always)."""
    if gate_up_MF2.dtype in (torch.float32, torch.float64) or not gate_up_MF2.requires_grad:
        return _swiglu(gate_up_MF2, limit)
    return _LowPrecisionSwiGLU.apply(gate_up_MF2, limit)


Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class ExpertLoRA:
    """Low-rank adapters of the routed experts: `scale` B A on the gate (w1), up (w3) and down
    (w2) projections, each (A [E', r, in], B [E', out, r]) or None. E' is the call's experts
    (one adapter per expert) or 1 (one shared by them). `drop` is applied to an adapter's input
    (LoRA dropout; identity when off)."""

    gate: Pair | None = None
    up: Pair | None = None
    down: Pair | None = None
    scale: float = 1.0
    drop: Any = None

    def pairs(self) -> list[Pair]:
        return [p for p in (self.gate, self.up, self.down) if p is not None]


def _in(lora: ExpertLoRA, x: torch.Tensor) -> torch.Tensor:
    return lora.drop(x) if lora.drop is not None else x


def _loop_delta(x: torch.Tensor, pair: Pair, e: int, lora: ExpertLoRA) -> torch.Tensor:
    a, b = pair
    i = 0 if a.shape[0] == 1 else e
    return (_in(lora, x) @ a[i].t()) @ b[i].t() * lora.scale


def _adapted_gate_up(h_MF2, x_MD, lora, delta) -> torch.Tensor:
    """h with the gate and up adapters added (`delta(x, pair)`): new tensors, never in place."""
    if lora is None or (lora.gate is None and lora.up is None):
        return h_MF2
    g, u = h_MF2.chunk(2, dim=-1)
    g = g + delta(x_MD, lora.gate) if lora.gate is not None else g
    u = u + delta(x_MD, lora.up) if lora.up is not None else u
    return torch.cat((g, u), dim=-1)


def grouped_experts_reference(
    x_MD: torch.Tensor,
    tokens_per_expert_E: list[int],
    w_gate_up_EF2D: torch.Tensor,
    w_down_EDF: torch.Tensor,
    *,
    limit: float,
    lora: ExpertLoRA | None = None,
) -> torch.Tensor:
    """Rows [off_e, off_e + n_e) go through expert e; returns [M, D] in the same order. Weights
    are [E, out, in] (nn.Linear's layout): gate rows [0, F), up rows [F, 2F). `lora` adds the
    experts' adapters."""
    outs = []
    offset = 0
    for e, n in enumerate(tokens_per_expert_E):
        if n == 0:
            continue
        rows = x_MD[offset : offset + n]

        def delta(x, pair, e=e):
            return _loop_delta(x, pair, e, lora)

        h = _adapted_gate_up(rows @ w_gate_up_EF2D[e].t(), rows, lora, delta)
        act = clamped_swiglu(h, limit)
        y = act @ w_down_EDF[e].t()
        if lora is not None and lora.down is not None:
            y = y + delta(act, lora.down)
        outs.append(y)
        offset += n
    if not outs:
        # Keep the expert weights (and adapters) in the graph so an empty batch still yields
        # (zero) grads.
        held = w_gate_up_EF2D.sum() + w_down_EDF.sum()
        for a, b in lora.pairs() if lora is not None else []:
            held = held + a.sum() + b.sum()
        return x_MD @ w_down_EDF.new_zeros(x_MD.shape[-1], x_MD.shape[-1]) + 0.0 * held
    return torch.cat(outs, dim=0)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: grouped_mm's backward rejects
    strided ones (a `.sum()` upstream yields a stride-0 gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g.contiguous()


def _grouped_delta(x: torch.Tensor, pair: Pair, offs_E: torch.Tensor, lora: ExpertLoRA):
    """scale B_e A_e x for each expert's rows: two grouped GEMMs (one shared adapter: two
    plain GEMMs over all rows)."""
    a, b = pair
    x = _in(lora, x)
    if a.shape[0] == 1:
        return (x @ a[0].t()) @ b[0].t() * lora.scale
    z = _ContiguousGrad.apply(F.grouped_mm(x, a.transpose(-2, -1), offs=offs_E))
    return _ContiguousGrad.apply(F.grouped_mm(z, b.transpose(-2, -1), offs=offs_E)) * lora.scale


def grouped_experts_grouped_mm(
    x_MD: torch.Tensor,
    tokens_per_expert_E: list[int],
    w_gate_up_EF2D: torch.Tensor,
    w_down_EDF: torch.Tensor,
    *,
    limit: float,
    lora: ExpertLoRA | None = None,
) -> torch.Tensor:
    """The reference's contract through `F.grouped_mm` calls (forward and backward are
    torch's). grouped_mm multiplies [M, in] rows by b[e] = [in, out]: the transposed views of
    the [E, out, in] weights, column-major per expert, as its kernels want (no copy). Adapters
    run as grouped GEMMs of their own ([M, in] x A_e^T -> [M, r] x B_e^T)."""
    ends = list(itertools.accumulate(tokens_per_expert_E))
    offs_E = torch.tensor(ends, dtype=torch.int32, device=x_MD.device)
    h_MF2 = _ContiguousGrad.apply(F.grouped_mm(x_MD, w_gate_up_EF2D.transpose(-2, -1), offs=offs_E))

    def delta(x, pair):
        return _grouped_delta(x, pair, offs_E, lora)

    a_MF = clamped_swiglu(_adapted_gate_up(h_MF2, x_MD, lora, delta), limit)
    y_MD = _ContiguousGrad.apply(F.grouped_mm(a_MF, w_down_EDF.transpose(-2, -1), offs=offs_E))
    if lora is not None and lora.down is not None:
        y_MD = y_MD + delta(a_MF, lora.down)
    return y_MD


# What torch's grouped_mm takes per device type: its CUDA / ROCm kernels check for bf16
# (torch/_meta_registrations.py mirrors that check); the CPU path also takes fp16 and fp32.
GROUPED_MM_DTYPES = {
    "cpu": (torch.bfloat16, torch.float16, torch.float32),
    "cuda": (torch.bfloat16,),
}
_TRIALS: dict[tuple[str, int | None, torch.dtype], str | None] = {}


def grouped_mm_probe() -> str | None:
    if not hasattr(F, "grouped_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm (2.9 or newer)"
    return None


def _trial(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run grouped_mm forward + backward once on this device and dtype (tiny, cached): what
    the installed torch really accepts there, and that it equals the per-expert loop."""
    key = (device.type, device.index, dtype)
    if key not in _TRIALS:
        try:
            # The first call may come under no_grad or inference_mode (an eval forward).
            with torch.inference_mode(False), torch.enable_grad():
                _TRIALS[key] = _run_trial(device, dtype)
        except (RuntimeError, NotImplementedError) as exc:
            _TRIALS[key] = f"grouped_mm fails on {device.type} {dtype}: {str(exc)[:160]}"
    return _TRIALS[key]


def _run_trial(device: torch.device, dtype: torch.dtype) -> str | None:
    gen = torch.Generator().manual_seed(0)
    counts = [8, 0, 16]  # an expert without rows included
    ins = [torch.randn(*s, generator=gen) for s in ((24, 16), (3, 32, 16), (3, 16, 16))]
    runs = []
    for fn in (grouped_experts_grouped_mm, grouped_experts_reference):
        x, w_gu, w_d = (t.to(device, dtype).requires_grad_(True) for t in ins)
        y = fn(x, counts, w_gu, w_d, limit=10.0)
        y.float().square().sum().backward()
        runs.append([t.detach().float() for t in (y, x.grad, w_gu.grad, w_d.grad)])
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # 16-term sums; bf16 rounds each product
    for got, want in zip(*runs, strict=True):
        if float((got - want).abs().max()) > tol * float(want.abs().max()):
            return f"grouped_mm differs from the per-expert loop on {device.type} {dtype}"
    return None


def grouped_mm_refuses(
    x_MD: torch.Tensor,
    tokens_per_expert_E: list[int],
    w_gate_up_EF2D: torch.Tensor,
    w_down_EDF: torch.Tensor,
    *,
    limit: float,
    lora: ExpertLoRA | None = None,
) -> str | None:
    """None when grouped_mm takes this call: dtype and device as torch's kernels check them,
    every row stride a multiple of 16 bytes (its alignment rule), and a trial on the device."""
    del tokens_per_expert_E, limit
    for a, b in lora.pairs() if lora is not None else []:
        if a.dtype != x_MD.dtype or b.dtype != x_MD.dtype:
            return f"LoRA adapters in {a.dtype}, rows in {x_MD.dtype}"
        if a.shape[1] * a.element_size() % 16:
            return f"LoRA rank {a.shape[1]} x {a.element_size()} bytes is not a multiple of 16"
    dtype, device = x_MD.dtype, x_MD.device
    if w_gate_up_EF2D.dtype != dtype or w_down_EDF.dtype != dtype:
        return f"mixed dtypes {dtype}, {w_gate_up_EF2D.dtype}, {w_down_EDF.dtype}"
    allowed = GROUPED_MM_DTYPES.get(device.type, ())
    if dtype not in allowed:
        return f"grouped_mm on {device.type} takes {[str(d) for d in allowed]}, not {dtype}"
    size = x_MD.element_size()
    d, f2 = x_MD.shape[-1], w_gate_up_EF2D.shape[1]
    for name, width in (("hidden", d), ("2 x expert ffn", f2), ("expert ffn", f2 // 2)):
        if width * size % 16:
            return f"{name} {width} x {size} bytes is not a multiple of 16 bytes"
    if not x_MD.is_contiguous():
        return "expert-sorted rows are not contiguous"
    for t in (x_MD, w_gate_up_EF2D, w_down_EDF):
        if t.data_ptr() % 16:
            return "a tensor does not start on a 16-byte boundary"
    return _trial(device, dtype)


register(OP_NAME, "torch", grouped_experts_reference)
register(
    OP_NAME,
    "grouped_mm",
    grouped_experts_grouped_mm,
    probe=grouped_mm_probe,
    refuses=grouped_mm_refuses,
)
