"""Pure-decode steps over fixed buffers, replayed as CUDA graphs (issue 16, item 4).

A decode step of a 135M-parameter model is ~1,300 small kernels; launched one by one from
Python the launch overhead, not the GPU, sets the step time. vLLM and nano-vllm capture the
decode forward once per batch-size bucket in a CUDA graph and replay it: one launch per step.

What a graph needs: every tensor it reads or writes lives at a fixed address and has a fixed
shape, and nothing inside asks the host for a value. So a pure-decode step (every sequence
computes one generated token, no drafts) of ``n`` sequences runs in the smallest bucket
``b >= n`` of (1, 2, 4, ..., 256) over static buffers of ``b`` rows: token ids, positions,
KV slots, int32 context lengths and block tables (``max_model_len / block_size`` columns).
Rows ``n..b`` are padding: token 0 at position 0, context length 1, writing its K/V to a
scratch block past the real ones (the runner allocates ``num_blocks + 1``; a hybrid model's
layer groups have their own slots and tables) and reading it back, so no real block is
touched. Attention is :meth:`AttentionMetadata.static_decode`:
the Triton block-table kernel where Triton is present (its grid depends on ``b`` only and it
reads the lengths on the device), else the masked torch form at the table's full width.

The step's inputs are built padded on the host and staged with the sampler's in the step's
one host->device copy (worker/staging.py), then copied into the static buffers (five small
device copies the graph reads). Prefill and mixed steps, steps with drafts, and batches above
the largest bucket run eagerly as before.

``capture=False`` runs the same buffers, metadata and forward without capturing: how the CPU
tests exercise this path (a CPU has no graphs), and what ``--enforce-eager`` would be if it
kept the static path (it does not: it turns the whole path off).
"""

from __future__ import annotations

import logging
import time

import torch

from tinyserve.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def buckets_for(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes captured: up to the first bucket holding ``max_num_seqs`` rows."""
    out = []
    for b in BUCKETS:
        out.append(b)
        if b >= max_num_seqs:
            break
    return tuple(out)


class DecodeGraphs:
    def __init__(
        self,
        model,
        kv_caches: list,
        block_size: int,
        scratch_block: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        capture: bool,
        num_groups: int = 1,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.capture_graphs = capture
        self.buckets = buckets_for(max_num_seqs)
        self.max_rows = self.buckets[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.scratch_slot = scratch_block * block_size
        self.backend = model.attention_method.decode_backend or "masked"
        b, dev = self.max_rows, device
        self.ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int64, device=dev)
        self.slots = torch.full((b,), self.scratch_slot, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=dev)
        self.tables = torch.full((b, self.max_blocks), scratch_block, dtype=torch.int32,
                                 device=dev)  # fmt: skip
        self.metas = {
            n: AttentionMetadata.static_decode(
                self.slots[:n], self.seq_lens[:n], self.tables[:n], block_size, self.backend
            )
            for n in self.buckets
        }
        # A hybrid model's other layer groups: their own slots and tables (the scratch block
        # is a page of the shared pool, utils/kv_groups.py).
        self.groups = [(self.slots.clone(), self.tables.clone()) for _ in range(num_groups - 1)]
        for n, meta in self.metas.items():
            if self.groups:
                meta.group_metas = [
                    AttentionMetadata.static_decode(slots[:n], self.seq_lens[:n], tables[:n],
                                                    block_size, self.backend)  # fmt: skip
                    for slots, tables in self.groups
                ]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.num_replays = 0  # steps this path ran (replayed or, capture off, eager)

    def fits(self, query_lens: list[int], num_decode_seqs: int, block_tables: list) -> bool:
        """A pure-decode step this path can take: one generated token per sequence, within
        the largest bucket, every block table within max_model_len."""
        n = len(query_lens)
        return (
            0 < n <= self.max_rows
            and num_decode_seqs == n
            and all(q == 1 for q in query_lens)
            and all(len(t) <= self.max_blocks for t in block_tables)
        )

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def host_inputs(self, step) -> list[torch.Tensor]:
        """The step's inputs padded to its bucket, on the host (staged by the caller). The
        block tables are as wide as this step's longest context needs: the static table's
        columns past that are never read for these lengths (they hold valid, older ids)."""
        n = len(step.input_ids)
        pad = self.bucket(n) - n
        inputs = [
            torch.tensor(step.input_ids + [0] * pad, dtype=torch.int64),
            torch.tensor(step.positions + [0] * pad, dtype=torch.int64),
            *self._slots_and_tables(step.block_tables, step.seq_lens, self.scratch_slot, pad),
            torch.tensor(step.seq_lens + [1] * pad, dtype=torch.int32),
        ]
        for tables in step.group_block_tables or ():
            inputs += self._slots_and_tables(tables, step.seq_lens, self.scratch_slot, pad)
        return inputs

    def _slots_and_tables(self, block_tables, seq_lens, scratch_slot: int, pad: int) -> list:
        """Each row's new slot and its block table as wide as the step's longest context,
        padded with the scratch block's."""
        bs = self.block_size
        scratch = scratch_slot // bs
        width = max(-(-sl // bs) for sl in seq_lens)
        tables = [t[:width] + [scratch] * (width - len(t[:width])) for t in block_tables]
        slots = [t[(sl - 1) // bs] * bs + (sl - 1) % bs
                 for t, sl in zip(block_tables, seq_lens, strict=True)]  # fmt: skip
        return [
            torch.tensor(slots + [scratch_slot] * pad, dtype=torch.int64),
            torch.tensor(tables + [[scratch] * width] * pad, dtype=torch.int32),
        ]

    def run(self, n: int, staged: list[torch.Tensor]) -> torch.Tensor:
        """The forward of ``n`` decode rows from ``staged`` (host_inputs on the device):
        hidden states [n, hidden]."""
        ids, pos, slots, tables, seq_lens, *groups = staged
        b = ids.shape[0]
        self.ids[:b].copy_(ids)
        self.positions[:b].copy_(pos)
        self.slots[:b].copy_(slots)
        self.seq_lens[:b].copy_(seq_lens)
        self.tables[:b, : tables.shape[1]].copy_(tables)
        for (g_slots, g_tables), new_slots, new_tables in zip(
            self.groups, groups[::2], groups[1::2], strict=True
        ):
            g_slots[:b].copy_(new_slots)
            g_tables[:b, : new_tables.shape[1]].copy_(new_tables)
        self.num_replays += 1
        if b in self.graphs:
            graph, out = self.graphs[b]
            graph.replay()
            return out[:n]
        return self._forward(b)[:n]

    def _forward(self, b: int) -> torch.Tensor:
        return self.model(self.ids[:b], self.positions[:b], self.kv_caches, self.metas[b])

    def capture(self) -> None:
        """Capture one graph per bucket (largest first, sharing one memory pool), after a
        warm-up run of each that compiles the Triton kernel and initialises the libraries.
        The buffers hold padding rows throughout: only the scratch block is written."""
        if not self.capture_graphs:
            return
        t0 = time.monotonic()
        torch.cuda.synchronize(self.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode():
            with torch.cuda.stream(stream):  # warm-up off the default stream, as torch advises
                for b in reversed(self.buckets):
                    self._forward(b)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            for b in reversed(self.buckets):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(b)
                self.graphs[b] = (graph, out)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.monotonic() - t0
        logger.info(
            "CUDA graphs: captured decode at batch sizes %s in %.1f s (attention: %s)",
            ",".join(map(str, self.buckets)), self.capture_seconds, self.backend,
        )  # fmt: skip
