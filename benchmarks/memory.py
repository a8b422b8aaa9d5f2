"""Peak memory of one PPO update against the response length, klppo beside TRL 1.12's PPO trainer (the peer).

    python benchmarks/memory.py --model smollm2 --lengths 128 256 512 1024            # results/memory/smollm2.*
    python benchmarks/memory.py --model-shape 135m-v152k --lengths 128 256 512       # a 152k vocabulary
    python benchmarks/memory.py --model tiny --lengths 16 32 --no-peer               # a smoke run

At each response length, one fresh process per side runs one PPO update of `bench.py`'s workload b (a LoRA policy
whose reference is the adapter-disabled policy; klppo with a shared critic and the sentiment reward, the peer with
its separate value and reward models) on `--sequences` sequences in `--num-mini-batches` mini-batches (of
`sequences / num_mini_batches` rows, one micro-batch each), one PPO epoch,
no stop token (every response has exactly that length), the sides alternating first. Its figure is the process's
peak memory: RSS on the CPU (`ru_maxrss`), `torch.cuda.max_memory_allocated()` on a GPU. A side that fails (the
kernel's out-of-memory killer, or an allocation error) is recorded as failed at that length, with its exit status,
and the curve goes on. The report gives each side's peak, the ratio, the slope in MB per response token between
successive lengths, and a plot (`.png`).

`--model` / `--model-shape` / `--device` / `--dtype` / `--assets` / `--peer-python` / `--peer-pythonpath` mean what
they mean in `bench.py` (whose machinery runs each side); the shape `135m-v152k` is SmolLM2-135M's shape with a
vocabulary of 151,936 tokens (Qwen 2.5's), random weights, SmolLM2's tokenizer.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402  (this script's folder)
import bench_assets  # noqa: E402
import bench_report  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", choices=list(bench_assets.MODEL_NAMES), default=None)
    model.add_argument("--model-shape", choices=list(bench_assets.SHAPES), default=None)
    parser.add_argument("--assets", default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    parser.add_argument("--sequences", type=int, default=16, help="sequences per update (fixed along the curve)")
    parser.add_argument("--num-mini-batches", type=int, default=4, help="micro-batches of sequences / this many")
    parser.add_argument("--peer-python", default=None)
    parser.add_argument("--peer-pythonpath", default=None)
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: torch's)")
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=1 << 20,
        help="glibc's MALLOC_MMAP_THRESHOLD_ in bytes for both sides' processes, as the klppo command sets it on a "
        "CPU (0: glibc's own, sliding threshold)",
    )
    parser.add_argument("--out", default=str(bench.REPO_ROOT / "results" / "memory"))
    parser.add_argument("--name", default=None, help="the report's file stem (default: the model's label)")
    args = parser.parse_args(argv)
    if args.model is None and args.model_shape is None:
        args.model = "smollm2"
    if args.sequences % args.num_mini_batches:
        parser.error("--sequences must be a multiple of --num-mini-batches")
    args.batch_size = args.sequences // args.num_mini_batches  # bench.py's per-mini-batch prompts
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def side_cmd(side: str, args, model_path: str, prompts: Path, length: int) -> list[str]:
    point = argparse.Namespace(
        **{**vars(args), "response_length": length, "warmup": 0, "updates": 1, "klppo_config": None}
    )
    cmd = bench.train_cmd(side, point, "b", model_path, prompts)
    return [*cmd, "--num-mini-batches", str(args.num_mini_batches), "--num-ppo-epochs", "1"]


def malloc_env(args) -> dict:
    """The allocator setting both sides run under: the same for both, so the figures compare the trainers."""
    return {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)} if args.mmap_threshold else {}


def peak_mb(run: dict) -> float:
    """A run's peak: GPU memory allocated where measured, else RSS."""
    return run["cuda_peak_allocated_mb"] if run.get("cuda_peak_allocated_mb") is not None else run["peak_rss_mb"]


def measure(args) -> dict:
    bench.THREADS["n"] = args.threads
    bench.DEVICE["name"] = args.device
    sides = ["klppo"] if args.no_peer else ["klppo", "peer"]
    if "peer" in sides:
        bench.PEER["env"] = bench.peer_env(args)
    model_path = bench.resolve_model_path(args)
    workdir = Path(tempfile.mkdtemp(prefix="klppo-memory-"))
    prompts = bench_assets.write_prompts(workdir / "prompts.json", args.sequences)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / (args.name or bench.model_label(args))
    report = {
        "model": bench.model_label(args),
        "command": "python benchmarks/memory.py " + shlex.join(sys.argv[1:]),
        "klppo_revision": bench.git_revision(),
        "device": args.device,
        "dtype": args.dtype,
        "sequences": args.sequences,
        "malloc_mmap_threshold": args.mmap_threshold or "glibc default",
        "num_mini_batches": args.num_mini_batches,
        "sides": sides,
        "points": [],
    }
    for i, length in enumerate(args.lengths):
        point = {"response_length": length}
        for side in sides if i % 2 == 0 else sides[::-1]:
            print(f"[memory] R={length}: {side}", flush=True)
            log = workdir / f"{side}-{length}.log"
            start = time.perf_counter()
            try:
                env = {**(bench.side_env(side) or {}), **malloc_env(args)}
                run = bench.run_json(side_cmd(side, args, model_path, prompts, length), log, env=env)
                point[side] = {
                    "peak_mb": peak_mb(run),
                    "peak_rss_mb": run["peak_rss_mb"],
                    "cuda_peak_allocated_mb": run.get("cuda_peak_allocated_mb"),
                    "seconds": time.perf_counter() - start,
                }
            except RuntimeError as err:
                point[side] = {"failed": str(err).splitlines()[0][-300:], "seconds": time.perf_counter() - start}
            print(f"[memory]   {point[side]}", flush=True)
        report["points"].append(point)
        report["machine"] = bench.machine()
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")  # what is done so far
    stem.with_suffix(".md").write_text(markdown(report))
    plot(report, stem.with_suffix(".png"))
    print(stem.with_suffix(".md").read_text())
    return report


def slopes(points: list[dict], side: str) -> list[float | None]:
    """MB per response token between each length and the one before (None where either failed)."""
    out = [None]
    for a, b in zip(points, points[1:]):
        pa, pb = a.get(side, {}), b.get(side, {})
        ok = "peak_mb" in pa and "peak_mb" in pb
        out.append((pb["peak_mb"] - pa["peak_mb"]) / (b["response_length"] - a["response_length"]) if ok else None)
    return out


def markdown(report: dict) -> str:
    sides = report["sides"]
    unit = "GPU peak allocated" if report["device"] == "cuda" else "peak RSS"
    lines = [
        f"# One PPO update's {unit} against the response length ({report['model']}, {report['dtype']})",
        "",
        f"Command: `{report['command']}` (klppo at `{report['klppo_revision']}`). Machine: "
        f"{report.get('machine', {}).get('cpu_count')} CPUs, torch {report.get('machine', {}).get('torch')}.",
        "",
        f"{report['sequences']} sequences per update in {report['num_mini_batches']} mini-batches, one PPO epoch, workload b "
        "of `benchmarks/bench.py`, one fresh process per side and length, both under glibc's mmap threshold "
        f"{report.get('malloc_mmap_threshold', 'glibc default')}.",
        "",
        "| R | "
        + " | ".join(f"{bench_report.SIDE_NAMES[s]} (MB) | MB per token" for s in sides)
        + (" | klppo / peer |" if "peer" in sides else " |"),
        "| ---: | " + " | ".join("---: | ---:" for _ in sides) + (" | ---: |" if "peer" in sides else " |"),
    ]
    per_side = {s: slopes(report["points"], s) for s in sides}
    for i, p in enumerate(report["points"]):
        cells = []
        for s in sides:
            r = p.get(s, {})
            cells.append(f"{r['peak_mb']:.0f}" if "peak_mb" in r else f"failed ({r.get('failed', '?')[:60]})")
            cells.append("" if per_side[s][i] is None else f"{per_side[s][i]:.2f}")
        row = f"| {p['response_length']} | " + " | ".join(cells)
        if "peer" in sides:
            k, q = p.get("klppo", {}), p.get("peer", {})
            row += f" | {k['peak_mb'] / q['peak_mb']:.2f}" if "peak_mb" in k and "peak_mb" in q else " | "
        lines.append(row + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for side in report["sides"]:
        xs = [p["response_length"] for p in report["points"] if "peak_mb" in p.get(side, {})]
        ys = [p[side]["peak_mb"] / 1024 for p in report["points"] if "peak_mb" in p.get(side, {})]
        ax.plot(xs, ys, marker="o", label=bench_report.SIDE_NAMES[side])
        failed = [p["response_length"] for p in report["points"] if "failed" in p.get(side, {})]
        if failed:
            ax.scatter(failed, [max(ys or [0])] * len(failed), marker="x", color="red", label=f"{side} failed")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("GiB (GPU allocated)" if report["device"] == "cuda" else "GiB (peak RSS)")
    ax.set_title(f"One PPO update, {report['sequences']} sequences: {report['model']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    measure(parse_args())
