"""How much memory the KV cache gets, and the start-up forward that measures it.

On a CPU (and MPS) the KV cache takes a fixed budget (``--kv-cache-memory``, default 1 GiB):
there is no device memory to share, and the host's RAM is the operating system's to manage.
On CUDA it takes what ``--gpu-memory-utilization`` (default 0.9, vLLM's) of the card leaves
once the weights and the largest step's activations are in: a profiling run (one prefill
chunk of ``max_num_batched_tokens`` tokens, then the logits and the sampler over
``max_num_seqs`` rows) measures the peak that torch allocated, and

    budget = utilization * total - peak - (memory other processes and non-torch
             allocations hold: total - free - reserved by torch)

vLLM's formula (its ``determine_available_memory``). The same run is the warm-up: cuBLAS
handles, kernel selection and the sampler's first launches happen before the first request,
not in it. On a CPU it does not run: the kernels' OpenMP team must start in the engine thread
(docs/architecture.md, "One OpenMP team per thread"), and CPU libraries need no warming.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 1 << 30  # CPU / MPS, when --kv-cache-memory is not given


def kv_budget_bytes(
    total: int, free: int, reserved: int, peak: int, utilization: float, scratch: int = 0
) -> int:
    """The KV cache's bytes: ``utilization`` of the card's ``total``, less the profiled
    ``peak`` torch allocation (weights + the largest step's activations, without the
    profiling run's own ``scratch`` KV blocks, which are freed) and less what others hold
    (``total - free - reserved``: other processes, the CUDA context, non-torch allocations).
    ValueError when nothing is left."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    others = max(0, total - free - reserved)
    budget = int(utilization * total) - (peak - scratch) - others
    if budget <= 0:
        gib = 2**30
        raise ValueError(
            f"no GPU memory left for the KV cache: {utilization:.2f} x {total / gib:.1f} GiB "
            f"minus the model and its largest step ({(peak - scratch) / gib:.2f} GiB) minus "
            f"other users ({others / gib:.2f} GiB): raise --gpu-memory-utilization, lower "
            "--max-num-batched-tokens / --max-num-seqs, or give --kv-cache-memory"
        )
    return budget


def profile_run(model, block_size: int, num_tokens: int, num_seqs: int, device) -> int:
    """The largest step the scheduler can make, once, on a scratch KV cache: a prefill chunk
    of ``num_tokens`` tokens, then the LM head and the sampler over ``num_seqs`` rows (greedy
    and random rows both). Returns the scratch cache's bytes (freed on return)."""
    from tinyserve.sampling_params import SamplingParams
    from tinyserve.worker.model_runner import ModelRunner, StepInput
    from tinyserve.worker.sampler import SamplingMetadata, SamplingRow

    blocks = -(-num_tokens // block_size)
    runner = ModelRunner(model, blocks, block_size, torch.device(device))
    scratch = sum(k.numel() * k.element_size() * 2 for k, _ in runner.kv_caches)
    with torch.inference_mode():
        step = StepInput([0] * num_tokens, list(range(num_tokens)), [num_tokens],
                         [num_tokens], [list(range(blocks))])  # fmt: skip
        hidden = runner.forward(step)
        rows = min(num_seqs, num_tokens)
        logits = model.compute_logits(hidden[:rows])
        params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.9)]
        meta = SamplingMetadata.build(
            [SamplingRow(params[i % 2], [0], []) for i in range(rows)],
            logits.shape[-1],
            runner.device,
        )
        runner.sampler(logits, meta).sampled_token_ids.cpu()
    del runner, hidden, logits
    return scratch


def cuda_kv_budget(model, device, block_size: int, num_tokens: int, num_seqs: int,
                   utilization: float) -> int:  # fmt: skip
    """The KV budget on a CUDA device, measured by :func:`profile_run` (also the warm-up)."""
    cuda = torch.cuda
    cuda.synchronize(device)
    cuda.empty_cache()
    cuda.reset_peak_memory_stats(device)
    scratch = profile_run(model, block_size, num_tokens, num_seqs, device)
    cuda.synchronize(device)
    peak = cuda.max_memory_allocated(device)
    cuda.empty_cache()
    free, total = cuda.mem_get_info(device)
    budget = kv_budget_bytes(total, free, cuda.memory_reserved(device), peak, utilization, scratch)
    logger.info(
        "GPU memory: %.1f GiB total, peak %.2f GiB for the model and a %d-token step, "
        "KV cache gets %.2f GiB (--gpu-memory-utilization %.2f)",
        total / 2**30, (peak - scratch) / 2**30, num_tokens, budget / 2**30, utilization,
    )  # fmt: skip
    return budget
