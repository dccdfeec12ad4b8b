"""Token log-probs and entropies from the last hidden states, with the softmax work done in chunks.

The update needs log π(o_t) = z[o_t] - logsumexp(z), z = (h / T) Wᵀ, for each completion token, and
π's entropy for logging. :class:`HeadLogprobs` computes the logits with one matmul in the compute dtype
and keeps them; the float32 work (logsumexp, softmax, the backward's dz = g (onehot(o_t) - softmax(z)),
written over the kept logits) runs a chunk of rows at a time, so its temporaries stay small.
``bench/cpu_kernels.py`` times it against ``lm_head`` and autograd (docs/architecture.md, "GRPO").
"""

from __future__ import annotations

import torch

from rlvr.generation import logprob_temperatures

_CHUNK_ELEMENTS = 1 << 20  # float32 logits per chunk (4 MB)


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperatures: torch.Tensor,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` [N] under softmax((hidden Wᵀ) / T) for hidden [N, H] and weight [V, H],
    differentiable in ``hidden`` and ``weight``; the entropy at each position (no gradient) when asked.

    ``temperatures`` [N] scales each row (a greedy temperature counts as 1). The matmuls run in the autocast dtype
    when autocast is on, else in the promoted dtype of ``hidden`` and ``weight``; the softmax in float32.
    """
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = torch.promote_types(hidden.dtype, weight.dtype)
    inverse_temperatures = 1.0 / logprob_temperatures(temperatures).to(hidden.device, torch.float32)
    with torch.autocast(device_type, enabled=False):
        logprobs, entropy = HeadLogprobs.apply(hidden, weight, targets, inverse_temperatures, dtype, with_entropy)
    return logprobs, entropy if with_entropy else None


class HeadLogprobs(torch.autograd.Function):
    """See the module docstring; ``apply(hidden, weight, targets, inverse_temperatures, dtype, with_entropy)``."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inverse_temperatures, dtype, with_entropy):
        # z = (h / T) Wᵀ: the temperature scales the [N, H] input, not the [N, V] logits
        h, w = (hidden * inverse_temperatures.unsqueeze(1).to(hidden.dtype)).to(dtype), weight.to(dtype)
        logits = h @ w.T  # [N, V] in the compute dtype; float32 only a chunk at a time
        logprobs = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        log_norm = torch.empty_like(logprobs)
        entropy = torch.zeros_like(logprobs)
        for rows in _chunks(hidden.shape[0], weight.shape[0]):
            z = logits[rows].float()  # read only: the logits are kept for the backward
            log_norm[rows] = torch.logsumexp(z, dim=-1)
            logprobs[rows] = z.gather(1, targets[rows].unsqueeze(1)).squeeze(1) - log_norm[rows]
            if with_entropy:  # H = logsumexp(z) - Σ softmax(z) z
                p = torch.sub(z, log_norm[rows].unsqueeze(1)).exp_()
                entropy[rows] = log_norm[rows] - torch.linalg.vecdot(p, z)
        ctx.save_for_backward(h, w, logits, targets, inverse_temperatures, log_norm)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):  # once: it reuses the kept logits' memory
        h, w, logits, targets, inverse_temperatures, log_norm = ctx.saved_tensors
        for rows in _chunks(h.shape[0], w.shape[0]):  # logits -> dz in place, chunk by chunk
            g = grad_logprobs[rows].float()
            # d logprob / dz = onehot(target) - softmax(z), times the upstream gradient
            dz = logits[rows].float().sub_(log_norm[rows].unsqueeze(1)).exp_().mul_(-g.unsqueeze(1))
            dz.scatter_add_(1, targets[rows].unsqueeze(1), g.unsqueeze(1))
            if logits.dtype != torch.float32:  # else dz already is that chunk of the logits
                logits[rows] = dz
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:  # through h / T
            grad_hidden = ((logits @ w).float() * inverse_temperatures.unsqueeze(1)).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:
            grad_weight = (logits.T @ h).to(ctx.dtypes[1])
        return grad_hidden, grad_weight, None, None, None, None


def _chunks(num_rows: int, vocab_size: int) -> list[slice]:
    size = max(16, _CHUNK_ELEMENTS // vocab_size)
    return [slice(start, min(start + size, num_rows)) for start in range(0, num_rows, size)]
