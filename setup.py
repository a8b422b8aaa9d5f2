"""Packaging beside pyproject.toml (which holds the metadata), for one thing pyproject's tables cannot say: the
experiment configs at the repository's root, `configs/*.yaml`, are the installed package's `klppo/configs/*.yaml`
(`klppo train --config tiny`). The root folder stays the one copy of them, where the README's commands read them."""

from setuptools import find_namespace_packages, setup

setup(
    packages=[*find_namespace_packages(include=["klppo*"]), "klppo.configs"],
    package_dir={"klppo.configs": "configs"},
    package_data={"klppo": ["assets/*"], "klppo.configs": ["*.yaml"]},
)
