"""The tiny job on one GPU under each engine (`lab/gpu_engines/run.sh`): final weights against plain accelerate,
each resume against the uninterrupted run, finite logits from the saved policy. Usage, from the repository root:
`python -m lab.gpu_engines.check_engines RUNS/tiny`."""

import json
import os
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from klppo.models import resolve_model_path

root = sys.argv[1]
init = load_file(os.path.join(resolve_model_path("klppo:tiny-llama"), "model.safetensors"))
out = {}
plain = None
for e in ["single_gpu", "fsdp", "deepspeed_zero2", "deepspeed_zero3"]:
    d = os.path.join(root, e)
    r = {}
    try:
        r["updates"] = json.load(open(os.path.join(d, "summary.json"))).get("updates")
        w = load_file(os.path.join(d, "model.safetensors"))
        r["keys_match_init"] = sorted(w) == sorted(init)
        if e == "single_gpu":
            plain = w
        if plain is not None and sorted(w) == sorted(plain):
            num = sum(float((w[k].double() - plain[k].double()).pow(2).sum()) for k in w)
            den = sum(float((plain[k].double() - init[k].double()).pow(2).sum()) for k in w if k in init)
            r["rel_l2_vs_single_gpu_update"] = (num / den) ** 0.5 if den else None
        model = AutoModelForCausalLM.from_pretrained(d)
        r["finite_logits"] = bool(torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all())
        a = load_file(os.path.join(d, "checkpoint-3", "klppo_trainable.safetensors"))
        b = load_file(os.path.join(root, e + "-resumed", "checkpoint-3", "klppo_trainable.safetensors"))
        r["resume_max_abs_diff"] = max(float((a[k] - b[k]).abs().max()) for k in a)
        c = [
            json.load(open(os.path.join(x, "checkpoint-3", "kl_controller.json")))["kl_controller"]
            for x in (d, os.path.join(root, e + "-resumed"))
        ]
        r["resume_controller_equal"] = c[0] == c[1]
        st = json.load(open(os.path.join(d, "trainer_state.json")))["log_history"]
        r["kl_coef"] = [h["kl/coef"] for h in st if "kl/coef" in h]
        r["loss_policy"] = [h.get("loss/policy") for h in st if "loss/policy" in h]
    except Exception as err:  # report and go on: one engine's failure must not hide the others
        r["error"] = repr(err)[:500]
    out[e] = r
print(json.dumps(out, indent=1))
