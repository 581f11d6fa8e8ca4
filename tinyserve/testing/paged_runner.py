"""A minimal driver for our model through the paged KV cache, for parity tests.

It plays the part of the scheduler and model runner (which these tests must not depend on):
each sequence gets blocks from a shuffled pool, so block tables are non-contiguous, and a
step is one flat forward over any mix of prefill chunks and decode rows.
"""

from __future__ import annotations

import random

import torch

from tinyserve.testing.checkpoints import random_tokens
from tinyserve.worker.kv_cache import allocate_kv_cache


class PagedRunner:
    def __init__(
        self, model, block_size: int, num_blocks: int = 256, seed: int = 0, kv_dtype=None
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = model.model.embed_tokens.weight.device  # the model's device
        self.kv_caches = allocate_kv_cache(  # kv_dtype: the cache's (default the model's)
            model.config, num_blocks, block_size, kv_dtype or model.dtype, self.device,
            model.tp.size,
        )  # fmt: skip
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def step(
        self, chunks: list[tuple[str, list[int]]], decode: set[str] | frozenset = frozenset()
    ) -> list[torch.Tensor]:
        """``chunks``: (sequence id, its new token ids) in batch order; ``decode``: the
        sequences whose new tokens are generated ones (the model runner puts them first in
        the flat batch, as here, and the linear layers may give them their own kernel).
        Returns, per chunk, the float32 logits of every new token: [len(new tokens), vocab],
        on the CPU whatever the model's device."""
        order = sorted(range(len(chunks)), key=lambda i: chunks[i][0] not in decode)
        num_decode = sum(1 for seq, _ in chunks if seq in decode)
        input_ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        for seq, new in (chunks[i] for i in order):
            start = self.num_computed.get(seq, 0)
            end = start + len(new)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            input_ids += new
            positions += range(start, end)
            query_lens.append(len(new))
            seq_lens.append(end)
            tables.append(list(table))
            self.num_computed[seq] = end
        meta = self.model.attention_method.metadata(
            query_lens, seq_lens, tables, self.block_size, self.device, self.model.dtype,
            num_decode, self.model.config.sliding_window,
        )  # fmt: skip
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            self.kv_caches,
            meta,
        )
        logits = self.model.compute_logits(hidden, meta.num_decode_tokens).cpu()
        rows = logits.split(query_lens)
        out: list[torch.Tensor] = [torch.empty(0)] * len(chunks)
        for pos, i in enumerate(order):
            out[i] = rows[pos]
        return out

    def share_prefix(self, seq: str, from_seq: str, num_tokens: int) -> None:
        """Start ``seq`` on ``from_seq``'s first ``num_tokens`` (whole blocks), already
        computed: what a prefix-cache hit gives the model runner."""
        assert num_tokens % self.block_size == 0
        self.tables[seq] = list(self.tables[from_seq][: num_tokens // self.block_size])
        self.num_computed[seq] = num_tokens

    def prefill_then_decode(
        self, tokens: list[int], prompt_len: int, seq: str = "s"
    ) -> torch.Tensor:
        """Teacher forcing: ``tokens[:prompt_len]`` in one chunk, then the rest one at a time.
        Returns logits for every position: [len(tokens), vocab]."""
        rows = [self.step([(seq, tokens[:prompt_len])])[0]]
        for t in tokens[prompt_len:]:
            rows.append(self.step([(seq, [t])], decode={seq})[0])
        return torch.cat(rows)


def greedy_generate(
    model, prompt: list[int], max_new_tokens: int, block_size: int, eos: set[int]
) -> list[int]:
    """Greedy decoding through the paged cache; stops after the first EOS (included)."""
    runner = PagedRunner(
        model, block_size, num_blocks=_cdiv(len(prompt) + max_new_tokens, block_size) + 4
    )
    logits = runner.step([("g", prompt)])[0][-1]
    out: list[int] = []
    while True:
        tok = int(logits.argmax())
        out.append(tok)
        if tok in eos or len(out) == max_new_tokens:
            return out
        logits = runner.step([("g", [tok])], decode={"g"})[0][-1]


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def mixed_steps(runner: PagedRunner, rng) -> list[torch.Tensor]:
    """Prefill chunks, a continued chunk and decode rows, in varied batch orders: every
    token's logits (the kernel tests compare two models or caches through them)."""
    seqs = {s: [rng.randrange(3, 250) for _ in range(40)] for s in "abc"}
    out = [runner.step([("a", seqs["a"][:9]), ("b", seqs["b"][:3])])]
    out.append(runner.step([("b", seqs["b"][3:4]), ("a", seqs["a"][9:10]), ("c", seqs["c"][:17])],
                           decode={"a"}))  # fmt: skip
    for i in range(3):
        chunk = [("c", seqs["c"][17 + i : 18 + i]), ("a", seqs["a"][10 + i : 11 + i]),
                 ("b", seqs["b"][4 + i : 5 + i])]  # fmt: skip
        out.append(runner.step(chunk, decode={"a", "b", "c"} if i else {"a", "b"}))
    return [t for step in out for t in step]


def batched_and_alone(model, block_size: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Two sequences' chunks (prefill, one token, a continued chunk) stepped alone, then
    together in varied batch orders: (label, batched logits, alone logits) per chunk, for the
    batch-invariance tests (equal bitwise)."""
    a, b = random_tokens(13, 1), random_tokens(9, 2)
    plan = {"a": [a[:8], a[8:9], a[9:13]], "b": [b[:3], b[3:8], b[8:9]]}
    alone = {}
    for seq, chunks in plan.items():
        runner = PagedRunner(model, block_size, num_blocks=32, seed=ord(seq))
        alone[seq] = [runner.step([(seq, c)])[0] for c in chunks]
    runner = PagedRunner(model, block_size, num_blocks=64, seed=5)
    out = []
    for step, order in enumerate([["a", "b"], ["b", "a"], ["a", "b"]]):
        got = runner.step([(s, plan[s][step]) for s in order])
        out += [
            (f"seq {s} step {step}", g, alone[s][step]) for s, g in zip(order, got, strict=True)
        ]
    return out


def random_paged_case(num_heads, num_kv_heads, head_dim, block_size, query_lens, seq_lens, seed):
    """Random float32 K/V caches, shuffled block tables for ``seq_lens`` and queries for
    ``query_lens``: (q, k_cache, v_cache, tables), for the attention kernel tests."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
    # q as the model passes it: the first heads of a fused [tokens, q + k heads, dim] tensor.
    qk = torch.randn(sum(query_lens), num_heads + num_kv_heads, head_dim, generator=gen)
    return qk[:, :num_heads], k_cache, v_cache, tables
