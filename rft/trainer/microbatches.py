"""How a trainer step's rows become optimizer steps and microbatches.

    mini-batches: algorithm.mini_batch_size rows per optimizer step, dealt over DP ranks
    microbatches: trainer.micro_batch_size rows, right-padded                (max_tokens_per_microbatch=0)
               or rows packed up to trainer.max_tokens_per_microbatch tokens (dynamic batch size)

With a token budget a microbatch holds as many rows as fit, back to back in one packed sequence
(rft/trainer/forward.py), so no compute goes to padding and a microbatch's memory is bounded by
the budget, not by a row count times the longest row. Rows are placed longest first into the
first microbatch with room (first-fit decreasing: few, full microbatches); a row longer than the
budget gets a microbatch of its own. DPO's preference pairs go into microbatches whole
(`pair_microbatches`): the loss needs both rows of a pair.
"""

from __future__ import annotations


def mini_batch_rows(num_rows: int, mini_batch_size: int) -> list[range]:
    """The rows of each optimizer step, over all DP ranks: the batch's rows in order,
    `mini_batch_size` per step (0: all)."""
    size = mini_batch_size or num_rows
    return [range(s, min(s + size, num_rows)) for s in range(0, num_rows, size)]


def mini_batches(num_rows: int, mini_batch_size: int, dp_rank: int, dp_size: int) -> list[list[int]]:
    """This DP rank's rows of each optimizer step (mini_batch_rows), dealt over the DP ranks."""
    return [list(rows)[dp_rank::dp_size] for rows in mini_batch_rows(num_rows, mini_batch_size)]


def microbatches(rows: list[int], lengths: list[int], micro_batch_size: int, max_tokens: int) -> list[list[int]]:
    """`rows` (indices into `lengths`, each row's prompt + response tokens) in microbatches:
    `micro_batch_size` at a time, or packed up to `max_tokens` tokens each when that is set."""
    if max_tokens <= 0:
        return [rows[s: s + micro_batch_size] for s in range(0, len(rows), micro_batch_size)]
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(rows, key=lambda r: -lengths[r]):
        fits = next((b for b, left in enumerate(room) if lengths[row] <= left), None)
        if fits is None:
            bins.append([row])
            room.append(max_tokens - lengths[row])
        else:
            bins[fits].append(row)
            room[fits] -= lengths[row]
    return bins


def pair_microbatches(pairs: list[int], lengths: list[int], micro_batch_size: int, max_tokens: int) -> list[list[int]]:
    """The rows of `pairs` (pair p is rows 2p, chosen, and 2p+1, rejected; `lengths` per row) in
    microbatches that keep each pair whole: `micro_batch_size` rows at a time, or packed up to
    `max_tokens` tokens each, a pair counting as its two rows' length."""
    pair_lengths = [lengths[2 * p] + lengths[2 * p + 1] for p in range(len(lengths) // 2)]
    return [[row for p in chunk for row in (2 * p, 2 * p + 1)]
            for chunk in microbatches(pairs, pair_lengths, max(1, micro_batch_size // 2), max_tokens)]
