"""A step's block tables as tensors, and a hybrid model's other layer groups' metadata.

Building the int64 table of a step from Python lists is the larger part of building its
attention metadata: ``torch.tensor`` on a nested list costs ~85 ns an id (32 rows x 63 blocks:
~170 us), numpy's conversion of one flat list ~35 ns (~70 us). A hybrid model builds one table
per layer group each step (Gemma 3 1B: 7), so :func:`group_metadata` derives the kernel path's
metadata of the other groups from group 0's: the same tokens, rows and lengths, only the
tables and the slots the new K/V go to differ.
"""

from __future__ import annotations

import dataclasses

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
    ``meta`` (group 0's, ``meta.kernel`` set) with each group's tables and slots."""
    k, bs = meta.kernel, meta.block_size
    qsl = k.query_start_loc
    rows = k.seq_of_token
    positions = k.seq_lens[rows] - qsl[1:][rows] + torch.arange(len(rows), dtype=torch.int64)
    blocks, offsets = positions // bs, positions % bs
    out = []
    for tables in group_block_tables:
        padded = pad_tables(tables, k.block_tables.shape[1])
        kernel = dataclasses.replace(k, block_tables=padded.to(torch.int32))
        slots = padded[rows, blocks] * bs + offsets
        out.append(dataclasses.replace(meta, slot_mapping=slots, block_tables=tables,
                                       kernel=kernel, group_metas=None))  # fmt: skip
    return out
