"""Builds the relay's optional C frame walker; everything else is in pyproject.toml.

`optional=True`: without a C compiler the install still succeeds and the relay uses the
pure-Python scanner (sidecar/proxy/frames.py), which is also the reference the tests compare.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sidecar.proxy._framewalk",
            ["sidecar/proxy/_framewalk.c"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
