"""In-tree PEP 517 backend: setuptools' own, reached without downloading anything.

pip builds in an isolated environment and would download the `requires` of pyproject.toml, which
fails offline. This backend needs nothing installed into that environment: it puts the
interpreter's own site-packages (where Debian's python3-setuptools and python3-wheel live) back on
sys.path and hands every hook to setuptools.build_meta. So a plain `pip install ./client/python`
works with no network.
"""
import site
import sys

for _path in site.getsitepackages():
    if _path not in sys.path:
        sys.path.append(_path)

from setuptools import build_meta as _setuptools  # noqa: E402

build_wheel = _setuptools.build_wheel
build_sdist = _setuptools.build_sdist
prepare_metadata_for_build_wheel = _setuptools.prepare_metadata_for_build_wheel


def get_requires_for_build_wheel(config_settings=None):
    return []  # setuptools and wheel come from the interpreter's site-packages (above)


def get_requires_for_build_sdist(config_settings=None):
    return []
