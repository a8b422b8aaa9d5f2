"""Undo an update: copies of the trainable weights, optimizer state and scheduler state, and their restore."""

from __future__ import annotations

import copy

import torch
from torch import nn


def snapshot_optimisation(model: nn.Module, optimizer, scheduler=None) -> dict:
    """Copies of `model`'s trainable weights, the optimizer state and the scheduler state. With LoRA this is
    small; for full fine-tuning it is one more copy of the weights and of the optimizer state."""
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "scheduler": copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None,
    }


@torch.no_grad()
def restore_optimisation(snapshot: dict, model: nn.Module, optimizer, scheduler=None) -> None:
    """Put back what `snapshot_optimisation` copied."""
    params = dict(model.named_parameters())
    for name, value in snapshot["params"].items():
        params[name].copy_(value)
    optimizer.load_state_dict(snapshot["optimizer"])
    if snapshot["scheduler"] is not None:
        scheduler.load_state_dict(snapshot["scheduler"])
