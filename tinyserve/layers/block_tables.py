"""A step's block tables as tensors, and a hybrid model's other layer groups' metadata.

Building the int64 table of a step from Python lists is the larger part of building its
attention metadata: ``torch.tensor`` on a nested list costs ~85 ns an id (32 rows x 63 blocks:
~170 us), numpy's conversion of one flat list ~35 ns (~70 us). A hybrid model builds one table
per layer group each step (Gemma 3 1B: 7), so :func:`group_metadata` derives the kernel path's
metadata of the other groups from group 0's: the same tokens, rows and lengths, only the
tables and the slots the new K/V go to differ.
"""

from __future__ import annotations

import copy

import numpy as np
import torch


def pad_tables(block_tables: list[list[int]], width: int) -> torch.Tensor:
    """int64 [len(block_tables), width]: each table cut or padded with block 0 to ``width``."""
    flat: list[int] = []
    for table in block_tables:
        row = table[:width]
        flat += row
        flat += [0] * (width - len(row))
    return torch.from_numpy(np.array(flat, dtype=np.int64)).view(len(block_tables), width)


def group_metadata(meta, group_block_tables: list[list[list[int]]]) -> list:
    """The kernel path's metadata of layer groups 1, 2, ... (``group_block_tables[g - 1]``):
    ``meta`` (group 0's, ``meta.kernel`` set) with each group's tables and slots, all groups'
    converted and gathered at once (a step's cost, not a group's)."""
    k, bs = meta.kernel, meta.block_size
    qsl, rows = k.query_start_loc, k.seq_of_token
    positions = k.seq_lens[rows] - qsl[1:][rows] + torch.arange(len(rows), dtype=torch.int64)
    num_seqs, width = k.block_tables.shape
    tables = pad_tables([t for group in group_block_tables for t in group], width)
    tables = tables.view(len(group_block_tables), num_seqs, width)
    slots = tables[:, rows, positions // bs] * bs + positions % bs  # [groups, tokens]
    tables32 = tables.to(torch.int32)
    out = []
    for g, block_tables in enumerate(group_block_tables):
        kernel = copy.copy(k)
        kernel.block_tables = tables32[g]
        group = copy.copy(meta)
        group.slot_mapping, group.block_tables, group.kernel = slots[g], block_tables, kernel
        group.group_metas = None
        out.append(group)
    return out
