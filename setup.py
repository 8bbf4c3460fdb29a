"""Builds the relay's optional C extensions; everything else is in pyproject.toml.

`optional=True`: without a C compiler the install still succeeds and the relay uses the
pure-Python code, which is also the reference the tests compare: the frame scanner
(sidecar/proxy/frames.py), the relay's `data_received` (relay.py) and an inference stream's
message reading (stream_messages.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sidecar.proxy._framewalk",
            ["sidecar/proxy/_framewalk.c"],
            depends=["sidecar/proxy/_varint.h"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(
            "sidecar.proxy._pump",
            ["sidecar/proxy/_pump.c"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(
            "sidecar.proxy._messagewalk",
            ["sidecar/proxy/_messagewalk.c"],
            depends=["sidecar/proxy/_varint.h"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
    ]
)
