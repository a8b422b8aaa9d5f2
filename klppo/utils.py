"""Small helpers shared by klppo's modules and its lab."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

__all__ = ["KLPPODeprecationWarning", "atomic_path", "write_json"]


class KLPPODeprecationWarning(DeprecationWarning):
    """The category of klppo's own deprecations (the tests turn it into an error, wherever its stacklevel points)."""


@contextmanager
def atomic_path(path: str | os.PathLike, folder: bool = False):
    """Write `path` all at once: yields a new temporary sibling (a file name, or with `folder` an empty folder) to
    write; when the block ends without an error it replaces `path` (`os.replace`, atomic on one file system), else
    it is removed. A crash never leaves a half-written `path`, and readers see the old one or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if folder:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        if folder and path.is_dir():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def write_json(path: str | os.PathLike, data, **kwargs) -> None:
    """`json.dump` of `data` to `path`, atomically (`atomic_path`); `kwargs` go to `json.dump`
    (default `indent=2`)."""
    kwargs.setdefault("indent", 2)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, **kwargs)
        f.write("\n")


NONE_TEXTS = ("None", "null")


def none_from_text(config) -> None:
    """Set to None every optional field of the dataclass `config` that holds the text 'None' or 'null': a command
    line cannot give None otherwise (transformers' parser keeps the text of an optional string field as it is)."""
    import dataclasses
    import typing

    try:  # the annotations: transformers' parser replaces an optional field's `type` with the type inside
        hints = typing.get_type_hints(type(config))
    except (NameError, TypeError):
        hints = {}
    for f in dataclasses.fields(config):
        kind = hints.get(f.name, f.type)
        optional = type(None) in typing.get_args(kind) or "None" in str(kind) or "Optional" in str(kind)
        if optional and isinstance(getattr(config, f.name, None), str) and getattr(config, f.name) in NONE_TEXTS:
            setattr(config, f.name, None)
