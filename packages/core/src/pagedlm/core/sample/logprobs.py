"""Logprob tensors returned with sampled tokens (and with prompt tokens)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: host lists of logprobs, one entry per position: (ids, logprobs, ranks). A rank is the column-0
#: token's, or a list of every column's where the columns are explicitly asked ids
#: (``SamplingParams.logprob_token_ids``).
LogprobsLists = tuple[list[list[int]], list[list[float]], list[int | list[int]]]


@dataclass
class LogprobsTensors:
    """Logprobs of N positions, still on the device until ``tolists``.

    Attributes:
        logprob_token_ids: ``[N, k+1]`` int64; column 0 is the sampled (or prompt/target) token,
            columns 1.. the top-k ids in descending logprob order.
        logprobs: ``[N, k+1]`` float32, matching ``logprob_token_ids``.
        selected_token_ranks: ``[N]`` int64; 1-based rank of the column-0 token (1 = most likely;
            tokens with an equal logprob share the better rank).
        column_ranks: ``[N, k+1]`` int64 or None: the rank of every column, set only for rows
            whose columns 1.. hold explicitly asked ids (``with_explicit_ids``), 0 elsewhere;
            columns 1.. of the other rows are ranks 1..k by construction.
    """

    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    selected_token_ranks: torch.Tensor
    column_ranks: torch.Tensor | None = None

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        """Host copies: (ids ``N x (k+1)``, logprobs ``N x (k+1)``, ranks ``N``)."""
        return (
            self.logprob_token_ids.tolist(),
            self.logprobs.tolist(),
            self.selected_token_ranks.tolist(),
        )

    @property
    def num_positions(self) -> int:
        return int(self.logprob_token_ids.shape[0])

    def slice(self, start: int, end: int) -> LogprobsTensors:
        """Rows ``[start, end)`` (e.g. one request's prompt positions out of a flat batch)."""
        return LogprobsTensors(
            self.logprob_token_ids[start:end],
            self.logprobs[start:end],
            self.selected_token_ranks[start:end],
            None if self.column_ranks is None else self.column_ranks[start:end],
        )

    def with_explicit_ids(self, logprobs: torch.Tensor, explicit: dict[int, list[int]]) -> LogprobsTensors:
        """These tensors with columns ``1..m`` of each row in ``explicit`` replaced by its ``m``
        asked ids (in the order asked) and their logprobs, and ``column_ranks`` giving their true
        ranks. ``logprobs``: the ``[N, V]`` distribution these were gathered from.

        NOTE: the top-k width must already be at least every row's ``m``.
        """
        if not explicit:
            return self
        ids, values = self.logprob_token_ids.clone(), self.logprobs.clone()
        ranks = torch.zeros_like(ids)
        for row, wanted in explicit.items():
            cols = torch.tensor(wanted, dtype=torch.int64, device=ids.device)
            ids[row, 1:1 + len(wanted)] = cols
            values[row, 1:1 + len(wanted)] = logprobs[row, cols]
            row_values = values[row, :1 + len(wanted)]
            ranks[row, :1 + len(wanted)] = (logprobs[row].unsqueeze(0) > row_values.unsqueeze(1)).sum(-1) + 1
        return LogprobsTensors(ids, values, self.selected_token_ranks, ranks)


def compute_topk_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """Gathers the target token's logprob, its rank and the top-``num_logprobs`` entries.

    Args:
        logprobs: ``[N, V]`` float32, already log-softmaxed.
        num_logprobs: k >= 0 top entries to return besides the target (k = 0: target only).
        token_ids: ``[N]`` integer ids of the target tokens (sampled or next prompt token).

    Returns:
        ``LogprobsTensors`` with ``[N, k+1]`` ids/logprobs and ``[N]`` ranks, on the input's device.
    """
    if num_logprobs < 0:
        raise ValueError(f"num_logprobs={num_logprobs} must be >= 0")
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.int64).unsqueeze(-1)  # [N, 1]
    token_logprobs = logprobs.gather(-1, token_ids)  # [N, 1]
    # Rank = 1 + number of strictly better tokens; a comparison + sum avoids a full sort.
    ranks = (logprobs > token_logprobs).sum(-1) + 1  # [N]
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)  # [N, k]
        ids = torch.cat([token_ids, top_ids], dim=-1)
        values = torch.cat([token_logprobs, top_logprobs], dim=-1)
    else:
        ids, values = token_ids, token_logprobs
    return LogprobsTensors(
        logprob_token_ids=ids,
        logprobs=values.to(torch.float32),
        selected_token_ranks=ranks.to(torch.int64),
    )
