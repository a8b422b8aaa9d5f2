"""Peak extra memory of full-vocabulary KL, one variant per fresh process (run by `benchmarks/bench.py`):

    python benchmarks/bench_kl_memory.py --variant chunked --positions 64 --vocab 49152

One forward + backward of full-vocabulary KL over `positions x vocab` logits: `chunked` is
`klppo.kl.full_kl(..., chunk_size)`, `dense` is the same function with one chunk holding every position, `naive` is
the textbook dense formula `(softmax(p) * (log_softmax(p) - log_softmax(q))).sum(-1)` as old TRL wrote it. Each
variant runs in its own process so that peak RSS (`ru_maxrss`) belongs to it alone; the process imports torch and
`klppo.kl` only. Prints one JSON object (also written to `--out`).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench_workload import emit, resolve_device  # this script's folder is on sys.path


def status_mb(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS, VmHWM) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def reset_peak_rss() -> float | None:
    """Reset the kernel's peak-RSS mark to the current RSS and return it (None where unsupported).

    Linux resets VmHWM when "5" is written to /proc/self/clear_refs. With glibc's mmap threshold
    pinned low (`MALLOC_MMAP_THRESHOLD_`, set by `bench.py`), freed tensors go back to the kernel at
    once, so VmHWM follows the live tensors and its growth is the peak extra memory.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return status_mb("VmRSS")
    except OSError:
        return None


def kl_memory(args) -> dict:
    """Peak extra memory of full-vocabulary KL, forward + backward, for one variant."""
    import torch.nn.functional as F

    from klppo.kl import full_kl

    device = torch.device(resolve_device(args))

    def run(positions: int):
        torch.manual_seed(0)
        logits = torch.randn(positions, args.vocab, device=device, requires_grad=True)
        ref_logits = torch.randn(positions, args.vocab, device=device)
        if args.variant == "naive":
            logp, logq = F.log_softmax(logits, -1), F.log_softmax(ref_logits, -1)
            kl = (logp.exp() * (logp - logq)).sum(-1)
        else:
            kl = full_kl(logits, ref_logits, chunk_size=args.chunk_size if args.variant == "chunked" else positions)
        kl.sum().backward()
        return logits, ref_logits, kl.detach()

    run(2)  # first calls set up thread pools and caches: keep them out of the measurement
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss_base = reset_peak_rss()
    start = time.perf_counter()
    logits, _, kl = run(args.positions)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    input_mb = 2 * logits.numel() * logits.element_size() / 2**20
    peak_rss = status_mb("VmHWM") if rss_base is not None else None

    result = {
        "variant": args.variant,
        "positions": args.positions,
        "vocab": args.vocab,
        "chunk_size": args.chunk_size if args.variant == "chunked" else args.positions,
        "device": device.type,
        "inputs_mb": input_mb,
        "grad_mb": input_mb / 2,
        # the inputs are allocated inside the measured window: count what comes on top of them
        "peak_extra_rss_mb": peak_rss - rss_base - input_mb if peak_rss is not None else None,
        "seconds": seconds,
        "kl_mean": float(kl.mean()),
    }
    if device.type == "cuda":
        result["peak_extra_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20 - input_mb
    return result


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=["chunked", "dense", "naive"], required=True)
    parser.add_argument("--positions", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--chunk-size", type=int, default=4)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    emit(kl_memory(args), args.out)


if __name__ == "__main__":
    main()
