"""The reports of `bench.py`: the markdown report of one run of the benchmark (`<name>.md`) and its console table, the
growth report (`growth.md`, `growth.png`), the summary of several reports (`summary.md`), and a saved report
rendered again from its raw runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import bench_assets  # this script's folder is on sys.path
from bench_summary import PHASE_ROWS, growth_slopes, ratio_of, summarise_workload


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
            " ".join(f"{c['graphs']}/{c['cudagraph_recordings']}" for c in run)
            for run in k.get("compiles_per_update") or []
            if run
        )
        lines.append(
            f"- klppo decoding: {k['decoding']['cache']} KV cache"
            + (f", compiled ({k['decoding']['compile_config']})" if k["decoding"]["compile_config"] else "")
            + (f"; graphs compiled / CUDA graphs recorded in each update (warm-up first): {counts}" if counts else "")
        )
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
    row(
        "tokens / s (batch x response_length / time)",
        k["tokens_per_s"],
        p and p["tokens_per_s"],
        p and k["tokens_per_s"] / p["tokens_per_s"],
    )
    if k.get("first_update_s") is not None:
        row(
            "first update (s; a warm-up update, not in the median)",
            k["first_update_s"],
            p and p.get("first_update_s"),
            ratio.get("first_update_ratio_klppo_over_peer"),
        )
        row(
            "all updates of a run, the first included (s)",
            k.get("all_updates_s"),
            p and p.get("all_updates_s"),
            ratio_of(k.get("all_updates_s"), p and p.get("all_updates_s")),
        )
        row(
            "setup: load the models, build the trainer (s)",
            k.get("setup_s"),
            p and p.get("setup_s"),
            ratio.get("setup_ratio_klppo_over_peer"),
        )
        row(
            "whole process, imports included (s)",
            k.get("process_s"),
            p and p.get("process_s"),
            ratio_of(k.get("process_s"), p and p.get("process_s")),
        )
    if k.get("cuda_peak_allocated_mb") is not None:
        row(
            "GPU peak allocated (MB, torch.cuda.max_memory_allocated)",
            k["cuda_peak_allocated_mb"],
            p and p.get("cuda_peak_allocated_mb"),
            ratio.get("cuda_peak_allocated_ratio_klppo_over_peer"),
        )
        row(
            "GPU peak reserved (MB, torch.cuda.max_memory_reserved)",
            k["cuda_peak_reserved_mb"],
            p and p.get("cuda_peak_reserved_mb"),
            ratio.get("cuda_peak_reserved_ratio_klppo_over_peer"),
        )
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
    lines.append(
        f"| other (update minus the phases above) | {fmt(k['phases_s']['time/other'])} | "
        f"{fmt(p and p['phases_s']['time/other'])} |"
    )
    lines.append(
        f"| whole update (wall, between step ends) | {fmt(k['time_per_update_s'])} | "
        f"{fmt(p and p['time_per_update_s'])} |"
    )
    lines.append("")
    if "profile" in result:
        lines += profile_table(result["profile"])
    return lines


PROFILE_ROWS = [
    "generation",
    "score_policy",
    "score_value",
    "score_ref",
    "reward",
    "kl",
    "advantages",
    "rollback_snapshot",
    "optimise",
]


OPTIMISE_PARTS = ["forward", "backward", "clip_grad_norm", "optimizer_step"]


def profile_table(profile: dict) -> list[str]:
    """Where each second of klppo's update goes, from one `torch.profiler` run (CPU time per update)."""
    ranges = {k.removeprefix("klppo/"): v for k, v in profile["ranges_s"].items()}
    lines = [
        f"Where klppo's update goes (one profiled run, {profile['updates']} updates; CPU seconds per update; "
        "the profiler adds some overhead of its own):",
        "",
        "| range | s per update |",
        "| --- | ---: |",
    ]
    for name in PROFILE_ROWS:
        if name in ranges:
            lines.append(f"| {name} | {fmt(ranges[name])} |")
        if name == "optimise":
            for part in OPTIMISE_PARTS:
                lines.append(f"| - {part} | {fmt(ranges.get(part, 0.0))} |")
            rest = ranges.get("optimise", 0.0) - sum(ranges.get(part, 0.0) for part in OPTIMISE_PARTS)
            lines.append(f"| - rest of the PPO epochs (batching, statistics) | {fmt(rest)} |")
    lines += [
        "",
        "Operators with the most self CPU time (s per update): "
        + ", ".join(f"`{k}` {fmt(v)}" for k, v in profile["top_ops_self_s"].items()),
        "",
    ]
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
            + (
                f" (random weights, {bench_assets.SHAPE_TITLES[report['model_shape']]})"
                if report.get("model_shape")
                else ""
            )
            + f"; {s['batch_size']} prompts per update, "
            f"{s['response_length']} response tokens, 2 PPO epochs, 1 mini-batch, temperature 0.7, "
            f"{s.get('dtype', 'float32')} on {s.get('device', 'cpu')}; "
            f"{s['warmup']} warm-up + {s['updates']} measured updates per run, {s['repeats']} alternating "
            f"repeat(s) per side, each run a fresh process with {s['threads_per_run']} torch thread(s). Figures "
            "are medians over all measured updates (time) or runs (memory). "
            + (
                "Update boundaries wait for the GPU on both sides; the phases are host time without waiting, so a "
                "phase's kernels can be counted in a later one."
                if s.get("device") == "cuda"
                else "Shared machine: compare ratios, not absolute times."
            )
        ),
        "",
    ]
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
    print(
        f"\nklppo vs TRL 1.12 PPO on {report['model']}, {s.get('dtype', 'float32')}, {s['batch_size']} prompts x "
        f"{s['response_length']} tokens ({where})"
    )
    gpu = any(
        r.get("cuda_peak_allocated_mb") is not None
        for w in report["workloads"].values()
        for r in (w.get("klppo"), w.get("peer"))
        if r
    )
    header = (
        f"{'workload':<9}{'side':<7}{'s/update':>10}{'tok/s':>9}{'1st upd s':>11}{'setup s':>9}"
        f"{'peak RSS MB':>13}" + (f"{'GPU alloc MB':>14}{'GPU rsrv MB':>13}" if gpu else "") + f"{'KL share':>10}"
    )
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
                + (
                    f"{num(r.get('cuda_peak_allocated_mb'), 14, '.0f')}{num(r.get('cuda_peak_reserved_mb'), 13, '.0f')}"
                    if gpu
                    else ""
                )
                + f"{share:>10.3f}"
            )
        if "ratios" in result:
            q = result["ratios"]
            memory = (
                f"GPU peak allocated klppo/peer {fmt(q.get('cuda_peak_allocated_ratio_klppo_over_peer'))}"
                if gpu
                else f"peak RSS klppo/peer {q['peak_rss_ratio_klppo_over_peer']:.3f}"
            )
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


def write_report(report: dict, stem: Path, quiet: bool = False) -> None:
    # with_name, not with_suffix: a stem such as `random-1.7b-bf16` has a dot of its own
    stem.with_name(stem.name + ".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_name(stem.name + ".md").write_text(markdown(report))
    if quiet:
        return
    print_table(report)
    print(f"\nwrote {stem}.json and {stem}.md")


def growth_markdown(report: dict) -> str:
    m, sides = report["machine"], report["sides"]
    lines = [
        f"# How cost grows with the work: {' vs '.join(SIDE_NAMES[x] for x in sides)}, workload b ({report['model']})",
        "",
        f"Command: `{report['command']}` (klppo at `{report['klppo_revision']}`)",
        "",
        f"Machine: {m['cpu_count']} CPUs ({m['processor']}), torch {m['torch']}. Per point: {report['warmup']} "
        f"warm-up + {report['updates']} measured update(s) per run, {report['repeats']} alternating repeat(s) per side, "
        f"fresh processes with {report['threads_per_run']} thread(s); medians. Workload b as in `smollm2.md`: klppo's "
        "LoRA policy with a shared value head and the sentiment function"
        + ("; the peer's LoRA policy with separate value and reward models" if "peer" in sides else "")
        + ". 2 PPO epochs, 1 mini-batch.",
        "",
        "| prompts x tokens | klppo s/update | "
        + ("peer s/update | throughput ratio | per repeat | " if "peer" in sides else "")
        + "klppo generation | klppo PPO epochs | klppo peak RSS MB | "
        + ("peer peak RSS MB | RSS ratio |" if "peer" in sides else ""),
        "| --- | ---: | "
        + ("---: | ---: | ---: | " if "peer" in sides else "")
        + "---: | ---: | ---: | "
        + ("---: | ---: |" if "peer" in sides else ""),
    ]
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
            ax.plot(
                [p["batch_size"] * p["response_length"] for p in line],
                [p[side]["time_per_update_s"] for p in line],
                marker=marker,
                color=colour,
                label=f"{side}, {batch} prompts",
            )
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


SUMMARY_COLUMNS = [
    "model",
    "dtype",
    "workload",
    "klppo s/update",
    "peer s/update",
    "throughput klppo/peer",
    "klppo 1st update s",
    "peer 1st update s",
    "klppo peak MB",
    "peer peak MB",
    "memory klppo/peer",
]


def combine(paths: list[Path], out_dir: Path) -> dict:
    """One table of several reports' workloads (`<out>/summary.md`): time per update, throughput ratio, first
    update, and peak memory (GPU allocated where measured, else RSS)."""
    reports = [json.loads(p.read_text()) for p in paths]
    lines = ["# klppo vs TRL 1.12 PPO: summary", ""]
    first = reports[0] if reports else {}
    if first:
        m, s = first["machine"], first["settings"]
        where = (
            f"GPU {m['cuda']} ({m.get('cuda_memory_gb', '?')} GiB)"
            if s.get("device") == "cuda"
            else f"{m['cpu_count']} CPUs"
        )
        lines += [
            f"{where}, torch {m['torch']}; {s['batch_size']} prompts x {s['response_length']} new tokens per "
            f"update, 2 PPO epochs, 1 mini-batch, no stop token; {s['warmup']} warm-up + {s['updates']} "
            f"measured update(s) per run, {s['repeats']} run(s) per side, sides alternating. Peak memory: "
            + ("torch's peak GPU allocation per process." if s.get("device") == "cuda" else "peak RSS.")
            + " Workload a: four separate models on both sides; b: each side's most economical layout.",
            "",
        ]
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
                "model": report["model"],
                "dtype": report["settings"].get("dtype", "float32"),
                "workload": name,
                "klppo s/update": k["time_per_update_s"],
                "peer s/update": p and p["time_per_update_s"],
                "throughput klppo/peer": p and p["time_per_update_s"] / k["time_per_update_s"],
                "klppo 1st update s": k.get("first_update_s"),
                "peer 1st update s": p and p.get("first_update_s"),
                "klppo peak MB": k.get(memory),
                "peer peak MB": p and p.get(memory),
                "memory klppo/peer": ratio_of(k.get(memory), p and p.get(memory)),
                "report": path.name,
            }
            rows.append(row)
            lines.append("| " + " | ".join(fmt(row[c]) for c in SUMMARY_COLUMNS) + " |")
    lines += [""] + [
        f"Failed: `{path.name}` workload {name} (the error is in its .md)."
        for path, report in zip(paths, reports)
        for name in report.get("failures", {})
    ]
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
        ]
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
