"""A step's tables as tensors (numpy's conversion) and a hybrid model's other layer groups'
metadata derived from group 0's, each against building it from scratch."""

from __future__ import annotations

import random

import torch

from tinyserve.layers.attention import AttentionMetadata
from tinyserve.layers.block_tables import group_metadata, pad_tables


def test_pad_tables_cuts_and_pads_with_block_zero():
    got = pad_tables([[5, 6, 7], [8], []], 2)
    assert got.dtype == torch.int64 and got.tolist() == [[5, 6], [8, 0], [0, 0]]


def test_group_metadata_equals_building_each_group_from_scratch():
    """Decode rows and prefill chunks of ragged lengths (a step's mix), three groups' tables
    of random ids: the derived tables, slots and kernel inputs are the ones
    AttentionMetadata.build gives for each group's tables."""
    rng = random.Random(0)
    bs = 4
    query_lens = [1, 1, 1, 7, 12]
    seq_lens = [9, 30, 4, 7, 40]
    groups = [
        [[rng.randrange(500) for _ in range(-(-sl // bs) + rng.randrange(3))] for sl in seq_lens]
        for _ in range(3)
    ]
    base = AttentionMetadata.build(query_lens, seq_lens, groups[0], bs, use_kernel=True,
                                   num_decode_seqs=3)  # fmt: skip
    for got, tables in zip(group_metadata(base, groups[1:]), groups[1:], strict=True):
        want = AttentionMetadata.build(query_lens, seq_lens, tables, bs, use_kernel=True,
                                       num_decode_seqs=3)  # fmt: skip
        assert torch.equal(got.slot_mapping, want.slot_mapping)
        assert got.block_tables == tables and got.num_decode_tokens == want.num_decode_tokens
        for name in ("query_start_loc", "seq_lens", "seq_of_token", "block_tables"):
            a, b = getattr(got.kernel, name), getattr(want.kernel, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
        assert not torch.equal(got.slot_mapping, base.slot_mapping)
