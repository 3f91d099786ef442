"""Build hook: compiles the cffi native module (narad._native) at install time.

All project metadata lives in pyproject.toml; setup.py exists only because
cffi's ``cffi_modules`` keyword has no pyproject.toml spelling.
"""

from setuptools import setup

setup(cffi_modules=["native/build_native.py:ffibuilder"])
