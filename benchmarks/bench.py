"""Side-by-side benchmark: klppo's `KLPPOTrainer` against TRL 1.12's PPO trainer (the peer).

    python benchmarks/bench.py --model tiny                        # both workloads, 3 alternating repeats
    python benchmarks/bench.py --model smollm2 --repeats 3 --warmup 1 --updates 3
    python benchmarks/bench.py --quick                             # tiny model, klppo only, 2 updates

TRL removed its PPO trainer in 1.13, so the peer runs in a virtual environment of its own
(`$KLPPO_BENCH_PEER_VENV`, default ~/.cache/klppo/bench-peer-venv), which this script creates on
first use: torch==2.13.0 first (an open pin pulls a CUDA build), then trl==1.12.0 and peft.

Every measurement is a fresh subprocess (`benchmarks/bench_klppo.py` in this environment,
`benchmarks/bench_peer.py` in the peer's), so peak RSS belongs to one run; klppo and peer runs
alternate (klppo first in even repeats, the peer first in odd ones) so that a slow spell of a shared
machine hits both sides. Matched settings: the same model folder, the same prompts (plain text),
`--batch-size` prompts per update, `--response-length` sampled tokens (no stop token, so both sides
generate exactly that many), 2 PPO epochs, 1 mini-batch, temperature 0.7, fp32, the same learning
rate and KL coefficient (k1 estimator, fixed coefficient, KL in the reward on both sides).

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
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--workloads", default="a,b", help="comma-separated: a, b")
    parser.add_argument("--updates", type=int, default=3, help="measured PPO updates per run")
    parser.add_argument("--warmup", type=int, default=1, help="PPO updates per run before measuring")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side and workload, alternating sides")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--response-length", type=int, default=24)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch/OpenMP threads per run (default 1: on a shared machine two OpenMP threads stall "
        "whenever one is descheduled, which makes timings swing tenfold)",
    )
    parser.add_argument("--peer", action="store_true", help="with --quick: run the peer too")
    parser.add_argument("--no-peer", action="store_true", help="run klppo only")
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 warm-up + 1 update, 1 repeat, no peer")
    parser.add_argument("--kl-positions", type=int, default=64)
    parser.add_argument("--kl-vocab", type=int, default=49152)
    parser.add_argument("--kl-chunk-size", type=int, default=4)
    parser.add_argument("--out", default=str(REPO_ROOT / "results" / "bench"))
    parser.add_argument("--render", metavar="JSON", help="only rebuild a saved report's summaries, .json and .md")
    parser.add_argument("--profile", action="store_true",
                        help="also one profiled klppo run per workload: where each second of an update goes")
    parser.add_argument("--growth", metavar="BxL,...",
                        help="instead of the workloads: workload b at each `prompts x response length` point "
                        "(e.g. 8x24,8x96,8x256,32x24); writes <out>/growth.{json,md,png}")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.warmup, args.updates, args.repeats = "tiny", 1, 1, 1
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


def machine() -> dict:
    import torch

    info = {
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        info["mem_total_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    return info


THREADS = {"n": 1}


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


def run_json(cmd: list[str], log_path: Path, **extra_env: str) -> dict:
    """Run one measurement in a fresh process, its output logged to `log_path`; return its JSON result."""
    out_path = log_path.with_suffix(".json")
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    threads = str(THREADS["n"])
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, **extra_env)
    with open(log_path, "w") as log:
        done = subprocess.run(
            [*cmd, "--out", str(out_path)], stdout=log, stderr=subprocess.STDOUT, env=env, check=False
        )
    if done.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{shlex.join(cmd)} failed (exit {done.returncode}):\n{tail}")
    return json.loads(out_path.read_text())


def train_cmd(side: str, args, workload: str, model_path: str, prompts: Path) -> list[str]:
    common = [
        "--model-path", model_path,
        "--prompts", str(prompts),
        "--workload", workload,
        "--updates", str(args.updates),
        "--warmup", str(args.warmup),
        "--batch-size", str(args.batch_size),
        "--response-length", str(args.response_length),
    ]  # fmt: skip
    if side == "klppo":
        return [sys.executable, str(HERE / "bench_klppo.py"), "train", *common]
    return [str(bench_assets.peer_python()), str(HERE / "bench_peer.py"), *common]


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
        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
        "peak_rss_per_repeat_mb": [r["peak_rss_mb"] for r in runs],
        "peak_rss_above_start_mb": statistics.median(r["peak_rss_mb"] - r["rss_at_start_mb"] for r in runs),
        "cuda_peak_mb": runs[0].get("cuda_peak_mb"),
        "trainable_parameters": runs[0]["trainable_parameters"],
        "measured_updates": len(measured),
        "versions": runs[0]["versions"],
    }
    if side == "klppo":
        summary["kl_share"] = statistics.median(u.get("time/kl", 0.0) / u["time/update"] for u in measured)
    else:
        summary["kl_window_share"] = statistics.median(u.get("time/kl_rewards_gae", 0.0) / u[wall] for u in measured)
    return summary


def compare(klppo: dict, peer: dict) -> dict:
    paired = [k / p for k, p in zip(klppo["time_per_update_per_repeat_s"], peer["time_per_update_per_repeat_s"])]
    return {
        "time_ratio_klppo_over_peer": klppo["time_per_update_s"] / peer["time_per_update_s"],
        "time_ratio_per_repeat": paired,
        "throughput_ratio_peer_time_over_klppo_time": peer["time_per_update_s"] / klppo["time_per_update_s"],
        "peak_rss_ratio_klppo_over_peer": klppo["peak_rss_mb"] / peer["peak_rss_mb"],
        "peak_rss_above_start_ratio_klppo_over_peer": klppo["peak_rss_above_start_mb"]
        / peer["peak_rss_above_start_mb"],
    }


def kl_memory_check(args, workdir: Path) -> dict:
    results = {}
    for variant in ("chunked", "dense", "naive"):
        cmd = [
            sys.executable, str(HERE / "bench_klppo.py"), "kl-memory",
            "--variant", variant,
            "--positions", str(args.kl_positions),
            "--vocab", str(args.kl_vocab),
            "--chunk-size", str(args.kl_chunk_size),
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
    if p:
        lines.append(f"- peer ({p['implementation']}): {p['layout']}")
    lines += ["", "| metric | klppo | peer | klppo / peer |", "| --- | ---: | ---: | ---: |"]

    def row(label, kv, pv, r=None):
        lines.append(f"| {label} | {fmt(kv)} | {fmt(pv)} | {fmt(r)} |")

    row(
        "time per update (s, median)",
        k["time_per_update_s"],
        p and p["time_per_update_s"],
        ratio.get("time_ratio_klppo_over_peer"),
    )
    row("tokens / s (batch x response_length / time)", k["tokens_per_s"], p and p["tokens_per_s"],
        p and k["tokens_per_s"] / p["tokens_per_s"])  # fmt: skip
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
            f"Settings: model `{report['model_path']}`; {s['batch_size']} prompts per update, "
            f"{s['response_length']} response tokens, 2 PPO epochs, 1 mini-batch, temperature 0.7, fp32; "
            f"{s['warmup']} warm-up + {s['updates']} measured updates per run, {s['repeats']} alternating "
            f"repeats per side, each run a fresh process with {s['threads_per_run']} torch thread(s). Figures "
            "are medians over all measured updates (time) or runs (memory). Shared machine: compare "
            "ratios, not absolute times."
        ),
        "",
    ]
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
]


def print_table(report: dict) -> None:
    print(f"\nklppo vs TRL 1.12 PPO on {report['model']} ({report['machine']['cpu_count']} CPUs)")
    header = f"{'workload':<9}{'side':<7}{'s/update':>10}{'tok/s':>9}{'peak RSS MB':>13}{'KL share':>10}"
    print(header)
    print("-" * len(header))
    for name, result in report["workloads"].items():
        for side in ("klppo", "peer"):
            r = result.get(side)
            if r is None:
                continue
            share = r.get("kl_share", r.get("kl_window_share"))
            print(
                f"{name:<9}{side:<7}{r['time_per_update_s']:>10.3f}{r['tokens_per_s']:>9.1f}"
                f"{r['peak_rss_mb']:>13.0f}{share:>10.3f}"
            )
        if "ratios" in result:
            q = result["ratios"]
            print(
                f"{name:<9}ratios: time klppo/peer {q['time_ratio_klppo_over_peer']:.3f}, throughput "
                f"peer/klppo time {q['throughput_ratio_peer_time_over_klppo_time']:.3f}, peak RSS klppo/peer "
                f"{q['peak_rss_ratio_klppo_over_peer']:.3f}"
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
    THREADS["n"] = args.threads
    command = "python benchmarks/bench.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.with_peer:
        bench_assets.ensure_peer_venv()
    model_path = bench_assets.resolve_model(args.model)
    workdir = Path(tempfile.mkdtemp(prefix="klppo-bench-"))
    prompts = bench_assets.write_prompts(workdir / "prompts.json", args.batch_size * (args.warmup + args.updates))
    sides = ["klppo", "peer"] if args.with_peer else ["klppo"]

    started, revision = time.time(), git_revision()  # each run imports klppo afresh: note the code it starts from
    if args.growth:
        return growth(args, model_path, workdir, sides, command, revision, out_dir)
    workloads = {}
    for workload in args.workloads:
        workloads[workload] = summarise_workload(alternate(args, sides, workload, model_path, prompts, workdir))
        if args.profile:
            print(f"[bench] workload {workload}: one profiled klppo run", flush=True)
            cmd = [*train_cmd("klppo", args, workload, model_path, prompts), "--profile"]
            workloads[workload]["profile"] = run_json(cmd, workdir / f"{workload}-klppo-profile.log")["profile"]
    print("[bench] full-vocabulary KL memory check", flush=True)
    kl = kl_memory_check(args, workdir)

    report = {
        "model": args.model,
        "model_path": model_path,
        "command": command,
        "klppo_revision": revision,
        "machine": machine(),
        "settings": {
            "batch_size": args.batch_size,
            "response_length": args.response_length,
            "num_ppo_epochs": 2,
            "num_mini_batches": 1,
            "temperature": 0.7,
            "dtype": "float32",
            "warmup": args.warmup,
            "updates": args.updates,
            "repeats": args.repeats,
            "threads_per_run": args.threads,
            "sides": sides,
        },
        "workloads": workloads,
        "kl_memory": kl,
        "notes": NOTES,
        "wall_seconds": time.time() - started,
    }
    write_report(report, out_dir / (f"{args.model}-quick" if args.quick else args.model))
    return report


def alternate(args, sides: list[str], workload: str, model_path: str, prompts: Path, workdir: Path, tag: str = ""):
    """`args.repeats` fresh runs per side, the order alternating between repeats: `{side: [run, ...]}`."""
    runs = {side: [] for side in sides}
    for repeat in range(args.repeats):
        for side in sides if repeat % 2 == 0 else sides[::-1]:
            print(f"[bench] workload {workload}{tag}, repeat {repeat + 1}/{args.repeats}: {side}", flush=True)
            log = workdir / f"{workload}{tag.replace(' ', '')}-{side}-{repeat}.log"
            runs[side].append(run_json(train_cmd(side, args, workload, model_path, prompts), log))
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
        "model": args.model, "model_path": model_path, "command": command, "klppo_revision": revision,
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


def write_report(report: dict, stem: Path) -> None:
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    print_table(report)
    print(f"\nwrote {stem.with_suffix('.json')} and {stem.with_suffix('.md')}")


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
    write_report(report, path.with_suffix(""))
    return report


if __name__ == "__main__":
    main()
