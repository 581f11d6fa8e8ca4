"""The only place that builds tensors from requests: SchedulerOutput -> flat batch ->
one forward -> sample -> one device->host copy -> ModelRunnerOutput.

Under tensor parallel the runner on rank 0 (the driver) broadcasts each step's flat batch
(a StepInput: plain lists) to the other ranks before its forward; they run the same forward
on their shards (the all-reduces inside pair them up) and discard the result. Only the
driver computes logits and samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyserve.kernels import gemm, ops
from tinyserve.models.llama import LlamaForCausalLM
from tinyserve.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprob
from tinyserve.utils.kv_groups import kv_groups
from tinyserve.worker.contention import ThreadGovernor
from tinyserve.worker.kv_cache import allocate_kv_cache
from tinyserve.worker.sampler import Sampler, SamplingMetadata, SamplingRow
from tinyserve.worker.staging import HostToDevice

_HOST = torch.device("cpu")  # where the step's inputs are built, before the one copy


@dataclass
class StepInput:
    """One step's flat batch, as plain lists (what the driver sends the other ranks)."""

    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    num_decode_seqs: int = 0  # the first sequences, whose new tokens were generated
    # A hybrid model's other layer groups' tables, [group - 1][sequence]
    # (ScheduledRequest.group_block_ids), or None.
    group_block_tables: list[list[list[int]]] | None = None


class ModelRunner:
    """Owns the model and the KV-cache tensors (seeded sampling keeps no state: its noise is
    a function of the seed and the position, worker/sampler.py)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        decode_graphs: str = "off",
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """``decode_graphs``: "capture" (CUDA graphs for pure-decode steps), "eager" (the
        same fixed-buffer path run without capturing: the CPU tests), or "off". ``kv_dtype``:
        the cache's (default the model's; worker/kv_cache.py resolve_kv_cache_dtype)."""
        if decode_graphs not in ("off", "eager", "capture"):
            raise ValueError(f"decode_graphs must be off, eager or capture, not {decode_graphs!r}")
        self.model = model
        self.config = model.config
        self.tp = model.tp
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        graphs = decode_graphs != "off" and self.tp.size == 1  # (graphs hold no collectives)
        # The fixed-buffer decode path's padding rows write a scratch block past the real ones.
        # A hybrid model's layer groups share pages of groups.size layers (utils/kv_groups.py).
        self.kv_groups = kv_groups(self.config)
        self.kv_caches = allocate_kv_cache(self.config, num_blocks + int(graphs), block_size,
                                           kv_dtype or model.dtype, device,
                                           tp_size=self.tp.size,
                                           groups=self.kv_groups)  # fmt: skip
        self.sampler = Sampler()
        self.to_device = HostToDevice(device)
        # Fewer kernel threads while other processes take our cores (worker/contention.py).
        self.governor = ThreadGovernor() if device.type == "cpu" and self.tp.size == 1 else None
        self.decode_graphs = None
        if graphs:
            from tinyserve.worker.decode_graphs import DecodeGraphs

            self.decode_graphs = DecodeGraphs(
                model, self.kv_caches, block_size, num_blocks, max_num_seqs,
                max_model_len or self.config.max_position_embeddings, device,
                capture=decode_graphs == "capture",
                num_groups=1 if self.kv_groups is None else self.kv_groups.num_groups,
            )  # fmt: skip

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if not sched.scheduled:
            return ModelRunnerOutput()
        if self.governor is not None:
            self.governor.tick()
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        group_tables: list[list[list[int]]] = []  # a hybrid model's other layer groups'
        logits_indices: list[int] = []
        sampling: list = []  # the requests that sample, in logits-row order
        scoring: list[PromptRows] = []  # prompt rows whose logprobs were asked for
        # Decode rows first (a stable sort): the linear layers give generated tokens their
        # own kernel path (layers/linear.py), chosen by the token, never by the batch.
        flagged = sorted(((not _decodes(it), it) for it in sched.scheduled), key=lambda p: p[0])
        num_decode_seqs = sum(1 for prompt, _ in flagged if not prompt)
        decode_rows = 0  # logits rows of decoding sequences (the first ones)
        for prompt, item in flagged:
            req, spec = item.request, item.spec_token_ids
            start = req.num_computed_tokens
            end = start + item.num_new_tokens
            if prompt and req.needs_prompt_logprobs:
                scoring.extend(PromptRows.of(req, len(input_ids), start, end))
            input_ids.extend(req.all_token_ids[start : end - len(spec)])
            input_ids.extend(spec)  # drafts after the last token: verified by this forward
            positions.extend(range(start, end))
            query_lens.append(item.num_new_tokens)
            seq_lens.append(end)
            block_tables.append(item.block_ids)
            for g, table in enumerate(item.group_block_ids or ()):
                if g == len(group_tables):
                    group_tables.append([])
                group_tables[g].append(table)
            if item.samples:
                n = 1 + len(spec)  # one logits row per draft, and one after the last
                logits_indices.extend(range(len(input_ids) - n, len(input_ids)))
                sampling.append((req, spec))
                decode_rows += 0 if prompt else n
        step = StepInput(input_ids, positions, query_lens, seq_lens, block_tables, num_decode_seqs,
                         group_tables or None)  # fmt: skip
        if not sampling:
            hidden = self.forward(step)
            return ModelRunnerOutput(prompt_logprobs=self._prompt_logprobs(hidden, scoring))
        # The sampler's inputs are built before the forward, so that one copy takes every
        # host-built tensor of the step to the device (worker/staging.py).
        rows = [row for req, spec in sampling for row in self._rows(sched, req, spec)]
        smeta = SamplingMetadata.build(rows, self.config.vocab_size, _HOST)
        idx = torch.tensor(logits_indices, dtype=torch.int64)
        hidden, (idx, smeta) = self._forward(step, [idx, smeta])  # [num_tokens, hidden]
        logits = self.model.compute_logits(hidden[idx], decode_rows)  # [num_rows, vocab]
        out = self.sampler(logits, smeta)
        result = self._to_host(sampling, out)
        result.prompt_logprobs = self._prompt_logprobs(hidden, scoring)
        return result

    def _prompt_logprobs(self, hidden: torch.Tensor, scoring: list[PromptRows]) -> dict:
        """Each scored prompt row's next prompt token: its logprob under the model (log-softmax
        of the float32 logits, no sampling stage), rank and top-k. Where the head is gemm.c's
        (``score_head``), all of a request's rows in one call that never writes the logits
        (kernels/gemm_score.h); else prompt_logprob_rows rows of logits at a time, then on a
        CPU ops.c's two passes a row (kernels.ops.logprob_rows), elsewhere torch."""
        result: dict[str, list[TokenLogprob]] = {}
        head = self.model.score_head() if scoring else None
        for rows in scoring:
            fused = head is not None and rows.k <= gemm.SCORE_MAX_K
            chunk = len(rows.targets) if fused else prompt_logprob_rows(self.config.vocab_size)
            for s in range(0, len(rows.targets), chunk):
                first = rows.first_row + s
                targets = rows.targets[s : s + chunk]
                h = hidden[first : first + len(targets)]
                want = torch.tensor(targets, dtype=torch.int64)
                if fused:
                    stats = gemm.score_rows(h, head.kernel, want, rows.k, head.bf16)
                else:
                    stats = _row_logprobs(self.model.compute_logits(h), want, rows.k)
                lp, rank, top_id, top_lp = stats
                parts = [want[:, None], lp[:, None], rank[:, None], top_id, top_lp]
                host = torch.cat([p.to(_HOST, torch.float64) for p in parts], dim=1).tolist()
                result.setdefault(rows.request_id, []).extend(
                    TokenLogprob(int(r[0]), r[1], _pairs(r[3 : 3 + rows.k], r[3 + rows.k :]), int(r[2]))
                    for r in host
                )  # fmt: skip
        return result

    def _rows(self, sched: SchedulerOutput, req, spec: list[int]) -> list[SamplingRow]:
        """A request's sampling rows: one, or with drafts one per position, each with the
        history plain decoding would have there (penalties, min_tokens and the seeded noise
        see the drafts before it)."""
        return [
            SamplingRow(
                params=req.sampling_params,
                prompt_token_ids=req.prompt_token_ids,
                output_token_ids=req.output_token_ids + spec[:j] if j else req.output_token_ids,
                eos_token_ids=req.eos_token_ids,
                grammar_bitmask=_grammar_row(sched, req.request_id, j),
            )
            for j in range(1 + len(spec))
        ]

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        """The model over one flat batch -> hidden states [num_tokens, hidden]. On the driver
        under tensor parallel, first hands the batch to the other ranks."""
        return self._forward(step, [])[0]

    def _forward(self, step: StepInput, extra: list) -> tuple[torch.Tensor, list]:
        """``forward``, taking ``extra`` (host tensors, or dataclasses of them) to the device
        in the same copy as the step's own inputs; returns them there."""
        if self.tp.size > 1 and self.tp.is_driver:
            self.tp.broadcast(step)
        graphs = self.decode_graphs
        if graphs is not None and graphs.fits(step.query_lens, step.num_decode_seqs,
                                              step.block_tables):  # fmt: skip
            inputs = graphs.host_inputs(step)
            staged = self.to_device([*inputs, *extra])
            return graphs.run(len(step.input_ids), staged[: len(inputs)]), staged[len(inputs) :]
        meta = self.model.attention_method.metadata(
            step.query_lens, step.seq_lens, step.block_tables, self.block_size, _HOST,
            self.model.dtype, step.num_decode_seqs, self.model.config.sliding_window,
            step.group_block_tables,
        )  # fmt: skip
        ids = torch.tensor(step.input_ids, dtype=torch.int64)
        pos = torch.tensor(step.positions, dtype=torch.int64)
        # One transfer for the whole step (on a CPU the objects come back as they are).
        ids, pos, meta, *extra = self.to_device([ids, pos, meta, *extra])
        return self.model(ids, pos, self.kv_caches, meta), extra

    def serve_driver(self) -> None:
        """Ranks > 0: run every step the driver broadcasts, until it sends None."""
        while (step := self.tp.broadcast()) is not None:
            self.forward(step)

    @staticmethod
    def _to_host(sampling: list, out) -> ModelRunnerOutput:
        """The one device->host copy per step (plus the logprob tensors when asked for).

        Verification: row j of a request with drafts sampled ``y_j`` from exactly the
        distribution plain decoding would use after ``drafts[:j]``. The drafts are kept while
        ``y_j == drafts[j]``, and the first ``y_j`` that differs (or the bonus row's) is the
        next token. With a point-mass proposer this is the standard acceptance rule: draft x
        is accepted with probability p(x), and on rejection the token is drawn from p with x
        removed and renormalised. Greedy: kept while the draft is the argmax."""
        tokens, lps, top_ids, top_lps = _read_back(out)
        result = ModelRunnerOutput()
        row = 0
        for req, spec in sampling:
            ys = tokens[row : row + 1 + len(spec)]
            kept = 0
            while kept < len(spec) and ys[kept] == spec[kept]:
                kept += 1
            result.sampled_token_ids[req.request_id] = ys[: kept + 1]
            k = req.sampling_params.logprobs
            if lps is not None and k is not None:
                result.logprobs[req.request_id] = [
                    TokenLogprob(ys[j], lps[row + j], list(zip(top_ids[row + j][:k],
                                 top_lps[row + j][:k], strict=True)))
                    for j in range(kept + 1)
                ]  # fmt: skip
            row += 1 + len(spec)
        return result


# Prompt logprobs: rows of logits computed at once, as many as fit this many bytes (SmolLM2's
# 49,152-token vocabulary: 85 rows). 256 rows' 48 MiB were mapped fresh for every chunk (past
# glibc's 32 MiB ceiling for reusing freed memory): the page faults cost the head's matmul 15%
# (benchmarks/README.md, "Scoring prompts").
PROMPT_LOGPROB_BYTES = 16 << 20


def prompt_logprob_rows(vocab_size: int) -> int:
    """Rows of prompt logits per chunk for this vocabulary (at least 16)."""
    return max(16, PROMPT_LOGPROB_BYTES // (4 * vocab_size))


@dataclass
class PromptRows:
    """One request's prompt rows scored this step: flat rows [first_row, first_row +
    len(targets)), row i's target the prompt token after its position."""

    request_id: str
    first_row: int
    targets: list[int]
    k: int

    @classmethod
    def of(cls, req, base: int, start: int, end: int) -> list[PromptRows]:
        """The rows of positions [start, end) (flat rows from ``base``) whose next token is
        a prompt token not yet scored: position p scores token p + 1."""
        lo = max(start, len(req.prompt_logprobs))
        hi = min(end, req.num_prompt_tokens - 1)
        if lo >= hi:
            return []
        targets = req.prompt_token_ids[lo + 1 : hi + 1]
        return [
            cls(req.request_id, base + lo - start, targets, req.sampling_params.prompt_logprobs)
        ]


def _row_logprobs(logits: torch.Tensor, want: torch.Tensor, k: int) -> tuple:
    """(logprob, rank, top ids, top logprobs) of each row's target: ops.c on a CPU with the
    kernels, torch elsewhere (the same values to float32 rounding)."""
    if logits.device.type == "cpu" and k <= ops.LOGPROB_MAX_K and ops.library() is not None:
        return ops.logprob_rows(logits, want, k)
    lp = torch.log_softmax(logits, -1)
    want = want.to(lp.device)[:, None]
    chosen = lp.gather(1, want)
    rank = (lp > chosen).sum(dim=1) + 1
    top_lp, top_id = lp.topk(k, dim=-1, sorted=True)
    return chosen[:, 0], rank, top_id, top_lp


def _pairs(ids: list[float], lps: list[float]) -> list[tuple[int, float]]:
    return [(int(t), v) for t, v in zip(ids, lps, strict=True)]


def _read_back(out) -> tuple[list[int], list | None, list | None, list | None]:
    """The step's one device->host transfer: the sampled ids, and the logprobs with them when
    asked for (one float64 matrix [B, 2 + 2k]: ids and top ids are exact in float64, and so
    are float32 logprobs), so that a GPU waits for the device once per step."""
    ids = out.sampled_token_ids
    if out.logprobs is None:
        return ids.tolist(), None, None, None
    k = out.top_token_ids.shape[1]
    parts = (ids[:, None], out.logprobs[:, None], out.top_token_ids, out.top_logprobs)
    rows = torch.cat([p.to(torch.float64) for p in parts], dim=1).tolist()
    tokens = [int(r[0]) for r in rows]
    lps = [r[1] for r in rows]
    top_ids = [[int(t) for t in r[2 : 2 + k]] for r in rows]
    return tokens, lps, top_ids, [r[2 + k :] for r in rows]


def _decodes(item) -> bool:
    """The scheduled item computes generated tokens only (its prompt is all computed)."""
    return item.request.num_computed_tokens >= item.request.num_prompt_tokens


def _grammar_row(sched: SchedulerOutput, request_id: str, pos: int) -> torch.Tensor | None:
    """The request's allowed-token bitmask row at verified position ``pos`` this step
    (constrained decoding; 0 without drafts), or None."""
    row = sched.grammar_rows.get(request_id)
    return None if row is None else sched.grammar_bitmask[row + pos]
