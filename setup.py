"""Builds the relay's optional C extensions; everything else is in pyproject.toml.

`optional=True`: without a C compiler the install still succeeds and the relay uses the
pure-Python code, which is also the reference the tests compare: the frame scanner
(sidecar/proxy/frames.py), the relay's `data_received` (relay.py), an inference stream's
message reading (stream_messages.py) and the HTTP relay's client `data_received`
(http/relay.py, http/request_reader.py). A build that fails where a compiler exists is not
quiet: scripts/setup.sh (and so CI) runs `python -m sidecar.proxy.native_check --require`
after installing, which exits 1 naming the extension and showing its build error, and the
image's build imports each. `/metrics` (`xsp_relay_native_info`) and `serve`'s first log
lines say which paths run.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sidecar.proxy._framewalk",
            ["sidecar/proxy/_framewalk.c"],
            depends=["sidecar/proxy/_varint.h", "sidecar/proxy/_names.h"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(
            "sidecar.proxy._pump",
            ["sidecar/proxy/_pump.c"],
            depends=["sidecar/proxy/_names.h"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(
            "sidecar.proxy._messagewalk",
            ["sidecar/proxy/_messagewalk.c"],
            depends=["sidecar/proxy/_varint.h", "sidecar/proxy/_names.h"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(  # llhttp (vendored, MIT: sidecar/proxy/llhttp/README.md) built in
            "sidecar.proxy._httppump",
            [
                "sidecar/proxy/_httppump.c",
                "sidecar/proxy/llhttp/api.c",
                "sidecar/proxy/llhttp/http.c",
                "sidecar/proxy/llhttp/llhttp.c",
            ],
            depends=["sidecar/proxy/_names.h", "sidecar/proxy/llhttp/llhttp.h"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
    ]
)
