"""Expert matrix products on the expert-major buffer.

Rows of expert e are contiguous. In the padded layout (capacity given) every expert owns exactly
`capacity` rows, so one batched matmul does all experts. In the packed layout expert e owns
counts[e] rows starting at the sum of earlier counts; rows past the last expert are padding and
their outputs are never read.
"""

from __future__ import annotations

import torch


def expert_matmul(x_RI: torch.Tensor, w_EIO: torch.Tensor, counts_E: torch.Tensor, capacity: int | None) -> torch.Tensor:
    """y[r] = x[r] @ w[expert_of(r)] -> [R, O]."""
    num_experts, _, out_dim = w_EIO.shape
    if capacity is not None:
        x_ECI = x_RI.view(num_experts, capacity, -1)
        return torch.bmm(x_ECI, w_EIO).view(-1, out_dim)
    counts = counts_E.tolist()
    used = sum(counts)
    pieces = [x @ w for x, w in zip(torch.split(x_RI[:used], counts), w_EIO)]
    if used < x_RI.size(0):
        pieces.append(x_RI.new_zeros(x_RI.size(0) - used, out_dim, dtype=pieces[0].dtype if pieces else x_RI.dtype))
    return torch.cat(pieces)


def expert_bias(b_EO: torch.Tensor, counts_E: torch.Tensor, capacity: int | None, num_rows: int) -> torch.Tensor:
    """The bias of each row's expert -> [R, O] (padding rows get expert 0's, never read)."""
    num_experts = b_EO.size(0)
    if capacity is not None:
        return b_EO.repeat_interleave(capacity, dim=0)
    ends_E = torch.cumsum(counts_E, 0)
    row_expert_R = torch.searchsorted(ends_E, torch.arange(num_rows, device=b_EO.device), right=True)
    return b_EO[row_expert_R.clamp(max=num_experts - 1)]
