"""Decoding micro-benchmark: plain compiled `generate` against klppo's rollout generation, same model, same batch.

    python benchmarks/decode.py --device cuda --model-shape 360m --dtype bfloat16 --batch-size 64 --response-length 128
    python benchmarks/decode.py --device cpu --model-shape tiny --batch-size 4 --response-length 8 --force-compile

Each variant is a fresh model (a Llama of SmolLM2's shape with random weights, `bench_assets`) called `--calls` times
on the same prompts, `--response-length` new tokens each, no stop token:

  plain   `model.generate(do_sample=True, temperature, top_k=0, cache_implementation="static")`: transformers' own
          sampling into its static cache, the decoding step compiled with `--compile-config`;
  klppo   the generation phase of `KLPPOTrainer.rollout` (`time/generation`) on workload (b)'s policy: a LoRA adapter
          (merged into kept copies of the weights for sampling), a shared critic's value head, klppo's sampler; with
          `cache_implementation="static"` and the same compile settings;
  klppo-unmerged  the same with the adapter left unmerged (`merge_adapter_for_generation=False`);
  vllm    the same rollout with `use_vllm=True`: a vLLM engine colocated in the process (`.venv-vllm`), the merged
          weights synced before every call as in training (`time/weight_sync`, reported apart), `generate`'s
          compile settings unused; the engine as it runs by default (`vllm_enforce_eager`: eager on a CPU, compiled on a GPU);
  vllm-compiled  the same with the engine's model compiled on a CPU too (`vllm_enforce_eager=False`).

The first call compiles (and, with CUDA graphs, warms up); the report gives it apart, then the second call, then
the median of the others, and for every call the graphs dynamo compiled and the CUDA graphs recorded
(`compile_counts`). A step of PPO training between the klppo calls is not needed here: `bench.py` measures whole
updates. `--force-compile` compiles on a CPU too (transformers compiles only on accelerators), with dynamo's
`eager` backend unless `--compile-config` names another: the counts are then the CPU's proof of the mechanism,
the times are not a GPU's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_assets  # noqa: E402
from compile_counts import CompileCounter, per_step  # noqa: E402

VARIANTS = ("plain", "klppo", "klppo-unmerged", "vllm", "vllm-compiled")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-shape", choices=list(bench_assets.SHAPES), default="360m")
    parser.add_argument("--assets", metavar="DIR", default=None, help="tokenizer folder (bench.py --export-assets)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--response-length", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--calls", type=int, default=5, help="generate calls per variant (the first compiles)")
    parser.add_argument("--variants", default="plain,klppo", help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument(
        "--compile-config",
        default=None,
        help="JSON: transformers' CompileConfig fields (default: klppo's generation_compile_config default)",
    )
    parser.add_argument("--force-compile", action="store_true", help="compile on a CPU too")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="one more call of each variant under torch.profiler: the operators with the most host "
        "time and device time",
    )
    parser.add_argument("--out", default=None, help="write decode.json and decode.md into this folder")
    args = parser.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        parser.error(f"unknown variant(s) {bad}: choose from {', '.join(VARIANTS)}")
    if args.calls < 3:
        parser.error("--calls must be >= 3: the first compiles, the second may record, the rest are measured")
    return args


def compile_settings(args) -> dict:
    from klppo.ppo.config import DEFAULT_GENERATION_COMPILE

    settings = {**DEFAULT_GENERATION_COMPILE, **(json.loads(args.compile_config) if args.compile_config else {})}
    if args.force_compile and args.device == "cpu":
        settings.setdefault("backend", "eager")
        if args.compile_config is None:
            settings["backend"] = "eager"
    return settings


def synchronize(args) -> None:
    if args.device == "cuda":
        import torch

        torch.cuda.synchronize()


def prompts_batch(tokenizer, args):
    texts = bench_assets.load_prompts(args.batch_size)
    tokenizer.padding_side = "left"
    return tokenizer(texts, return_tensors="pt", padding=True)


def load_model(args, path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(args.device)


def time_calls(args, call) -> dict:
    """Run `call()` `--calls` times; seconds and compile counts of each."""
    counter, seconds, snapshots = CompileCounter(), [], []
    for _ in range(args.calls):
        synchronize(args)
        start = time.perf_counter()
        call()
        synchronize(args)
        seconds.append(time.perf_counter() - start)
        snapshots.append(counter.snapshot())
    return {
        "first_s": seconds[0],
        "second_s": seconds[1],
        "steady_s": statistics.median(seconds[2:]),
        "seconds": seconds,
        "counts": per_step(snapshots),
    }


def run_plain(args, path, tokenizer, settings) -> dict:
    import torch
    from transformers import CompileConfig

    model = load_model(args, path).eval()
    batch = prompts_batch(tokenizer, args).to(args.device)
    config = CompileConfig(**settings)
    if args.force_compile:
        config._compile_all_devices = True

    @torch.no_grad()
    def call():
        model.generate(
            **batch,
            do_sample=True,
            temperature=args.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=args.response_length,
            min_new_tokens=args.response_length,
            eos_token_id=[],
            pad_token_id=tokenizer.pad_token_id,
            cache_implementation="static",
            compile_config=config,
        )

    return {**time_calls(args, call), **profiled(args, call)}


def profiled(args, call) -> dict:
    """With `--profile`: one more call under `torch.profiler`, its 12 operators with the most self host time and
    (on a GPU) the most self device time, in seconds."""
    if not args.profile:
        return {}
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        call()
        synchronize(args)
    events = prof.key_averages()
    host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    top = {
        "host_self_s": {e.key: e.self_cpu_time_total / 1e6 for e in host},
        "host_total_s": sum(e.self_cpu_time_total for e in events) / 1e6,
    }
    if args.device == "cuda":
        device_time = lambda e: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))  # noqa: E731
        gpu = sorted(events, key=lambda e: -device_time(e))[:12]
        top["device_self_s"] = {e.key: device_time(e) / 1e6 for e in gpu}
        top["device_total_s"] = sum(device_time(e) for e in events) / 1e6
    del torch
    return {"profile": top}


def run_klppo(args, path, tokenizer, settings, merged: bool, vllm: str | None = None) -> dict:
    """`vllm`: None (`generate`), "vllm" (the engine as it runs by default: eager on a CPU, compiled on a GPU) or
    "vllm-compiled" (compiled on a CPU too)."""
    from collections import defaultdict

    from datasets import Dataset
    from peft import LoraConfig

    from klppo import KLPPOConfig, KLPPOTrainer
    from klppo.rewards.sentiment import positive_sentiment_reward

    config = KLPPOConfig(
        output_dir=tempfile.mkdtemp(prefix="klppo-decode-"),
        per_device_train_batch_size=args.batch_size,
        response_length=args.response_length,
        temperature=args.temperature,
        stop_token=None,
        critic="shared",
        kl_estimator="k1",
        kl_controller="fixed",
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        eval_strategy="no",
        num_sample_generations=0,
        use_cpu=args.device == "cpu",
        bf16=args.dtype == "bfloat16",
        cache_implementation="dynamic" if vllm else "static",
        use_vllm=vllm is not None,
        experimental={
            "merge_adapter_for_generation": merged,
            "generation_compile_config": settings,
            **({"vllm_enforce_eager": False} if vllm == "vllm-compiled" else {}),
        },
    )
    prompts = Dataset.from_dict({"prompt": bench_assets.load_prompts(args.batch_size)})
    lora = LoraConfig(
        r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        task_type="CAUSAL_LM",
    )
    trainer = KLPPOTrainer(
        model=load_model(args, path),
        args=config,
        processing_class=tokenizer,
        reward_funcs=positive_sentiment_reward,
        train_dataset=prompts,
        peft_config=lora,
    )
    if args.force_compile and not vllm:
        trainer.sampler.generation_config.compile_config._compile_all_devices = True
    trainer.setup_optimisation(1)
    batch = trainer.prompt_batch(list(prompts["prompt"]))
    generation, syncs = [], []

    def call():
        timings = defaultdict(float)
        trainer.rollout(batch, timings)
        generation.append(timings["time/generation"])
        syncs.append(timings.get("time/weight_sync", 0.0))

    result = {**time_calls(args, call), **profiled(args, call)}
    result["generation_s"] = generation[: args.calls]  # the generation phase alone (the calls include scoring)
    result["steady_generation_s"] = statistics.median(generation[2:])
    if vllm:
        result["engine_start_s"] = trainer.sampler.start_seconds
        result["weight_sync_s"] = syncs[: args.calls]
    return result


def render(report: dict) -> str:
    s = report["settings"]
    lines = [
        "# Decoding: plain compiled `generate` against klppo's rollout generation",
        "",
        f"{report['machine']}; random {s['model_shape']} Llama, {s['dtype']}, {s['batch_size']} prompts x "
        f"{s['response_length']} new tokens, compile settings {s['compile']}, {s['calls']} calls per variant.",
        "",
        "| variant | first call s (compile) | second call s | later calls s (median) | graphs compiled per call | "
        "CUDA graphs recorded per call |",
        "| --- | ---: | ---: | ---: | --- | --- |",
    ]
    for name, r in report["variants"].items():
        steady = r.get("steady_generation_s", r["steady_s"])
        graphs = ", ".join(str(c["graphs"]) for c in r["counts"])
        recorded = ", ".join(str(c["cudagraph_recordings"]) for c in r["counts"])
        lines.append(f"| {name} | {r['first_s']:.2f} | {r['second_s']:.2f} | {steady:.3f} | {graphs} | {recorded} |")
    plain, klppo = report["variants"].get("plain"), report["variants"].get("klppo")
    if plain and klppo:
        ratio = klppo["steady_generation_s"] / plain["steady_s"]
        lines += ["", f"klppo's generation / plain `generate`, after warm-up: {ratio:.2f}x."]
    for name in ("vllm", "vllm-compiled"):
        engine = report["variants"].get(name)
        if not engine:
            continue
        lines += [
            "",
            f"{name}: engine started in {engine['engine_start_s']:.1f} s; weight sync per call "
            f"{statistics.median(engine['weight_sync_s']):.3f} s (median), not in its generation figures.",
        ]
        if klppo:
            ratio = engine["steady_generation_s"] / klppo["steady_generation_s"]
            lines += [f"{name}'s generation / klppo's (`generate`), after warm-up: {ratio:.2f}x."]
    lines += ["", "klppo's figures are the generation phase of `rollout` (`time/generation`), without its scoring."]
    for name, r in report["variants"].items():
        prof = r.get("profile")
        if not prof:
            continue
        lines += [
            "",
            f"### {name}: one call under torch.profiler",
            "",
            f"Host time, all operators: {prof['host_total_s']:.3f} s"
            + (f"; device time, all kernels: {prof['device_total_s']:.3f} s" if "device_total_s" in prof else "")
            + ".",
            "",
            "| operator | self host s | | operator | self device s |",
            "| --- | ---: | --- | --- | ---: |",
        ]
        host = list(prof["host_self_s"].items())
        dev = list(prof.get("device_self_s", {}).items())
        for i in range(len(host)):
            h = host[i]
            d = dev[i] if i < len(dev) else ("", None)
            lines.append(f"| `{h[0][:60]}` | {h[1]:.4f} | | `{d[0][:60]}` | {'' if d[1] is None else f'{d[1]:.4f}'} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    import torch
    import transformers

    from klppo.models import load_tokenizer

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    path = bench_assets.random_model(
        args.model_shape, bench_assets.SHAPE_STORAGE_DTYPE, args.assets, device=args.device
    )
    tokenizer = load_tokenizer(path)
    settings = compile_settings(args)
    variants = {}
    for name in args.variants:
        torch._dynamo.reset()
        if name == "plain":
            variants[name] = run_plain(args, path, tokenizer, settings)
        else:
            variants[name] = run_klppo(
                args,
                path,
                tokenizer,
                settings,
                merged=name != "klppo-unmerged",
                vllm=name if name.startswith("vllm") else None,
            )
        print(f"[decode] {name}: {json.dumps({k: v for k, v in variants[name].items() if k != 'counts'})}", flush=True)
    machine = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    report = {
        "machine": machine,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "settings": {
            "model_shape": args.model_shape,
            "dtype": args.dtype,
            "batch_size": args.batch_size,
            "response_length": args.response_length,
            "calls": args.calls,
            "compile": {k: str(v) for k, v in settings.items()},
            "device": args.device,
        },
        "variants": variants,
    }
    text = render(report)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode.json").write_text(json.dumps(report, indent=1))
        (out / "decode.md").write_text(text)
    return report


if __name__ == "__main__":
    main()
