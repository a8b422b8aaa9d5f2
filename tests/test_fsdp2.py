"""FSDP2 pieces on CPU (gloo, one process, `torch.distributed.fsdp.fully_shard` without accelerate, which turns
FSDP on only on GPUs): the actor-critic names its transformer blocks for the transformer-based wrap, and a
forward that enters through the policy instead of the FSDP root works only with the root unsharded, and then
gives the unsharded model's logits (generation likewise); a checkpoint's whole weights load into the shards.

The sharding runs in a subprocess (this file run as a script), so that its process group does not leak into the
other tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_fsdp2_root_unsharded_for_off_root_forwards(tiny_model_path, tmp_path):
    out = tmp_path / "fsdp2.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["no_split_modules"] == ["LlamaDecoderLayer"]
    assert result["wrapped_blocks"] == 2  # the tiny Llama's two decoder layers, found from that name
    assert result["sharded_root_param"] is True
    assert "DTensor" in result["error_without_unshard"]  # the pitfall: the root's weights are still sharded
    assert result["logits_match"] is True and result["generation_matches"] is True
    assert result["resharded_after"] is True
    assert result["root_forward_after_off_root_matches"] is True
    assert result["loaded_logits_match"] is True and result["loaded_differs_from_before"] is True


def _run(out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from klppo.models import tiny_model_and_tokenizer
    from klppo.ppo.engines import load_full_weights, root_unsharded
    from klppo.ppo.value import ActorCritic, ValueHead

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", MASTER_PORT=os.environ.get("MASTER_PORT", "29591"))
    dist.init_process_group("gloo")
    model, _ = tiny_model_and_tokenizer()
    actor_critic = ActorCritic(model, value_head=ValueHead(model.config.hidden_size))
    ids = torch.tensor([[1, 5, 9, 20, 33]])
    expected = model(ids).logits.detach().clone()
    expected_generation = model.generate(ids, max_new_tokens=4, do_sample=False)

    mesh = init_device_mesh("cpu", (1,))
    blocks = set(actor_critic._no_split_modules)
    wrapped = 0
    for module in actor_critic.modules():  # what accelerate's transformer-based wrap does with those names
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
            wrapped += 1
    fully_shard(actor_critic, mesh=mesh)
    result = {"no_split_modules": actor_critic._no_split_modules, "wrapped_blocks": wrapped,
              "sharded_root_param": isinstance(model.lm_head.weight, DTensor)}  # fmt: skip
    try:
        model(ids)
        result["error_without_unshard"] = ""
    except RuntimeError as err:
        result["error_without_unshard"] = str(err)[:200]
    with torch.no_grad(), root_unsharded(actor_critic):
        logits = model(ids).logits
        generation = model.generate(ids, max_new_tokens=4, do_sample=False)
    result["logits_match"] = bool(torch.allclose(logits, expected, atol=1e-6))
    result["generation_matches"] = bool(torch.equal(generation, expected_generation))
    result["resharded_after"] = isinstance(model.lm_head.weight, DTensor)
    # after those off-root forwards, the actor-critic's own forward (the PPO loss) still works, with the same logits
    with torch.no_grad():
        root_logits = actor_critic(ids)[0]
    result["root_forward_after_off_root_matches"] = bool(torch.allclose(root_logits, expected, atol=1e-6))
    # resuming: a checkpoint's whole weights go into the sharded actor-critic
    torch.manual_seed(1)
    other, _ = tiny_model_and_tokenizer(seed=1)
    saved = {f"policy.{name}": value for name, value in other.state_dict().items()}
    load_full_weights(actor_critic, saved)
    with torch.no_grad(), root_unsharded(actor_critic):
        reloaded = model(ids).logits
    result["loaded_logits_match"] = bool(torch.allclose(reloaded, other(ids).logits, atol=1e-6))
    result["loaded_differs_from_before"] = not bool(torch.allclose(reloaded, expected, atol=1e-3))
    with open(out_path, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    _run(sys.argv[1])
