"""The package's surface: `dir(klppo)`, `help(klppo)` and IDEs see the public names, which still load lazily."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECK = """
import pydoc, sys
import klppo
names = dir(klppo)
assert set(klppo.__all__) <= set(names), names
assert "transformers" not in sys.modules, "dir(klppo) imported the trainer"
for name in klppo.__all__:
    assert getattr(klppo, name) is not None, name
assert klppo.KLPPOTrainer.__name__ == "KLPPOTrainer" and klppo.PPOConfig.__name__ == "PPOConfig"
text = pydoc.render_doc(klppo, renderer=pydoc.plaintext)
for name in ("KLPPOConfig", "KLPPOTrainer", "PPOConfig", "PPOTrainer"):
    assert f"class {name}" in text, name
print("ok")
"""


def test_dir_and_help_list_the_lazy_public_names():
    """In a fresh interpreter: `dir(klppo)` holds every name of `__all__` without importing transformers, each name
    resolves, and `help(klppo)` documents the four classes."""
    proc = subprocess.run(
        [sys.executable, "-c", CHECK],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ROOT},
        cwd=ROOT,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_an_unknown_name_is_an_attribute_error():
    import klppo

    assert not hasattr(klppo, "NoSuchTrainer")
    assert "__version__" in dir(klppo) and "NoSuchTrainer" not in dir(klppo)


def test_klppos_own_deprecations_are_errors_in_the_tests_and_third_parties_are_not():
    """pyproject's `filterwarnings`: a DeprecationWarning raised in a klppo module, or of klppo's category wherever it
    points, fails the test; a third party's is ignored."""
    import warnings

    import pytest

    from klppo.utils import KLPPODeprecationWarning

    with pytest.raises(KLPPODeprecationWarning):
        warnings.warn("a klppo name is deprecated", KLPPODeprecationWarning, stacklevel=2)
    with pytest.raises(DeprecationWarning):
        warnings.warn_explicit("deprecated", DeprecationWarning, "klppo/kl/x.py", 1, module="klppo.kl.x")
    warnings.warn_explicit("deprecated", DeprecationWarning, "transformers/x.py", 1, module="transformers.x")
    warnings.warn("a third party's deprecation", DeprecationWarning)
